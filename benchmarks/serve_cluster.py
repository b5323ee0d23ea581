"""The service on Ray Serve against the single process, in one run (`retrieve.py --serve --engine ray`).

    flock /tmp/cfir-bench.lock python benchmarks/serve_cluster.py --workdir demo_work [--shards 1,2,4]

For the single process (`--engine local`) and then Ray with each shard count (1 front, 1 replica per shard, each a
real command on a free 127.0.0.1 port, exact SR on both sides, the spaCy pool off on both sides; with 1 shard the
front scores its candidates itself, one hop fewer):
  - p50 and p95 at concurrency 1 (--requests requests, one after the other);
  - documents/s at concurrency 16 (16 client threads for --seconds);
  - whether every answer (ids, order, scores) equals the single process's for the same text;
  - where the time goes at concurrency 16: the stages' ms per document (the front's /metrics) and the CPU seconds
    of each engine's processes (the command's, and its Ray's: the head's session) per document;
and, in this process, what one query sends to each shard and receives back (pickled bytes of the shard calls, the
payload Ray carries; per query, the mean over the test documents). The load average is printed with every row.
"""

from __future__ import annotations

import argparse
import os
import pickle
import re
import signal
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
from accelerator_serve import stage_totals
from common import hardware_description  # also puts the repository root on sys.path

from cfir_jax.cluster.scoring import ShardedSR
from cfir_jax.cluster.shard import LocalShards, ShardSearch
from cfir_jax.core import cli
from cfir_jax.core.cli import cli_main
from cfir_jax.retrieve.pipeline import DocumentInput, Retriever

ROOT = Path(__file__).resolve().parents[1]
SETTINGS = ["--config.retrieval.sr=exact", "--config.entity_workers.serve=0", "--config.serve.verify_mb_per_s=0",
            "--config.serve.shard_num_cpus=0.1", "--config.serve.front_num_cpus=0.1",
            "--config.serve.object_store_mb=400", "--config.serve.deadline_ms=60000",
            "--config.serve.shard_timeout_s=20", "--config.serve.queue_size=256"]


def load_averages() -> str:
    return "/".join(f"{x:.2f}" for x in os.getloadavg())


def start(workdir: str, *args: str) -> tuple[subprocess.Popen, str]:
    """The command, ready: (its process, its URL); `proc.sessions` holds its session and its Ray head's."""
    proc = subprocess.Popen([sys.executable, "retrieve.py", "--index", workdir, "--serve", "--port", "0", *SETTINGS,
                             *args], cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                            start_new_session=True, env={**os.environ, "PYTHONPATH": str(ROOT)})
    log = []
    proc.sessions = [proc.pid]
    while line := proc.stderr.readline():
        log.append(line)
        head = re.search(r"starting a Ray head .*\(process group (\d+)", line)
        if head:
            proc.sessions.append(int(head.group(1)))
        if line.rstrip().endswith("; ready"):
            threading.Thread(target=lambda: proc.stderr.read(), daemon=True).start()  # keep draining
            return proc, "http" + line.split(" at http", 1)[1].split(": loaded", 1)[0]
    raise SystemExit(f"server exited {proc.wait()}: {''.join(log)[-2000:]}")


def cpu_seconds(sessions: list[int]) -> float:
    """User + system CPU seconds so far of every live process of these sessions (from /proc)."""
    tick, total = os.sysconf("SC_CLK_TCK"), 0
    for entry in os.scandir("/proc"):
        if entry.name.isdigit():
            try:
                stat = Path(entry.path, "stat").read_text()
            except OSError:
                continue
            fields = stat[stat.rfind(")") + 2:].split()
            if int(fields[3]) in sessions:
                total += int(fields[11]) + int(fields[12])
    return total / tick


def stop(proc: subprocess.Popen) -> None:
    os.killpg(proc.pid, signal.SIGTERM)
    try:
        proc.wait(180)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)


def measure(url: str, docs: list[tuple[str, str]], requests: int, seconds: float, sessions=()) -> dict:
    """p50/p95 (ms) at concurrency 1, documents/s at concurrency 16 with its stages' ms per document and the CPU
    seconds per document of the processes of `sessions`, and each text's hits."""
    answers = {}
    with httpx.Client(base_url=url, timeout=120) as c:
        for doc_id, text in docs:  # warm, and the answers compared
            r = c.post("/v1/search", json={"text": text, "id": doc_id})
            r.raise_for_status()
            answers[doc_id] = [(h["image_id"], h["score"]) for h in r.json()["hits"]]
        times = []
        for n in range(requests):
            t0 = time.perf_counter()
            c.post("/v1/search", json={"text": docs[n % len(docs)][1]}).raise_for_status()
            times.append(time.perf_counter() - t0)
    done, failed, stop_at = [0], [0], time.monotonic() + seconds

    def client(n: int) -> None:
        with httpx.Client(base_url=url, timeout=120) as c:
            while time.monotonic() < stop_at:
                r = c.post("/v1/search", json={"text": docs[n % len(docs)][1]})
                (done if r.status_code == 200 else failed)[0] += 1

    stages0, cpu0, t0 = stage_totals(url), cpu_seconds(list(sessions)), time.perf_counter()
    threads = [threading.Thread(target=client, args=(n,)) for n in range(16)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    elapsed, cpu, stages = time.perf_counter() - t0, cpu_seconds(list(sessions)) - cpu0, stage_totals(url)
    split = {stage: 1e3 * (s - stages0.get(stage, (0, 0))[0]) / max(1, n - stages0.get(stage, (0, 0))[1])
             for stage, (s, n) in stages.items()}
    qs = sorted(times)
    return {"p50": 1e3 * statistics.median(qs), "p95": 1e3 * qs[int(0.95 * (len(qs) - 1))],
            "docs_s": done[0] / elapsed, "failed": failed[0], "answers": answers, "split": split,
            "cpu_per_doc_ms": 1e3 * cpu / max(1, done[0])}


class CountingShards(LocalShards):
    """In-process shards that count the pickled bytes of what each call sends to a shard and each returns."""

    def __init__(self, shards):
        super().__init__(shards)
        self.sent = self.received = 0

    def score(self, vid, fused, queries, parts):
        answers = super().score(vid, fused, queries, parts)
        self.sent += sum(len(pickle.dumps((vid, fused, queries, p))) for p in parts.values()) / self.shards
        self.received += sum(len(pickle.dumps(a)) for a in answers.values()) / self.shards
        return answers

    def search(self, vid, queries, k, weights):
        found = super().search(vid, queries, k, weights)
        self.sent += len(pickle.dumps((vid, queries, k, weights)))
        self.received += sum(len(pickle.dumps(f)) for f in found) / len(found)
        return found


def front(config, workdir: str, shards, method: str = "cfir") -> Retriever:
    """A front's Retriever over in-process shards (the code the Ray fronts and shards run)."""
    return Retriever(config, workdir, method, scoring=ShardedSR.factory(shards, shards.parts[0].vid))


def shard_bytes(workdir: str, docs: list[tuple[str, str]], shards: int) -> tuple[float, float]:
    """(bytes sent to each shard, bytes each shard returns) per query, one query per call."""
    config = cli.apply_overrides(cli.workdir_config(workdir), ["--config.retrieval.sr=exact"])
    client = CountingShards([ShardSearch(config, workdir, s, shards) for s in range(shards)])
    retriever = front(config, workdir, client)
    for doc_id, text in docs:
        retriever.retrieve(DocumentInput(text, doc_id))
    return client.sent / len(docs), client.received / len(docs)


def fast_sr_agreement(workdir: str, docs: list[tuple[str, str]], shards: int, top_k: int = 1000) -> float:
    """With the two-pass SR (retrieval.sr="fast"), each shard shortlists on its own rows: the mean share of one
    process's top `top_k` that the merged shards' top `top_k` holds, over `docs`."""
    config = cli.apply_overrides(cli.workdir_config(workdir), ["--config.retrieval.sr=fast",
                                                               f"--config.retrieval.top_k={top_k}"])
    inputs = [DocumentInput(text, doc_id) for doc_id, text in docs]
    one = Retriever(config, workdir, "cfir").retrieve_many(inputs)
    parts = LocalShards([ShardSearch(config, workdir, s, shards) for s in range(shards)])
    many = front(config, workdir, parts).retrieve_many(inputs)
    shares = [len({h.row for h in a.hits} & {h.row for h in b.hits}) / max(1, len(a.hits)) for a, b in zip(one, many)]
    return statistics.mean(shares)


@cli_main
def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--workdir", required=True)
    p.add_argument("--shards", default="1,2,4")
    p.add_argument("--requests", type=int, default=60)
    p.add_argument("--seconds", type=float, default=20.0)
    p.add_argument("--documents", type=int, default=20)
    p.add_argument("--parts", default="serve,bytes,fast", help="serve (the engines over HTTP), bytes (per shard), "
                   "fast (the two-pass SR's top-1000 agreement with one process)")
    args = p.parse_args()
    parts = set(args.parts.split(","))
    from cfir_jax.data.corpus import Corpus

    corpus = Corpus.open(Path(args.workdir) / "corpus")
    test = sorted(corpus.qrels("test"))[: args.documents]
    rows = {d: i for i, d in enumerate(corpus.doc_ids)}
    docs = [(d, corpus.document(rows[d]).text) for d in test]
    print(f"{hardware_description()}; {args.workdir}: {len(docs)} test documents; load {load_averages()}")
    if "serve" in parts:
        serve_rows(args, docs)
    for s in map(int, args.shards.split(",")):
        if "bytes" in parts:
            sent, received = shard_bytes(args.workdir, docs, s)
            print(f"{s} shard(s): per query, each shard is sent {sent:,.0f} B and returns {received:,.0f} B (pickled)")
        if "fast" in parts:
            share = fast_sr_agreement(args.workdir, docs, s)
            print(f"{s} shard(s), two-pass SR (each shard shortlists its own rows): {share:.4f} of one process's "
                  f"top 1000 in the merged top 1000; load {load_averages()}", flush=True)


def serve_rows(args, docs) -> None:
    """The single process, then Ray with each shard count, over HTTP on this host."""
    print(f"{'engine':<22}{'p50 c=1 ms':>12}{'p95 c=1 ms':>12}{'docs/s c=16':>13}{'failed':>8}  equal  load")
    single = None
    for label, extra in [("single process", ["--engine", "local"])] + [
            (f"ray, {s} shard{'s' if s > 1 else ''}", ["--engine", "ray", f"--config.serve.shards={s}"])
            for s in map(int, args.shards.split(","))]:
        proc, url = start(args.workdir, *extra)
        try:
            m = measure(url, docs, args.requests, args.seconds, proc.sessions)
        finally:
            stop(proc)
        single = single or m
        equal = "yes" if m["answers"] == single["answers"] else "NO"
        print(f"{label:<22}{m['p50']:>12.1f}{m['p95']:>12.1f}{m['docs_s']:>13.1f}{m['failed']:>8}  {equal:<5}  "
              f"{load_averages()}", flush=True)
        split = ", ".join(f"{stage} {ms:.1f}" for stage, ms in sorted(m["split"].items()))
        print(f"{'':<22}c=16: CPU {m['cpu_per_doc_ms']:.1f} ms per document over the engine's processes; stages "
              f"(ms per document): {split}", flush=True)
        if label != "single process":
            print(f"{'':<22}p50 {m['p50'] / single['p50']:.2f}x the single process's, documents/s at c=16 "
                  f"{m['docs_s'] / single['docs_s']:.2f}x", flush=True)


if __name__ == "__main__":
    main()
