"""The project's own BART (nlp.bart, nlp.bart_generate) against transformers' PyTorch and Flax `generate`, token for
token in float32, and the compiled decoding loop's shape (no matmul over the source length inside it)."""

from __future__ import annotations

import os
import re

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from bart_reference import flax_generate
from flax import nnx

from cfir_jax.nlp import bart as bart_lib
from cfir_jax.nlp import bart_generate
from cfir_jax.nlp import summarizer as summarizer_lib
from cfir_jax.nlp.bart_summarizer import published_config, read_generation_config

SETTINGS = dict(max_length=24, min_length=6, num_beams=4, length_penalty=2.0, no_repeat_ngram_size=3)
TINY = dict(vocab_size=96, d_model=32, encoder_layers=2, decoder_layers=2, encoder_attention_heads=4,
            decoder_attention_heads=4, encoder_ffn_dim=48, decoder_ffn_dim=48, max_position_embeddings=64,
            init_std=0.3)
# BART-large-CNN's widths (d_model, heads, FFN, vocabulary, 1,024 positions) with 2 layers a side: every layer is the
# same code at these widths, and the tiny model's tests stack layers too; 12 a side took four minutes of the suite.
LARGE = dict(summarizer_lib.ARCHITECTURES["facebook/bart-large-cnn"], encoder_layers=2, decoder_layers=2,
             init_std=0.02)


def _random_bart(directory, shape: dict, eos_bias: float, seed: int = 0):
    """A random PyTorch BART with BART-large-CNN's generation config, saved to `directory` (safetensors)."""
    import torch
    from transformers import BartConfig, BartForConditionalGeneration

    torch.manual_seed(seed)
    config = BartConfig(**shape, forced_bos_token_id=0, forced_eos_token_id=2, num_beams=4, early_stopping=True,
                        scale_embedding=False)
    model = BartForConditionalGeneration(config).eval()
    with torch.no_grad():  # EOS likely enough that hypotheses end at different lengths
        model.final_logits_bias[0, 2] = eos_bias
    model.generation_config.update(forced_bos_token_id=0, forced_eos_token_id=2, num_beams=4, early_stopping=True)
    model.save_pretrained(directory)
    return model


def _documents(count: int, length: int, vocab: int, seed: int):
    """Token ids [count, length] (BOS ... EOS, then padding) of random lengths between length / 4 and length."""
    rng = np.random.default_rng(seed)
    ids, mask = np.ones((count, length), np.int32), np.zeros((count, length), np.int32)
    for i in range(count):
        n = int(rng.integers(length // 4, length + 1))
        ids[i, :n] = np.concatenate([[0], rng.integers(4, vocab, n - 2), [2]])
        mask[i, :n] = 1
    return ids, mask


def _ours(directory, ids, mask, semantics: str, dtype=jnp.float32):
    model = bart_lib.load_bart(directory, dtype)
    raw = bart_lib.read_config(directory)
    settings = summarizer_lib.generation_settings(raw, read_generation_config(directory),
                                                  semantics=semantics, **SETTINGS)
    graphdef, state = nnx.split(model)
    return np.asarray(jax.jit(bart_generate.make_generate(graphdef, settings))(state, ids, mask))


def _torch_generate(model, ids, mask):
    import torch

    with torch.no_grad():
        return model.generate(input_ids=torch.tensor(ids, dtype=torch.long), do_sample=False,
                              attention_mask=torch.tensor(mask, dtype=torch.long), **SETTINGS).numpy()


def _cut(rows) -> list[list[int]]:
    """Each sequence up to and including its first EOS after the decoder start (the rest is padding)."""
    out = []
    for row in np.asarray(rows):
        ends = np.flatnonzero(row[1:] == 2)
        out.append(row[: ends[0] + 2].tolist() if ends.size else row.tolist())
    return out


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    directory = tmp_path_factory.mktemp("tiny_bart")
    return directory, _random_bart(directory, TINY, eos_bias=7.0)


@pytest.mark.slow  # ~60 s at load 4: two beam searches over 60 documents
def test_tiny_bart_equals_pytorch_generate_on_60_documents(tiny):
    directory, model = tiny
    ids, mask = _documents(60, 40, TINY["vocab_size"], seed=1)
    ours, ref = _cut(_ours(directory, ids, mask, "torch")), _cut(_torch_generate(model, ids, mask))
    assert ours == ref
    assert len({len(r) for r in ref}) > 5 and len({tuple(r) for r in ref}) > 50  # varied: equality says something


@pytest.mark.slow  # ~60 s at load 4: a subprocess with transformers 4.x's Flax BART
def test_tiny_bart_equals_flax_generate_on_60_documents(tiny, tmp_path):
    directory, _ = tiny
    ids, mask = _documents(60, 40, TINY["vocab_size"], seed=2)
    ref = _cut(flax_generate(directory, ids, mask, SETTINGS, tmp_path))
    assert _cut(_ours(directory, ids, mask, "flax")) == ref
    assert len({len(r) for r in ref}) > 5 and len({tuple(r) for r in ref}) > 50


@pytest.mark.slow  # a minute: three implementations at BART-large-CNN's widths over 1,024 tokens
def test_real_width_bart_equals_pytorch_and_flax_generate(tmp_path):
    directory = tmp_path / "bart"
    model = _random_bart(directory, LARGE, eos_bias=6.0)
    # Two documents (their encoders are most of the test's time at this shape; the tiny model's tests above take 60
    # each for variety): one fills the 1,024 tokens, the other is padded from a random length. The Flax process
    # peaks at ~7 GB with these two (~9 GB with 5).
    ids, mask = _documents(2, 1024, LARGE["vocab_size"], seed=3)
    ids[0], mask[0] = np.concatenate([[0], ids[0, 1:1023], [2]]), 1
    assert mask[1].sum() < 1024
    assert _cut(_ours(directory, ids, mask, "torch")) == _cut(_torch_generate(model, ids, mask))
    del model
    assert _cut(_ours(directory, ids, mask, "flax")) == _cut(flax_generate(directory, ids, mask, SETTINGS, tmp_path))


REAL = os.environ.get("CFIR_BART_DIR", "")


@pytest.mark.slow
@pytest.mark.skipif(not REAL, reason="no real-weights BART: set CFIR_BART_DIR to a save_pretrained directory of "
                                     "facebook/bart-large-cnn or sshleifer/distilbart-cnn-12-6")
def test_real_weights_summaries_equal_pytorch_generate():
    from transformers import AutoTokenizer, BartForConditionalGeneration

    tokenizer = AutoTokenizer.from_pretrained(REAL)
    texts = ["The tower is 324 metres tall, about the same height as an 81-storey building, and the tallest "
             "structure in Paris. Its base is square, measuring 125 metres on each side.",
             "Heavy rain fell across the region on Tuesday, flooding roads and closing schools, officials said."]
    batch = tokenizer(texts, return_tensors="np", padding=True, truncation=True, max_length=1024)
    ids, mask = batch["input_ids"].astype(np.int32), batch["attention_mask"].astype(np.int32)
    model = BartForConditionalGeneration.from_pretrained(REAL).eval()
    assert _cut(_ours(REAL, ids, mask, "torch")) == _cut(_torch_generate(model, ids, mask))


def _while_bodies(hlo: str) -> list[str]:
    """The text of every computation a while loop of the optimized HLO runs as its body."""
    bodies = set(re.findall(r"body=%?([\w.\-]+)", hlo))
    blocks = re.split(r"\n(?=\S)", hlo)
    return [b for b in blocks for name in bodies if re.match(rf"%?{re.escape(name)}\s", b)]


def _called(hlo: str, block: str, seen: set) -> str:
    """`block` with every computation it calls (fusions, nested loops), recursively."""
    text = block
    for name in set(re.findall(r"(?:calls|to_apply|body|condition)=%?([\w.\-]+)", block)) - seen:
        seen.add(name)
        for b in re.split(r"\n(?=\S)", hlo):
            if re.match(rf"%?{re.escape(name)}\s", b):
                text += "\n" + _called(hlo, b, seen)
    return text


def _dots(text: str) -> list[tuple[int, ...]]:
    """The result shapes of the dots (and convolutions) in HLO text."""
    shapes = re.findall(r"= \w+\[([\d,]*)\][^\n]*? (?:dot|convolution)\(", text)
    return [tuple(int(d) for d in shape.split(",") if d) for shape in shapes]


@pytest.mark.slow  # ~40 s at load 4: one compile of the beam search
def test_compiled_decoding_loop_has_no_projection_of_the_source_states(tiny):
    """Compiled for CPU, the beam search's while loop holds no matmul that makes a d_model-wide vector per source
    token (the cross-attention keys or values of the source states: docs x src x d_model outputs or more); the only
    source-length products in it are the attention scores, heads x beams per source token. The projections are
    made once per document, before the loop (the same pattern finds them there)."""
    directory, _ = tiny
    docs, src, d = 3, 56, TINY["d_model"]
    model = bart_lib.abstract_model(bart_lib.BartConfig.from_dict(bart_lib.read_config(directory)))
    settings = summarizer_lib.generation_settings(bart_lib.read_config(directory), None, **SETTINGS)
    graphdef, state = nnx.split(model)
    ids = jax.ShapeDtypeStruct((docs, src), jnp.int32)
    hlo = jax.jit(bart_generate.make_generate(graphdef, settings)).lower(state, ids, ids).compile().as_text()
    bodies = _while_bodies(hlo)
    assert bodies, "no while loop in the compiled program"
    loop = _dots("\n".join(_called(hlo, b, set()) for b in bodies))
    assert loop, "no matmul found in the loop (the pattern is stale)"
    assert not [s for s in loop if np.prod(s) >= docs * src * d], loop
    heads, beams = TINY["decoder_attention_heads"], SETTINGS["num_beams"]
    assert all(np.prod(s) <= docs * src * heads * beams for s in loop if src in s)
    assert [s for s in _dots(hlo) if np.prod(s) >= docs * src * d and src in s]  # outside the loop


def test_rows_per_device_follow_the_free_memory():
    """A device's rows per call: the configured batch where memory is unknown (CPU) or ample, fewer (a power of
    two, at least 1) where the documents' working set does not fit."""
    from cfir_jax.nlp.bart_summarizer import rows_for_memory

    raw = published_config("facebook/bart-large-cnn")
    config = bart_lib.BartConfig.from_dict(raw)
    settings = summarizer_lib.generation_settings(raw, None, **SETTINGS)
    fits = [rows_for_memory(64, config, settings, 1024, 4, gib * 2**30) for gib in (0.01, 1, 4, 16, 1024)]
    assert rows_for_memory(64, config, settings, 1024, 4, None) == 64
    assert fits[0] == 1 and fits[-1] == 64 and fits == sorted(fits) and len(set(fits)) >= 4
    assert all(f & (f - 1) == 0 for f in fits)  # powers of two: the row buckets stay few
    assert rows_for_memory(64, config, settings, 1024, 2, 4 * 2**30) >= fits[2]  # bfloat16 holds at least as many
