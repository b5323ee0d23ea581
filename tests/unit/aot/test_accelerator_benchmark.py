"""benchmarks/accelerator.sh on a host without an accelerator: it says so, runs every measurement's code path at
tiny sizes, writes its JSON and markdown, and exits 0 (so the GPU command keeps working between GPU runs)."""

import json
import math
import os
import subprocess

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
