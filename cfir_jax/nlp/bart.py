"""BART (facebook/bart-large-cnn, distilbart) in Flax NNX, written from the architecture, and its weights' loader.

Encoder and decoder of post-LN transformer layers (self-attention, for the decoder cross-attention, a GELU
feed-forward; each block's output added to its input, then layer-normed), learned positions offset by 2 (BART's
table has two rows before position 0), `layernorm_embedding` after the embeddings, the embeddings scaled by
sqrt(d_model) where the config's `scale_embedding` says, and an LM head tied to the token embeddings plus
`final_logits_bias`. The decoding pieces (the encoder, each decoder layer's cross-attention keys and values from
it, one decoder step against a static cache) are methods here; the beam search is `nlp.bart_generate`.

Weights load from a `save_pretrained` directory: `model.safetensors`, `pytorch_model.bin` (read with torch, only
when it is the one present) or `flax_model.msgpack`.
"""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx, serialization
from safetensors import safe_open
from safetensors.numpy import save_file

from cfir_jax.core.errors import CfirError

_NEG = -1e9  # Added to the scores of masked keys: exp() of it is exactly 0 next to any real score.


@dataclasses.dataclass(frozen=True)
class BartConfig:
    """The architecture fields of a BART config.json that the model reads."""

    vocab_size: int
    d_model: int
    encoder_layers: int
    decoder_layers: int
    encoder_attention_heads: int
    decoder_attention_heads: int
    encoder_ffn_dim: int
    decoder_ffn_dim: int
    max_position_embeddings: int
    scale_embedding: bool = False
    activation_function: str = "gelu"

    @classmethod
    def from_dict(cls, raw: dict) -> BartConfig:
        names = {f.name for f in dataclasses.fields(cls)}
        missing = [f.name for f in dataclasses.fields(cls) if f.default is dataclasses.MISSING and f.name not in raw]
        if missing:
            raise CfirError(f"BART config: no {', '.join(missing)} (not a BART config.json)")
        if raw.get("activation_function", "gelu") != "gelu":
            raise CfirError(f"BART config: activation_function={raw['activation_function']!r}; only gelu is built")
        return cls(**{k: v for k, v in raw.items() if k in names})


def read_config(model_dir: Path) -> dict:
    """config.json of a model directory, as a dict."""
    path = Path(model_dir) / "config.json"
    if not path.is_file():
        raise CfirError(f"{model_dir}: no config.json; not a model directory made by save_pretrained")
    raw = json.loads(path.read_text())
    if not raw.get("is_encoder_decoder", True) or raw.get("model_type", "bart") != "bart":
        raise CfirError(f"{model_dir}: {raw.get('model_type')} is not a BART encoder-decoder summarisation model")
    return raw


class Dense(nnx.Module):
    def __init__(self, d_in: int, d_out: int, dtype, rngs: nnx.Rngs):
        self.kernel = nnx.Param(jax.random.normal(rngs.params(), (d_in, d_out), dtype) * 0.02)
        self.bias = nnx.Param(jnp.zeros((d_out,), dtype))

    def __call__(self, x):
        return x @ self.kernel[...] + self.bias[...]


class LayerNorm(nnx.Module):
    def __init__(self, d: int, dtype):
        self.scale, self.bias = nnx.Param(jnp.ones((d,), dtype)), nnx.Param(jnp.zeros((d,), dtype))

    def __call__(self, x):
        x32 = x.astype(jnp.float32)
        mean = x32.mean(-1, keepdims=True)
        var = jnp.square(x32 - mean).mean(-1, keepdims=True)
        y = (x32 - mean) * jax.lax.rsqrt(var + 1e-5)
        return (y * self.scale[...].astype(jnp.float32) + self.bias[...].astype(jnp.float32)).astype(x.dtype)


def _heads(x, heads: int):
    """[..., length, d] -> [..., heads, length, d / heads]."""
    *lead, length, d = x.shape
    return jnp.swapaxes(x.reshape(*lead, length, heads, d // heads), -2, -3)


def _merge(x):
    """[..., heads, length, hd] -> [..., length, heads * hd]."""
    x = jnp.swapaxes(x, -2, -3)
    return x.reshape(*x.shape[:-2], x.shape[-2] * x.shape[-1])


def _softmax(scores, dtype):
    return jax.nn.softmax(scores.astype(jnp.float32), axis=-1).astype(dtype)


class Attention(nnx.Module):
    def __init__(self, d: int, heads: int, dtype, rngs: nnx.Rngs):
        self.heads = heads
        self.q_proj, self.k_proj = Dense(d, d, dtype, rngs), Dense(d, d, dtype, rngs)
        self.v_proj, self.out_proj = Dense(d, d, dtype, rngs), Dense(d, d, dtype, rngs)

    def query(self, x):
        return _heads(self.q_proj(x), self.heads) * (x.shape[-1] // self.heads) ** -0.5

    def query_per_head(self, x):
        """Queries of x [..., d] as [..., heads, head_dim] (one position per row: no length axis)."""
        hd = x.shape[-1] // self.heads
        return self.q_proj(x).reshape(*x.shape[:-1], self.heads, hd) * hd ** -0.5

    def keys_values(self, x):
        """Keys and values of `x` [..., length, d]: each [..., heads, length, head_dim]."""
        return _heads(self.k_proj(x), self.heads), _heads(self.v_proj(x), self.heads)

    def full(self, x, key_mask):
        """Self-attention over the whole of x [rows, length, d]; key_mask bool [rows, length]."""
        q = self.query(x)
        k, v = self.keys_values(x)
        scores = jnp.einsum("bhqd,bhkd->bhqk", q, k) + jnp.where(key_mask, 0.0, _NEG)[:, None, None, :]
        return self.out_proj(_merge(jnp.einsum("bhqk,bhkd->bhqd", _softmax(scores, q.dtype), v)))


class EncoderLayer(nnx.Module):
    def __init__(self, c: BartConfig, dtype, rngs: nnx.Rngs):
        self.self_attn = Attention(c.d_model, c.encoder_attention_heads, dtype, rngs)
        self.self_attn_layer_norm = LayerNorm(c.d_model, dtype)
        self.fc1, self.fc2 = Dense(c.d_model, c.encoder_ffn_dim, dtype, rngs), Dense(c.encoder_ffn_dim, c.d_model,
                                                                                    dtype, rngs)
        self.final_layer_norm = LayerNorm(c.d_model, dtype)

    def __call__(self, h, mask):
        h = self.self_attn_layer_norm(h + self.self_attn.full(h, mask))
        return self.final_layer_norm(h + self.fc2(jax.nn.gelu(self.fc1(h), approximate=False)))


class DecoderLayer(nnx.Module):
    def __init__(self, c: BartConfig, dtype, rngs: nnx.Rngs):
        self.self_attn = Attention(c.d_model, c.decoder_attention_heads, dtype, rngs)
        self.self_attn_layer_norm = LayerNorm(c.d_model, dtype)
        self.encoder_attn = Attention(c.d_model, c.decoder_attention_heads, dtype, rngs)
        self.encoder_attn_layer_norm = LayerNorm(c.d_model, dtype)
        self.fc1, self.fc2 = Dense(c.d_model, c.decoder_ffn_dim, dtype, rngs), Dense(c.decoder_ffn_dim, c.d_model,
                                                                                    dtype, rngs)
        self.final_layer_norm = LayerNorm(c.d_model, dtype)

    def step(self, h, position, cache, cross, src_mask):
        """One decoding step of rows = docs x beams. h [docs, beams, d]; cache (k, v) [docs, beams, heads, max_len,
        hd]; cross (k, v) [docs, heads, src, hd], once per document: the beams' queries broadcast over them."""
        attn = self.self_attn
        q = attn.query(h[:, :, None, :])  # [docs, beams, heads, 1, hd]
        k_new, v_new = attn.keys_values(h[:, :, None, :])
        k = jax.lax.dynamic_update_slice_in_dim(cache[0], k_new, position, axis=3)
        v = jax.lax.dynamic_update_slice_in_dim(cache[1], v_new, position, axis=3)
        seen = jnp.arange(k.shape[3]) <= position
        scores = jnp.einsum("dbhqe,dbhke->dbhqk", q, k) + jnp.where(seen, 0.0, _NEG)
        out = jnp.einsum("dbhqk,dbhke->dbhqe", _softmax(scores, q.dtype), v)
        h = self.self_attn_layer_norm(h + attn.out_proj(_merge(out)[:, :, 0]))
        cq = self.encoder_attn.query_per_head(h)  # [docs, beams, heads, hd]: no copy of the keys per beam
        scores = jnp.einsum("dbhe,dhse->dbhs", cq, cross[0]) + jnp.where(src_mask, 0.0, _NEG)[:, None, None, :]
        out = jnp.einsum("dbhs,dhse->dbhe", _softmax(scores, cq.dtype), cross[1])
        h = self.encoder_attn_layer_norm(h + self.encoder_attn.out_proj(out.reshape(*out.shape[:2], -1)))
        h = self.final_layer_norm(h + self.fc2(jax.nn.gelu(self.fc1(h), approximate=False)))
        return h, (k, v)


class Bart(nnx.Module):
    """BartForConditionalGeneration's arithmetic: encode, cross keys/values, one decoder step."""

    def __init__(self, c: BartConfig, dtype=jnp.float32, rngs: nnx.Rngs | None = None):
        rngs = rngs or nnx.Rngs(0)
        self.config = c
        self.shared = nnx.Param(jax.random.normal(rngs.params(), (c.vocab_size, c.d_model), dtype) * 0.02)
        self.encoder_positions = nnx.Param(jnp.zeros((c.max_position_embeddings + 2, c.d_model), dtype))
        self.decoder_positions = nnx.Param(jnp.zeros((c.max_position_embeddings + 2, c.d_model), dtype))
        self.encoder_layernorm_embedding = LayerNorm(c.d_model, dtype)
        self.decoder_layernorm_embedding = LayerNorm(c.d_model, dtype)
        self.encoder_layers = nnx.List([EncoderLayer(c, dtype, rngs) for _ in range(c.encoder_layers)])
        self.decoder_layers = nnx.List([DecoderLayer(c, dtype, rngs) for _ in range(c.decoder_layers)])
        self.final_logits_bias = nnx.Param(jnp.zeros((c.vocab_size,), dtype))

    def _embed(self, ids):
        scale = math.sqrt(self.config.d_model) if self.config.scale_embedding else 1.0
        return jnp.take(self.shared[...], ids, axis=0) * scale

    def encode(self, input_ids, mask):
        """Encoder states [docs, src, d] of input_ids [docs, src] (mask: 1 for tokens, 0 for padding)."""
        mask = mask.astype(bool)
        h = self._embed(input_ids) + self.encoder_positions[...][2 : 2 + input_ids.shape[1]]
        h = self.encoder_layernorm_embedding(h)
        for layer in self.encoder_layers:
            h = layer(h, mask)
        return h

    def cross_keys_values(self, states):
        """Each decoder layer's cross-attention (keys, values) [docs, heads, src, hd], once per document."""
        return tuple(layer.encoder_attn.keys_values(states) for layer in self.decoder_layers)

    def empty_cache(self, docs: int, beams: int, max_length: int, dtype):
        c = self.config
        shape = (docs, beams, c.decoder_attention_heads, max_length, c.d_model // c.decoder_attention_heads)
        return tuple((jnp.zeros(shape, dtype), jnp.zeros(shape, dtype)) for _ in self.decoder_layers)

    def decode_step(self, tokens, position, cache, cross, src_mask):
        """Logits (float32) [docs, beams, vocab] of the next token after tokens [docs, beams] at `position`, and the
        self-attention cache with this position's keys and values written."""
        h = self._embed(tokens) + jax.lax.dynamic_index_in_dim(self.decoder_positions[...], position + 2, 0, False)
        h = self.decoder_layernorm_embedding(h)
        new_cache = []
        for layer, layer_cache, layer_cross in zip(self.decoder_layers, cache, cross):
            h, kv = layer.step(h, position, layer_cache, layer_cross, src_mask.astype(bool))
            new_cache.append(kv)
        logits = h @ self.shared[...].T + self.final_logits_bias[...]
        return logits.astype(jnp.float32), tuple(new_cache)


# How a parameter of this model is named in a transformers checkpoint (its "model." prefix dropped): the leaf's name
# in PyTorch terms (a Dense kernel is stored transposed there, as `weight`).
_LEAF = {"kernel": "weight", "scale": "weight", "bias": "bias"}


def checkpoint_name(path: tuple) -> str:
    """The transformers name of the parameter at `path` of the NNX state (e.g. encoder_layers/0/fc1/kernel ->
    encoder.layers.0.fc1.weight)."""
    top, rest = str(path[0]), [str(p) for p in path[1:]]
    if top == "shared":
        return "shared.weight"
    if top == "final_logits_bias":
        return "final_logits_bias"
    side, part = top.split("_", 1)
    if part == "positions":
        return f"{side}.embed_positions.weight"
    if part == "layernorm_embedding":
        return f"{side}.layernorm_embedding.{_LEAF[rest[-1]]}"
    return ".".join([side, "layers", *rest[:-1], _LEAF[rest[-1]]])


def _flatten(tree: dict, prefix: str = "") -> dict:
    out = {}
    for k, v in tree.items():
        name = f"{prefix}{k}"
        out.update(_flatten(v, name + ".") if isinstance(v, dict) else {name: v})
    return out


def read_checkpoint(model_dir: Path) -> dict[str, np.ndarray]:
    """Every tensor of the directory's weights by its PyTorch-style name, without the "model." prefix: Flax
    kernels transposed to PyTorch's [out, in], embeddings and layer-norm scales named `weight`."""
    model_dir = Path(model_dir)
    if (model_dir / "model.safetensors").is_file():
        with safe_open(str(model_dir / "model.safetensors"), framework="flax") as f:
            tensors = {k: np.asarray(f.get_tensor(k), np.float32) for k in f.keys()}
    elif (model_dir / "pytorch_model.bin").is_file():
        # why: torch is only the reader of a PyTorch-only checkpoint, never a runtime need.
        import torch

        state = torch.load(model_dir / "pytorch_model.bin", map_location="cpu", weights_only=True)
        tensors = {k: v.float().numpy() for k, v in state.items()}
    elif (model_dir / "flax_model.msgpack").is_file():
        raw = _flatten(serialization.msgpack_restore((model_dir / "flax_model.msgpack").read_bytes()))
        tensors = {}
        for k, v in raw.items():
            head, _, leaf = k.rpartition(".")
            v = np.asarray(v, np.float32)
            name = "weight" if leaf in ("kernel", "embedding", "scale") else leaf
            tensors[f"{head}.{name}" if head else name] = v.T if leaf == "kernel" else v
    else:
        raise CfirError(f"{model_dir}: no weights (model.safetensors, pytorch_model.bin or flax_model.msgpack); "
                        "save it with save_pretrained")
    return {k.removeprefix("model."): v for k, v in tensors.items()}


def load_bart(model_dir: Path, dtype=jnp.float32) -> Bart:
    """The model of a save_pretrained directory, its parameters in `dtype`."""
    config = BartConfig.from_dict(read_config(model_dir))
    tensors = read_checkpoint(model_dir)
    if "shared.weight" not in tensors:  # Some checkpoints keep the tied table under the encoder's name only.
        tensors["shared.weight"] = tensors.get("encoder.embed_tokens.weight", tensors.get("lm_head.weight"))
    model = nnx.eval_shape(lambda: Bart(config, dtype))
    graphdef, state = nnx.split(model)
    pure = nnx.to_pure_dict(state)

    def fill(path, leaf):
        name = checkpoint_name(tuple(k.key if hasattr(k, "key") else k.idx for k in path))
        value = tensors.get(name)
        if value is None:
            raise CfirError(f"{model_dir}: the weights have no {name}; not a BART checkpoint of this config")
        value = value.reshape(-1) if name == "final_logits_bias" else value
        value = value.T if path[-1].key == "kernel" else value
        if value.shape != leaf.shape:
            raise CfirError(f"{model_dir}: {name} has shape {value.shape}, the config needs {leaf.shape}")
        return jnp.asarray(value, dtype)

    nnx.replace_by_pure_dict(state, jax.tree_util.tree_map_with_path(fill, pure))
    return nnx.merge(graphdef, state)


def abstract_model(config: BartConfig, dtype=jnp.float32) -> Bart:
    """The model with abstract parameters (jax.ShapeDtypeStruct): nothing allocated."""
    return nnx.eval_shape(lambda: Bart(config, dtype))


def save_bart(model: Bart, directory: Path, config: dict) -> None:
    """`model` as a save_pretrained directory (config.json + model.safetensors, transformers' names), which
    `load_bart` and transformers' BartForConditionalGeneration both read."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    tensors = {}
    for path, leaf in jax.tree_util.tree_leaves_with_path(nnx.to_pure_dict(nnx.state(model))):
        keys = tuple(k.key if hasattr(k, "key") else k.idx for k in path)
        value = np.asarray(leaf, np.float32)
        name = checkpoint_name(keys)
        tensors["model." + name if name != "final_logits_bias" else name] = (
            value.T if keys[-1] == "kernel" else value[None] if name == "final_logits_bias" else value)
    save_file({k: np.ascontiguousarray(v) for k, v in tensors.items()}, str(directory / "model.safetensors"),
              metadata={"format": "pt"})
    (directory / "config.json").write_text(json.dumps({"model_type": "bart", "is_encoder_decoder": True,
                                                       "architectures": ["BartForConditionalGeneration"], **config},
                                                      indent=1))
