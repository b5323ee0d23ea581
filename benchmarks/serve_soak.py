"""The service soaked, either engine: `--minutes` of mixed traffic (`soak_traffic`: text searches with filters,
without folding and in French, batches, images by id and uploaded, `cfir_jax.Client` searches with its retries,
hostile bodies) while its parts are SIGKILLed at random every `--kill-every` seconds (entity workers; on Ray also a
front, a shard replica or a gateway) and changes commit and reload every `--change-every` seconds (`index.py
--remove`, `--add`, `--remove`, `--compact` in turn, then SIGHUP), against the real command on 127.0.0.1 only, over a
copy of `--workdir` (each image given a field `n`, which the filters read).

    python benchmarks/serve_soak.py --workdir demo_work --engine ray              # 30 minutes
    python benchmarks/serve_soak.py --workdir demo_work --engine single --minutes 3 --kill-every 20 --change-every 40

Every answer is checked against what one process (an in-process `cfir_jax.Index`, exact SR as the services are
run) answers at the version the answer names: ids and order; a refusal is counted by kind; wrong and lost (no
answer at all) must be 0, and so must the 500s. Prints the totals, the refusals by kind, each process's RSS after
the first minute and at the end (growth at most 10% for those alive at both), and the processes left 5 s after
SIGTERM to the command's process group (0). --json writes it all. Exit 1 when a goal is missed.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import numpy as np
from common import hardware_description  # also puts the repository root on sys.path
from soak_traffic import EXACT, Reference, Traffic, make_asks, removal_candidate, tally, write_addition

ROOT = Path(__file__).resolve().parents[1]
RAY = ["--engine", "ray", "--config.serve.shards=2", "--config.serve.shard_replicas=2",
       "--config.serve.front_replicas=2", "--config.serve.gateway_replicas=2", "--config.serve.shard_num_cpus=0.1",
       "--config.serve.front_num_cpus=0.1", "--config.serve.gateway_num_cpus=0.1",
       "--config.serve.object_store_mb=300", "--config.serve.shard_timeout_s=10"]
RAY_ROLES = ("Front", "ShardReplica", "Gateway")  # the replicas the killer picks from, beside entity workers
CHANGES = ("remove", "add", "remove", "compact")
GROWTH_GOAL = 0.10


def processes(sessions: set[int]) -> dict[int, str]:
    """{pid: role} of the live processes of these sessions (the command's, the Ray head's)."""
    found = {}
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        try:
            stat = Path(entry.path, "stat").read_text()
            cmd = Path(entry.path, "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        rest = stat[stat.rfind(")") + 2:].split()
        if rest[0] != "Z" and int(rest[3]) in sessions:
            found[int(entry.name)] = _role(cmd, stat[stat.index("(") + 1:stat.rfind(")")])
    return found


def _role(cmd: str, comm: str) -> str:
    if "entity_worker_main" in cmd:
        return "entity worker"
    replica = re.match(r"ray::ServeReplica:cfir:([A-Za-z]+)", cmd)  # its title: ...:Front.handle_request...
    if replica:
        return replica.group(1)
    if cmd.startswith("ray::"):
        return cmd.split()[0][5:].split(".")[0]
    if "retrieve.py" in cmd:
        return "command"
    return comm


def rss_mib(pid: int) -> float:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    except OSError:
        pass
    return 0.0


class Command:
    """The service's command in a session of its own; its stderr kept; `url` once ready, and on Ray the session of
    the head it started."""

    def __init__(self, workdir: Path, engine: str, extra: list[str], home: Path):
        env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_")} if engine == "ray" else dict(os.environ)
        env["HOME"] = str(home)
        self.proc = subprocess.Popen([sys.executable, "retrieve.py", "--index", str(workdir), "--serve", "--host",
                                      "127.0.0.1", "--port", "0", "--config.retrieval.sr=exact",
                                      *(RAY if engine == "ray" else []), *extra],
                                     cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                                     start_new_session=True, env=env)
        self.log: list[str] = []
        self.sessions = {self.proc.pid}
        self.url = ""
        ready = threading.Event()

        def read():
            for line in self.proc.stderr:
                self.log.append(line)
                if "starting a Ray head" in line and "process group " in line:
                    self.sessions.add(int(line.split("process group ")[1].split(",")[0].split(")")[0]))
                if line.rstrip().endswith("; ready") and not ready.is_set():
                    self.url = line.split(" at http://", 1)[1].split(": loaded", 1)[0]
                    self.url = "http://" + self.url
                    ready.set()
            ready.set()

        threading.Thread(target=read, daemon=True).start()
        ready.wait(900)
        if not self.url:
            self.stop()
            raise SystemExit(f"error: the service was not ready: {''.join(self.log)[-3000:]}")

    def stop(self) -> tuple[int, int]:
        """SIGTERM to the command's process group, as systemctl stop does: (exit status, processes of its sessions
        left 5 s after it exited)."""
        try:
            os.killpg(self.proc.pid, signal.SIGTERM)
        except ProcessLookupError:
            pass
        try:
            code = self.proc.wait(180)
        except subprocess.TimeoutExpired:
            code = None
        time.sleep(5)
        left = processes(self.sessions)
        for pid in left:  # the soak's own cleanup, once counted
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        return code, len(left)


class Chaos:
    """The killer and the changer, each a thread until `end`; what they did, with when."""

    def __init__(self, args, cmd: Command, workdir: Path, reference: Reference, t0: float, end: float,
                 scratch: Path, rows: list[dict]):
        self.args, self.cmd, self.workdir, self.reference, self.rows = args, cmd, workdir, reference, rows
        self.t0, self.end, self.scratch = t0, end, scratch
        self.events: list[tuple[float, str]] = []
        self.removed: set[str] = set()
        self.added: set[str] = set()
        self.rng = random.Random(59)
        self.kills = 0

    def say(self, what: str) -> None:
        self.events.append((time.monotonic() - self.t0, what))
        print(f"  {self.events[-1][0]:7.1f} s: {what}", flush=True)

    def killer(self) -> None:
        roles = ("entity worker", *RAY_ROLES) if self.args.engine == "ray" else ("entity worker",)
        while self._sleep(self.args.kill_every * self.rng.uniform(0.6, 1.4)):
            live = processes(self.cmd.sessions)
            choices = [r for r in roles if any(v == r for v in live.values())]
            if not choices:
                continue
            order = self.args.kill_order
            role = order[self.kills % len(order)] if order else self.rng.choice(choices)
            self.kills += 1
            if role not in choices:
                continue
            victim = self.rng.choice([p for p, v in live.items() if v == role])
            try:
                os.kill(victim, signal.SIGKILL)
                self.say(f"SIGKILL {role} {victim}")
            except ProcessLookupError:
                pass

    def changer(self) -> None:
        turn = 0
        while self._sleep(self.args.change_every):
            kind = CHANGES[turn % len(CHANGES)]
            try:
                self._change(kind, turn)
            except Exception as e:  # noqa: BLE001 - said, and the soak goes on (the reference did not move)
                self.say(f"{kind} failed: {type(e).__name__}: {str(e)[-400:]}")
            turn += 1

    def _change(self, kind: str, turn: int) -> None:
        flags = []
        if kind == "remove":
            image = removal_candidate(self.reference, self.removed, self.added, turn)
            ids = self.scratch / f"remove{turn}.txt"
            ids.write_text(f"image:{image}\n")
            flags, what = ["--remove", str(ids)], f"remove {image}"
            self.removed.add(image)
        elif kind == "add":
            new = write_addition(self.scratch / f"add{turn}", self.rows[2 * turn % len(self.rows):][:2], turn)
            flags, what = ["--add", str(self.scratch / f"add{turn}")], f"add {', '.join(new)}"
            self.added.update(new)
        else:
            flags, what = ["--compact"], "compact"
        t = time.monotonic()
        proc = subprocess.run([sys.executable, "index.py", "--workdir", str(self.workdir), *flags], cwd=ROOT,
                              capture_output=True, text=True, timeout=900)
        if proc.returncode != 0:
            raise RuntimeError(proc.stderr[-600:])
        version = self.reference.record(str(self.workdir))
        os.kill(self.cmd.proc.pid, signal.SIGHUP)
        self.say(f"{what}: committed version {version} in {time.monotonic() - t:.0f} s (reference included); "
                 "SIGHUP")

    def _sleep(self, seconds: float) -> bool:
        """Waits; False once the soak's end is nearer than `seconds`' end (nothing more to do)."""
        at = time.monotonic() + seconds
        if at >= self.end - 5:
            return False
        time.sleep(max(0.0, at - time.monotonic()))
        return True


def prepare(args) -> tuple[Path, Path, list, list, bytes, list]:
    """The soak's copy of the workdir (fields written), its scratch folder, documents, image ids, an upload, and
    the rows its adds take (images of the workdir's own cache again, with their embeddings: imported or not, an
    add of precomputed embeddings needs no vision tower)."""
    from cfir_jax.builders.image_fields import columns_of, write_store
    from cfir_jax.data.corpus import Corpus
    from cfir_jax.stores.image_cache import ImageCache

    scratch = Path(tempfile.mkdtemp(prefix=f"soak-{args.engine}-", dir=args.scratch))
    workdir = scratch / "W"
    shutil.copytree(args.workdir, workdir, ignore=shutil.ignore_patterns("train", "pretrain", "*.lock"))
    cache = ImageCache.open(workdir / "image_cache")
    write_store(workdir / "image_fields", columns_of([{"n": r % 4} for r in range(cache.num_images)], {}), cache,
                0.0)
    corpus = Corpus.open(workdir / "corpus")
    documents = [(corpus.doc_ids[i], corpus.document(i).text[:6000]) for i in range(min(6, len(corpus.doc_ids)))]
    image_ids = [cache.ids[i] for i in (7, cache.num_images // 2, cache.num_images - 3)]
    images = sorted((ROOT / "examples/collection/images").glob("*.png"))
    imported = corpus.embeddings() if corpus.embedding_dim else None  # the collection's own, as it imported them
    rows = [{"caption": f"An image like {cache.ids[r]}", "source": images[r % len(images)],
             **({"embedding": [float(x) for x in imported[r]]} if imported is not None else {})}
            for r in range(0, 40, 3)]
    return scratch, workdir, documents, image_ids, images[-1].read_bytes(), rows


def report(args, counts: dict, rss: tuple[dict, dict], code, left: int, chaos: Chaos, records, reference) -> bool:
    c = counts["counts"]
    lat = np.array([r.latency_s for r in records if r.status == 200]) * 1e3
    start, end = rss
    both = [p for p in start if p in end]
    growth = {p: (end[p][1] - start[p][1]) / max(start[p][1], 1.0) for p in both}
    worst = max(growth.values(), default=0.0)
    print(f"\nengine {args.engine}, {args.minutes:g} min: {c.get('requests', 0)} requests, answered "
          f"{c.get('answered', 0)}, refused {c.get('refused', 0)}, hostile refused {c.get('hostile_refused', 0)}, "
          f"wrong {c.get('wrong', 0)}, lost {c.get('lost', 0)}, 500s {c.get('http_500', 0)}, other 5xx "
          f"{c.get('other_5xx', 0)}, not one JSON line {c.get('not_one_line', 0)}; p50 {np.percentile(lat, 50):.0f} "
          f"ms, p99 {np.percentile(lat, 99):.0f} ms; kills {sum('SIGKILL' in e for _, e in chaos.events)}, "
          f"changes {sum('committed' in e for _, e in chaos.events)} (versions {sorted(reference.answers)}); exit "
          f"{code} after SIGTERM to the group, processes left {left}; load {os.getloadavg()[0]:.2f}")
    print("refused by kind:", json.dumps(counts["refusals"]))
    if counts["wrong_examples"]:
        print("wrong:", json.dumps(counts["wrong_examples"])[:3000])
    print("\n| process | pid | RSS after 1 min MiB | RSS at the end MiB | growth |\n|---|---|---|---|---|")
    for p in sorted(set(start) | set(end), key=lambda p: (start.get(p, end.get(p))[0], p)):
        role = (start.get(p) or end.get(p))[0]
        a = f"{start[p][1]:.0f}" if p in start else "-"
        b = f"{end[p][1]:.0f}" if p in end else "-"
        print(f"| {role} | {p} | {a} | {b} | {f'{100 * growth[p]:+.1f}%' if p in growth else '-'} |")
    ok = not c.get("wrong") and not c.get("lost") and not c.get("http_500") and left == 0 and code == 0 \
        and worst <= GROWTH_GOAL
    if args.json:
        Path(args.json).write_text(json.dumps({
            "engine": args.engine, "minutes": args.minutes, **counts, "exit": code, "left": left,
            "rss_start": {str(p): v for p, v in start.items()}, "rss_end": {str(p): v for p, v in end.items()},
            "events": chaos.events, "reference_s": reference.seconds,
            "p50_ms": float(np.percentile(lat, 50)), "p99_ms": float(np.percentile(lat, 99)), "ok": ok}, indent=1))
    return ok


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--workdir", required=True)
    ap.add_argument("--engine", choices=["single", "ray"], default="single")
    ap.add_argument("--minutes", type=float, default=30.0)
    ap.add_argument("--concurrency", type=int, default=6)
    ap.add_argument("--kill-every", type=float, default=60.0, help="seconds between two kills, on average")
    ap.add_argument("--kill-order", type=lambda v: v.split(","), default=None,
                    help="roles killed in turn (\"Front,ShardReplica,Gateway,entity worker\"); default: at random")
    ap.add_argument("--change-every", type=float, default=150.0, help="seconds between two committed changes")
    ap.add_argument("--timeout", type=float, default=60.0, help="per request (the client's deadline), seconds")
    ap.add_argument("--scratch", default=None, help="where the workdir's copy goes (default: the temp dir)")
    ap.add_argument("--json", help="also write the figures here")
    ap.add_argument("server_args", nargs="*", help="more arguments for the command (--config.serve.x=y)")
    args = ap.parse_args()
    scratch, workdir, documents, image_ids, image, rows = prepare(args)
    print(f"{hardware_description()}; load {os.getloadavg()[0]:.2f} at the start; workdir copy {workdir}", flush=True)
    reference = Reference(documents, image_ids, image)
    print(f"reference: version {reference.record(str(workdir))} ({EXACT})", flush=True)
    (scratch / "home").mkdir()
    t_start = time.perf_counter()
    cmd = Command(workdir, args.engine, args.server_args, scratch / "home")
    print(f"{args.engine} service at {cmd.url} ready in {time.perf_counter() - t_start:.0f} s", flush=True)
    t0 = time.monotonic()
    end = t0 + 60 * args.minutes
    chaos = Chaos(args, cmd, workdir, reference, t0, end, scratch, rows)
    traffic = Traffic(cmd.url, make_asks(documents, image_ids, image), end, t0, args.timeout)
    rss: list[dict] = []

    def sample_rss():  # after the first minute (warmed), then a line a minute: RSS by role, MiB
        time.sleep(min(60.0, 30 * args.minutes))
        rss.append({p: (r, rss_mib(p)) for p, r in processes(cmd.sessions).items()})
        while time.monotonic() < end - 60:
            time.sleep(60)
            by_role: dict[str, float] = {}
            for p, r in processes(cmd.sessions).items():
                by_role[r] = by_role.get(r, 0.0) + rss_mib(p)
            chaos.say("RSS " + ", ".join(f"{r} {v:.0f}" for r, v in sorted(by_role.items()) if v > 100))

    threads = [threading.Thread(target=f, daemon=True) for f in (chaos.killer, chaos.changer, sample_rss)]
    for t in threads:
        t.start()
    traffic.run(args.concurrency)
    threads[1].join(900)  # a change under way ends first (its reference too)
    rss.append({p: (r, rss_mib(p)) for p, r in processes(cmd.sessions).items()})
    code, left = cmd.stop()
    counts = tally(traffic.records, reference)
    ok = report(args, counts, (rss[0], rss[-1]), code, left, chaos, traffic.records, reference)
    if code != 0:
        print("".join(cmd.log)[-2000:])
    shutil.rmtree(scratch, ignore_errors=True)
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
