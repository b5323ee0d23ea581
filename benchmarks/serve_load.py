"""The resident service under load (`retrieve.py --serve`), against the CLI and the in-process pipeline, in one run.

    flock /tmp/cfir-bench.lock python benchmarks/serve_load.py --workdir demo_work
    flock /tmp/cfir-bench.lock python benchmarks/serve_load.py --workdir demo_work --million /tmp/w1m

For each index (the demo's, and with --million a synthetic 1M-image index made from it, see `make_million`):
  - baselines measured in this run: the CLI's wall time per query (`retrieve.py --query`, a fresh process each),
    the in-process time per document (`benchmarks/retrieval_latency.py --part e2e`) and the bulk path's documents/s
    (`benchmarks/bulk_retrieval.py`);
  - the server (a subprocess on a free 127.0.0.1 port) with micro-batching on (serve.max_batch) and off (1): p50,
    p95, p99 and throughput at concurrency 1, 4, 16 and 64 (an asyncio httpx client; every request bounded, the run
    stops by itself); at concurrency 1 also alternating document by document with the in-process Retriever on the
    same texts (the goal's ratio, both sides under the same load); p99 at concurrency 64 over a run --long-factor
    times longer, to show the queue bounds it;
  - on the demo index: 1,000 requests with 10% malformed mixed in (each good answer equal to `retrieve.py --format
    json` for the same text, each bad one a 4xx) and the server's RSS over 5,000 requests (steady within 5%).
Only 127.0.0.1 is ever contacted. The goals of issue 19 are printed with whether each is met.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import json
import os
import random
import re
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
from common import hardware_description  # also puts the repository root on sys.path

from cfir_jax.core.cli import cli_main
from cfir_jax.core.errors import CfirError

ROOT = Path(__file__).resolve().parents[1]
LEVELS = (1, 4, 16, 64)
BAD_BODIES = (b"{not json", b"[1]", b"{}", b'{"text": ""}', b'{"text": "a\\u0000b"}', b'{"text": "x", "top_k": 0}',
              b'{"text": "x", "method": "bm25"}', b'{"text": "x", "extra": 1}', b'{"text": 3}')


def load_averages() -> str:
    return "/".join(f"{x:.2f}" for x in os.getloadavg())


def _env() -> dict:
    return {**os.environ, "PYTHONPATH": str(ROOT), "JAX_PLATFORMS": os.environ.get("JAX_PLATFORMS", "cpu")}


def test_documents(workdir: str, n: int) -> list[tuple[str, str]]:
    """(id, text) of the test split's documents, fresh (the server recomputes their entities and summaries)."""
    from cfir_jax.data.corpus import Corpus

    corpus = Corpus.open(Path(workdir) / "corpus")
    wanted = set(corpus.qrels("test"))
    docs = [(d, corpus.document(i).text) for i, d in enumerate(corpus.doc_ids) if d in wanted]
    if not docs:
        raise CfirError(f"{workdir}: no test documents")
    return [docs[i % len(docs)] for i in range(n)]


# ------------------------------------------------------------------------------------------------------ baselines
def cli_wall(workdir: str, text: str, runs: int) -> list[float]:
    """Seconds of `retrieve.py --index W --query doc.txt --format json`, a fresh process each (what a user pays)."""
    doc = Path(f"/tmp/serve_load_doc_{os.getpid()}.txt")
    doc.write_text(text)
    out = []
    for _ in range(runs):
        t0 = time.perf_counter()
        subprocess.run([sys.executable, "retrieve.py", "--index", workdir, "--query", str(doc), "--format", "json"],
                       cwd=ROOT, env=_env(), check=True, capture_output=True)
        out.append(time.perf_counter() - t0)
    doc.unlink()
    return out


def _run_benchmark(args: list[str], pattern: str) -> tuple[float, str]:
    proc = subprocess.run([sys.executable, *args], cwd=ROOT, env=_env(), capture_output=True, text=True)
    if proc.returncode:
        raise CfirError(f"{' '.join(args)} failed: {proc.stderr.strip().splitlines()[-1:]}")
    found = re.search(pattern, proc.stdout)
    if not found:
        raise CfirError(f"{' '.join(args)}: no line matching {pattern!r} in its output")
    return float(found.group(1)), proc.stdout


def in_process_ms(workdir: str, docs: int) -> float:
    """p50 ms per document of `retrieval_latency.py --part e2e` (the Retriever in process, one document per call)."""
    ms, _ = _run_benchmark(["benchmarks/retrieval_latency.py", "--part", "e2e", "--workdir", workdir, "--docs",
                            str(docs)], r"total per document\s+p50\s+([\d.]+) ms")
    return ms


def bulk_rate(workdir: str, docs: int) -> float:
    """Documents/s of `bulk_retrieval.py`'s bulk path (batches of 64, spaCy workers)."""
    rate, _ = _run_benchmark(["benchmarks/bulk_retrieval.py", "--workdir", workdir, "--docs", str(docs)],
                             r"bulk \(batches.*?\):\s+([\d.]+) documents/s")
    return rate


def interleaved_c1(url: str, workdir: str, docs: list[tuple[str, str]], overrides: tuple[str, ...] = (),
                   timeout: float = 60.0) -> tuple[float, float]:
    """p50 ms per document in this process (`Retriever.retrieve_many([doc])`, as retrieval_latency.py --part e2e
    times it) and over HTTP at concurrency 1, alternating document by document on the same texts, each side idle
    while the other runs: the concurrency-1 goal's ratio with the same machine load on both sides. `overrides`: the
    server's `--config.x=y`, applied in process too so both sides run the same summarizer."""
    import httpx

    from cfir_jax.core.cli import apply_overrides, workdir_config
    from cfir_jax.retrieve.pipeline import DocumentInput, Retriever

    retriever = Retriever(apply_overrides(workdir_config(workdir), overrides), workdir, "cfir")
    retriever.retrieve_many([DocumentInput(docs[0][1], "warm-up")])
    inproc, served = [], []
    with httpx.Client(base_url=url, timeout=timeout) as client:
        for doc_id, text in docs:
            t0 = time.perf_counter()
            retriever.retrieve_many([DocumentInput(text, doc_id)])
            t1 = time.perf_counter()
            r = client.post("/v1/search", json={"text": text, "id": doc_id})
            t2 = time.perf_counter()
            if r.status_code != 200:
                raise CfirError(f"the server answered {r.status_code}: {r.text[:200]}")
            inproc.append(t1 - t0)
            served.append(t2 - t1)
    return 1e3 * float(np.median(inproc)), 1e3 * float(np.median(served))


# --------------------------------------------------------------------------------------------------------- server
class Server:
    """`retrieve.py --index W --serve --port 0 OVERRIDES` (either engine), ready; its stderr drained (the last lines
    kept for an error). env: the server's environment (default: this run's, on the CPU unless JAX_PLATFORMS says)."""

    def __init__(self, workdir: str, *overrides: str, env: dict | None = None):
        self.proc = subprocess.Popen([sys.executable, "retrieve.py", "--index", workdir, "--serve", "--port", "0",
                                      *overrides], cwd=ROOT, env=env or _env(), stderr=subprocess.PIPE, text=True)
        self.log: collections.deque[str] = collections.deque(maxlen=20)
        t0 = time.perf_counter()
        for line in self.proc.stderr:
            self.log.append(line)
            if line.rstrip().endswith("; ready"):  # "... at http://HOST:PORT: loaded and warmed in X s; ready"
                self.url = "http" + line.split(" at http", 1)[1].split(": loaded", 1)[0]
                break
        else:
            last = [x.strip() for x in self.log if x.strip()][-1:] or ["no output"]
            raise CfirError(f"the server exited {self.proc.wait()} before it was ready: {last[0][:300]}")
        threading.Thread(target=lambda: self.log.extend(self.proc.stderr), daemon=True).start()
        if not self.url.startswith("http://127.0.0.1:"):
            raise CfirError(f"the server listens on {self.url}, not 127.0.0.1")
        self.ready_s = time.perf_counter() - t0

    def rss_mib(self) -> float:
        for line in Path(f"/proc/{self.proc.pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
        return float("nan")

    def stop(self) -> int:
        self.proc.terminate()
        try:
            return self.proc.wait(timeout=120)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            return self.proc.wait()


async def load(url: str, bodies: list[bytes], concurrency: int, timeout: float = 60.0) -> dict:
    """Sends every body once, `concurrency` at a time; latencies of the 200s, status counts, wall time."""
    import httpx

    statuses, latencies, answers = [], [], [None] * len(bodies)
    queue = list(enumerate(bodies))[::-1]

    async def worker(client):
        while queue:
            i, body = queue.pop()
            t0 = time.perf_counter()
            r = await client.post("/v1/search", content=body, headers={"content-type": "application/json"})
            statuses.append(r.status_code)
            if r.status_code == 200:
                latencies.append(time.perf_counter() - t0)
            answers[i] = (r.status_code, r.content)

    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)
    async with httpx.AsyncClient(base_url=url, timeout=timeout, limits=limits) as client:
        t0 = time.perf_counter()
        await asyncio.gather(*(worker(client) for _ in range(concurrency)))
        wall = time.perf_counter() - t0
    ms = np.asarray(latencies) * 1e3 if latencies else np.asarray([np.nan])
    return {"p50": float(np.percentile(ms, 50)), "p95": float(np.percentile(ms, 95)),
            "p99": float(np.percentile(ms, 99)), "ok": statuses.count(200), "n": len(bodies),
            "busy": statuses.count(503), "rate": statuses.count(200) / wall, "answers": answers}


def search_bodies(docs: list[tuple[str, str]]) -> list[bytes]:
    return [json.dumps({"text": t, "id": d}).encode() for d, t in docs]


# ---------------------------------------------------------------------------------------------- the 1M-image index
def make_million(demo: str, out: str, n_images: int, k: int, seed: int = 0) -> None:
    """A synthetic index of n_images from the demo's: its 5,000 rows then random unit rows (float16), and each
    entity's candidate list its own top-K over the demo images followed by random other rows up to k, as an entity
    index over a large cache would hold (the paper's K = 10,000): SR then scores unions of realistic size, and the
    whole-cache searches (the no-entity fallback, unseen entities) run over n_images. Reused when present."""
    from cfir_jax.stores.atomic_write import write_json_atomic
    from cfir_jax.stores.image_cache import ImageCache
    from cfir_jax.stores.integrity import write_checksums

    out_path = Path(out)
    if (out_path / "index.json").is_file() and ImageCache.open(out_path / "image_cache").num_images == n_images:
        return
    if out_path.exists():
        shutil.rmtree(out_path)
    skip = ("train", "pretrain", "image_text", "entity_text_match", "sr_compact", "sr_compact_fused", "reranker",
            "train_document")
    shutil.copytree(demo, out_path, ignore=lambda d, names: [x for x in names if Path(d) == Path(demo) and x in skip])
    rng = np.random.default_rng(seed)
    cache = ImageCache.open(out_path / "image_cache")
    base, dim = np.asarray(cache.embeddings), cache.dim
    emb = np.lib.format.open_memmap(out_path / "image_cache" / "embeddings.new.npy", "w+", np.float16,
                                    (n_images, dim))
    emb[: len(base)] = base
    for start in range(len(base), n_images, 200_000):
        rows = rng.standard_normal((min(200_000, n_images - start), dim)).astype(np.float32)
        emb[start : start + len(rows)] = rows / np.linalg.norm(rows, axis=1, keepdims=True)
    emb.flush()
    del emb
    os.replace(out_path / "image_cache" / "embeddings.new.npy", out_path / "image_cache" / "embeddings.npy")
    ids = cache.ids + [f"synthetic{i:07d}" for i in range(len(base), n_images)]
    (out_path / "image_cache" / "ids.txt").write_text("\n".join(ids) + "\n")
    manifest = dict(cache.manifest, num_encoded=n_images, created=time.strftime("%Y-%m-%dT%H:%M:%S"),
                    synthetic=f"{len(base):,} demo rows + {n_images - len(base):,} random unit rows")
    write_json_atomic(out_path / "image_cache" / "manifest.json", manifest)
    fresh = ImageCache.open(out_path / "image_cache")
    ei = out_path / "entity_index"
    offsets, cand = np.load(ei / "offsets.npy"), np.load(ei / "candidates.npy")
    scores = np.load(ei / "scores.npy")
    new_c, new_s, new_o = [], [], [0]
    for j in range(len(offsets) - 1):
        own, own_s = cand[offsets[j] : offsets[j + 1]], scores[offsets[j] : offsets[j + 1]]
        extra = rng.choice(np.arange(len(base), n_images), size=max(0, k - len(own)), replace=False)
        new_c.append(np.concatenate([own, extra.astype(np.int32)]))
        low = own_s.min() if len(own_s) else 0.0
        new_s.append(np.concatenate([own_s, np.full(len(extra), low, np.float32)]).astype(scores.dtype))
        new_o.append(new_o[-1] + len(new_c[-1]))
    np.save(ei / "candidates.npy", np.concatenate(new_c).astype(cand.dtype))
    np.save(ei / "scores.npy", np.concatenate(new_s))
    np.save(ei / "offsets.npy", np.asarray(new_o, offsets.dtype))
    em = json.loads((ei / "manifest.json").read_text())
    em.update(n_images=n_images, n_candidates=int(new_o[-1]), k=k, k_requested=k, has_searcher=False,
              cache_fingerprint=fresh.content_fingerprint)
    write_json_atomic(ei / "manifest.json", em)
    for store in ("image_cache", "entity_index"):  # what `index.py --verify` and the served verification read
        write_checksums(out_path / store)
    index = json.loads((out_path / "index.json").read_text())
    index["config"]["index"]["entity_index"]["k"] = k
    write_json_atomic(out_path / "index.json", index)


# ------------------------------------------------------------------------------------------------------------ runs
def measure_index(name: str, workdir: str, args) -> dict:
    docs = test_documents(workdir, max(LEVELS) * args.per_level)
    print(f"\n== {name}: {workdir}")
    cli = cli_wall(workdir, docs[0][1], args.cli_runs)
    print(f"CLI retrieve.py --query, wall per query: {', '.join(f'{s:.2f} s' for s in cli)}", flush=True)
    inproc = in_process_ms(workdir, args.e2e_docs)
    print(f"in process (retrieval_latency.py --part e2e): {inproc:.1f} ms per document (p50)", flush=True)
    bulk = bulk_rate(workdir, args.bulk_docs)
    print(f"bulk path (bulk_retrieval.py): {bulk:.1f} documents/s", flush=True)
    rows = {}
    for mode, overrides in (("on", [f"--config.serve.max_batch={args.max_batch}"]),
                            ("off", ["--config.serve.max_batch=1"])):
        server = Server(workdir, *overrides, "--config.serve.queue_size=256", "--config.serve.deadline_ms=60000")
        print(f"server, micro-batching {mode}: ready in {server.ready_s:.1f} s", flush=True)
        try:
            asyncio.run(load(server.url, search_bodies(docs[:8]), 4))  # connections and first requests
            if mode == "on":
                rows["interleaved"] = interleaved_c1(server.url, workdir, docs[: args.e2e_docs])
                print(f"  concurrency 1 interleaved with the in-process Retriever on the same {args.e2e_docs} "
                      f"documents: p50 {rows['interleaved'][1]:.1f} ms served vs {rows['interleaved'][0]:.1f} ms "
                      "in process", flush=True)
            for c in LEVELS:
                n = max(args.min_requests, c * args.per_level)
                r = asyncio.run(load(server.url, search_bodies(docs[:n]), c))
                rows[(mode, c)] = r
                print(f"  concurrency {c:3d}: {r['ok']}/{r['n']} ok ({r['busy']} busy), p50 {r['p50']:8.1f} ms  "
                      f"p95 {r['p95']:8.1f}  p99 {r['p99']:8.1f}  {r['rate']:7.1f} documents/s", flush=True)
            if mode == "on":
                n = max(LEVELS) * args.per_level * args.long_factor
                long_docs = test_documents(workdir, n)
                r = asyncio.run(load(server.url, search_bodies(long_docs), max(LEVELS)))
                rows[("long", max(LEVELS))] = r
                print(f"  concurrency 64, {args.long_factor}x longer ({n} requests): p99 {r['p99']:.1f} ms "
                      f"(vs {rows[('on', 64)]['p99']:.1f})", flush=True)
                if args.reliability:
                    rows.update(reliability(server, workdir, args))
        finally:
            code = server.stop()
            print(f"  SIGTERM: exit {code}", flush=True)
    return {"cli": cli, "inproc": inproc, "bulk": bulk, "rows": rows, "docs": len(docs)}


def reliability(server: Server, workdir: str, args) -> dict:
    """1,000 requests, 10% malformed, good answers equal to retrieve.py --format json; RSS over 5,000 requests."""
    rng = random.Random(0)
    docs = test_documents(workdir, 200)
    distinct = {d: t for d, t in docs}
    queries = Path(f"/tmp/serve_load_q_{os.getpid()}.jsonl")
    queries.write_text("".join(json.dumps({"id": d, "text": t}) + "\n" for d, t in distinct.items()))
    proc = subprocess.run([sys.executable, "retrieve.py", "--index", workdir, "--queries", str(queries), "--format",
                           "json"], cwd=ROOT, env=_env(), check=True, capture_output=True, text=True)
    queries.unlink()
    want = {a["id"]: a for a in map(json.loads, proc.stdout.splitlines())}
    bodies, expected = [], []
    for i in range(args.mixed):
        if i % 10 == 9:
            bodies.append(rng.choice(BAD_BODIES))
            expected.append(None)
        else:
            d, t = docs[rng.randrange(len(docs))]
            bodies.append(json.dumps({"text": t, "id": d}).encode())
            expected.append(d)
    r = asyncio.run(load(server.url, bodies, 16))
    good = bad = mismatched = 0
    for (status, content), doc_id in zip(r["answers"], expected):
        if doc_id is None:
            bad += 400 <= status < 500
            continue
        answer = json.loads(content) if status == 200 else None
        same = answer is not None and [h["image_id"] for h in answer["hits"]] == \
            [h["image_id"] for h in want[doc_id]["hits"]] and np.allclose(
                [h["score"] for h in answer["hits"]], [h["score"] for h in want[doc_id]["hits"]], rtol=1e-5,
                atol=1e-6)
        good += same
        mismatched += not same
    n_bad = expected.count(None)
    print(f"  mixed run: {args.mixed} requests at concurrency 16, {n_bad} malformed: {good} good answers equal to "
          f"retrieve.py --format json, {mismatched} not; {bad} of {n_bad} malformed answered 4xx", flush=True)
    bodies = search_bodies(test_documents(workdir, args.rss_requests))
    warm = args.rss_requests // 10
    asyncio.run(load(server.url, bodies[:warm], 16))
    rss0 = server.rss_mib()
    asyncio.run(load(server.url, bodies[warm:], 16))
    rss1 = server.rss_mib()
    print(f"  RSS over {args.rss_requests:,} requests: {rss0:.0f} MiB after {warm:,}, {rss1:.0f} MiB after all "
          f"({100 * (rss1 - rss0) / rss0:+.1f}%)", flush=True)
    return {("mixed",): (good, mismatched, bad, n_bad), ("rss",): (rss0, rss1)}


def table(results: dict) -> str:
    lines = ["| index | micro-batching | concurrency | p50 ms | p95 ms | p99 ms | documents/s | ok / sent |",
             "|---|---|---|---|---|---|---|---|"]
    for name, res in results.items():
        for mode in ("on", "off"):
            for c in LEVELS:
                r = res["rows"][(mode, c)]
                lines.append(f"| {name} | {mode} | {c} | {r['p50']:.1f} | {r['p95']:.1f} | {r['p99']:.1f} | "
                             f"{r['rate']:.1f} | {r['ok']} / {r['n']} |")
    return "\n".join(lines)


def goals(results: dict) -> str:
    out = []
    for name, res in results.items():
        rows, cli = res["rows"], float(np.median(res["cli"]))
        p50 = rows[("on", 1)]["p50"]
        base, served = rows["interleaved"]
        out.append(f"{name}: p50 at concurrency 1, interleaved document by document with the in-process Retriever: "
                   f"{served:.1f} vs {base:.1f} ms: {served / base:.2f}x (goal <= 1.2x: "
                   f"{'met' if served <= 1.2 * base else 'NOT met'}); the separate runs: {p50:.1f} ms vs "
                   f"retrieval_latency.py's {res['inproc']:.1f} ms, {p50 / res['inproc']:.2f}x; vs the CLI's "
                   f"{cli:.2f} s: {1e3 * cli / p50:.0f}x faster (goal >= 100x: "
                   f"{'met' if 1e3 * cli / p50 >= 100 else 'NOT met'})")
        rate = rows[("on", 16)]["rate"]
        out.append(f"{name}: throughput at concurrency 16 {rate:.1f} documents/s vs the bulk path's {res['bulk']:.1f}: "
                   f"{rate / res['bulk']:.2f}x (goal >= 1x: {'met' if rate >= res['bulk'] else 'NOT met'})")
        if ("long", 64) in rows:
            short, long = rows[("on", 64)]["p99"], rows[("long", 64)]["p99"]
            out.append(f"{name}: p99 at concurrency 64 {short:.0f} ms, over a run {res.get('long_factor', '')}x longer "
                       f"{long:.0f} ms: {long / short:.2f}x (goal: bounded, not growing with the run's length: "
                       f"{'met' if long <= 1.25 * short else 'NOT met'})")
        if ("mixed",) in rows:
            good, mismatched, bad, n_bad = rows[("mixed",)]
            out.append(f"{name}: mixed run {good} good answers equal to the CLI's, {mismatched} not; {bad}/{n_bad} "
                       f"malformed answered 4xx ({'met' if not mismatched and bad == n_bad else 'NOT met'})")
            rss0, rss1 = rows[("rss",)]
            out.append(f"{name}: RSS {rss0:.0f} -> {rss1:.0f} MiB ({100 * (rss1 - rss0) / rss0:+.1f}%; goal within "
                       f"5%: {'met' if abs(rss1 - rss0) <= 0.05 * rss0 else 'NOT met'})")
    return "\n".join(out)


@cli_main
def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--workdir", required=True, help="the demo's workdir (bash scripts/demo.sh)")
    p.add_argument("--million", default="", help="where to make (or reuse) the synthetic 1M-image index")
    p.add_argument("--n-images", type=int, default=1_000_000)
    p.add_argument("--k", type=int, default=10_000, help="candidates per entity in the synthetic index")
    p.add_argument("--per-level", type=int, default=4, help="requests per unit of concurrency at each level")
    p.add_argument("--min-requests", type=int, default=40)
    p.add_argument("--long-factor", type=int, default=3)
    p.add_argument("--max-batch", type=int, default=16)
    p.add_argument("--cli-runs", type=int, default=2)
    p.add_argument("--e2e-docs", type=int, default=40)
    p.add_argument("--bulk-docs", type=int, default=120)
    p.add_argument("--mixed", type=int, default=1000)
    p.add_argument("--rss-requests", type=int, default=5000)
    p.add_argument("--no-reliability", dest="reliability", action="store_false")
    args = p.parse_args()
    print(hardware_description())
    print(f"load average (1/5/15 min) at start {load_averages()}")
    results = {"demo": measure_index("demo", args.workdir, args)}
    if args.million:
        t0 = time.perf_counter()
        make_million(args.workdir, args.million, args.n_images, args.k)
        print(f"\nsynthetic index: {args.n_images:,} images, K = {args.k:,} per entity "
              f"({time.perf_counter() - t0:.0f} s)")
        args.reliability = False
        results[f"{args.n_images:,}-image synthetic"] = measure_index("1M", args.million, args)
    for res in results.values():
        res["long_factor"] = args.long_factor
    print("\n" + table(results))
    print("\n" + goals(results))
    print(f"load average at the end {load_averages()}")


if __name__ == "__main__":
    main()
