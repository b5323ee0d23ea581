"""What BM25 over the images' own text costs (W/lexical): build time and memory, query ms per document, and SR's
time for the union BM25's candidates grow.

    flock /tmp/cfir-bench.lock python benchmarks/lexical.py --demo demo_work --synthetic 4000000

Part `demo` (--demo W, a built demo workdir): W/lexical rebuilt from W's corpus into a temporary directory (time, peak
memory of the building process), then every test document of W as a query: BM25's search p50/p95 (the configured
pruning, and exact), and the Retriever's `cfir` against `cfir_bm25` (SR's ms and candidates per query).

Part `synthetic` (--synthetic N): N captions of 8-20 words drawn from a Zipf vocabulary of `--vocab` words, one in
ten with a made-up name; documents of ~400 words from the same vocabulary naming a few of the captions' names. The
store is built from the captions (terms, bm25s scoring, writing: time and peak memory of the building process), then
`--queries` documents are searched with the default pruning (`retrieval.lexical.max_terms` / `max_postings`), the
first 20 also exactly; the pruned top 1,000's overlap with the exact one, and how many of the captions each document
names reach each top 10, are stated. SR's time for a union of `--union` rows, and
the same union with M = retrieval.lexical.candidates BM25 rows added, over a random float16 [--sr-rows, 768] cache.
"""

from __future__ import annotations

import argparse
import multiprocessing
import os
import resource
import tempfile
import time
from pathlib import Path

import numpy as np
from common import hardware_description

from cfir_jax.builders.lexical import tokenize, write_store
from cfir_jax.core.config import retrieval_config
from cfir_jax.search.bm25 import BM25Search, Pruning
from cfir_jax.stores.lexical import LexicalIndex

EXACT_QUERIES = 20  # documents searched exactly (every term): the pruning's baseline
SETTINGS = dict(fields=["caption_reference_description"], method="robertson", k1=1.2, b=0.75, stemmer="english")


class _Cache:
    def __init__(self, n: int):
        self.ids = [f"s{i}" for i in range(n)]
        self.num_images, self.content_fingerprint = n, "synthetic"


def _words(vocab: int) -> list[str]:
    """`vocab` made-up lower-case words of 4-9 letters (distinct with high probability; duplicates merge)."""
    rng = np.random.default_rng(7)
    codes = rng.integers(97, 123, (vocab, 9), dtype=np.uint8)
    lengths = rng.integers(4, 10, vocab)
    return [bytes(codes[i, : lengths[i]]).decode() for i in range(vocab)]


def synthetic_captions(n: int, vocab: int, seed: int = 0) -> tuple[list[str], list[str]]:
    """(captions, names): Zipf words, a made-up name in one caption of ten."""
    rng = np.random.default_rng(seed)
    words = _words(vocab)
    lengths = rng.integers(8, 21, n)
    tokens = [words[i] for i in np.minimum(rng.zipf(1.3, int(lengths.sum())) - 1, vocab - 1).tolist()]
    names = [f"zq{i:07d}x" for i in range(-(-n // 10))]
    caps, at = [], 0
    for i, length in enumerate(lengths.tolist()):
        caps.append(" ".join(tokens[at : at + length]) + (f" {names[i // 10]}" if i % 10 == 0 else ""))
        at += length
    return caps, names


def synthetic_documents(q: int, vocab: int, names: list[str], seed: int = 1) -> tuple[list[str], list[np.ndarray]]:
    """(documents, the caption rows each names): ~400 Zipf words and three names of the captions."""
    rng = np.random.default_rng(seed)
    words = _words(vocab)
    docs, named = [], []
    for _ in range(q):
        ids = np.minimum(rng.zipf(1.3, 400) - 1, vocab - 1).tolist()
        which = rng.integers(0, len(names), 3)
        docs.append(" ".join(words[i] for i in ids) + " " + " ".join(names[j] for j in which))
        named.append(10 * which)
    return docs, named


def _build_child(source: tuple, out: str, queue) -> None:
    """Makes the captions (synthetic, or a workdir's images' text), then builds the store from them."""
    if source[0] == "synthetic":
        captions = synthetic_captions(*source[1:])[0]
    else:
        captions = _workdir_texts(source[1])
    t0 = time.perf_counter()
    vocab: dict[str, int] = {}
    offsets, doc_terms = tokenize(captions, vocab, SETTINGS["stemmer"], progress=False)
    t1 = time.perf_counter()
    write_store(out, vocab, offsets, doc_terms, SETTINGS, _Cache(len(captions)), time.time())
    queue.put((t1 - t0, time.perf_counter() - t1, resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20))


def _workdir_texts(workdir: str) -> list[str]:
    from cfir_jax.builders.image_text import FIELDS
    from cfir_jax.builders.lexical import row_texts
    from cfir_jax.data.corpus import Corpus
    from cfir_jax.stores.image_cache import ImageCache

    corpus, cache = Corpus.open(Path(workdir) / "corpus"), ImageCache.open(Path(workdir) / "image_cache")
    return row_texts(corpus, cache.ids, FIELDS)


def build_in_child(source: tuple, out: str) -> tuple[float, float, float]:
    """(terms s, scoring + writing s, peak RSS GiB of the building process, which also made the captions), in a
    fresh process (spawned: jax's threads are not forked)."""
    ctx = multiprocessing.get_context("spawn")
    queue = ctx.Queue()
    proc = ctx.Process(target=_build_child, args=(source, out, queue))
    proc.start()
    result = queue.get()
    proc.join()
    return result


def query_times(store: LexicalIndex, docs: list[str], pruning: Pruning, k: int = 1000):
    """(ms per document [Q], top-k rows per document): terms + search, the configured pruning."""
    search = BM25Search(store.indptr, store.indices, store.data, store.num_rows, pruning=pruning)
    search.search(*store.query_terms(docs[0]), k)  # the per-thread buffers
    times, tops = [], []
    for d in docs:
        t = time.perf_counter()
        ranked = search.search(*store.query_terms(d), k)
        times.append(1e3 * (time.perf_counter() - t))
        tops.append(ranked[1])
    return np.array(times), tops


def _row(name: str, ms: np.ndarray) -> str:
    return f"{name:<44} p50 {np.percentile(ms, 50):8.2f} ms   p95 {np.percentile(ms, 95):8.2f} ms"


def query_table(store: LexicalIndex, docs: list[str], named: list[np.ndarray] | None = None) -> None:
    """BM25's ms per document, pruned and exact, their top-1000 overlap, and (synthetic) how many of the captions a
    document names are in each top 10."""
    lc = retrieval_config().lexical
    pruned, pruned_top = query_times(store, docs, Pruning(lc.max_terms, lc.max_postings))
    exact, exact_top = query_times(store, docs[:EXACT_QUERIES], Pruning())  # seconds each at millions of images
    overlap = np.mean([len(np.intersect1d(a, b)) / max(1, len(b)) for a, b in zip(pruned_top, exact_top)])
    print(_row(f"BM25 top 1000, pruned ({lc.max_terms} terms, {lc.max_postings:,} postings)", pruned))
    print(_row(f"BM25 top 1000, exact (every term), {len(exact)} documents", exact))
    speedup = np.median(exact) / np.median(pruned)
    print(f"pruned top 1000 overlap with exact: {overlap:.4f}; speed-up (p50) {speedup:.1f}x")
    if named is not None:
        for label, tops in (("pruned", pruned_top), ("exact", exact_top)):
            found = np.mean([np.isin(n, t[:10]).mean() for n, t in zip(named, tops)])
            print(f"named captions in the top 10, {label} ({len(tops)} documents): {found:.4f}")


def sr_table(sr_rows: int, union: int, m: int, repeat: int = 30) -> None:
    """SR's exact scoring of a union of `union` rows and of it grown by `m` rows, on a random float16 cache."""
    from cfir_jax.search.topk import exact_top_k

    rng = np.random.default_rng(0)
    cache = rng.standard_normal((sr_rows, 768), np.float32).astype(np.float16)
    query = rng.standard_normal(768).astype(np.float32)
    for size in (union, union + m):
        ids = np.sort(rng.choice(sr_rows, size, replace=False)).astype(np.int32)
        exact_top_k(cache, query, ids, 1000)
        t = []
        for _ in range(repeat):
            t0 = time.perf_counter()
            exact_top_k(cache, query, ids, 1000)
            t.append(1e3 * (time.perf_counter() - t0))
        print(_row(f"SR exact, union {size:,} of {sr_rows:,} x 768", np.array(t)))


def synthetic(n: int, vocab: int, queries: int, sr_rows: int, union: int) -> None:
    names = [f"zq{i:07d}x" for i in range(-(-n // 10))]
    docs, named = synthetic_documents(queries, vocab, names)
    print(f"synthetic: {n:,} captions, {queries} documents of ~400 words naming 3 captions each")
    with tempfile.TemporaryDirectory(dir=os.environ.get("TMPDIR")) as tmp:
        terms_s, score_s, rss = build_in_child(("synthetic", n, vocab), f"{tmp}/lexical")
        store = LexicalIndex.open(f"{tmp}/lexical")
        size = sum(p.stat().st_size for p in Path(f"{tmp}/lexical").iterdir())
        print(f"build: terms {terms_s:.1f} s, bm25s scoring + write {score_s:.1f} s, peak RSS {rss:.2f} GiB, "
              f"{store.manifest['num_postings']:,} postings, {store.manifest['vocab_size']:,} terms, "
              f"{size / 2**20:,.0f} MiB on disk")
        query_table(store, docs, named)
    sr_table(sr_rows, union, int(retrieval_config().lexical.candidates))


def demo(workdir: str) -> None:
    # why: the Retriever (jax, the models) loads for this part only
    from cfir_jax.core.cli import workdir_config
    from cfir_jax.retrieve.pipeline import Retriever

    with tempfile.TemporaryDirectory() as tmp:
        terms_s, score_s, rss = build_in_child(("workdir", workdir), f"{tmp}/lexical")
        rows = LexicalIndex.open(tmp + "/lexical").num_rows
        print(f"demo {workdir}: {rows:,} images; build: terms {terms_s:.2f} s, bm25s scoring + write "
              f"{score_s:.2f} s, peak RSS {rss:.2f} GiB")
    config = workdir_config(workdir)
    base = Retriever(config, workdir, "cfir")
    docs = base.corpus_documents("test")
    store = LexicalIndex.open(Path(workdir) / "lexical")
    query_table(store, [d.text for d in docs])
    base.retrieve_many(docs)  # warm: the encoders compiled, the stores read once
    for method in ("cfir", "cfir_bm25"):
        retriever = Retriever(config, workdir, method)
        retriever.retrieve_many(docs[:1])
        results = retriever.retrieve_many(docs)
        score = np.array([r.times_ms["score"] for r in results])
        print(_row(f"{method}: SR, {np.mean([r.num_candidates for r in results]):,.0f} candidates/q", score))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--demo", default="", help="a built demo workdir (with W/lexical)")
    p.add_argument("--synthetic", type=int, default=0, help="captions of the synthetic part (0: skip it)")
    p.add_argument("--vocab", type=int, default=200000)
    p.add_argument("--queries", type=int, default=200)
    p.add_argument("--sr-rows", type=int, default=1000000)
    p.add_argument("--union", type=int, default=10000, help="rows of ER's union SR scores (the paper: ~10 entities "
                   "x K = 1,000)")
    args = p.parse_args()
    print(hardware_description())
    print(f"load at start: {os.getloadavg()}")
    if args.demo:
        demo(args.demo)
    if args.synthetic:
        synthetic(args.synthetic, args.vocab, args.queries, args.sr_rows, args.union)
    print(f"load at end: {os.getloadavg()}")


if __name__ == "__main__":
    main()
