"""A workdir at the paper's sizes with random weights, built from shapes alone (nothing is downloaded), so that the
query path can be timed as a user of the paper's models would run it.

    python benchmarks/realsize.py build --out ~/realsize/base --size base     # 4M x 768 cache (6 GB), minutes
    python benchmarks/realsize.py build --out ~/realsize/large --size large   # 11M x 1,024 cache (23 GB)
    python benchmarks/realsize.py build --out /tmp/rs --size tiny                 # the test's: seconds

What it holds (OUT/ is the directory given; keep it outside the repository):
  - OUT/work: a workdir `retrieve.py`, `retrieval_latency.py --part e2e` and `serve_load.py` open as any other. It
    starts as the synthetic tiny world indexed by `index.py --config configs/demo.py:tiny` (corpus, spaCy entities, the
    entity vocabulary), then every model-sized part is replaced by its real-size counterpart:
      * the text tower: a randomly initialised D-BEiT-3 base (768 dims, 12 layers) or large (1,024, 24) in W/encoder
        (the entity encoder) and again in W/model (the query encoder; no train.py run: weights are random either way);
      * the image cache: the corpus' images first, then random unit rows up to 4,000,000 (base) or 11,019,202 (large)
        float16 rows, written in chunks through a memory map;
      * the entity index: every entity of the world with K = 10,000 candidates (its own top list over the corpus'
        images first, then distinct random rows), so SR scores unions of the paper's size;
      * the recorded config: the paper's model, retrieval (top 1,000, fast SR, unseen entities searched) and summary
        settings (BART-large-CNN, 4 beams, up to 64 tokens, 1,024 input tokens) over OUT/bart/bart-large-cnn.
  - OUT/bart/bart-large-cnn and OUT/bart/distilbart-cnn-12-6: Flax BART with the published architectures (12 + 12
    layers, d_model 1,024, 50,264 tokens; the distilled one has 6 decoder layers), random weights, and a byte-level
    BPE tokenizer trained here on the world's text (no download; its merges are not BART's, so a word costs a few
    more tokens than with BART's own, which only matters below the 1,024-token cut).

Random weights show time and memory, never quality: the summaries are random token strings and retrieval scores are
random. How to measure an option's quality once real weights are present: docs/real-size.md.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import numpy as np
from common import hardware_description  # also puts the repository root on sys.path

from cfir_jax.core.cli import cli_main
from cfir_jax.core.errors import CfirError
from cfir_jax.stores.atomic_write import write_json_atomic

ROOT = Path(__file__).resolve().parents[1]
# The paper's sizes (AToMiC base: every image the qrels judge, rounded up; large: the whole collection) and a tiny one
# for tests. bart: the architecture of each named summarizer directory made under OUT/bart.
SIZES = {
    "base": dict(model="base", rows=4_000_000, k=10_000, bart="large"),
    "large": dict(model="large", rows=11_019_202, k=10_000, bart="large"),
    "tiny": dict(model="tiny", rows=2_000, k=200, bart="tiny"),
}
# BART-large-CNN (facebook/bart-large-cnn's config.json) and distilbart-cnn-12-6 (sshleifer's: 6 decoder layers).
BART_SHAPES = {
    "large": {"bart-large-cnn": dict(d_model=1024, encoder_layers=12, decoder_layers=12, heads=16, ffn=4096,
                                     vocab=50264, positions=1024),
              "distilbart-cnn-12-6": dict(d_model=1024, encoder_layers=12, decoder_layers=6, heads=16, ffn=4096,
                                          vocab=50264, positions=1024)},
    "tiny": {"bart-large-cnn": dict(d_model=32, encoder_layers=2, decoder_layers=2, heads=2, ffn=64, vocab=1200,
                                    positions=1024),
             "distilbart-cnn-12-6": dict(d_model=32, encoder_layers=2, decoder_layers=1, heads=2, ffn=64, vocab=1200,
                                         positions=1024)},
}
CHUNK_ROWS = 200_000


def log(message: str) -> None:
    print(f"[realsize] {message}", flush=True)


# --------------------------------------------------------------------------------------------------------- BART
def write_tokenizer(directory: Path, texts: list[str], vocab_size: int) -> None:
    """A byte-level BPE tokenizer with BART's special ids (<s>=0 <pad>=1 </s>=2 <unk>=3), trained on `texts`."""
    from tokenizers import ByteLevelBPETokenizer
    from transformers import BartTokenizerFast

    bpe = ByteLevelBPETokenizer()
    bpe.train_from_iterator(texts, vocab_size=vocab_size, min_frequency=2, show_progress=False,
                            special_tokens=["<s>", "<pad>", "</s>", "<unk>", "<mask>"])
    bpe.save_model(str(directory))
    BartTokenizerFast(vocab_file=str(directory / "vocab.json"), merges_file=str(directory / "merges.txt")
                      ).save_pretrained(directory)


def write_bart(directory: Path, shape: dict, texts: list[str], seed: int = 0) -> None:
    """A BART of `shape` with random weights (the project's own, nlp.bart) and BART-large-CNN's generation config,
    saved atomically as a save_pretrained directory."""
    import jax.numpy as jnp
    from flax import nnx

    from cfir_jax.nlp import bart as bart_lib
    from cfir_jax.stores.contract import atomic_dir

    if (directory / "model.safetensors").is_file():
        return
    config = dict(
        vocab_size=shape["vocab"], d_model=shape["d_model"], encoder_layers=shape["encoder_layers"],
        decoder_layers=shape["decoder_layers"], encoder_attention_heads=shape["heads"],
        decoder_attention_heads=shape["heads"], encoder_ffn_dim=shape["ffn"], decoder_ffn_dim=shape["ffn"],
        max_position_embeddings=shape["positions"], bos_token_id=0, pad_token_id=1, eos_token_id=2,
        decoder_start_token_id=2, forced_bos_token_id=0, forced_eos_token_id=2, num_beams=4, early_stopping=True,
        length_penalty=2.0, max_length=142, min_length=56, no_repeat_ngram_size=3)
    with atomic_dir(directory) as tmp:
        write_tokenizer(tmp, texts, shape["vocab"])
        model = bart_lib.Bart(bart_lib.BartConfig.from_dict(config), jnp.float32, nnx.Rngs(seed))
        bart_lib.save_bart(model, Path(tmp), config)
    log(f"{directory}: random BART {shape}")


# ------------------------------------------------------------------------------------------------------ workdir
# What a copied world leaves behind: every model-sized part is remade, and a trained model would take the random
# encoder's place as the query encoder.
_NOT_COPIED = ("train", "model", "train_document", "model_document", "train_full", "model_full", "image_cache_full",
               "pretrain", "image_text", "entity_text_match", "sr_compact", "sr_compact_fused", "reranker")


def index_tiny_world(work: Path, world: Path | None = None) -> None:
    """The synthetic tiny world indexed at the demo's sizes (corpus, entities, summaries, entity vocabulary), or a
    copy of `world`, such a workdir already indexed (the tests' session workdir)."""
    if (work / "index.json").is_file():
        return
    if world is not None:
        if not (world / "index.json").is_file():
            raise CfirError(f"--world {world}: not an indexed workdir (no index.json)")
        shutil.copytree(world, work, ignore=lambda d, names: [n for n in names if Path(d) == world
                                                               and n in _NOT_COPIED])
        return
    proc = subprocess.run(
        [sys.executable, "index.py", "--config", "configs/demo.py:tiny", "--workdir", str(work),
         "--config.index.image_text.enabled=False", "--config.index.entity_text_match.enabled=False"],
        cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)}, capture_output=True, text=True)
    if proc.returncode:
        raise CfirError(f"index.py on the tiny world failed: {(proc.stderr.strip().splitlines() or ['?'])[-1]}")


def write_encoder(work: Path, model_cfg, seed: int = 0) -> dict:
    """A random D-BEiT-3 of `model_cfg` as W/encoder (the index encoder, which also scores queries untrained)."""
    from cfir_jax.model import beit3, checkpoint

    manifest = checkpoint.read_model_manifest(work / "encoder")
    keys = ("embed_dim", "num_layers", "num_heads", "ffn_dim", "vocab_size", "max_text_positions")
    if all(manifest["model_config"].get(key) == model_cfg[key] for key in keys):
        return manifest
    t = time.perf_counter()
    model = beit3.create_model(model_cfg, seed=seed)
    manifest = checkpoint.save_model(model, work / "encoder", trained="random (benchmarks/realsize.py)")
    log(f"W/encoder: random {model_cfg.embed_dim}-dim {model_cfg.num_layers}-layer D-BEiT-3, "
        f"{manifest['num_params']:,} parameters ({time.perf_counter() - t:.0f} s)")
    return manifest


def write_model(work: Path, encoder_manifest: dict) -> None:
    """W/model: the random encoder again, where train.py leaves the trained model (the service takes the model
    family from it; retrieval scores queries with it)."""
    from cfir_jax.stores.contract import atomic_dir

    manifest = work / "model" / "manifest.json"
    if manifest.is_file() and json.loads(manifest.read_text()).get("text_fingerprint") == \
            encoder_manifest["text_fingerprint"]:
        return
    with atomic_dir(work / "model") as tmp:
        shutil.copytree(work / "encoder", tmp, dirs_exist_ok=True)


def write_cache(work: Path, rows: int, dim: int, seed: int = 0):
    """W/image_cache: the corpus' image ids first, then synthetic ids, every row a random unit float16 vector."""
    from cfir_jax.stores.image_cache import ImageCache

    cache_dir = work / "image_cache"
    cache = ImageCache.open(cache_dir)
    if cache.num_images == rows and cache.dim == dim:
        return cache
    t = time.perf_counter()
    rng = np.random.default_rng(seed)
    new = cache_dir / "embeddings.new.npy"
    emb = np.lib.format.open_memmap(new, "w+", np.float16, (rows, dim))
    for start in range(0, rows, CHUNK_ROWS):
        block = rng.standard_normal((min(CHUNK_ROWS, rows - start), dim), dtype=np.float32)
        emb[start : start + len(block)] = block / np.linalg.norm(block, axis=1, keepdims=True)
    emb.flush()
    del emb
    ids = cache.ids[:rows] + [f"synthetic{i:08d}" for i in range(len(cache.ids), rows)]
    # The rows and ids first, the manifest that vouches for them last: an interrupted build is refused, then redone.
    (cache_dir / "manifest.json").unlink()
    os.replace(new, cache_dir / "embeddings.npy")
    (cache_dir / "ids.tmp").write_text("\n".join(ids) + "\n")
    os.replace(cache_dir / "ids.tmp", cache_dir / "ids.txt")
    write_json_atomic(cache_dir / "manifest.json", dict(
        cache.manifest, num_encoded=rows, dim=dim, max_row_norm=1.0, created=time.strftime("%Y-%m-%dT%H:%M:%S"),
        synthetic=f"benchmarks/realsize.py: {rows:,} random unit rows (the corpus' ids first)"))
    log(f"W/image_cache: {rows:,} x {dim} float16 ({rows * dim * 2 / 2**30:.1f} GiB, {time.perf_counter() - t:.0f} s)")
    return ImageCache.open(cache_dir)


def write_entity_index(work: Path, cache, k: int, encoder_manifest: dict, seed: int = 0) -> None:
    """W/entity_index: each entity's own list over the corpus' images first, then distinct random rows up to k."""
    ei = work / "entity_index"
    manifest = json.loads((ei / "manifest.json").read_text())
    offsets, cand = np.load(ei / "offsets.npy"), np.load(ei / "candidates.npy")
    scores = np.load(ei / "scores.npy") if manifest.get("has_scores") else None
    rng = np.random.default_rng(seed)
    new_c, new_s, new_o = [], [], [0]
    n = cache.num_images
    for j in range(len(offsets) - 1):
        own = cand[offsets[j] : offsets[j + 1]][:k]
        own = own[own < n]  # a cache rebuilt smaller (another --rows) keeps the rows it still has
        extra = rng.choice(n, size=min(n, k + len(own)), replace=False)
        extra = extra[~np.isin(extra, own)][: k - len(own)]
        new_c.append(np.concatenate([own, extra]).astype(np.int32))
        if scores is not None:
            own_s = scores[offsets[j] : offsets[j + 1]][: len(own)].astype(np.float32)
            low = own_s.min() if len(own_s) else 0.0
            new_s.append(np.concatenate([own_s, np.linspace(low, low - 1.0, len(extra), dtype=np.float32)]))
        new_o.append(new_o[-1] + len(new_c[-1]))
    (ei / "manifest.json").unlink()  # the arrays first, the manifest last (as write_cache)
    np.save(ei / "candidates.npy", np.concatenate(new_c))
    if scores is not None:
        np.save(ei / "scores.npy", np.concatenate(new_s).astype(scores.dtype))
    np.save(ei / "offsets.npy", np.asarray(new_o, offsets.dtype))
    if (ei / "scann").exists():
        shutil.rmtree(ei / "scann")
    manifest.update(n_images=n, n_candidates=int(new_o[-1]), k=k, k_requested=k, has_searcher=False,
                    cache_fingerprint=cache.content_fingerprint, dim=cache.dim,
                    model_fingerprint=encoder_manifest["text_fingerprint"], backend="exact")
    write_json_atomic(ei / "manifest.json", manifest)
    log(f"W/entity_index: {len(offsets) - 1} entities x K={k:,} over {n:,} images")


def record_config(work: Path, size: str, model_cfg, bart_dir: Path, k: int) -> None:
    """index.json's config at the paper's settings (model, retrieval, summaries) for the commands that read it."""
    from configs.base import experiment

    paper = experiment("base" if size == "tiny" else size)
    index = json.loads((work / "index.json").read_text())
    config = index["config"]
    config["model"] = model_cfg.to_dict()
    retrieval = paper.retrieval.to_dict()
    retrieval["sr_buckets"] = list(retrieval["sr_buckets"])
    retrieval["document_fields"] = list(retrieval["document_fields"])
    config["retrieval"] = retrieval
    summaries = paper.index.summaries.to_dict()
    summaries["bart_model"] = str(bart_dir)
    config["index"]["summaries"] = summaries
    config["index"]["entity_index"]["k"] = k
    index["realsize"] = dict(size=size, bart=str(bart_dir), built=time.strftime("%Y-%m-%dT%H:%M:%S"))
    write_json_atomic(work / "index.json", index)


def cache_rows(rows: int, world_images: int) -> int:
    """The cache's rows: the world's own images come first, every one of them (the entity index, the entities and
    the corpus refer to them), then random rows up to `rows`; a world larger than `rows` raises it to its size."""
    if rows < world_images:
        log(f"--rows {rows:,} is below the world's {world_images:,} images: the cache holds them all")
    return max(rows, world_images)


def build(out: Path, size: str, rows: int | None = None, world: Path | None = None) -> Path:
    """Builds (or completes) OUT for `size`; returns the workdir. Each part is skipped when already at size."""
    from cfir_jax.core.config import model_config
    from cfir_jax.data.corpus import Corpus

    spec = SIZES[size]
    rows = int(rows or spec["rows"])
    if rows < 1:
        raise CfirError(f"--rows {rows}: need at least 1")
    work = out / "work"
    out.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    index_tiny_world(work, world)
    log(f"the tiny world indexed ({time.perf_counter() - t0:.0f} s)")
    corpus = Corpus.open(work / "corpus")
    rows = cache_rows(rows, corpus.num_images)
    texts = [corpus.document(i).text for i in range(corpus.num_documents)]
    for name, shape in BART_SHAPES[spec["bart"]].items():
        write_bart(out / "bart" / name, shape, texts)
    model_cfg = model_config(spec["model"], max_text_positions=512 if size == "tiny" else 1024)
    encoder = write_encoder(work, model_cfg)
    write_model(work, encoder)
    cache = write_cache(work, rows, model_cfg.embed_dim)
    k = min(spec["k"], rows)  # a list holds distinct rows
    write_entity_index(work, cache, k, encoder)
    record_config(work, size, model_cfg, out / "bart" / "bart-large-cnn", k)
    log(f"done: {work} ({time.perf_counter() - t0:.0f} s)")
    return work


# ------------------------------------------------------------------------------------------------- measurements
def load_averages() -> str:
    return "/".join(f"{x:.2f}" for x in os.getloadavg())


def long_texts(texts: list[str], words: int) -> list[str]:
    """Each text followed by the next ones (cyclically) until it has `words` words: documents of AToMiC's longest,
    which BART reads up to its 1,024-token cut (0: the texts unchanged)."""
    if words <= 0:
        return list(texts)
    out = []
    for i in range(len(texts)):
        parts, n, j = [], 0, i
        while n < words:
            parts.append(texts[j % len(texts)])
            n += len(parts[-1].split())
            j += 1
        out.append(" ".join(parts))
    return out


def query_documents(work: Path, n: int, words: int) -> list[tuple[str, str]]:
    """(id, text) of n documents of the world (test split first), lengthened to `words` words."""
    from cfir_jax.data.corpus import Corpus

    corpus = Corpus.open(work / "corpus")
    test = set(corpus.qrels("test"))
    order = sorted(range(corpus.num_documents), key=lambda i: corpus.doc_ids[i] not in test)
    texts = long_texts([corpus.document(i).text for i in order], words)
    return [(f"{corpus.doc_ids[order[i % len(order)]]}#{i}", texts[i % len(texts)]) for i in range(n)]


# Each cheaper summary option as the config overrides that select it (the paper's setting is the default, "paper").
SUMMARY_OPTIONS = {
    "paper": {},
    "bfloat16": {"index.summaries.dtype": "bfloat16"},
    "greedy": {"index.summaries.num_beams": 1},
    "max32": {"index.summaries.max_length": 32},
    "distilbart": {"index.summaries.bart_model": "{out}/bart/distilbart-cnn-12-6"},
    "extractive": {"retrieval.summarizer": "extractive"},
}


def option_config(work: Path, out: Path, option: str):
    from cfir_jax.core.cli import workdir_config

    config = workdir_config(work)
    with config.unlocked():
        for key, value in SUMMARY_OPTIONS[option].items():
            node = config
            *path, last = key.split(".")
            for part in path:
                node = node[part]
            node[last] = value.format(out=out) if isinstance(value, str) else value
    return config


def time_summaries(out: Path, options: list[str], docs: int, words: int, batch_docs: int) -> None:
    """Per option, one after another (each line printed with the load it ran under, so a busy machine still gives
    what finished): ms per query document (one per call, the query path) and, with batch_docs, summaries/s at that
    many documents per call; bfloat16's token agreement with the paper setting's output on the same documents."""
    from cfir_jax.nlp.bart_summarizer import BartSummarizer
    from cfir_jax.nlp.summarizer import make_summarizer

    work = out / "work"
    texts = [t for _, t in query_documents(work, docs + 1, words)]
    print(f"{docs} documents of >= {words} words, one per call (the query path), after one warm-up call; options "
          f"one after another; load before {load_averages()}", flush=True)
    paper_ids = None
    for option in options:
        config = option_config(work, out, option)
        t0 = time.perf_counter()
        s = make_summarizer(config, config.retrieval.get("summarizer") or None)
        bart = isinstance(s, BartSummarizer)
        s.summarize(texts[:1])  # load and compile the 1-row program
        ready = time.perf_counter() - t0
        times, ids = [], []
        for text in texts[1:]:
            t = time.perf_counter()
            if bart:
                ids.append(s.generate_ids([text])[0])
            else:
                s.summarize([text])
            times.append(time.perf_counter() - t)
        ms = 1e3 * np.asarray(times)
        extra = ""
        if bart:
            tokens = len(s.tokenizer(texts[1], truncation=True, max_length=s.max_input_tokens)["input_ids"])
            extra = f"; {tokens} input tokens, loaded and compiled in {ready:.0f} s"
        if option == "paper":
            paper_ids = ids
        if option == "bfloat16" and paper_ids:  # the same weights and decoding: only the dtype differs
            same = [np.mean(a[: min(len(a), len(b))] == b[: min(len(a), len(b))]) * min(len(a), len(b))
                    / max(len(a), len(b)) for a, b in zip(ids, paper_ids)]
            exact = sum(a.tolist() == b.tolist() for a, b in zip(ids, paper_ids))
            extra += f"; tokens agreeing with float32 {np.mean(same):.1%}, identical {exact}/{len(same)}"
        print(f"  {option:11s} p50 {np.percentile(ms, 50):9.1f} ms  max {ms.max():9.1f} ms  "
              f"{SUMMARY_OPTIONS[option] or '(the default)'}{extra}; load {load_averages()}", flush=True)
        if batch_docs and bart:
            chunk = (texts[1:] * batch_docs)[:batch_docs]
            s.generate_ids(chunk)  # compile the batch's row bucket
            t = time.perf_counter()
            s.generate_ids(chunk)
            dt = time.perf_counter() - t
            print(f"  {option:11s} {batch_docs / dt:6.2f} summaries/s at {batch_docs} documents per call "
                  f"({dt:.1f} s); load {load_averages()}", flush=True)
        del s


def time_served(out: Path, levels: list[int], per_level: int, words: int, docs_c1: int, max_batch: int,
                overrides: list[str], min_requests: int = 1) -> None:
    """The service on the real-size workdir: concurrency 1 interleaved with the in-process Retriever on the same
    documents (the 1.3x goal's ratio under the same load), then p50/p95/p99 and documents/s at each level. Every
    level gets documents no earlier request sent (the service caches summaries by document text, so a repeated one
    would cost a lookup instead of a generation)."""
    import asyncio

    import serve_load

    work = out / "work"
    counts = [max(c * per_level, min_requests) for c in levels]
    docs = query_documents(work, 1 + docs_c1 + sum(counts), words)
    if len({text for _, text in docs}) < len(docs):
        raise CfirError(f"{len(docs)} documents wanted but the world has fewer distinct texts; lower --per-level, "
                        f"--min-requests or --c1-docs, or lengthen them (--words)")
    server = serve_load.Server(str(work), f"--config.serve.max_batch={max_batch}", "--config.serve.queue_size=256",
                               "--config.serve.deadline_ms=600000", *overrides)
    print(f"server ready in {server.ready_s:.0f} s ({' '.join(overrides) or 'the paper settings'}); "
          f"load {load_averages()}", flush=True)
    try:
        t = time.perf_counter()
        asyncio.run(serve_load.load(server.url, serve_load.search_bodies(docs[:1]), 1, timeout=1800))
        print(f"first query (its length bucket compiled if the warm-up's was another) {time.perf_counter() - t:.0f} s; "
              f"load {load_averages()}", flush=True)
        inproc, served = serve_load.interleaved_c1(server.url, str(work), docs[1 : 1 + docs_c1], tuple(overrides),
                                                   timeout=1800)
        print(f"concurrency 1 interleaved with the in-process Retriever, {docs_c1} documents: p50 {served:.0f} ms "
              f"served vs {inproc:.0f} ms in process ({served / inproc:.2f}x); load {load_averages()}", flush=True)
        start = 1 + docs_c1
        for c, n in zip(levels, counts):
            bodies = serve_load.search_bodies(docs[start : start + n])
            start += n
            r = asyncio.run(serve_load.load(server.url, bodies, c, timeout=1800))
            print(f"concurrency {c:3d}: {r['ok']}/{r['n']} ok, p50 {r['p50']:8.0f} ms  p95 {r['p95']:8.0f}  "
                  f"p99 {r['p99']:8.0f}  {r['rate']:6.3f} documents/s; load {load_averages()}", flush=True)
    finally:
        server.stop()


@cli_main
def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="command", required=True)
    b = sub.add_parser("build", help="build (or complete) a real-size workdir from shapes")
    b.add_argument("--out", required=True, help="a directory outside the repository, e.g. ~/realsize/base")
    b.add_argument("--size", choices=tuple(SIZES), default="base")
    b.add_argument("--rows", type=int, default=None, help="cache rows (default: the size's: 4M base, 11M large)")
    b.add_argument("--world", default=None, help="copy this indexed synthetic workdir instead of indexing one")
    t = sub.add_parser("summaries", help="time each summary option on a built workdir (interleaved)")
    t.add_argument("--out", required=True)
    t.add_argument("--options", default=",".join(SUMMARY_OPTIONS), help=f"subset of {','.join(SUMMARY_OPTIONS)}")
    t.add_argument("--docs", type=int, default=5)
    t.add_argument("--words", type=int, default=900, help="documents lengthened to this many words (0: as they are)")
    t.add_argument("--batch-docs", type=int, default=0, help="also summaries/s at this many documents per call")
    v = sub.add_parser("serve", help="the service on a built workdir: p50/p95/p99 and documents/s per concurrency")
    v.add_argument("--out", required=True)
    v.add_argument("--levels", default="1,4,16")
    v.add_argument("--per-level", type=int, default=2, help="requests per unit of concurrency")
    v.add_argument("--c1-docs", type=int, default=4, help="documents of the interleaved concurrency-1 comparison")
    v.add_argument("--words", type=int, default=900)
    v.add_argument("--max-batch", type=int, default=16)
    v.add_argument("--min-requests", type=int, default=1, help="at least this many requests per level")
    v.add_argument("overrides", nargs="*", help="--config.x=y given to the server (a summary option)")
    args = p.parse_args()
    out = Path(args.out).absolute()
    if args.command == "summaries":
        unknown = set(args.options.split(",")) - set(SUMMARY_OPTIONS)
        if unknown or args.docs < 1:
            raise CfirError(f"--options: unknown {sorted(unknown)} (use {','.join(SUMMARY_OPTIONS)}); --docs >= 1")
        print(hardware_description())
        time_summaries(out, args.options.split(","), args.docs, args.words, args.batch_docs)
        return
    if args.command == "serve":
        print(hardware_description())
        time_served(out, [int(x) for x in args.levels.split(",")], args.per_level, args.words, args.c1_docs,
                    args.max_batch, args.overrides, args.min_requests)
        return
    if ROOT in (out, *out.parents):
        raise CfirError(f"--out {out}: inside the repository; pick a directory outside it (e.g. ~/realsize)")
    print(hardware_description())
    build(out, args.size, args.rows, Path(args.world).absolute() if args.world else None)


if __name__ == "__main__":
    main()
