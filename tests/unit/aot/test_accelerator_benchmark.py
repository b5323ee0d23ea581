"""benchmarks/accelerator.sh --dry-run: every unit of the device run (the train step beside torchscale's, the towers,
the device SR, BART in both dtypes, the served query's build, the single process and Ray with 1 shard) at tiny sizes
on the CPU, with every device branch forced: two CPU devices per unit, the SR cache sharded and held to numpy's SR,
BART's rows sized to a device's free memory, the served query's SR on the device (the warm-up that crashed there).
It writes its JSON and markdown and exits 0, and leaves no process behind."""

import json
import math
import os
import subprocess
from pathlib import Path

import pytest
from repo import ROOT


def _processes_with_home(home: Path) -> list[str]:
    """The command lines of this machine's processes whose HOME is `home` (the Ray a run started, if left behind)."""
    found = []
    for proc in Path("/proc").glob("[0-9]*"):
        try:
            if f"HOME={home}".encode() in proc.joinpath("environ").read_bytes().split(b"\0"):
                found.append(proc.joinpath("cmdline").read_bytes().replace(b"\0", b" ").decode()[:200])
        except OSError:  # gone, or not ours
            continue
    return found


@pytest.mark.benchmark
@pytest.mark.slow  # 90 s on a quiet 2-core machine (10 units, one process each; Ray's start), minutes under load
def test_the_dry_run_runs_every_unit_with_every_device_branch_forced(workdir, tmp_path):
    home = tmp_path / "home"  # Ray keeps state in HOME: an empty one, as on a fresh machine
    home.mkdir()
    env = {k: v for k, v in os.environ.items() if k not in ("JAX_PLATFORMS", "XLA_FLAGS") and not k.startswith("RAY_")}
    env.update(HOME=str(home), JAX_PLATFORMS="cpu")  # forced so that a libtpu probe cannot change that
    out = subprocess.run(["bash", "benchmarks/accelerator.sh", "--dry-run", "--out", str(tmp_path / "out"),
                          "--world", str(workdir)],  # the session's indexed tiny world, copied: not indexed again
                         cwd=ROOT, env=env, capture_output=True, text=True, timeout=2400)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    assert out.stdout.startswith("no accelerator on this host (jax backend: cpu): the dry run")
    result = json.loads((tmp_path / "out" / "accelerator.json").read_text())
    assert result["dry_run"] is True and result["accelerator"] is False and result["failed"] == []
    # each unit's time, printed as it ended, in the order of the parts
    ends = [line.split(":")[0] + ":" + line.split(":")[1] for line in out.stdout.splitlines()
            if " done in " in line and line.split(":")[0] in ("sr", "train", "encode", "bart", "serve")]
    assert ends == result["units"] == ["sr:cache", "train:tiny", "encode:text", "encode:image", "bart:float32",
                                       "bart:bfloat16", "serve:build", "serve:local", "serve:ray"]
    rows = result["rows"]
    whats = [r["what"] for r in rows]
    for expected in ("train step tiny bf16", "text encoding", "image encoding", "device SR", "BART summaries"):
        assert any(w.startswith(expected) for w in whats), (expected, whats)
    measured = [r for r in rows if "served" not in r and "workdir" not in r]
    assert all(r["devices"] == 2 for r in measured)  # every measured unit on two devices
    train = next(r for r in rows if r["what"].startswith("train step"))
    assert train["jax_seq_s"] > 0 and train["torch_seq_s"] > 0
    assert math.isclose(train["ratio"], train["jax_seq_s"] / train["torch_seq_s"], rel_tol=1e-6)
    sr = [r for r in rows if "ms_per_query" in r]
    assert len(sr) == 2 and all(r["ms_per_query"] > 0 and r["paper_ms"] == 4.7 for r in sr)
    assert all(r["shards"] == 2 and r["equal_to_cpu"] for r in sr)  # sharded, and equal to numpy's SR
    # BART: summaries/s at the index's batch and one query document, float32 and bfloat16; float32's rows per device
    # sized down to the stated free memory
    bart = [r for r in rows if r["what"].startswith("BART")]
    assert [("summaries_s" in r, "ms_per_doc" in r) for r in bart] == [(True, False), (False, True)] * 2
    assert "float32" in bart[0]["what"] and "bfloat16" in bart[2]["what"]
    assert bart[0]["rows_per_device"] < 8 and bart[0]["batch"] == 2 * bart[0]["rows_per_device"]
    # the served query: built from the world, then each engine with SR on the device, every request answered
    build, local, ray = (next(r for r in rows if r["unit"] == u) for u in ("serve:build", "serve:local", "serve:ray"))
    assert build["shape"].startswith("2,000 rows, K = 200") and not build["reused"]
    for row in (local, ray):
        assert row["sr"] == "device" and row["c1"] == "3/3" and row["c16"] == "16/16" and row["exit"] == 0
        assert row["p95_ms"] >= row["p50_ms"] > 0 and row["docs_s"] > 0
        assert list(row["stages_ms"]) == ["spaCy", "BART", "tower", "ER", "SR"]
        assert all(ms > 0 for ms in row["stages_ms"].values())
    table = (tmp_path / "out" / "accelerator.md").read_text()
    assert "NOT accelerator figures" in table and "| single process |" in table and "| Ray, 1 shard |" in table
    assert table.count("\n| ") == len(measured) + 1 + 2 + 1  # each measured row, the header, each engine, its header
    pids = {r["unit"]: r.get("pid") for r in rows}
    assert len(set(pids.values())) == len(pids) == 9  # one process per unit, none of them the driver's
    assert _processes_with_home(home) == []  # every server and the Ray it started are gone
