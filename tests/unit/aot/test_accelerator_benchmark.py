"""benchmarks/accelerator.sh on a host without an accelerator: it says so, runs every measurement's code path at
tiny sizes (the served query's too: a tiny real-size workdir, one process, then Ray), writes its JSON and markdown,
and exits 0 (so the GPU command keeps working between GPU runs)."""

import json
import math
import os
import subprocess
from pathlib import Path

import pytest
from repo import ROOT


@pytest.mark.slow
def test_accelerator_script_runs_every_path_at_tiny_sizes_without_an_accelerator(tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "JAX_PLATFORMS"}
    env["JAX_PLATFORMS"] = "cpu"  # this host has no accelerator; forced so a libtpu probe cannot change that
    out = subprocess.run(["bash", "benchmarks/accelerator.sh", "--out", str(tmp_path)], cwd=ROOT, env=env,
                         capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.startswith("no accelerator on this host")
    result = json.loads((tmp_path / "accelerator.json").read_text())
    assert result["accelerator"] is False
    whats = [r["what"] for r in result["rows"]]
    for expected in ("train step tiny bf16", "text encoding", "image encoding", "device SR", "BART summaries"):
        assert any(w.startswith(expected) for w in whats), (expected, whats)
    train = next(r for r in result["rows"] if r["what"].startswith("train step"))
    assert train["jax_seq_s"] > 0 and train["torch_seq_s"] > 0
    assert math.isclose(train["ratio"], train["jax_seq_s"] / train["torch_seq_s"], rel_tol=1e-6)
    sr = [r for r in result["rows"] if "ms_per_query" in r]
    assert len(sr) == 2 and all(r["ms_per_query"] > 0 and r["paper_ms"] == 4.7 for r in sr)
    # BART: summaries/s at the index's batch and one query document, float32 and bfloat16 (issue 30)
    bart = [r for r in result["rows"] if r["what"].startswith("BART")]
    assert [("summaries_s" in r, "ms_per_doc" in r) for r in bart] == [(True, False), (False, True)] * 2
    assert "float32" in bart[0]["what"] and "bfloat16" in bart[2]["what"]
    table = (tmp_path / "accelerator.md").read_text()
    assert "NOT accelerator figures" in table and table.count("\n| ") == len(whats) + 1
    # one process per unit (SR, the train size, each encoder, each BART dtype), none of them the driver's
    pids = {r["unit"]: r.get("pid") for r in result["rows"]}
    assert len(pids) == 6 and len(set(pids.values())) == 6


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


@pytest.mark.slow  # 4 min at load 18, 10 at load 30: a tiny real-size workdir indexed, one server, then Ray
def test_accelerator_script_serves_a_real_size_workdir_locally_and_on_ray_at_tiny_sizes(workdir, tmp_path):
    home = tmp_path / "home"  # Ray keeps state in HOME: an empty one, as on a fresh machine
    home.mkdir()
    env = {k: v for k, v in os.environ.items() if k != "JAX_PLATFORMS" and not k.startswith("RAY_")}
    env.update(HOME=str(home), JAX_PLATFORMS="cpu")
    out = subprocess.run(["bash", "benchmarks/accelerator.sh", "--parts", "serve", "--out", str(tmp_path / "out"),
                          "--world", str(workdir)],  # the session's indexed tiny world, copied: not indexed again
                         cwd=ROOT, env=env, capture_output=True, text=True, timeout=1500)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    assert out.stdout.startswith("no accelerator on this host")
    result = json.loads((tmp_path / "out" / "accelerator.json").read_text())
    assert [r["unit"] for r in result["rows"]] == ["serve:build", "serve:local", "serve:ray"], result["rows"]
    assert all("workdir" in r or "served" in r for r in result["rows"]), out.stdout[-3000:]  # none failed or cut
    build, local, ray = result["rows"]
    assert build["shape"].startswith("2,000 rows, K = 200") and not build["reused"]
    for row in (local, ray):
        assert row["c1"] == "3/3" and row["c16"] == "16/16" and row["exit"] == 0
        assert row["p95_ms"] >= row["p50_ms"] > 0 and row["docs_s"] > 0
    # the per-stage split is each server's own /metrics (on Ray, the one front is the ingress): every stage named
    for row in (local, ray):
        assert list(row["stages_ms"]) == ["spaCy", "BART", "tower", "ER", "SR"]
        assert all(ms > 0 for ms in row["stages_ms"].values())
    table = (tmp_path / "out" / "accelerator.md").read_text()
    assert "| single process |" in table and "| Ray, 1 shard |" in table and "| spaCy ms | BART ms |" in table
    assert _processes_with_home(home) == []  # every server and the Ray it started are gone
