"""The cluster on a synthetic 1M-image index, in one command: answers equal to one process with 1, 2 and 4 shards,
and the two-pass SR across shards on unions larger than its shortlist.

    flock /tmp/cfir-bench.lock python benchmarks/serve_cluster_1m.py --demo demo_work --out /tmp/w1m [--shards 1,2,4]

1. The index (made once, then reused): the demo workdir's images, then random unit rows up to --images (float16),
   and each entity's list its own top-K over the demo's images followed by random other rows up to --k (the paper's
   K = 10,000); no tower runs (`serve_load.make_million`). A test document's union is then tens of thousands of
   rows: more than `retrieval.sr_shortlist` (2,560), so the two-pass SR really cuts.
2. `serve`: the single process (`retrieve.py --serve --engine local`), then Ray with each shard count (1 front, 1
   replica per shard), exact SR on both sides, each the real command on a free 127.0.0.1 port: p50 at concurrency 1,
   documents/s at concurrency 16 (`serve_cluster.measure`), every document's top 1,000 (ids, order, scores) compared
   with the single process's, and the memory (PSS) of every process of the run's HOME while it serves.
3. `fast`: with `retrieval.sr=fast`, where each shard shortlists its own rows, the share of one process's top 1,000
   that the merged shards' top 1,000 holds, and each one's share of exact SR's top 1,000, over the documents whose
   union is larger than the shortlist (their union sizes printed). The first pass's dims are the workdir's
   `retrieval.sr_compact_dims` (128, at most the cache's: at the demo's 64 dims it keeps every one, in int8).

Ray keeps state in HOME: run it with HOME set to a folder of its own. The load average is printed with every row.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from pathlib import Path

import httpx
import serve_cluster
import serve_load
from common import hardware_description  # also puts the repository root on sys.path

from cfir_jax.core import cli
from cfir_jax.core.cli import cli_main
from cfir_jax.core.errors import CfirError

TOP_K = 1000


def top_answers(url: str, docs: list[tuple[str, str]], top_k: int = TOP_K) -> dict[str, list[tuple[str, float]]]:
    """Each document's top_k hits (image id, score), best first."""
    out = {}
    with httpx.Client(base_url=url, timeout=300) as client:
        for doc_id, text in docs:
            r = client.post("/v1/search", json={"text": text, "id": doc_id, "top_k": top_k})
            if r.status_code != 200:
                raise CfirError(f"{url}: {doc_id} answered {r.status_code}: {r.text[:200]}")
            out[doc_id] = [(h["image_id"], h["score"]) for h in r.json()["hits"]]
    return out


def home_pss_mib() -> float:
    """MiB of proportional set size of every process whose HOME is this run's (the server, the Ray it started, its
    workers): shared pages, the memory-mapped cache's included, counted once across them."""
    home, total = f"HOME={os.environ.get('HOME', '')}".encode(), 0
    for proc in Path("/proc").glob("[0-9]*"):
        if proc.name == str(os.getpid()):  # the benchmark's own client
            continue
        try:
            if home in proc.joinpath("environ").read_bytes().split(b"\0"):
                rollup = proc.joinpath("smaps_rollup").read_text()
                total += next(int(line.split()[1]) for line in rollup.splitlines() if line.startswith("Pss:"))
        except (OSError, StopIteration):  # gone, or not ours
            continue
    return total / 1024


def serve_rows(workdir: str, docs: list[tuple[str, str]], shard_counts: list[int], requests: int,
               seconds: float) -> None:
    """The single process, then Ray with each shard count: latency, throughput, memory, top-1000 equality."""
    print(f"{'engine':<16}{'ready s':>8}{'p50 c=1 ms':>12}{'p95 c=1 ms':>12}{'docs/s c=16':>13}{'failed':>8}"
          f"{'PSS MiB':>9}  top-{TOP_K} equal  load", flush=True)
    single = None
    for shards in [0, *shard_counts]:
        label = "single process" if shards == 0 else f"ray, {shards} shard{'s' if shards > 1 else ''}"
        extra = ["--engine", "local"] if shards == 0 else ["--engine", "ray", f"--config.serve.shards={shards}"]
        t0 = time.perf_counter()
        proc, url = serve_cluster.start(workdir, *extra)
        ready = time.perf_counter() - t0
        try:
            answers = top_answers(url, docs)
            pss = home_pss_mib()
            m = serve_cluster.measure(url, docs, requests, seconds)
        finally:
            serve_cluster.stop(proc)
        single = single or answers
        same = sum(answers[d] == single[d] for d in single)
        print(f"{label:<16}{ready:>8.0f}{m['p50']:>12.1f}{m['p95']:>12.1f}{m['docs_s']:>13.1f}{m['failed']:>8}"
              f"{pss:>9.0f}  {same}/{len(single)} docs{'':<5}{serve_cluster.load_averages()}", flush=True)


def top_rows(workdir: str, docs: list[tuple[str, str]], sr: str, shards: int = 0) -> list[set[int]]:
    """Each document's top-1000 rows with retrieval.sr=`sr`: one process's Retriever (shards 0), or `shards` shards
    in this process merged by the cluster's retriever (the code the Ray fronts and shards run)."""
    # why: the in-process retrievers (jax, the stores) are only needed here
    from cfir_jax.cluster.shard import LocalShards, ShardSearch
    from cfir_jax.retrieve.pipeline import DocumentInput, Retriever

    config = cli.apply_overrides(cli.workdir_config(workdir), [f"--config.retrieval.sr={sr}",
                                                               f"--config.retrieval.top_k={TOP_K}"])
    inputs = [DocumentInput(text, doc_id) for doc_id, text in docs]
    if shards == 0:
        results = Retriever(config, workdir, "cfir").retrieve_many(inputs)
    else:
        parts = LocalShards([ShardSearch(config, workdir, s, shards) for s in range(shards)])
        results = serve_cluster.front(config, workdir, parts).retrieve_many(inputs)
    return [{h.row for h in r.hits} for r in results]


def overlap(a: list[set[int]], b: list[set[int]]) -> float:
    """The mean share of a's top rows that b's hold."""
    return statistics.mean(len(x & y) / max(1, len(x)) for x, y in zip(a, b))


def fast_rows(workdir: str, docs: list[tuple[str, str]], shard_counts: list[int]) -> None:
    """The two-pass SR's top-1000 agreement with one process (and each one's with exact SR), over the documents
    whose union exceeds the shortlist."""
    # why: the in-process Retriever (jax, the stores) is only needed here
    from cfir_jax.retrieve.pipeline import DocumentInput, Retriever

    config = cli.apply_overrides(cli.workdir_config(workdir), ["--config.retrieval.sr=exact"])
    retriever = Retriever(config, workdir, "cfir")
    shortlist = int(config.retrieval.sr_shortlist)
    dims = min(int(config.retrieval.sr_compact_dims), retriever.cache.dim)  # as the SR front end cuts it
    results = retriever.retrieve_many([DocumentInput(t, d) for d, t in docs])
    unions = {d: r.num_candidates for (d, _), r in zip(docs, results)}
    large = [(d, t) for d, t in docs if unions[d] > shortlist]
    sizes = sorted(unions[d] for d, _ in large)
    if not large:
        raise CfirError(f"no test document's union exceeds the shortlist ({shortlist}): raise --k")
    print(f"two-pass SR (retrieval.sr=fast, shortlist {shortlist:,}, first pass over {dims} int8 dims): {len(large)} "
          f"of {len(docs)} documents have a union larger than the shortlist (union rows: min {sizes[0]:,}, median "
          f"{statistics.median(sizes):,.0f}, max {sizes[-1]:,})", flush=True)
    exact, one = top_rows(workdir, large, "exact"), top_rows(workdir, large, "fast")
    print(f"one process: fast SR holds {overlap(exact, one):.4f} of exact SR's top {TOP_K}", flush=True)
    for shards in shard_counts:
        many = top_rows(workdir, large, "fast", shards)
        print(f"{shards} shard(s): the merged top {TOP_K} holds {overlap(one, many):.4f} of one process's (fast "
              f"SR both) and {overlap(exact, many):.4f} of exact SR's; load {serve_cluster.load_averages()}",
              flush=True)


@cli_main
def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--demo", required=True, help="an indexed and trained demo workdir (scripts/demo.sh's)")
    p.add_argument("--out", required=True, help="where the synthetic index is made, or found and reused")
    p.add_argument("--images", type=int, default=1_000_000)
    p.add_argument("--k", type=int, default=10_000, help="candidates per entity")
    p.add_argument("--shards", default="1,2,4")
    p.add_argument("--documents", type=int, default=20, help="test documents compared")
    p.add_argument("--requests", type=int, default=40, help="requests at concurrency 1")
    p.add_argument("--seconds", type=float, default=15.0, help="seconds at concurrency 16")
    p.add_argument("--parts", default="serve,fast", help="serve (the engines over HTTP), fast (the two-pass SR)")
    args = p.parse_args()
    parts, shard_counts = set(args.parts.split(",")), [int(s) for s in args.shards.split(",")]
    if not parts <= {"serve", "fast"} or not parts:
        raise CfirError(f"--parts {args.parts}: choose from serve, fast")
    t0 = time.perf_counter()
    serve_load.make_million(args.demo, args.out, args.images, args.k)
    print(f"{hardware_description()}; {args.out}: {args.images:,} images, K = {args.k:,} (made or found in "
          f"{time.perf_counter() - t0:.0f} s); load {serve_cluster.load_averages()}", flush=True)
    docs = list(dict(serve_load.test_documents(args.out, args.documents)).items())  # each test document once
    if "serve" in parts:
        serve_rows(args.out, docs, shard_counts, args.requests, args.seconds)
    if "fast" in parts:
        fast_rows(args.out, docs, shard_counts)


if __name__ == "__main__":
    main()
