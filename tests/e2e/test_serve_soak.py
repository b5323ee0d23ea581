"""The soak's short profile (benchmarks/serve_soak.py; its 30-minute runs are in benchmarks/RESULTS.md): 90 s of
the Ray engine over the session's tiny world (2 shards x 2 replicas, 2 fronts, 2 gateways), mixed traffic (text
searches with filters, without folding and in French, batches, images by id and uploaded, `cfir_jax.Client` with
its retries, hostile bodies) while a front, a shard replica, a gateway and an entity worker are SIGKILLed in turn and
changes commit and reload (`index.py --remove`, `--add`, `--remove`, `--compact` in turn as time allows, each then
SIGHUP). Every answer equals one process's at the version it
names (ids and order); none is lost, none is a 500 (a search in flight at a dying ingress replica is sent again by
the command's door, cfir_jax/cluster/door.py, or answered 503 with Retry-After), hostile bodies are one JSON line
4xx; SIGTERM to the command's group exits 0 and leaves no process. It replaces the cluster tests that killed one
replica under load (a shard replica, each front, a gateway).

Marked benchmark: about 4 minutes of the 2-core machine (the cluster's start, the reference, the traffic, the stop)
that CI's 30 minutes do not hold beside the rest; `scripts/test.sh --benchmarks` runs it."""

import json
import subprocess
import sys

import pytest
from repo import ROOT

pytest.importorskip("ray.serve", reason="the cluster service needs Ray Serve: pip install -e '.[cluster]'")


@pytest.mark.slow
@pytest.mark.benchmark
def test_ninety_seconds_of_the_ray_engine_under_kills_and_changes_lose_nothing(workdir, tmp_path):
    out = tmp_path / "soak.json"
    proc = subprocess.run(
        [sys.executable, "benchmarks/serve_soak.py", "--workdir", str(workdir), "--engine", "ray", "--minutes", "1.5",
         "--concurrency", "4", "--kill-every", "18", "--change-every", "20", "--scratch", str(tmp_path),
         "--kill-order", "Gateway,ShardReplica,Front,entity worker,Front,Gateway", "--json", str(out), "--",
         "--config.serve.deadline_ms=30000",
         "--config.serve.verify_mb_per_s=0"],
        cwd=ROOT, capture_output=True, text=True, timeout=1500)
    assert out.exists(), proc.stdout[-3000:] + proc.stderr[-3000:]
    soak = json.loads(out.read_text())
    counts, log = soak["counts"], proc.stdout[-4000:]
    print(log)
    assert counts["requests"] > 100 and counts["answered"] > counts["requests"] / 2, log
    assert counts.get("wrong", 0) == 0 and soak["wrong_examples"] == [], log  # ids and order at the version named
    assert counts.get("lost", 0) == 0 and counts.get("http_500", 0) == 0 and counts.get("other_5xx", 0) == 0, log
    assert counts.get("not_one_line", 0) == 0 and counts.get("hostile_refused", 0) > 0, log
    assert all(kind.split()[0] in ("503", "504") for kind in soak["refusals"]), soak["refusals"]
    killed = {e.split()[1] for _, e in soak["events"] if e.startswith("SIGKILL")}
    assert {"Gateway", "ShardReplica", "Front", "entity"} <= killed, soak["events"]
    committed = [e for _, e in soak["events"] if "committed version" in e]  # how many: the machine's pace
    assert committed and not [e for _, e in soak["events"] if " failed: " in e], soak["events"]
    assert soak["exit"] == 0 and soak["left"] == 0, log  # SIGTERM to the group: drained, nothing of its Ray left
