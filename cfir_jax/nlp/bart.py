"""BART-large-CNN with CFIR's generation settings: Flax, beam search jitted once per (rows, length) bucket, data
parallel over a host's devices, and its no-repeat n-gram rule as a dense static-shaped mask. Imported only where BART
summarises (`cfir_jax.nlp.summarizer.make_summarizer`) or compiles (`cfir_jax.aot.programs`).
"""

from __future__ import annotations

import copy
import os
import socket
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import huggingface_hub
import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P
from transformers import BartConfig, BartTokenizerFast, FlaxBartForConditionalGeneration
from transformers.generation.flax_logits_process import FlaxLogitsProcessor, FlaxLogitsProcessorList

from cfir_jax.core.errors import CfirError

# Input lengths are padded up to one of these (capped at max_input_tokens), so generation compiles at most
# len(buckets) times however long the documents are; doubling keeps the padding waste under 2x.
_LENGTH_BUCKETS = (64, 128, 256, 512, 1024)


# The files a Flax BART checkpoint directory needs, without the weights.
_CONFIG_FILES = ("config.json", "generation_config.json")


_TOKENIZER_FILES = ("vocab.json", "merges.txt", "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")


_FLAX_WEIGHTS = "flax_model.msgpack"


_PT_WEIGHTS = ("model.safetensors", "pytorch_model.bin")


def no_repeat_ngram_mask(sequences, cur_len, ngram_size: int, vocab_size: int):
    """Tokens that would repeat an n-gram already in the sequence: bool [rows, vocab_size].

    sequences: int [rows, max_length], generated up to `cur_len` (a traced scalar inside the generation loop). A token
    t is banned when the last n-1 tokens followed by t occur earlier. Dense and static-shaped, O(rows * max_length):
    transformers' Flax processor builds a sparse BCOO tensor that jax>=0.7 can no longer gather from.
    """
    n = ngram_size
    rows, length = sequences.shape
    windows = length - n + 1  # Start positions of n-grams.
    if windows < 1:
        return jnp.zeros((rows, vocab_size), bool)
    start = jnp.maximum(cur_len - (n - 1), 0)
    prefix = jax.lax.dynamic_slice(sequences, (0, start), (rows, n - 1))  # [rows, n - 1]
    match = jnp.arange(windows)[None, :] <= cur_len - n  # Only n-grams that are fully generated.
    for j in range(n - 1):
        match = match & (sequences[:, j : j + windows] == prefix[:, j : j + 1])
    following = sequences[:, n - 1 :]  # [rows, windows]: the token ending each n-gram.
    return jnp.zeros((rows, vocab_size), bool).at[jnp.arange(rows)[:, None], following].max(match)


class NoRepeatNGram(FlaxLogitsProcessor):
    """A transformers Flax logits processor around `no_repeat_ngram_mask`."""

    def __init__(self, ngram_size: int):
        self.ngram_size = ngram_size

    def __call__(self, input_ids, scores, cur_len):
        banned = no_repeat_ngram_mask(input_ids, cur_len, self.ngram_size, scores.shape[-1])
        return jnp.where(banned, -jnp.inf, scores)


def _no_repeat_processor(ngram_size: int) -> NoRepeatNGram:
    return NoRepeatNGram(ngram_size)


def _looks_local(name: str) -> bool:
    return os.path.isabs(name) or name.startswith((".", "~")) or name.count("/") > 1 or os.path.exists(name)


def _hub_unreachable() -> bool:
    """True when huggingface.co does not even resolve (no network) and no proxy could reach it for us."""
    if any(os.environ.get(v) for v in ("HTTPS_PROXY", "https_proxy", "ALL_PROXY", "all_proxy")):
        return False
    try:
        socket.getaddrinfo("huggingface.co", 443)
    except OSError:
        return True
    return False


def resolve_model_dir(name_or_path: str) -> Path:
    """A local directory holding the BART checkpoint: `name_or_path` itself, or the hub snapshot of that id.

    Fails fast with a one-line CfirError rather than letting the hub client retry for minutes without a network.
    """
    expanded = os.path.expanduser(name_or_path)
    if _looks_local(name_or_path):
        if not os.path.isdir(expanded):
            raise CfirError(f"{name_or_path}: no such model directory; pass a directory made by save_pretrained")
        return Path(expanded)

    patterns = [*_CONFIG_FILES, *_TOKENIZER_FILES]
    try:  # Cached already: no network needed.
        local = huggingface_hub.snapshot_download(name_or_path, allow_patterns=patterns, local_files_only=True)
        if any((Path(local) / w).exists() for w in (_FLAX_WEIGHTS, *_PT_WEIGHTS)):
            return Path(local)
    except Exception:  # noqa: BLE001 - any failure here just means "not cached"; the download below reports.
        pass
    if os.environ.get("HF_HUB_OFFLINE") or _hub_unreachable():
        raise CfirError(
            f"{name_or_path}: not a local directory and the Hugging Face hub is unreachable; download it elsewhere "
            "(huggingface-cli download) and pass the directory"
        )
    try:
        local = Path(huggingface_hub.snapshot_download(name_or_path, allow_patterns=[*patterns, _FLAX_WEIGHTS]))
        if not (local / _FLAX_WEIGHTS).exists():  # Only PyTorch weights published: convert at load time.
            local = Path(huggingface_hub.snapshot_download(name_or_path, allow_patterns=[*patterns, *_PT_WEIGHTS]))
    except Exception as e:  # noqa: BLE001 - hub errors come in many types; all mean the same to the user.
        raise CfirError(f"{name_or_path}: could not fetch from the Hugging Face hub ({type(e).__name__})") from None
    return local


def _check_bart_settings(max_length, min_length, num_beams, max_input_tokens, batch_size, no_repeat_ngram_size,
                         dtype) -> None:
    if not 1 <= min_length <= max_length:
        raise CfirError(f"BartSummarizer: need 1 <= min_length ({min_length}) <= max_length ({max_length})")
    if num_beams < 1 or batch_size < 1 or max_input_tokens < 2 or no_repeat_ngram_size < 0:
        raise CfirError(
            f"BartSummarizer: num_beams={num_beams}, batch_size={batch_size} must be >= 1, "
            f"max_input_tokens={max_input_tokens} >= 2, no_repeat_ngram_size={no_repeat_ngram_size} >= 0"
        )
    if dtype not in ("float32", "bfloat16", "float16"):
        raise CfirError(f"BartSummarizer: dtype={dtype!r}; use float32, bfloat16 or float16")


def _generation_config(model, max_length: int, min_length: int, num_beams: int, length_penalty: float):
    """An explicit GenerationConfig: the model's own (decoder start, forced BOS/EOS, early stopping) with CFIR's
    settings on top. Passing it whole avoids transformers re-deriving one from config.json at call time."""
    config = copy.deepcopy(model.generation_config)
    config.update(
        max_length=max_length,
        min_length=min_length,
        num_beams=num_beams,
        length_penalty=length_penalty,
        do_sample=False,
        # The n-gram rule is ours (see no_repeat_ngram_mask); the built-in one fails under current jax.
        no_repeat_ngram_size=0,
    )
    return config


def generation_function(model, generation_config, no_repeat_ngram_size: int,
                        on_trace: Callable[[], None] | None = None):
    """CFIR's generation as a pure function (params, input_ids [rows, length], attention_mask [rows, length]) ->
    token ids [rows, max_length]: transformers' Flax beam search with our n-gram rule. One function for the
    summarizer (jitted over its devices) and the compile-only registry (lowered for a TPU topology)."""
    processors = FlaxLogitsProcessorList()
    if no_repeat_ngram_size > 0:
        processors.append(_no_repeat_processor(no_repeat_ngram_size))

    def generate(params, input_ids, attention_mask):
        if on_trace is not None:
            on_trace()  # Runs only while tracing.
        out = model.generate(input_ids, attention_mask=attention_mask, params=params,
                             generation_config=generation_config, logits_processor=processors)
        return out.sequences

    return generate


def generation_shardings(mesh):
    """(the parameters' sharding: replicated, the rows' sharding: split over the mesh's 'data' axis)."""
    return NamedSharding(mesh, P()), NamedSharding(mesh, P("data"))


def data_parallel(generate, mesh):
    """`generate` run by every device of `mesh` on its own rows (jax.shard_map): parameters replicated, rows split.
    Left to the partitioner (jit with in_shardings alone), transformers' beam search came back replicated: the
    compiled TPU program's temporaries grew with the whole batch, not a device's rows."""
    return jax.jit(jax.shard_map(generate, mesh=mesh, in_specs=(P(), P("data"), P("data")), out_specs=P("data"),
                                 check_vma=False))


def row_buckets(batch_size: int, devices: int) -> tuple[int, ...]:
    """The row counts generation compiles for: devices x (1, 2, 4, ... up to batch_size, and batch_size)."""
    per_device = [1 << i for i in range(batch_size.bit_length()) if 1 << i < batch_size] + [batch_size]
    return tuple(devices * b for b in per_device)


class BartSummarizer:
    """Abstractive summaries with Flax BART, with CFIR's generation settings as defaults (the CFIR paper's).

    Generation is one jitted function of (params, input_ids [rows, bucket], attention_mask [rows, bucket]) -> token
    ids [rows, max_length], data parallel over `devices` (default: every local device; parameters replicated, rows
    split). Texts are sorted by length, batched up to `batch_size` rows per device, and each batch padded to a row
    bucket (devices x 1, 2, 4 ... batch_size) and a length bucket, so the function compiles at most once per pair
    and a lone query pays for one row per device. Padding changes no summary: the attention mask hides pad keys
    from the encoder and from cross-attention, positions are absolute from the left, and padded rows are dropped.

    Generation is transformers' Flax beam search. With one beam it equals PyTorch `generate` token for token (tested);
    with several it can differ from the PyTorch beam search CFIR ran in two rare cases: Flax finalises a hypothesis
    that ends in EOS anywhere in the top 2 * num_beams candidates (PyTorch only in the top num_beams), and at
    max_length Flax prefers any finished hypothesis to the unfinished ones (PyTorch scores both). On the tests'
    random model this changed 1 summary in 5; a trained model's EOS is rarely that borderline.
    """
    name = "bart"

    def __init__(
        self,
        model_name_or_path: str = "facebook/bart-large-cnn",
        max_length: int = 64,
        min_length: int = 8,
        num_beams: int = 4,
        length_penalty: float = 2.0,
        no_repeat_ngram_size: int = 3,
        max_input_tokens: int = 1024,
        batch_size: int = 8,
        dtype: str = "float32",
        devices: Sequence[Any] | None = None,
    ):

        _check_bart_settings(max_length, min_length, num_beams, max_input_tokens, batch_size, no_repeat_ngram_size,
                             dtype)
        self.model_name_or_path = model_name_or_path
        self.model_dir = resolve_model_dir(model_name_or_path)
        self.model, self.tokenizer = _load_bart(self.model_dir, jnp.dtype(dtype))

        positions = getattr(self.model.config, "max_position_embeddings", max_input_tokens)
        self.max_input_tokens = min(max_input_tokens, positions)
        if max_length > positions:
            raise CfirError(f"BartSummarizer: max_length={max_length} exceeds the model's {positions} positions")
        self.batch_size = batch_size
        self.dtype = dtype
        self.buckets = tuple(b for b in _LENGTH_BUCKETS if b < self.max_input_tokens) + (self.max_input_tokens,)

        self.generation_config = _generation_config(self.model, max_length, min_length, num_beams, length_penalty)
        self.no_repeat_ngram_size = no_repeat_ngram_size
        self.num_traces = 0  # Compilations of the generation function; the tests bound it by the bucket count.

        def count_trace():
            self.num_traces += 1

        # Data parallel over `devices` (default: every local device): the parameters replicated, the rows split.
        # A call's rows are a power of two times the device count, up to batch_size per device: a lone query pays
        # for one row per device, not for the index's whole batch.
        self.devices = list(devices) if devices is not None else jax.local_devices()
        self.mesh = jax.sharding.Mesh(np.array(self.devices), ("data",))
        replicated, _ = generation_shardings(self.mesh)
        self.params = jax.device_put(self.model.params, replicated)
        self.rows_per_call = batch_size * len(self.devices)
        self.row_buckets = row_buckets(batch_size, len(self.devices))
        fn = generation_function(self.model, self.generation_config, no_repeat_ngram_size, count_trace)
        self._generate = data_parallel(fn, self.mesh)

    @property
    def settings(self) -> dict[str, Any]:
        g = self.generation_config
        return {
            "model": self.model_name_or_path,
            "max_length": g.max_length,
            "min_length": g.min_length,
            "num_beams": g.num_beams,
            "length_penalty": g.length_penalty,
            "no_repeat_ngram_size": self.no_repeat_ngram_size,
            "early_stopping": g.early_stopping,
            "max_input_tokens": self.max_input_tokens,
            "dtype": self.dtype,
        }

    def _bucket(self, length: int) -> int:
        return next(b for b in self.buckets if b >= length)

    def _rows(self, n: int) -> int:
        return next(b for b in self.row_buckets if b >= n)

    def generate_ids(self, texts: list[str]) -> list[np.ndarray]:
        """Generated token ids per text, in order: int32 [<= max_length] each, starting with the decoder start.

        All of `texts` in as few generation calls as the batch allows (batch_size rows per device each)."""
        if not texts:
            return []
        encoded = self.tokenizer(list(texts), truncation=True, max_length=self.max_input_tokens)["input_ids"]
        order = sorted(range(len(texts)), key=lambda i: -len(encoded[i]))  # Similar lengths share a bucket.
        pad_id = self.tokenizer.pad_token_id
        results: list[np.ndarray] = [np.zeros([0], np.int32)] * len(texts)
        for start in range(0, len(order), self.rows_per_call):
            rows = order[start : start + self.rows_per_call]
            width = self._bucket(max(len(encoded[i]) for i in rows))
            height = self._rows(len(rows))
            ids = np.full((height, width), pad_id, np.int32)
            mask = np.zeros((height, width), np.int32)
            # Filler rows repeat the first row: a real input, so no all-masked row reaches the softmax.
            for r in range(height):
                tokens = encoded[rows[r] if r < len(rows) else rows[0]]
                ids[r, : len(tokens)] = tokens
                mask[r, : len(tokens)] = 1
            sequences = np.asarray(self._generate(self.params, ids, mask))
            eos = self.generation_config.eos_token_id
            for r, i in enumerate(rows):
                # Cut after the first EOS past the decoder start (also EOS in BART): beyond it is padding.
                ends = np.flatnonzero(np.isin(sequences[r, 1:], eos))
                results[i] = sequences[r, : ends[0] + 2] if ends.size else sequences[r]
        return results

    def summarize(self, texts: list[str]) -> list[str]:
        """Summaries of `texts`, in order; each input is truncated at `max_input_tokens` tokens."""
        decoded = self.tokenizer.batch_decode(self.generate_ids(texts), skip_special_tokens=True)
        return [summary.strip() for summary in decoded]


# The published architectures by hub id, so that a compile-only run needs no download (their config.json files).
ARCHITECTURES = {
    "facebook/bart-large-cnn": dict(d_model=1024, encoder_layers=12, decoder_layers=12, encoder_attention_heads=16,
                                    decoder_attention_heads=16, encoder_ffn_dim=4096, decoder_ffn_dim=4096,
                                    vocab_size=50264, max_position_embeddings=1024),
    "sshleifer/distilbart-cnn-12-6": dict(d_model=1024, encoder_layers=12, decoder_layers=6,
                                          encoder_attention_heads=16, decoder_attention_heads=16,
                                          encoder_ffn_dim=4096, decoder_ffn_dim=4096, vocab_size=50264,
                                          max_position_embeddings=1024),
}
# BART-large-CNN's special ids and generation defaults (its config.json); CFIR's settings go on top at call time.
_BART_COMMON = dict(bos_token_id=0, pad_token_id=1, eos_token_id=2, decoder_start_token_id=2, forced_bos_token_id=0,
                    forced_eos_token_id=2, num_beams=4, early_stopping=True, length_penalty=2.0, max_length=142,
                    min_length=56, no_repeat_ngram_size=3)


def abstract_bart(model_name_or_path: str, dtype: str):
    """(Flax BART without weights, its parameters as jax.ShapeDtypeStruct) from the architecture alone: a local
    directory's config.json, or a hub id of ARCHITECTURES. Nothing is downloaded or allocated."""
    expanded = Path(os.path.expanduser(model_name_or_path))
    if (expanded / "config.json").is_file():
        config = BartConfig.from_pretrained(expanded)
    elif model_name_or_path in ARCHITECTURES:
        config = BartConfig(**ARCHITECTURES[model_name_or_path], **_BART_COMMON)
    else:
        raise CfirError(f"index.summaries.bart_model={model_name_or_path!r}: no config.json there and not one of "
                        f"{', '.join(ARCHITECTURES)}; pass a model directory")
    model = FlaxBartForConditionalGeneration(config, dtype=jnp.dtype(dtype), _do_init=False)
    params = jax.eval_shape(lambda: model.init_weights(jax.random.PRNGKey(0), (1, 1)))
    return model, params


def _load_bart(model_dir: Path, dtype):
    """Flax BART and its tokenizer from a save_pretrained directory (PyTorch-only weights are converted)."""
    if not (model_dir / "config.json").is_file():
        raise CfirError(f"{model_dir}: no config.json; not a model directory made by save_pretrained")
    from_pt = not (model_dir / _FLAX_WEIGHTS).is_file()
    if from_pt and not any((model_dir / w).is_file() for w in _PT_WEIGHTS):
        raise CfirError(
            f"{model_dir}: no weights ({_FLAX_WEIGHTS}, {' or '.join(_PT_WEIGHTS)}); save it with save_pretrained"
        )
    if not ((model_dir / "tokenizer.json").is_file() or (model_dir / "vocab.json").is_file()):
        raise CfirError(f"{model_dir}: no tokenizer (vocab.json + merges.txt, or tokenizer.json); save it too")
    try:
        model = FlaxBartForConditionalGeneration.from_pretrained(model_dir, dtype=dtype, from_pt=from_pt)
        tokenizer = BartTokenizerFast.from_pretrained(model_dir)
    except (OSError, ValueError, KeyError) as e:
        raise CfirError(f"{model_dir}: cannot load the BART model ({type(e).__name__}: {str(e)[:150]})") from None
    if not model.config.is_encoder_decoder:
        raise CfirError(f"{model_dir}: {model.config.model_type} is not an encoder-decoder summarisation model")
    return model, tokenizer


