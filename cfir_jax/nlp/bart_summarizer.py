"""BartSummarizer: abstractive summaries with the project's own BART (nlp.bart, nlp.bart_generate), bucketed and
data parallel, with CFIR's generation settings; the model directory's resolution (local or the hub's snapshot)."""

from __future__ import annotations

import json
import os
import socket
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from cfir_jax.core.errors import CfirError

# Input lengths are padded up to one of these (capped at max_input_tokens), so generation compiles at most
# len(buckets) times however long the documents are; doubling keeps the padding waste under 2x.
_LENGTH_BUCKETS = (64, 128, 256, 512, 1024)


# The files a Flax BART checkpoint directory needs, without the weights.
_CONFIG_FILES = ("config.json", "generation_config.json")


_TOKENIZER_FILES = ("vocab.json", "merges.txt", "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")


_FLAX_WEIGHTS = "flax_model.msgpack"


_PT_WEIGHTS = ("model.safetensors", "pytorch_model.bin")


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
    # why: huggingface_hub loads only to resolve a hub model id, never for a local directory
    import huggingface_hub

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


# The generation fields BART's generation_config.json (or, without one, config.json) sets; CFIR's settings go on top.
_GENERATION_FIELDS = ("decoder_start_token_id", "eos_token_id", "pad_token_id", "forced_bos_token_id",
                      "forced_eos_token_id", "early_stopping")


def generation_settings(model_config: dict, generation_config: dict | None, max_length: int, min_length: int,
                        num_beams: int, length_penalty: float, no_repeat_ngram_size: int, semantics: str = "torch"):
    """The beam search's settings (nlp.bart_generate.GenerationSettings): the model's special tokens, forced BOS/EOS
    and early stopping (generation_config.json where present, else config.json, as transformers reads them) with
    CFIR's settings on top."""
    # why: jax and flax stay off the extractive summarizer's path.
    from cfir_jax.nlp.bart_generate import GenerationSettings

    source = generation_config if generation_config is not None else model_config
    fields = {k: source.get(k, model_config.get(k)) for k in _GENERATION_FIELDS}
    eos = fields["eos_token_id"]
    if isinstance(eos, list):
        if len(eos) != 1:
            raise CfirError(f"BART generation config: eos_token_id={eos}; one EOS token is supported")
        fields["eos_token_id"] = eos[0]
    fields["early_stopping"] = bool(fields["early_stopping"]) if fields["early_stopping"] != "never" else "never"
    return GenerationSettings(max_length=max_length, min_length=min_length, num_beams=num_beams,
                              length_penalty=float(length_penalty), no_repeat_ngram_size=no_repeat_ngram_size,
                              semantics=semantics, **fields)


def read_generation_config(model_dir: Path) -> dict | None:
    """A model directory's generation_config.json as a dict; None where it has none."""
    path = Path(model_dir) / "generation_config.json"
    return json.loads(path.read_text(encoding="utf-8")) if path.is_file() else None


def generation_shardings(mesh):
    """(the parameters' sharding: replicated, the rows' sharding: split over the mesh's 'data' axis)."""
    # why: jax stays off the extractive summarizer's path (nlp.summarizer imports this module)
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    return NamedSharding(mesh, P()), NamedSharding(mesh, P("data"))


def data_parallel(generate, mesh):
    """`generate` run by every device of `mesh` on its own rows (jax.shard_map): parameters replicated, rows split.
    Left to the partitioner (jit with in_shardings alone), transformers' beam search came back replicated: the
    compiled TPU program's temporaries grew with the whole batch, not a device's rows."""
    # why: jax stays off the extractive summarizer's path (nlp.summarizer imports this module)
    import jax
    from jax.sharding import PartitionSpec as P

    return jax.jit(jax.shard_map(generate, mesh=mesh, in_specs=(P(), P("data"), P("data")), out_specs=P("data"),
                                 check_vma=False))


def row_buckets(batch_size: int, devices: int) -> tuple[int, ...]:
    """The row counts generation compiles for: devices x (1, 2, 4, ... up to batch_size, and batch_size)."""
    per_device = [1 << i for i in range(batch_size.bit_length()) if 1 << i < batch_size] + [batch_size]
    return tuple(devices * b for b in per_device)


class BartSummarizer:
    """Abstractive summaries with the project's own BART (nlp.bart, Flax NNX), with CFIR's generation settings as
    defaults (the CFIR paper's).

    Generation (nlp.bart_generate) is one jitted function of (model state, input_ids [rows, bucket], attention_mask
    [rows, bucket]) -> token ids [rows, max_length], data parallel over `devices` (default: every local device;
    parameters replicated, rows split). The encoder and each decoder layer's cross-attention keys and values are
    computed once per document and shared by its beams; the decoder's own keys and values live in a static cache.
    Texts are sorted by length, batched up to `batch_size` rows per device (fewer where the device's memory says
    so), and each batch padded to a row bucket (devices x 1, 2, 4 ... batch_size) and a length bucket, so the
    function compiles at most once per pair and a lone query pays for one row per device. Padding changes no
    summary: the attention mask hides pad keys, positions are absolute from the left, padded rows are dropped, and
    the beam search ("torch" semantics: PyTorch `generate`'s, token for token) decides each document alone.
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
        semantics: str = "torch",
        free_bytes: int | None = None,
    ):
        # why: jax, flax and the model stay off the extractive summarizer's path.
        import jax
        import jax.numpy as jnp
        from flax import nnx

        # why: the model's modules import jax and flax at their top.
        from cfir_jax.nlp import bart as bart_lib
        from cfir_jax.nlp import bart_generate

        _check_bart_settings(max_length, min_length, num_beams, max_input_tokens, batch_size, no_repeat_ngram_size,
                             dtype)
        self.model_name_or_path = model_name_or_path
        self.model_dir = resolve_model_dir(model_name_or_path)
        raw = bart_lib.read_config(self.model_dir)
        model = bart_lib.load_bart(self.model_dir, jnp.dtype(dtype))
        self.tokenizer = _load_tokenizer(self.model_dir)
        positions = model.config.max_position_embeddings
        self.max_input_tokens = min(max_input_tokens, positions)
        if max_length > positions:
            raise CfirError(f"BartSummarizer: max_length={max_length} exceeds the model's {positions} positions")
        self.dtype = dtype
        self.buckets = tuple(b for b in _LENGTH_BUCKETS if b < self.max_input_tokens) + (self.max_input_tokens,)
        self.generation = generation_settings(raw, read_generation_config(self.model_dir), max_length, min_length,
                                              num_beams, length_penalty, no_repeat_ngram_size, semantics)
        self.num_traces = 0  # Compilations of the generation function; the tests bound it by the bucket count.

        def count_trace():
            self.num_traces += 1

        # Data parallel over `devices` (default: every local device): the parameters replicated, the rows split.
        self.devices = list(devices) if devices is not None else jax.local_devices()
        self.mesh = jax.sharding.Mesh(np.array(self.devices), ("data",))
        replicated, _ = generation_shardings(self.mesh)
        graphdef, state = nnx.split(model)
        self.params = jax.device_put(state, replicated)
        # Rows per device sized to a device's free memory (free_bytes: that figure instead of the device's report;
        # a CPU reports none, so the tests and the accelerator script's dry run give one).
        free = free_bytes if free_bytes is not None else _free_bytes(self.devices[0])
        self.batch_size = rows_for_memory(batch_size, model.config, self.generation, self.max_input_tokens,
                                          jnp.dtype(dtype).itemsize, free)
        self.rows_per_call = self.batch_size * len(self.devices)
        self.row_buckets = row_buckets(self.batch_size, len(self.devices))
        fn = bart_generate.make_generate(graphdef, self.generation, count_trace)
        self._generate = data_parallel(fn, self.mesh)

    @property
    def settings(self) -> dict[str, Any]:
        g = self.generation
        return {
            "model": self.model_name_or_path,
            "max_length": g.max_length,
            "min_length": g.min_length,
            "num_beams": g.num_beams,
            "length_penalty": g.length_penalty,
            "no_repeat_ngram_size": g.no_repeat_ngram_size,
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
            eos = self.generation.eos_token_id
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
CNN_DEFAULTS = dict(bos_token_id=0, pad_token_id=1, eos_token_id=2, decoder_start_token_id=2, forced_bos_token_id=0,
                    forced_eos_token_id=2, num_beams=4, early_stopping=True, length_penalty=2.0, max_length=142,
                    min_length=56, no_repeat_ngram_size=3)


def published_config(hub_id: str) -> dict:
    """The config.json of a published architecture (a hub id of ARCHITECTURES): its shape with BART-large-CNN's
    special ids and generation defaults, a new dict each call."""
    return {**ARCHITECTURES[hub_id], **CNN_DEFAULTS}


def abstract_bart(model_name_or_path: str, dtype: str):
    """(the model's graph definition, its state as jax.ShapeDtypeStruct, its config.json as a dict) from the
    architecture alone: a local directory's config.json, or a hub id of ARCHITECTURES. Nothing is downloaded or
    allocated."""
    # why: jax, flax and the model stay off the extractive summarizer's path.
    import jax.numpy as jnp
    from flax import nnx

    # why: the model's module imports jax and flax at its top.
    from cfir_jax.nlp import bart as bart_lib

    expanded = Path(os.path.expanduser(model_name_or_path))
    if (expanded / "config.json").is_file():
        raw = bart_lib.read_config(expanded)
    elif model_name_or_path in ARCHITECTURES:
        raw = published_config(model_name_or_path)
    else:
        raise CfirError(f"index.summaries.bart_model={model_name_or_path!r}: no config.json there and not one of "
                        f"{', '.join(ARCHITECTURES)}; pass a model directory")
    graphdef, state = nnx.split(bart_lib.abstract_model(bart_lib.BartConfig.from_dict(raw), jnp.dtype(dtype)))
    return graphdef, state, raw


def _load_tokenizer(model_dir: Path):
    """BART's tokenizer from a save_pretrained directory (transformers 4.x or 5.x)."""
    # why: transformers is heavy and only the BART path needs it.
    from transformers import AutoTokenizer

    if not ((model_dir / "tokenizer.json").is_file() or (model_dir / "vocab.json").is_file()):
        raise CfirError(f"{model_dir}: no tokenizer (vocab.json + merges.txt, or tokenizer.json); save it too")
    try:
        return AutoTokenizer.from_pretrained(model_dir)
    except (OSError, ValueError, KeyError) as e:
        raise CfirError(f"{model_dir}: cannot load the BART tokenizer ({type(e).__name__}: {str(e)[:150]})") from None


def rows_for_memory(batch_size: int, config, generation, src_tokens: int, itemsize: int, free: int | None) -> int:
    """Rows per device: `batch_size`, or fewer where a device's free memory (`free` bytes; None: unknown, as on a
    CPU) does not hold that many documents' working set: the encoder's activations, every decoder layer's cross
    keys and values, and the beams' self-attention cache, with 2x headroom for the compiler's temporaries."""
    if free is None:
        return batch_size
    d, beams = config.d_model, generation.num_beams
    encoder = src_tokens * (4 * d + 2 * config.encoder_ffn_dim + 2 * config.encoder_attention_heads * src_tokens)
    cross = config.decoder_layers * 2 * src_tokens * d
    cache = config.decoder_layers * 2 * beams * generation.max_length * d
    per_doc = 2 * itemsize * (encoder + cross + cache) + 4 * beams * config.vocab_size * 4
    fit = max(1, int(free // per_doc))
    return min(batch_size, 1 << (fit.bit_length() - 1))


def _free_bytes(device) -> int | None:
    """A device's memory left after the model's parameters, where the device reports it (GPU, TPU)."""
    stats = device.memory_stats() if hasattr(device, "memory_stats") else None
    if not stats or "bytes_limit" not in stats:
        return None
    return int(stats["bytes_limit"]) - int(stats.get("bytes_in_use", 0))
