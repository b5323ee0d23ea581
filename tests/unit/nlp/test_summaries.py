"""Summarisers (Flax BART against transformers' reference, extractive) and the summary store."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import numpy as np
import pytest

from cfir_jax.builders.summaries import build_summary_store
from cfir_jax.core.errors import CfirError, StoreError
from cfir_jax.nlp import bart_summarizer
from cfir_jax.nlp import summarizer as summarizer_lib
from cfir_jax.stores.summaries import SummaryStore

TEXTS = [
    "Berlin is the capital of Germany.",
    "Hello world",
    "The cat sat on the mat in Paris.",
    "Rain fell for three days on the hills of Rome.",
    # Longer than max_input_tokens below (byte-level tokens): exercises truncation.
    "In the beginning there was nothing but water and the wind over it, and then the land rose, " * 3,
]
SETTINGS = dict(max_length=20, min_length=6, num_beams=4, length_penalty=2.0, no_repeat_ngram_size=3)
MAX_INPUT = 64  # One length bucket, so the module's tests compile generation once.


def _byte_symbols() -> dict[int, str]:
    """Byte-level BPE's printable stand-in for each byte: printable Latin-1 bytes are themselves, the others take
    the characters from U+0100 on, in byte order."""
    keep = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    others = [b for b in range(256) if b not in keep]
    return {**{b: chr(b) for b in keep}, **{b: chr(256 + i) for i, b in enumerate(others)}}


def _write_tiny_tokenizer(directory: str) -> None:
    """A byte-level BPE vocabulary by hand: the 4 specials, the 256 byte symbols, a few merges, <mask>."""
    from transformers import BartTokenizer

    vocab = {"<s>": 0, "<pad>": 1, "</s>": 2, "<unk>": 3}
    for symbol in sorted(set(_byte_symbols().values())):
        vocab[symbol] = len(vocab)
    merges = [("Ġ", "t"), ("h", "e"), ("Ġt", "he"), ("Ġ", "a"), ("i", "n"), ("e", "r")]
    for a, b in merges:
        vocab[a + b] = len(vocab)
    vocab["<mask>"] = len(vocab)
    with open(os.path.join(directory, "vocab.json"), "w") as f:
        json.dump(vocab, f)
    with open(os.path.join(directory, "merges.txt"), "w") as f:
        f.write("#version: 0.2\n" + "".join(f"{a} {b}\n" for a, b in merges))
    vocab, merges_file = os.path.join(directory, "vocab.json"), os.path.join(directory, "merges.txt")
    BartTokenizer(vocab, merges_file).save_pretrained(directory)


@pytest.fixture(scope="module")
def tiny_bart(tmp_path_factory):
    """A random PyTorch BART (the reference) saved with its tokenizer; weights large enough that inputs matter."""
    import torch
    from transformers import BartConfig, BartForConditionalGeneration

    directory = str(tmp_path_factory.mktemp("tiny_bart"))
    _write_tiny_tokenizer(directory)
    torch.manual_seed(0)
    config = BartConfig(
        vocab_size=267,
        d_model=32,
        encoder_layers=1,
        decoder_layers=1,
        encoder_attention_heads=2,
        decoder_attention_heads=2,
        encoder_ffn_dim=32,
        decoder_ffn_dim=32,
        max_position_embeddings=160,
        init_std=0.5,
        forced_bos_token_id=0,
        forced_eos_token_id=2,
        num_beams=4,
        early_stopping=True,
    )
    model = BartForConditionalGeneration(config).eval()
    with torch.no_grad():  # Weights drawn here (transformers 4.x and 5.x initialise differently) ...
        for p in model.parameters():
            if p.dim() > 1:
                p.normal_(0.0, 0.5)
        model.final_logits_bias[0, 2] = 8.0  # ... and </s> likely, so that min_length has something to hold back.
    # BART-large-CNN's generation settings in generation_config.json, where transformers 5.x reads them.
    model.generation_config.update(forced_bos_token_id=0, forced_eos_token_id=2, num_beams=4, early_stopping=True)
    model.save_pretrained(directory)
    return directory, model


@pytest.fixture(scope="module")
def summarizer(tiny_bart):
    """Loads the PyTorch-only directory (from_pt conversion); batch 4 for 5 texts exercises the filler rows."""
    return summarizer_lib.BartSummarizer(tiny_bart[0], batch_size=4, max_input_tokens=MAX_INPUT, **SETTINGS)


@pytest.fixture(scope="module")
def outputs(summarizer):
    return summarizer.generate_ids(TEXTS)


def _reference(directory, model, texts, **settings):
    """transformers' PyTorch generate on the unbucketed batch: token ids [batch, <= max_length]."""
    import torch
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(directory)
    batch = tokenizer(texts, return_tensors="pt", padding=True, truncation=True, max_length=MAX_INPUT)
    with torch.no_grad():
        ids = model.generate(**batch, do_sample=False, **settings)
    return tokenizer, ids.numpy()


def _unpad(ids: np.ndarray, pad_id: int) -> list[list[int]]:
    return [row[row != pad_id].tolist() for row in ids]


def test_bart_summaries_equal_pytorch_generate_on_the_plain_batch(tiny_bart, summarizer, outputs):
    """Sorting, batch filler rows, length buckets and 4 beams: token for token transformers' PyTorch generate on the
    plain padded batch."""
    tokenizer, ids = _reference(*tiny_bart, TEXTS, **SETTINGS)
    assert [o.tolist() for o in outputs] == _unpad(ids, tokenizer.pad_token_id)
    assert len({tuple(o) for o in outputs}) == len(TEXTS)  # The inputs matter, so equality says something.
    assert summarizer.summarize(TEXTS[:2]) == [
        s.strip() for s in tokenizer.batch_decode(ids[:2], skip_special_tokens=True)
    ]


def test_bart_min_length_is_honoured(tiny_bart, outputs):
    assert min(len(o) for o in outputs) >= SETTINGS["min_length"]
    assert min(len(o) for o in outputs) < SETTINGS["max_length"]  # EOS is reachable: the bound is not vacuous.
    # Without min_length this model stops sooner on some input, so min_length is what held it back.
    tokenizer, free = _reference(*tiny_bart, TEXTS, **{**SETTINGS, "min_length": 0})
    assert min(len(row) for row in _unpad(free, tokenizer.pad_token_id)) < SETTINGS["min_length"]


def test_bart_summaries_repeat_no_trigram(outputs):
    for ids in outputs:
        trigrams = [tuple(ids[i : i + 3]) for i in range(len(ids) - 2)]
        assert len(trigrams) == len(set(trigrams))


def test_bart_compiles_once_per_row_and_length_bucket(summarizer, outputs):
    assert summarizer.buckets == (MAX_INPUT,) and summarizer.row_buckets == (1, 2, 4)
    for n in (1, 2, 3):  # 1, 2 and 4 rows (3 texts are padded to 4)
        summarizer.summarize(TEXTS[:n])
    traces = summarizer.num_traces
    assert traces <= len(summarizer.row_buckets) * len(summarizer.buckets)
    summarizer.summarize(TEXTS[1:2])
    summarizer.summarize(TEXTS[2:5])
    assert summarizer.num_traces == traces  # Other texts of the same row and length buckets: no new compilation.


def test_a_lone_text_pays_one_row_and_gets_the_batch_summary(summarizer, outputs):
    """The query path: one document is generated in a 1-row call, and its summary equals the batched one."""
    assert [summarizer.generate_ids([t])[0].tolist() for t in TEXTS[:2]] == [o.tolist() for o in outputs[:2]]


def test_cached_summarizer_generates_each_distinct_text_once_and_stays_bounded():
    class Counting:
        name, settings = "counting", {"x": 1}

        def __init__(self):
            self.seen = []

        def summarize(self, texts):
            self.seen += texts
            return [t.upper() for t in texts]

    inner = Counting()
    cached = summarizer_lib.CachedSummarizer(inner, max_entries=2)
    assert cached.summarize(["a", "b", "a"]) == ["A", "B", "A"] and inner.seen == ["a", "b"]
    assert cached.summarize(["b", "c"]) == ["B", "C"] and inner.seen == ["a", "b", "c"]  # b from the cache
    assert len(cached) == 2 and (cached.hits, cached.misses) == (2, 3)
    assert cached.summarize(["a"]) == ["A"] and inner.seen[-1] == "a"  # a was evicted (least recently used)
    assert cached.settings == {"x": 1} and cached.name == "counting"
    with pytest.raises(CfirError, match="max_entries"):
        summarizer_lib.CachedSummarizer(inner, 0)


def test_query_time_extractive_option_keeps_the_index_settings(config):
    s = summarizer_lib.make_summarizer(config, "extractive")
    assert isinstance(s, summarizer_lib.ExtractiveSummarizer)
    assert s.max_tokens == config.index.summaries.extractive_tokens
    with pytest.raises(CfirError, match="use 'bart' or 'extractive'"):
        summarizer_lib.make_summarizer(config, "t5")


@pytest.mark.slow
def test_bart_data_parallel_over_8_devices_equals_one_device(tiny_bart):
    """The index's generation split over 8 (fake CPU) devices gives the summaries of one device (~60 s)."""
    code = (
        "import json, sys, jax; from cfir_jax.nlp.summarizer import BartSummarizer as B\n"
        f"kw = dict(batch_size=2, max_input_tokens={MAX_INPUT}, **{SETTINGS!r})\n"
        "texts = json.loads(sys.argv[2])\n"
        "many = B(sys.argv[1], **kw); one = B(sys.argv[1], devices=jax.devices()[:1], **kw)\n"
        "assert len(many.devices) == 8 and many.rows_per_call == 16 and many.row_buckets == (8, 16)\n"
        "a = [x.tolist() for x in many.generate_ids(texts)]; b = [x.tolist() for x in one.generate_ids(texts)]\n"
        "print(json.dumps([a == b, len(a)]))\n"
    )
    env = dict(os.environ, JAX_PLATFORMS="cpu", XLA_FLAGS="--xla_force_host_platform_device_count=8",
               PYTHONPATH=str(Path(__file__).resolve().parents[1]))
    out = subprocess.run([sys.executable, "-c", code, tiny_bart[0], json.dumps(TEXTS * 2)], env=env,
                         capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    assert json.loads(out.stdout.strip().splitlines()[-1]) == [True, 2 * len(TEXTS)]


def test_rows_sized_to_a_devices_small_free_memory_give_the_same_summaries(tiny_bart, summarizer, outputs):
    """A GPU or TPU reports its free memory and the rows per device are sized to it (the CPU reports none: the
    figure is given here, as a device would). Fewer rows per call, the same summaries."""
    from types import SimpleNamespace

    small = summarizer_lib.BartSummarizer(tiny_bart[0], batch_size=4, max_input_tokens=MAX_INPUT, free_bytes=200_000,
                                          **SETTINGS)
    assert summarizer.batch_size == 4 and small.batch_size < 4
    assert [o.tolist() for o in small.generate_ids(TEXTS)] == [o.tolist() for o in outputs]
    device = SimpleNamespace(memory_stats=lambda: {"bytes_limit": 16 << 30, "bytes_in_use": 6 << 30})
    assert bart_summarizer._free_bytes(device) == 10 << 30  # what a device's report leaves
    assert bart_summarizer._free_bytes(SimpleNamespace(memory_stats=lambda: None)) is None  # the CPU's


def test_bart_settings_are_recorded(summarizer):
    settings = summarizer.settings
    for key, value in SETTINGS.items():
        assert settings[key] == value
    assert settings["max_input_tokens"] == MAX_INPUT and settings["early_stopping"] is True


def test_bart_greedy_equals_pytorch_generate(tiny_bart):
    """One beam: min_length, forced BOS/EOS and the no-repeat-ngram rule as PyTorch's greedy search."""
    settings = {**SETTINGS, "num_beams": 1}
    greedy = summarizer_lib.BartSummarizer(tiny_bart[0], batch_size=4, max_input_tokens=MAX_INPUT, **settings)
    tokenizer, ids = _reference(*tiny_bart, TEXTS, **settings)
    assert [o.tolist() for o in greedy.generate_ids(TEXTS)] == _unpad(ids, tokenizer.pad_token_id)


def test_no_repeat_ngram_mask_matches_a_direct_count():
    import functools

    import jax
    import jax.numpy as jnp

    rng = np.random.default_rng(0)
    sequences = rng.integers(0, 4, size=(6, 12)).astype(np.int32)  # A small vocabulary: many repeats.
    for n in (2, 3):
        masker = jax.jit(functools.partial(summarizer_lib.no_repeat_ngram_mask, ngram_size=n, vocab_size=4))
        for cur_len in range(0, 12):
            mask = np.asarray(masker(jnp.asarray(sequences), jnp.asarray(cur_len)))
            for row, seq in enumerate(sequences):
                prefix = tuple(seq[cur_len - n + 1 : cur_len]) if cur_len >= n - 1 else None
                banned = {
                    seq[p + n - 1]
                    for p in range(0, cur_len - n + 1)
                    if prefix is not None and tuple(seq[p : p + n - 1]) == prefix
                }
                assert set(np.flatnonzero(mask[row])) == banned, (n, cur_len, row)


def test_bart_flax_and_bin_directories_load_like_the_safetensors_one(tmp_path, tiny_bart):
    """The same weights saved as flax_model.msgpack (transformers 4.x's Flax BART, the test set's side copy) and as
    pytorch_model.bin load to the same parameters as model.safetensors."""
    import jax
    import torch
    from bart_reference import save_flax

    from cfir_jax.nlp import bart as bart_lib

    flax_dir, bin_dir = tmp_path / "flax", tmp_path / "bin"
    save_flax(tiny_bart[0], flax_dir)
    bin_dir.mkdir()
    (bin_dir / "config.json").write_text((Path(tiny_bart[0]) / "config.json").read_text())
    torch.save(tiny_bart[1].state_dict(), bin_dir / "pytorch_model.bin")
    assert (flax_dir / "flax_model.msgpack").exists() and not (flax_dir / "model.safetensors").exists()
    want = jax.tree.leaves(bart_lib.load_bart(Path(tiny_bart[0])))
    for directory in (flax_dir, bin_dir):
        for a, b in zip(jax.tree.leaves(bart_lib.load_bart(directory)), want, strict=True):
            np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_bart_missing_directory_is_a_cfir_error(tmp_path):
    with pytest.raises(CfirError, match="no such model directory"):
        summarizer_lib.BartSummarizer(str(tmp_path / "nope"))


def test_bart_directory_without_weights_is_a_cfir_error(tmp_path, tiny_bart):
    (tmp_path / "config.json").write_text((open(os.path.join(tiny_bart[0], "config.json"))).read())
    with pytest.raises(CfirError, match="no weights"):
        summarizer_lib.BartSummarizer(str(tmp_path))


def test_bart_unreachable_hub_is_a_cfir_error(monkeypatch):
    monkeypatch.setattr(bart_summarizer, "_hub_unreachable", lambda: True)
    with pytest.raises(CfirError, match="hub is unreachable"):
        summarizer_lib.BartSummarizer("someone/not-cached-bart")


def test_extractive_keeps_leading_sentences_within_the_word_budget():
    text = "Paris is the capital of France. It has the Eiffel Tower. The Louvre holds the Mona Lisa. More follows."
    s = summarizer_lib.ExtractiveSummarizer(max_tokens=12)
    assert s.summarize([text]) == ["Paris is the capital of France. It has the Eiffel Tower."]
    assert summarizer_lib.ExtractiveSummarizer(max_tokens=6).summarize([text]) == ["Paris is the capital of France."]


def test_extractive_cuts_an_overlong_first_sentence_at_the_budget():
    text = "one two three four five six seven eight nine ten. Second sentence."
    assert summarizer_lib.ExtractiveSummarizer(max_tokens=4).summarize([text]) == ["one two three four"]


def test_extractive_counts_tokens_of_a_given_tokenizer():
    chars = lambda s: list(s.replace(" ", ""))  # noqa: E731 - one token per character.
    s = summarizer_lib.ExtractiveSummarizer(max_tokens=21, tokenizer=chars)
    out = s.summarize(["Rome is old. Oslo is cold. Lima is far away."])[0]
    assert out == "Rome is old. Oslo is cold."  # 10 + 11 characters; the third sentence would overflow.
    assert summarizer_lib.ExtractiveSummarizer(max_tokens=20, tokenizer=chars).summarize([out]) == ["Rome is old."]


def test_extractive_handles_empty_text_and_is_deterministic():
    s = summarizer_lib.ExtractiveSummarizer()
    texts = ["", "   ", "A short one!  Then another? Yes."]
    assert s.summarize(texts) == ["", "", "A short one! Then another? Yes."]
    assert s.summarize(texts) == s.summarize(texts)


DOCS = [(f"doc-{i}", f"Document number {i} is about Paris. It has a second sentence. And a third.") for i in range(7)]


def test_summary_store_round_trip(tmp_path):
    s = summarizer_lib.ExtractiveSummarizer(max_tokens=8)
    docs = DOCS + [("empty", "")]
    manifest = build_summary_store(tmp_path / "s", docs, s, chunk_size=3)
    st = SummaryStore.open(tmp_path / "s", summarizer="extractive")
    assert st.doc_ids == [d for d, _ in docs] and st.num_docs == 8
    assert st.summaries == s.summarize([t for _, t in docs])
    assert st.summary(7) == "" and manifest["num_empty"] == 1
    assert manifest["max_tokens"] == 8
    with pytest.raises(CfirError, match="out of range"):
        st.summary(8)


def test_summary_store_keeps_line_breaks_inside_a_summary(tmp_path):
    class Echo:
        name = "echo"
        settings: dict = {}

        def summarize(self, texts):
            return [f"{t}\nsecond line" for t in texts]

    build_summary_store(tmp_path / "s", DOCS[:2], Echo())
    assert SummaryStore.open(tmp_path / "s").summary(1).endswith("\nsecond line")


def test_summary_store_resume_after_interruption_equals_uninterrupted_build(tmp_path):
    calls: list[str] = []

    class Counting(summarizer_lib.ExtractiveSummarizer):
        def summarize(self, texts):
            calls.extend(texts)
            return super().summarize(texts)

    build_summary_store(tmp_path / "whole", DOCS, Counting(max_tokens=8), chunk_size=3)

    def interrupted():
        yield from DOCS[:4]
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        build_summary_store(tmp_path / "resumed", interrupted(), Counting(max_tokens=8), chunk_size=3)
    assert not (tmp_path / "resumed").exists()
    calls.clear()
    build_summary_store(tmp_path / "resumed", DOCS, Counting(max_tokens=8), chunk_size=3)
    assert calls == [t for _, t in DOCS[3:]]  # The first chunk (3 docs) was read back, not recomputed.
    for name in ("doc_ids.txt", "summaries.jsonl"):
        assert (tmp_path / "whole" / name).read_text() == (tmp_path / "resumed" / name).read_text()


def test_summary_store_restarts_when_settings_change(tmp_path):
    def interrupted():
        yield from DOCS[:4]
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        build_summary_store(tmp_path / "s", interrupted(), summarizer_lib.ExtractiveSummarizer(8),
                                          chunk_size=3)
    build_summary_store(tmp_path / "s", DOCS, summarizer_lib.ExtractiveSummarizer(4), chunk_size=3)
    st = SummaryStore.open(tmp_path / "s")
    assert st.summaries == summarizer_lib.ExtractiveSummarizer(4).summarize([t for _, t in DOCS])


def test_summary_store_rejects_bad_documents(tmp_path):
    s = summarizer_lib.ExtractiveSummarizer()
    with pytest.raises(CfirError, match="document #1"):
        build_summary_store(tmp_path / "a", [("a", "x"), ("b", b"bytes")], s)
    with pytest.raises(CfirError, match="appears twice"):
        build_summary_store(tmp_path / "b", [("a", "x"), ("a", "y")], s)
    with pytest.raises(CfirError, match="no documents"):
        build_summary_store(tmp_path / "c", [], s)


def test_summary_store_open_rejects_truncated_and_foreign_stores(tmp_path):
    build_summary_store(tmp_path / "s", DOCS, summarizer_lib.ExtractiveSummarizer())
    with pytest.raises(StoreError, match="summarizer"):
        SummaryStore.open(tmp_path / "s", summarizer="bart")
    path = tmp_path / "s" / "summaries.jsonl"
    path.write_text("\n".join(path.read_text().split("\n")[:3]) + "\n")
    with pytest.raises(StoreError, match="3 lines but the manifest says 7"):
        SummaryStore.open(tmp_path / "s")
    with pytest.raises(StoreError, match="no summaries store"):
        SummaryStore.open(tmp_path / "missing")


# The summariser's input: the paper's fields or the authors' (with the section's category, media, hierachy lists).


def test_summary_input_is_the_text_for_the_paper_and_appends_the_lists_for_the_authors():
    from cfir_jax.data.corpus import Document

    doc = Document("t1", "Alpha History Alpha is a town.", metadata={"category": ("Towns", "Alps"), "media": (),
                                                                     "hierachy": ("Top", "History")})
    assert summarizer_lib.summary_input(doc) == summarizer_lib.summary_input(doc, "paper") == doc.text
    assert summarizer_lib.summary_input(doc, "authors") == "Alpha History Alpha is a town. Towns Alps Top History"
    with pytest.raises(CfirError, match="use one of paper, authors"):
        summarizer_lib.summary_input(doc, "everything")
    with pytest.raises(CfirError, match="category, media, hierachy lists"):
        summarizer_lib.summary_input(Document("s1", "a synthetic document"), "authors")


def test_index_summarises_the_configured_fields_of_atomic_documents_and_rebuilds_when_they_change(tmp_path):
    """AToMiC fixture corpus, extractive summaries long enough to keep a whole (short) input: 'paper' summarises the
    document text, 'authors' the text plus the lists; the manifest says which, and a change rebuilds the store."""
    from atomic_fixtures import write_atomic_fixture

    from cfir_jax.builders import summaries as indexing
    from cfir_jax.data.atomic import build_atomic_corpus
    from cfir_jax.stores.layout import Layout
    from configs.base import experiment

    fx = write_atomic_fixture(tmp_path / "atomic")
    layout = Layout.of(tmp_path / "w")
    corpus = build_atomic_corpus(fx.texts_dir, fx.images_dir, fx.qrels_dir, layout.corpus)
    config = experiment("base", "runlocal")
    config.index.summaries.update(summarizer="extractive", extractive_tokens=64)
    assert config.index.summaries.fields == "paper"

    def summary_of(doc_id: str) -> str:
        store = indexing.build_summaries(config, layout, corpus)
        return store.summary(store.doc_ids.index(doc_id))

    assert summary_of("t1") == "Alpha History Alpha is a town. It was founded in 1900."
    assert SummaryStore.open(layout.summaries).manifest["input_fields"] == "paper"
    config.index.summaries.fields = "authors"
    assert summary_of("t1") == "Alpha History Alpha is a town. It was founded in 1900. Cat i1 Top History"
    assert SummaryStore.open(layout.summaries).manifest["input_fields"] == "authors"
    config.index.summaries.fields = "section_only"
    with pytest.raises(CfirError, match="fields='section_only'"):
        indexing.build_summaries(config, layout, corpus)
