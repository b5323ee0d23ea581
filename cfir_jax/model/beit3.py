"""Decoupling-BEiT-3 in Flax NNX: the multiway BEiT-3 encoder used as a dual encoder.

BEiT-3 is a multiway transformer: every LayerNorm and Linear has a vision expert (A) and a language expert (B), and
only attention scores mix tokens. CFIR never fuses the two modalities ("Decoupling-BEiT-3": the vision-language
expert is dropped), so an image pass runs every layer with expert A and a text pass with expert B, and the two
experts share no parameter. We therefore store each expert as its own stack of layers (`A` and `B`), which makes
"train only the language expert" the single regex `B/.*` and keeps the frozen vision tower off the accelerators
while training.

Layers are stored stacked (every parameter of `A.layers`/`B.layers` has a leading `[num_layers]` axis), so the same
checkpoint serves `scan_layers=True` (one compiled layer, fast compiles for the 24-layer model) and an unrolled loop.

The computation follows torchscale's `BEiT3` exactly: pre-LN with Sub-LN, the query scaled before
the dot product, softmax in float32, exact erf GELU, separate position tables used from row 2 (fairseq), padded
positions zeroed after the embedding, a final per-expert LayerNorm, token 0 through a bias-free head, L2-normalised.
"""

from __future__ import annotations

import math
import re
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16, "float16": jnp.float16}
# What a rematerialised layer keeps for its backward pass (model.remat_policy): only its input, or also the outputs
# of its weight matmuls (dots without batch dimensions: q, k, v, out, fc1, fc2; not the attention's two products).
REMAT_POLICIES = {"nothing": jax.checkpoint_policies.nothing_saveable,
                  "projections": jax.checkpoint_policies.dots_with_no_batch_dims_saveable}

# Initialisers of the reference (`BEiT3Wrapper._init_weights`): truncated normal std 0.02 for Linear weights and
# the cls/mask tokens, zero biases, unit LayerNorms.
_dense_init = nnx.initializers.truncated_normal(stddev=0.02)


def axes(*names: str | None) -> dict[str, Any]:
    """Variable metadata naming each parameter axis logically ('embed', 'mlp', ...); `partition.py` maps the names
    to mesh axes with the config's rules. Not sharded at creation (eager_sharding off): the model is also built
    without a mesh (conversion, the host-side vision tower), and the trainer shards by jit out_shardings."""
    return {"out_sharding": names, "eager_sharding": False}


def _dtype(name: str | Any) -> Any:
    return DTYPES[name] if isinstance(name, str) else name


class Block(nnx.Module):
    """One encoder layer of one expert: Sub-LN attention then Sub-LN FFN, both pre-LN with residuals.

    x [batch, seq, dim] -> [batch, seq, dim].
    """

    def __init__(self, config: Any, *, rngs: nnx.Rngs):
        d, f = config.embed_dim, config.ffn_dim
        eps = config.layernorm_eps
        dtype, pdtype = _dtype(config.dtype), _dtype(config.param_dtype)
        self.num_heads = config.num_heads
        self.dtype = dtype

        def linear(i: int, o: int, names: tuple[str, str]) -> nnx.Linear:
            return nnx.Linear(i, o, kernel_init=_dense_init, dtype=dtype, param_dtype=pdtype, rngs=rngs,
                              kernel_metadata=axes(*names), bias_metadata=axes(names[1]))

        def norm(n: int, name: str) -> nnx.LayerNorm:
            return nnx.LayerNorm(n, epsilon=eps, dtype=dtype, param_dtype=pdtype, rngs=rngs,
                                 scale_metadata=axes(name), bias_metadata=axes(name))

        # Logical axes: 'embed' the residual stream, 'heads' the concatenated attention heads, 'mlp' the FFN.
        self.self_attn_layer_norm = norm(d, "embed")
        self.q_proj, self.k_proj, self.v_proj = (linear(d, d, ("embed", "heads")) for _ in range(3))
        self.inner_attn_ln = norm(d, "heads")
        self.out_proj = linear(d, d, ("heads", "embed"))
        self.final_layer_norm = norm(d, "embed")
        self.fc1 = linear(d, f, ("embed", "mlp"))
        self.ffn_layernorm = norm(f, "mlp")
        self.fc2 = linear(f, d, ("mlp", "embed"))

    def __call__(
        self,
        x: jax.Array,
        key_mask: jax.Array | None,
        drop_path_rate: jax.Array | float = 0.0,
        dropout_rate: float = 0.0,
        rng: jax.Array | None = None,
    ) -> jax.Array:
        """`key_mask` [batch, seq] bool is True where a key may be attended (not padding)."""
        b, s, d = x.shape
        heads = self.num_heads
        rngs = list(jax.random.split(rng, 4)) if rng is not None else [None] * 4

        h = self.self_attn_layer_norm(x)
        head_dim = d // heads
        # The reference scales the query before the product (not the logits): keep that order for parity.
        q = (self.q_proj(h) * head_dim**-0.5).reshape(b, s, heads, head_dim)
        k = self.k_proj(h).reshape(b, s, heads, head_dim)
        v = self.v_proj(h).reshape(b, s, heads, head_dim)
        mask = None if key_mask is None else key_mask[:, None, None, :]
        o = jax.nn.dot_product_attention(q, k, v, mask=mask, scale=1.0)
        o = self.out_proj(self.inner_attn_ln(o.reshape(b, s, d)))
        x = x + _drop_path(_dropout(o, dropout_rate, rngs[0]), drop_path_rate, rngs[1])

        h = self.fc1(self.final_layer_norm(x))
        h = jax.nn.gelu(h.astype(jnp.float32), approximate=False).astype(h.dtype)
        h = self.fc2(self.ffn_layernorm(h))
        return x + _drop_path(_dropout(h, dropout_rate, rngs[2]), drop_path_rate, rngs[3])


def _dropout(x: jax.Array, rate: float, rng: jax.Array | None) -> jax.Array:
    if rng is None or rate == 0.0:
        return x
    keep = jax.random.bernoulli(rng, 1.0 - rate, x.shape)
    return jnp.where(keep, x / (1.0 - rate), 0).astype(x.dtype)


def _drop_path(x: jax.Array, rate: jax.Array | float, rng: jax.Array | None) -> jax.Array:
    """Stochastic depth: drops the whole residual branch per example with probability `rate`."""
    if rng is None or (isinstance(rate, (int, float)) and rate == 0.0):
        return x
    keep_prob = 1.0 - rate
    keep = jax.random.uniform(rng, (x.shape[0],) + (1,) * (x.ndim - 1)) < keep_prob
    return jnp.where(keep, x / keep_prob, 0).astype(x.dtype)


class Expert(nnx.Module):
    """One modality's tower: its position table, `num_layers` stacked Blocks and the final LayerNorm.

    `activation_sharding` (a jax Sharding of [batch, seq, dim], set by the trainer after merging the module) keeps
    the residual stream split over the batch between layers: without it the partitioner met FSDP-sharded weights by
    gathering the whole batch's activations onto every chip (seen in the TPU-compiled large step).
    """

    activation_sharding: Any = None

    def __init__(self, config: Any, num_positions: int, *, rngs: nnx.Rngs):
        pdtype = _dtype(config.param_dtype)
        self.num_layers = config.num_layers
        self.scan_layers = bool(config.scan_layers)
        self.remat = bool(config.remat)
        self.remat_policy = str(config.remat_policy)
        if self.remat_policy not in REMAT_POLICIES:
            raise ValueError(f"model.remat_policy={self.remat_policy!r}: use one of {', '.join(REMAT_POLICIES)}")
        self.dropout = float(config.dropout)
        self.drop_path_rates = tuple(np.linspace(0.0, float(config.drop_path_rate), config.num_layers))
        self.embed_positions = nnx.Param(
            nnx.initializers.truncated_normal(0.02)(rngs.params(), (num_positions, config.embed_dim), pdtype),
            **axes("positions", "embed"),
        )

        @nnx.split_rngs(splits=config.num_layers)
        @nnx.vmap(in_axes=(0,), out_axes=0, transform_metadata={nnx.PARTITION_NAME: "layers"})
        def make_layers(rngs: nnx.Rngs) -> Block:
            return Block(config, rngs=rngs)

        self.layers = make_layers(rngs)
        self.layer_norm = nnx.LayerNorm(
            config.embed_dim,
            epsilon=config.layernorm_eps,
            dtype=_dtype(config.dtype),
            param_dtype=pdtype,
            rngs=rngs,
            scale_metadata=axes("embed"),
            bias_metadata=axes("embed"),
        )

    def __call__(
        self,
        x: jax.Array,
        padding_mask: jax.Array | None = None,
        rng: jax.Array | None = None,
        return_hidden: bool = False,
    ) -> jax.Array | tuple[jax.Array, list[jax.Array]]:
        """x [batch, seq, dim] token embeddings -> [batch, seq, dim] after the final LayerNorm.

        `padding_mask` [batch, seq]: 1/True marks padding (the reference convention). With `return_hidden`, also
        returns the input of every layer and the last layer's output (before the final LayerNorm), as the
        reference's `encoder_states`.
        """
        seq = x.shape[1]
        if seq + 2 > self.embed_positions.shape[0]:
            raise ValueError(f"sequence of {seq} tokens exceeds the {self.embed_positions.shape[0] - 2} positions")
        x = x + self.embed_positions[2 : seq + 2].astype(x.dtype)[None]
        key_mask = None
        if padding_mask is not None:
            padding_mask = padding_mask.astype(bool)
            x = x * (1 - padding_mask[..., None].astype(x.dtype))
            key_mask = ~padding_mask

        graphdef, layer_state = nnx.split(self.layers)
        rates = jnp.asarray(self.drop_path_rates, jnp.float32)
        keys = jax.random.split(rng, self.num_layers) if rng is not None else None
        dropout = self.dropout if rng is not None else 0.0
        # Inside the scan the rate is traced, so decide here (statically) whether drop path runs at all: a zero
        # rate must cost nothing (a random draw and a select per branch and layer otherwise).
        use_drop_path = rng is not None and max(self.drop_path_rates) > 0.0

        def apply(x, state, rate, key):
            return nnx.merge(graphdef, state)(x, key_mask, rate if use_drop_path else 0.0, dropout, key)

        if self.remat:
            apply = jax.checkpoint(apply, prevent_cse=not self.scan_layers, policy=REMAT_POLICIES[self.remat_policy])

        if self.activation_sharding is not None:
            sharding = self.activation_sharding
            unconstrained = apply
            apply = lambda *a: jax.lax.with_sharding_constraint(unconstrained(*a), sharding)  # noqa: E731
            x = jax.lax.with_sharding_constraint(x, sharding)

        hidden = [x]
        if self.scan_layers and not return_hidden:

            def body(x, xs):
                state, rate, key = xs
                return apply(x, state, rate, key), None

            x, _ = jax.lax.scan(body, x, (layer_state, rates, keys))
        else:
            for i in range(self.num_layers):
                state_i = jax.tree.map(lambda p, i=i: p[i], layer_state)
                x = apply(x, state_i, rates[i], None if keys is None else keys[i])
                hidden.append(x)
        out = self.layer_norm(x)
        return (out, hidden) if return_hidden else out


class PatchEmbed(nnx.Module):
    """Image [batch, H, W, 3] -> [batch, 1 + (H/p)*(W/p), dim]: a stride-p conv, patches row-major, cls first."""

    def __init__(self, config: Any, *, rngs: nnx.Rngs):
        p, d = config.patch_size, config.embed_dim
        pdtype = _dtype(config.param_dtype)
        self.dtype = _dtype(config.dtype)
        self.proj = nnx.Conv(
            config.in_chans, d, kernel_size=(p, p), strides=(p, p), padding="VALID",
            dtype=self.dtype, param_dtype=pdtype, rngs=rngs,
            kernel_metadata=axes(None, None, None, "embed"), bias_metadata=axes("embed"),
        )
        self.cls_token = nnx.Param(_dense_init(rngs.params(), (1, 1, d), pdtype), **axes(None, None, "embed"))
        # Present in every official checkpoint (masked image modelling), unused for retrieval; kept so parameter
        # counts and checkpoints match the reference.
        self.mask_token = nnx.Param(_dense_init(rngs.params(), (1, 1, d), pdtype), **axes(None, None, "embed"))

    def __call__(self, pixels: jax.Array) -> jax.Array:
        x = self.proj(pixels.astype(self.dtype))
        b, h, w, d = x.shape
        x = x.reshape(b, h * w, d)
        cls = jnp.broadcast_to(self.cls_token[...].astype(x.dtype), (b, 1, d))
        return jnp.concatenate([cls, x], axis=1)


class DBeit3(nnx.Module):
    """The Decoupling-BEiT-3 dual encoder with its two retrieval heads and the contrastive temperature.

    `encode_image(pixels [B, H, W, 3] in [-1, 1]) -> [B, D]` and `encode_text(ids [B, L], padding_mask [B, L])
    -> [B, D]` return L2-normalised float32 embeddings.
    """

    def __init__(self, config: Any, *, rngs: nnx.Rngs):
        d = config.embed_dim
        pdtype = _dtype(config.param_dtype)
        self.config = config
        self.dtype = _dtype(config.dtype)
        num_patches = (config.image_size // config.patch_size) ** 2
        self.text_embed = nnx.Embed(
            config.vocab_size, d, embedding_init=nnx.initializers.normal(d**-0.5), param_dtype=pdtype, rngs=rngs,
            embedding_metadata=axes("vocab", "embed"),
        )
        self.vision_embed = PatchEmbed(config, rngs=rngs)
        self.A = Expert(config, num_patches + 1 + 2, rngs=rngs)  # vision expert
        self.B = Expert(config, config.max_text_positions, rngs=rngs)  # language expert

        def head() -> nnx.Linear:
            # 'joint': the shared image-text embedding space the heads project into.
            return nnx.Linear(d, d, use_bias=False, kernel_init=_dense_init, dtype=self.dtype, param_dtype=pdtype,
                              rngs=rngs, kernel_metadata=axes("embed", "joint"))

        self.vision_head = head()
        self.language_head = head()
        self.logit_scale = nnx.Param(jnp.asarray(math.log(1 / 0.07), pdtype))

    def image_features(self, pixels: jax.Array, rng: jax.Array | None = None, return_hidden: bool = False):
        """pixels [B, H, W, 3] -> final-LayerNorm token states [B, 1 + N, D] (and hidden states on request)."""
        return self.A(self.vision_embed(pixels), None, rng, return_hidden)

    def text_features(
        self, ids: jax.Array, padding_mask: jax.Array, rng: jax.Array | None = None, return_hidden: bool = False
    ):
        """ids [B, L] int32, padding_mask [B, L] (1 = pad) -> token states [B, L, D] (and hidden states)."""
        return _text_features(self, ids, padding_mask, rng, return_hidden)

    def encode_image(self, pixels: jax.Array, rng: jax.Array | None = None) -> jax.Array:
        """pixels [B, H, W, 3] float in [-1, 1] -> L2-normalised embeddings [B, D] float32."""
        return _l2_normalize(self.vision_head(self.image_features(pixels, rng)[:, 0]))

    def encode_text(self, ids: jax.Array, padding_mask: jax.Array, rng: jax.Array | None = None) -> jax.Array:
        """ids [B, L] int32, padding_mask [B, L] (1 = pad) -> L2-normalised embeddings [B, D] float32.

        `rng` enables dropout and drop path (training); None is the deterministic evaluation pass.
        """
        return _encode_text(self, ids, padding_mask, rng)

    def text_tower(self) -> TextTower:
        """The text path alone (sharing this model's Variables)."""
        return TextTower(self)


class TextTower(nnx.Module):
    """The text path of a DBeit3: token embedding, language expert B, language head and temperature.

    It shares the Variables of the DBeit3 it is made from and has the same parameter paths, so training can put
    exactly this on the accelerators and leave the vision tower on the host.
    """

    def __init__(self, model: DBeit3):
        self.config = model.config
        self.dtype = model.dtype
        self.text_embed = model.text_embed
        self.B = model.B
        self.language_head = model.language_head
        self.logit_scale = model.logit_scale

    def encode_text(self, ids: jax.Array, padding_mask: jax.Array, rng: jax.Array | None = None) -> jax.Array:
        """As `DBeit3.encode_text`."""
        return _encode_text(self, ids, padding_mask, rng)

    def encode_text_tokens(self, ids: jax.Array, padding_mask: jax.Array) -> jax.Array:
        """ids [B, L], padding_mask [B, L] -> every token's final state through the language head, L2-normalised,
        [B, L, D] float32: token 0 is `encode_text`'s embedding, the others live in the same joint space (the
        re-ranker's late interaction with image embeddings)."""
        return _l2_normalize(self.language_head(_text_features(self, ids, padding_mask)))


def _text_features(m: DBeit3 | TextTower, ids, padding_mask, rng=None, return_hidden=False):
    x = m.text_embed(ids).astype(m.dtype)
    return m.B(x, padding_mask, rng, return_hidden)


def _encode_text(m: DBeit3 | TextTower, ids, padding_mask, rng=None) -> jax.Array:
    return _l2_normalize(m.language_head(_text_features(m, ids, padding_mask, rng)[:, 0]))


def _l2_normalize(x: jax.Array) -> jax.Array:
    x = x.astype(jnp.float32)
    # torch.nn.functional.normalize: x / max(||x||, 1e-12)
    return x / jnp.maximum(jnp.linalg.norm(x, axis=-1, keepdims=True), 1e-12)


def create_model(config: Any, seed: int = 0) -> DBeit3:
    """A randomly initialised model (initialised in one compiled program: eager init is op-by-op and slow)."""
    graphdef, _ = nnx.split(abstract_model(config))
    state = jax.jit(lambda: nnx.split(DBeit3(config, rngs=nnx.Rngs(seed)))[1])()
    return nnx.merge(graphdef, state)


def abstract_model(config: Any) -> DBeit3:
    """The model with `jax.ShapeDtypeStruct` leaves: shapes and counts without allocating anything."""
    return nnx.eval_shape(lambda: DBeit3(config, rngs=nnx.Rngs(0)))


def count_params(model: DBeit3, regex: str | None = None) -> int:
    """Number of parameters, optionally only those whose '/'-joined path matches `regex` (re.fullmatch)."""
    state = nnx.state(model, nnx.Param)
    total = 0
    for path, leaf in jax.tree_util.tree_flatten_with_path(state)[0]:
        name = param_path(path)
        if regex is None or re.fullmatch(regex, name):
            total += int(np.prod(leaf.shape))
    return total


def param_path(path: tuple) -> str:
    """'/'-joined parameter path from a jax key path ('B/layers/q_proj/kernel')."""
    parts = []
    for k in path:
        name = getattr(k, "key", getattr(k, "name", getattr(k, "idx", None)))
        if name is None:
            name = str(k)
        if name == "value":  # the Variable's own leaf
            continue
        parts.append(str(name))
    return "/".join(parts)
