"""The service soaked: `--minutes` of searches at concurrency 8, one entity worker SIGKILLed every `--kill-every`
seconds (as the OOM killer would), against the real server on 127.0.0.1 only.

    python benchmarks/serve_soak.py --workdir demo_work                  # 30 minutes, a worker killed every 5
    python benchmarks/serve_soak.py --workdir demo_work --minutes 2 --kill-every 30

Prints one row per minute (requests, p50 and p99 latency, non-2xx answers, the server's RSS and its workers', worker
restarts so far) and the totals; the goal is 0 non-2xx answers. The server is started in a process group of its own
and stopped at the end with SIGTERM to that whole group, as `systemctl stop` does; its exit status is reported.
--json writes the rows too. Bounded: every request has a timeout, the run ends at --minutes.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
from common import hardware_description  # also puts the repository root on sys.path

ROOT = Path(__file__).resolve().parents[1]


def _rss_mib(pid: int) -> float:
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) / 1024
    except OSError:
        pass
    return 0.0


def _metric(text: str, name: str) -> float:
    total = 0.0
    for line in text.splitlines():
        if line.startswith(name) and not line.startswith("#"):
            total += float(line.rsplit(" ", 1)[1])
    return total


def start_server(workdir: str, extra: list[str]) -> tuple[subprocess.Popen, str, list[str]]:
    proc = subprocess.Popen([sys.executable, "retrieve.py", "--index", workdir, "--serve", "--host", "127.0.0.1",
                             "--port", "0", *extra], cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                            text=True, start_new_session=True)
    log: list[str] = []
    while True:
        line = proc.stderr.readline()
        if not line:
            raise SystemExit(f"error: the server exited with {proc.wait()}: {''.join(log)[-2000:]}")
        log.append(line)
        if line.rstrip().endswith("; ready"):
            url = line.split(" at ", 1)[1].split(": loaded", 1)[0]
            break
    # Keep reading its log (one line per restart), so the pipe never fills.
    threading.Thread(target=lambda: log.extend(iter(proc.stderr.readline, "")), daemon=True).start()
    return proc, url, log


class Soak:
    """The load (concurrency threads), the killer (one worker every kill_every s) and the per-minute sampler."""

    def __init__(self, args, proc, client, texts):
        self.args, self.proc, self.client, self.texts = args, proc, client, texts
        self.t0 = time.monotonic()
        self.end = self.t0 + 60 * args.minutes
        self.records: list[tuple[float, float, int]] = []  # (time since t0, latency s, status; 0 = no answer)
        self.lock = threading.Lock()
        self.kills: list[tuple[float, int]] = []
        self.rows: list[dict] = []

    def searcher(self, k: int) -> None:
        import httpx

        n = k
        while time.monotonic() < self.end:
            t = time.monotonic()
            try:
                status = self.client.post("/v1/search", json={"text": self.texts[n % len(self.texts)],
                                                              "top_k": 20}).status_code
            except httpx.HTTPError:
                status = 0
            with self.lock:
                self.records.append((t - self.t0, time.monotonic() - t, status))
            n += self.args.concurrency

    def pids(self) -> list[int]:
        import httpx

        try:
            return self.client.get("/readyz", timeout=5).json()["entity_pool"]["pids"]
        except (httpx.HTTPError, KeyError, ValueError):
            return []

    def killer(self) -> None:
        at = self.t0 + self.args.kill_every
        while at < self.end:
            time.sleep(max(0.0, at - time.monotonic()))
            pids = self.pids()
            if time.monotonic() >= self.end or not pids:
                break
            victim = pids[len(self.kills) % len(pids)]
            try:
                os.kill(victim, signal.SIGKILL)
            except ProcessLookupError:
                continue
            self.kills.append((time.monotonic() - self.t0, victim))
            print(f"  {self.kills[-1][0]:7.1f} s: killed entity worker {victim}", flush=True)
            at += self.args.kill_every

    def sampler(self) -> None:
        minute, rss, worker_rss = 1, [], []
        while True:
            rss.append(_rss_mib(self.proc.pid))
            worker_rss.append(sum(_rss_mib(p) for p in self.pids()))
            now = time.monotonic()
            if now >= self.t0 + 60 * minute or now >= self.end:
                self.rows.append(self.row(minute, max(rss), max(worker_rss)))
                minute, rss, worker_rss = minute + 1, [], []
                if now >= self.end:
                    return
            time.sleep(5)

    def row(self, minute: int, rss: float, worker_rss: float) -> dict:
        import httpx

        with self.lock:
            mine = [r for r in self.records if 60 * (minute - 1) <= r[0] < 60 * minute]
        try:
            restarts = _metric(self.client.get("/metrics", timeout=5).text, "cfir_entity_worker_restarts_total")
        except httpx.HTTPError:
            restarts = float("nan")
        lat = np.array([r[1] for r in mine]) * 1e3
        row = {"minute": minute, "requests": len(mine),
               "p50_ms": float(np.percentile(lat, 50)) if len(lat) else 0.0,
               "p99_ms": float(np.percentile(lat, 99)) if len(lat) else 0.0,
               "non_2xx": sum(1 for r in mine if not 200 <= r[2] < 300),
               "rss_mib": rss, "workers_rss_mib": worker_rss, "restarts": restarts, "load1": os.getloadavg()[0]}
        print(f"  minute {minute:3d}: {row['requests']:5d} requests, p50 {row['p50_ms']:7.1f} ms, "
              f"p99 {row['p99_ms']:7.1f} ms, non-2xx {row['non_2xx']}, RSS {rss:.0f} MiB (workers "
              f"{worker_rss:.0f}), restarts {restarts:.0f}, load {row['load1']:.2f}", flush=True)
        return row

    def run(self) -> None:
        threads = [threading.Thread(target=self.sampler, daemon=True), threading.Thread(target=self.killer,
                                                                                         daemon=True)]
        for t in threads:
            t.start()
        with concurrent.futures.ThreadPoolExecutor(self.args.concurrency) as pool:
            list(pool.map(self.searcher, range(self.args.concurrency)))
        threads[0].join(90)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--workdir", required=True)
    ap.add_argument("--minutes", type=float, default=30.0)
    ap.add_argument("--concurrency", type=int, default=8)
    ap.add_argument("--kill-every", type=float, default=300.0, help="seconds between two workers killed")
    ap.add_argument("--timeout", type=float, default=30.0, help="per request, seconds")
    ap.add_argument("--json", help="also write the rows here")
    ap.add_argument("server_args", nargs="*", help="more arguments for the server (--config.serve.x=y)")
    args = ap.parse_args()
    import httpx

    from cfir_jax.data.corpus import Corpus

    corpus = Corpus.open(Path(args.workdir) / "corpus")
    texts = [corpus.document(i).text[:16000] for i in range(min(500, len(corpus.doc_ids)))]
    print(f"{hardware_description()}; load {os.getloadavg()[0]:.2f} at the start", flush=True)
    t_start_server = time.perf_counter()
    proc, url, log = start_server(args.workdir, args.server_args)
    print(f"server {url} (pid {proc.pid}) ready in {time.perf_counter() - t_start_server:.1f} s", flush=True)
    client = httpx.Client(base_url=url, timeout=args.timeout, limits=httpx.Limits(max_connections=64))
    soak = Soak(args, proc, client, texts)
    soak.run()
    records, rows = soak.records, soak.rows
    statuses = [r[2] for r in records]
    failed = sum(1 for s in statuses if not 200 <= s < 300)
    os.killpg(proc.pid, signal.SIGTERM)  # the whole group, as systemctl stop does
    try:
        code = proc.wait(120)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        code = proc.wait()
    lat = np.array([r[1] for r in records]) * 1e3
    restarts_logged = sum("replaced by pid" in line for line in log)
    print(f"\ntotal: {len(records)} requests in {args.minutes:g} min, p50 {np.percentile(lat, 50):.1f} ms, "
          f"p99 {np.percentile(lat, 99):.1f} ms; non-2xx {failed} (statuses {sorted(set(statuses))}); "
          f"workers killed {len(soak.kills)}, restarts logged {restarts_logged}; RSS {rows[0]['rss_mib']:.0f} -> "
          f"{rows[-1]['rss_mib']:.0f} MiB; server exit {code} after SIGTERM to its group; load "
          f"{os.getloadavg()[0]:.2f} at the end")
    print("\n| minute | requests | p50 ms | p99 ms | non-2xx | server RSS MiB | workers RSS MiB | restarts | load |")
    print("|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['minute']} | {r['requests']} | {r['p50_ms']:.1f} | {r['p99_ms']:.1f} | {r['non_2xx']} "
              f"| {r['rss_mib']:.0f} | {r['workers_rss_mib']:.0f} | {r['restarts']:.0f} | {r['load1']:.2f} |")
    if args.json:
        Path(args.json).write_text(json.dumps({"rows": rows, "kills": soak.kills, "failed": failed, "exit": code,
                                               "requests": len(records)}, indent=1))
    if failed or code != 0:
        sys.exit(1)


if __name__ == "__main__":
    main()
