"""Retrieval latency: the SR stage against its baselines at AToMiC-base scale, and the pipeline's time per stage.

    python benchmarks/retrieval_latency.py      # 4M x 768 float16 cache generated in memory (6 GB, minutes)
    python benchmarks/retrieval_latency.py --cache-file /tmp/srbench/cache_4000000x768.npy \
        --compact-dir /tmp/srbench/compact_128v2  # generated and saved on the first run, reused afterwards
    python benchmarks/retrieval_latency.py --n-images 500000        # scaled down
    python benchmarks/retrieval_latency.py --n-images 500000 --workdir /tmp/demo   # + end to end on a demo index
    python benchmarks/retrieval_latency.py --workdir /tmp/demo --part e2e           # end to end only

Part 1 (SR, synthetic): each query is a document with 10 entities, each bringing its top-`--per-entity` images
(~45% overlap by construction), and a summary embedding near them. The two-pass `SRScorer` (dedup, approximate int8
pass over the compact copy, shortlist, exact float16 re-rank) runs interleaved across thread counts, query by query,
so load from other jobs hits every variant alike. Then, on the same queries and cache: the plain numpy baseline
(gather the unique float16 rows, cast, matmul, top-k; also the reference for agreement), every unique candidate
through the scorer's exact kernels, the jitted JAX gather + dot, the device path (`cfir_jax.search.device_sr`:
the cache resident on the JAX devices, jitted exact SR, one query per call and batched; on CPU when no accelerator is
present, with the paper's 4.7 ms/query as a reference line when one is), and exact search of the whole cache (fewer
queries: seconds each at 4M). Prints ms/query p50/p95/min, where the scorer's time goes, ratios, and the top-k
agreement with exact scoring of the same candidates (mean and worst query).

Part 2 (end to end, `--workdir W`, a workdir built by index.py and train.py, e.g. `bash scripts/demo.sh`): the
Retriever on `--docs` documents of a split, fresh (entities recomputed with spaCy, summaries recomputed with the
configured summarizer), one document per call, so each stage is timed per document: entities, summary, encode
(text tower) and SR (the rank stage: candidate lists, union, scoring, hits). Prints p50/p95 ms per stage.
"""

from __future__ import annotations

import argparse
import os
import time
from pathlib import Path

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax
import jax.numpy as jnp
import numpy as np
from common import hardware_description  # also puts the repository root on sys.path

from cfir_jax.core.cli import cli_main
from cfir_jax.core.errors import CfirError
from cfir_jax.search.compact import CompactCache, build_compact, compact_in_memory
from cfir_jax.search.cpu_sr import SRScorer, StageTimes
from cfir_jax.search.device_sr import DeviceCache, has_accelerator
from cfir_jax.search.knn import synthetic_embeddings
from cfir_jax.search.topk import exact_topk, unique_sorted
from cfir_jax.stores.atomic_write import save_npy_atomic

GOAL_P50_MS = 5.0  # the project's target for SR on 2 CPU cores (the paper's GPU figure is 4.7 ms)
PAPER_MS_PER_QUERY = 4.7  # CFIR-L's reported retrieval time per query (the CFIR paper, Table 3)
GOAL_AGREEMENT = 0.99  # ... with the final top-1000 agreeing this well with exact scoring of the same candidates
# XLA's CPU client aliases a host buffer instead of copying it when it is 64-byte aligned: the JAX baseline then
# scores the same 6 GB cache without a second copy, and exact_topk's blocks are not copied either (measured
# 0.5-1.3 s vs 3.6-4.3 s per query over 1M x 768 float16 for an array 16 bytes off alignment, numpy's default).
_XLA_ALIGN = 64


# --------------------------------------------------------------------------------------------------- inputs


def make_documents(n: int, n_docs: int, per_entity: int, entities: int, seed: int) -> list[np.ndarray]:
    """Candidate unions with ~45% overlap: entities share a pool of images, plus their own. [ids [M] int32]"""
    rng = np.random.default_rng(seed)
    docs = []
    for _ in range(n_docs):
        shared = rng.choice(n, int(per_entity * 0.9), replace=False)
        lists = [np.concatenate([rng.choice(shared, per_entity // 2, replace=False),
                                 rng.integers(0, n, per_entity - per_entity // 2)]) for _ in range(entities)]
        docs.append(np.concatenate(lists).astype(np.int32))
    return docs


def aligned_copy(src: np.ndarray) -> np.ndarray:
    """src copied into a 64-byte aligned array (see _XLA_ALIGN); src may be a memmap (read once, sequentially)."""
    nbytes = src.size * src.dtype.itemsize
    raw = np.empty(nbytes + _XLA_ALIGN, np.uint8)
    off = (-raw.ctypes.data) % _XLA_ALIGN
    out = raw[off : off + nbytes].view(src.dtype).reshape(src.shape)
    for a in range(0, len(src), 262144):  # blocks: a memmap is read without a second full-size temporary
        out[a : a + 262144] = src[a : a + 262144]
    return out


def load_cache(args) -> np.ndarray:
    """The float16 cache [N, D]: from --cache-file (generated and saved there if missing), else generated."""
    if args.cache_file is None:
        return aligned_copy(synthetic_embeddings(args.n_images, args.dim, dtype=np.float16))
    path = Path(args.cache_file)
    if not path.exists():
        t = time.perf_counter()
        cache = synthetic_embeddings(args.n_images, args.dim, dtype=np.float16)
        save_npy_atomic(path, cache)
        print(f"generated and saved {path} in {time.perf_counter() - t:.1f}s")
        return aligned_copy(cache)
    try:
        cache = np.load(path, mmap_mode="r")
    except ValueError:
        raise CfirError(f"{path}: not a readable .npy array; pass another --cache-file "
                        "or delete it to regenerate") from None
    if cache.shape != (args.n_images, args.dim) or cache.dtype != np.float16:
        raise CfirError(f"{path} holds {cache.dtype} {cache.shape}, not float16 ({args.n_images}, {args.dim}); "
                        "pass matching --n-images/--dim or another --cache-file")
    # In memory (numpy backs big arrays with huge pages): a memmap adds a page fault per first touch of a page.
    return cache if args.mmap else aligned_copy(cache)


def load_compact(args, cache: np.ndarray) -> CompactCache:
    """The scorer's compact copy: from --compact-dir (built there if missing), else built in memory."""
    if args.compact_dir is None:
        return compact_in_memory(cache, dims=args.compact_dims)
    if not Path(args.compact_dir).exists():
        build_compact(cache, args.compact_dir, dims=args.compact_dims, progress=True)
    c = CompactCache.open(args.compact_dir, expect_n=cache.shape[0], expect_dim=cache.shape[1])
    if c.dims != args.compact_dims:
        raise CfirError(f"{args.compact_dir} has {c.dims} dims, not --compact-dims {args.compact_dims}; pass "
                        f"--compact-dims {c.dims} or another --compact-dir")
    return c if args.mmap else CompactCache(c.rotation, np.array(c.codes), np.array(c.scales))


# ------------------------------------------------------------------------------------------------ baselines


def plain_numpy_topk(cache: np.ndarray, query: np.ndarray, ids: np.ndarray, k: int) -> np.ndarray:
    """The issue's plain numpy SR: unique ids, gather float16 rows, cast, matmul, top-k. -> ids [k] best first."""
    u = unique_sorted(ids)
    scores = np.asarray(cache[u], np.float32) @ query
    part = np.argpartition(scores, max(0, u.size - k))[-k:]
    return u[part[np.argsort(-scores[part], kind="stable")]]


@jax.jit
def _jax_gather_dot(cache, ids, query):
    """cache [N, D] f16, ids [B] int32, query [D] f32 -> scores [B] f32 (exact: f16 -> f32 before the dot)."""
    rows = jnp.take(cache, ids, axis=0, mode="clip").astype(jnp.float32)
    return jnp.dot(rows, query, precision=jax.lax.Precision.HIGHEST)


class JaxGatherDot:
    """The issue's jitted JAX gather + dot baseline, top-k by numpy's argpartition on the host.

    Unions are padded to one size so every query reuses one compilation. The top-k stays out of the jit: XLA's
    CPU top_k of 1000 of ~60k scores measured ~35 ms, argpartition ~1 ms, and the baseline should be its best.
    """

    def __init__(self, cache: np.ndarray, pad_to: int, k: int):
        # Zero-copy when cache is 64-byte aligned (aligned_copy), else XLA copies it once here.
        self.cache = jax.device_put(cache)
        self.pad_to, self.k = pad_to, k

    def __call__(self, query: np.ndarray, ids: np.ndarray) -> np.ndarray:
        """query [D], ids [M] (duplicates allowed) -> the top-k ids [k] best first."""
        u = unique_sorted(ids)
        padded = np.zeros(self.pad_to, np.int32)
        padded[: u.size] = u
        scores = np.asarray(_jax_gather_dot(self.cache, padded, query))[: u.size]
        k = min(self.k, u.size)
        part = np.argpartition(scores, u.size - k)[u.size - k :]
        return u[part[np.argsort(-scores[part], kind="stable")]]


def device_path(args, cache: np.ndarray, queries: list, docs: list) -> tuple[list[float], float, list[float]]:
    """The device path on whatever JAX backend is present: seconds per query one per call, seconds per query in
    batches of --device-batch, and top-k agreement with plain numpy (1.0 expected: it scores exactly)."""
    if not args.naive_queries:
        return [], 0.0, []
    dc = DeviceCache(cache, k=args.k, query_batch=1)
    batched = DeviceCache(cache, k=args.k, query_batch=args.device_batch)
    unions = [unique_sorted(d) for d in docs]
    dc.score(queries[0], unions[0])  # compile
    n = args.naive_queries
    batched.score_batch(np.stack(queries[:n]), unions[:n])
    seconds, agree = [], []
    for q, u in list(zip(queries, unions))[:n]:
        t0 = time.perf_counter()
        _, top = dc.score(q, u)
        seconds.append(time.perf_counter() - t0)
        agree.append(len(np.intersect1d(plain_numpy_topk(cache, q, u, args.k), top)) / args.k)
    t0 = time.perf_counter()
    batched.score_batch(np.stack(queries[:n]), unions[:n])
    return seconds, (time.perf_counter() - t0) / n, agree


# ---------------------------------------------------------------------------------------------------- report


def pct(seconds) -> tuple[float, float, float]:
    """(p50, p95, min) in ms of wall seconds."""
    s = np.asarray(seconds)
    return float(np.percentile(s, 50) * 1e3), float(np.percentile(s, 95) * 1e3), float(s.min() * 1e3)


def timed_line(name: str, seconds, sr_p50_ms: float | None = None) -> str:
    p50, p95, mn = pct(seconds)
    line = f"{name}: p50 {p50:.2f} ms  p95 {p95:.2f} ms  min {mn:.2f} ms  ({len(seconds)} queries)"
    if sr_p50_ms:
        line += f"  -> SR {p50 / sr_p50_ms:.1f}x faster"
    return line


def load_averages() -> str:
    return "/".join(f"{x:.2f}" for x in os.getloadavg())


# ------------------------------------------------------------------------------------------------ SR stage


def sr_benchmark(args) -> None:
    """Part 1: SRScorer vs the baselines on a synthetic cache; prints everything."""
    print(f"SR stage: cache {args.n_images:,} x {args.dim} float16, {args.queries} queries of 10 entities x "
          f"{args.per_entity:,} candidates, top-{args.k}")
    t = time.perf_counter()
    cache = load_cache(args)
    compact = load_compact(args, cache)
    print(f"cache ({cache.nbytes / 2**30:.2f} GiB) + compact copy ({compact.dims} int8 dims per row, "
          f"{compact.codes.nbytes / 2**20:.0f} MiB) ready in {time.perf_counter() - t:.1f}s")
    docs = make_documents(args.n_images, args.queries, args.per_entity, 10, seed=1)
    rng = np.random.default_rng(2)
    queries = []
    for ids in docs:
        q = np.asarray(cache[rng.choice(ids, 10)], np.float32).mean(0)
        queries.append(q / np.linalg.norm(q))
    sizes = [len(unique_sorted(d)) for d in docs]
    with_dups = np.mean([len(d) for d in docs])
    print(f"candidates per query: {with_dups:,.0f} with duplicates, {np.mean(sizes):,.0f} unique "
          f"({min(sizes):,}-{max(sizes):,}; {1 - np.mean(sizes) / with_dups:.1%} overlap)")

    scorers = {t: SRScorer(cache, compact, shortlist=args.shortlist, k=args.k, threads=t) for t in args.threads}
    # Every unique candidate through the scorer's own exact kernels (chunked gather, vectorised cast, sgemv).
    all_exact = SRScorer(cache, compact, shortlist=max(sizes), k=args.k, threads=max(args.threads))
    for q, ids in list(zip(queries, docs))[:2]:  # warm-up: thread pools, BLAS, first touches
        for s in scorers.values():
            s.score(q, ids)
        all_exact.score(q, ids)
    load_start = load_averages()
    times = {t: StageTimes() for t in scorers}
    total = {t: [] for t in scorers}
    cpu = {t: [] for t in scorers}
    tops = {t: [] for t in scorers}
    for q, ids in zip(queries, docs):
        for t, s in scorers.items():  # interleaved, so load from other jobs hits every variant alike
            c0, t0 = time.process_time(), time.perf_counter()
            tops[t].append(s.score(q, ids, times[t])[1])
            total[t].append(time.perf_counter() - t0)
            cpu[t].append(time.process_time() - c0)
    load_sr = load_averages()
    base = time_baselines(args, cache, queries, docs, tops, sizes, all_exact)
    print(f"load average (1/5/15 min) before the SR loop {load_start}, after it {load_sr}, at the end "
          f"{load_averages()} ({os.cpu_count()} cpus: above {os.cpu_count()} other jobs share the cores)")
    print_sr_results(args, compact, scorers, total, cpu, times, base)


def time_baselines(args, cache, queries, docs, tops, sizes, all_exact) -> dict:
    """The baselines on the same queries, after the scorer's timed loop (see sr_benchmark); returns their seconds
    per query and their agreement with the plain numpy reference."""
    # The baselines after the timed loop: their 85 MB gathers would evict the caches and TLB entries the scorer's
    # next query finds warm in a pipeline that only runs SR. The plain numpy one is also the agreement reference.
    numpy_t, agree = [], {t: [] for t in tops}
    for i, (q, ids) in enumerate(zip(queries, docs)):
        t0 = time.perf_counter()
        ref = plain_numpy_topk(cache, q, ids, args.k)
        numpy_t.append(time.perf_counter() - t0)
        for t in tops:
            agree[t].append(len(np.intersect1d(ref, tops[t][i])) / len(ref))
    all_exact_t = []
    for q, ids in list(zip(queries, docs))[: args.naive_queries]:
        t0 = time.perf_counter()
        all_exact.score(q, ids)
        all_exact_t.append(time.perf_counter() - t0)
    jax_t, jax_agree = [], []
    if args.naive_queries:
        jax_fn = JaxGatherDot(cache, pad_to=-(-max(sizes) // 4096) * 4096, k=args.k)
        jax_fn(queries[0], docs[0])  # compile
        for q, ids in list(zip(queries, docs))[: args.naive_queries]:
            t0 = time.perf_counter()
            top = jax_fn(q, ids)
            jax_t.append(time.perf_counter() - t0)
            jax_agree.append(len(np.intersect1d(plain_numpy_topk(cache, q, ids, args.k), top)) / args.k)
    device_t, device_batch_s, device_agree = device_path(args, cache, queries, docs)
    # Exact full-cache search last: XLA's worker threads stay busy after a big call and would slow what follows.
    exact_t = []
    for q in queries[: args.exact_queries]:
        t0 = time.perf_counter()
        exact_topk(q[None], cache, args.k)
        exact_t.append(time.perf_counter() - t0)
    return dict(agree=agree, numpy=numpy_t, all_exact=all_exact_t, jax=jax_t, jax_agree=jax_agree, device=device_t,
                device_batch=device_batch_s, device_agree=device_agree, exact=exact_t)


def print_sr_results(args, compact, scorers, total, cpu, times, base: dict) -> None:
    """The SR stage's report: the scorer per thread count, where its time goes, its agreement, the baselines' ratios
    and the goals."""
    agree, numpy_t, all_exact_t, jax_t = base["agree"], base["numpy"], base["all_exact"], base["jax"]
    device_t, device_batch_s, device_agree, exact_t = base["device"], base["device_batch"], base["device_agree"], \
        base["exact"]
    jax_agree = base["jax_agree"]
    best = min(scorers, key=lambda t: np.median(total[t]))
    for t in scorers:
        print(timed_line(f"SR  SRScorer (compact {compact.dims}d int8, shortlist {args.shortlist}, {t} thread(s))",
                         total[t]) + f"; CPU p50 {np.median(cpu[t]) * 1e3:.2f} ms/query")
        stage_ms = times[t].p50_ms()
        p50_total = np.median(total[t]) * 1e3
        for name, ms in stage_ms.items():
            print(f"      {name:12s} p50 {ms:6.2f} ms  ({ms / p50_total:.0%} of the p50 total)")
        print(f"      top-{args.k} agreement with exact scoring of the same candidates: mean {np.mean(agree[t]):.4f}"
              f"  worst {np.min(agree[t]):.4f}")
    sr50 = np.median(total[best]) * 1e3
    if len(scorers) > 1:
        print("thread ratios (p50 / p50 of the fastest): "
              + ", ".join(f"{t}: {np.median(total[t]) * 1e3 / sr50:.2f}" for t in scorers))
    print(f"baselines (ratios against SR with {best} thread(s), p50 {sr50:.2f} ms):")
    print("  " + timed_line("plain numpy gather + f16->f32 + matmul + top-k", numpy_t, sr50))
    if all_exact_t:
        print("  " + timed_line("all unique candidates through SRScorer's exact kernels", all_exact_t, sr50))
    if jax_t:
        print("  " + timed_line("jitted JAX gather + f16->f32 + dot (+ numpy top-k)", jax_t, sr50)
              + f"; agreement with numpy mean {np.mean(jax_agree):.4f}")
    if device_t:
        backend = f"{jax.default_backend()} x{jax.local_device_count()}"
        print("  " + timed_line(f"device path (sr_device, jitted exact SR on {backend}), one query per call",
                                device_t, sr50) + f"; agreement with numpy mean {np.mean(device_agree):.4f}")
        print(f"  device path, {args.device_batch} queries per call: {device_batch_s * 1e3:.2f} ms/query "
              f"({1 / device_batch_s:.1f} queries/s)")
        if has_accelerator():
            print(f"  device path p50 vs the paper's {PAPER_MS_PER_QUERY} ms/query: "
                  f"{np.median(device_t) * 1e3 / PAPER_MS_PER_QUERY:.2f}x")
    if exact_t:
        print("  " + timed_line("exact full-cache search (search.topk.exact_topk)", exact_t, sr50))
    worst = min(np.min(agree[t]) for t in scorers)
    print(f"goal SR p50 <= {GOAL_P50_MS:g} ms: {'met' if sr50 <= GOAL_P50_MS else 'NOT met'} ({sr50:.2f} ms); "
          f"goal top-{args.k} agreement >= {GOAL_AGREEMENT:.0%}: "
          f"{'met' if np.mean(agree[best]) >= GOAL_AGREEMENT else 'NOT met'} (mean {np.mean(agree[best]):.4f}, "
          f"worst query {worst:.4f})")


# ------------------------------------------------------------------------------------------------ end to end


def workdir_config(workdir: str, spec: str | None):
    """The config of --config, else the one the index was built with (its index.json, read as retrieve.py does)."""
    from cfir_jax.core import cli

    if spec:
        return cli.load_config_file(spec)
    from cfir_jax.core.cli import workdir_config

    return workdir_config(workdir)


def end_to_end(args) -> None:
    """Part 2: the Retriever on fresh documents of a workdir, one per call; prints p50/p95 ms per stage."""
    from cfir_jax.retrieve.pipeline import DocumentInput, Retriever

    config = workdir_config(args.workdir, args.config)
    retriever = Retriever(config, args.workdir, "cfir")
    stored = retriever.corpus_documents(args.split)
    if len(stored) < 2:
        raise CfirError(f"{args.workdir}: split {args.split!r} has {len(stored)} documents; need 2 or more "
                        "(--split another one)")
    # entities=None, summary=None: recomputed per query, as for a document the index has never seen.
    docs = [DocumentInput(d.text, d.doc_id) for d in stored[: args.docs + 1]]
    if args.doc_words:  # each followed by the next ones up to N words (realsize.py: BART's 1,024-token inputs)
        from realsize import long_texts

        texts = long_texts([d.text for d in stored], args.doc_words)
        docs = [DocumentInput(texts[i % len(texts)], f"{stored[i % len(stored)].doc_id}#{i}")
                for i in range(args.docs + 1)]
    retriever.retrieve_many(docs[:1])  # warm-up: spaCy, the summarizer, encoder compiles, the SR scorer
    stages = ("entities", "summary", "encode", "er", "score", "hits")
    per_stage = {s: [] for s in stages}
    wall, candidates, n_entities, notes = [], [], [], 0
    for doc in docs[1:]:
        t0 = time.perf_counter()
        result = retriever.retrieve_many([doc])[0]
        wall.append(time.perf_counter() - t0)
        for s in stages:
            per_stage[s].append(result.times_ms[s] / 1e3)
        candidates.append(result.num_candidates)
        n_entities.append(len(result.entities))
        notes += bool(result.note)
    s = config.index.summaries
    summarizer = s.summarizer + (f" {s.bart_model}" if s.summarizer == "bart" else "")
    print(f"end to end: {args.workdir}, {len(wall)} {args.split} documents, fresh (entities and summaries "
          f"recomputed), one per call; cache {retriever.cache.num_images:,} x {retriever.cache.dim} "
          f"{retriever.embeddings.dtype}; summarizer {summarizer}; {np.mean(n_entities):.1f} entities and "
          f"{np.mean(candidates):,.0f} unique candidates per document"
          + (f"; {notes} fell back to full search (no usable entity)" if notes else ""))
    total = np.median(wall) * 1e3
    labels = {"entities": "entities (spaCy)", "summary": f"summary ({s.summarizer})",
              "encode": "encode (text tower)", "er": "ER (candidate lists, union)", "score": "SR (scoring)",
              "hits": "hits (entity bookkeeping)"}
    for st in stages:
        p50, p95, _ = pct(per_stage[st])
        print(f"  {labels[st]:28s} p50 {p50:8.2f} ms  p95 {p95:8.2f} ms  ({p50 / total:.0%} of the p50 total)")
    p50, p95, _ = pct(wall)
    print(f"  {'total per document':28s} p50 {p50:8.2f} ms  p95 {p95:8.2f} ms  (load average {load_averages()})")


@cli_main
def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--part", choices=("sr", "e2e", "both"), default=None,
                   help="what to run (default: both with --workdir, else sr)")
    g = p.add_argument_group("SR stage (synthetic cache)")
    g.add_argument("--n-images", type=int, default=4_000_000)
    g.add_argument("--dim", type=int, default=768)
    g.add_argument("--cache-file", help=".npy float16 cache to reuse (written on the first run)")
    g.add_argument("--compact-dir", help="build_compact directory to reuse (built on the first run)")
    g.add_argument("--mmap", action="store_true", help="score from memory maps instead of loading into memory")
    g.add_argument("--queries", type=int, default=40)
    g.add_argument("--per-entity", type=int, default=10_000)
    g.add_argument("--compact-dims", type=int, default=128)
    g.add_argument("--shortlist", type=int, default=2560)
    g.add_argument("--k", type=int, default=1000)
    g.add_argument("--threads", type=int, nargs="+", default=[1, 2], help="scorer thread counts to compare")
    g.add_argument("--naive-queries", type=int, default=10,
                   help="queries for the all-exact and JAX gather+dot baselines")
    g.add_argument("--device-batch", type=int, default=8, help="queries per call of the batched device path")
    g.add_argument("--exact-queries", type=int, default=3, help="full-cache exact searches (seconds each at 4M)")
    g = p.add_argument_group("end to end (a built workdir)")
    g.add_argument("--workdir", help="workdir built by index.py + train.py (e.g. /tmp/demo)")
    g.add_argument("--config", help="config file (default: the one in the workdir's index.json)")
    g.add_argument("--split", default="test")
    g.add_argument("--docs", type=int, default=50, help="documents to time (after one warm-up document)")
    g.add_argument("--doc-words", type=int, default=0,
                   help="lengthen each document with the next ones to this many words (0: as stored)")
    args = p.parse_args()
    part = args.part or ("both" if args.workdir else "sr")
    if part != "sr" and not args.workdir:
        raise CfirError(f"--part {part} needs --workdir W (build one with `bash scripts/demo.sh`)")
    for name in ("n_images", "dim", "queries", "per_entity", "compact_dims", "k", "docs", "device_batch"):
        if getattr(args, name) < 1:
            raise CfirError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    if args.shortlist < args.k or args.per_entity > args.n_images:
        raise CfirError(f"need --k <= --shortlist and --per-entity <= --n-images, got k={args.k}, "
                        f"shortlist={args.shortlist}, per-entity={args.per_entity}, n-images={args.n_images}")
    print(hardware_description())
    print(f"load average (1/5/15 min) at start {load_averages()}")
    if part in ("sr", "both"):
        sr_benchmark(args)
    if part in ("e2e", "both"):
        end_to_end(args)


if __name__ == "__main__":
    main()
