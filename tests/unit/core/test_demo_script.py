"""scripts/demo.sh's shell logic, with every command it runs replaced by a stub `python` (no JAX, no spaCy): the query
and the two fits run side by side, their printouts come in the demo's order, and a failed one stops the demo before
the evaluation."""

import shutil
import subprocess

from repo import ROOT

# The stub of `python`: the query waits (up to 10 s) for the fusion's fit to have started, which only a run side by
# side gives; the fusion's fit exits with $FUSION_RC.
STUB = r"""#!/usr/bin/env bash
case " $* " in
  *" --query "*)
    for _ in $(seq 100); do [ -f "$MARKS/fusion" ] && break; sleep 0.1; done
    [ -f "$MARKS/fusion" ] || { echo "query: the fusion's fit did not start beside it" >&2; exit 1; }
    echo "note: the query's note" >&2; echo "query hits" ;;
  *" --fit-reranker "*) echo "reranker fitted" ;;
  *" --fit-fusion "*) touch "$MARKS/fusion"; echo "fusion fitted"; exit "${FUSION_RC:-0}" ;;
  *" --evaluate "*) echo "the table" ;;
  *) echo "ran $1" ;;
esac
"""


def _demo(tmp_path, fusion_rc: int) -> subprocess.CompletedProcess:
    (tmp_path / "scripts").mkdir()
    shutil.copy(ROOT / "scripts" / "demo.sh", tmp_path / "scripts" / "demo.sh")
    (tmp_path / "scripts" / "setup.sh").write_text("exit 0\n")
    bin_dir, marks = tmp_path / "bin", tmp_path / "marks"
    bin_dir.mkdir()
    marks.mkdir()
    (bin_dir / "python").write_text(STUB)
    (bin_dir / "python").chmod(0o755)
    (tmp_path / ".venv" / "bin").mkdir(parents=True)
    (tmp_path / ".venv" / "bin" / "activate").write_text(f'export PATH="{bin_dir}:$PATH"\n')
    env = {"PATH": "/usr/bin:/bin", "MARKS": str(marks), "FUSION_RC": str(fusion_rc), "WORK": str(tmp_path / "W")}
    return subprocess.run(["bash", str(tmp_path / "scripts" / "demo.sh")], capture_output=True, text=True, env=env,
                          timeout=60)


def test_the_query_and_the_fits_run_side_by_side_and_print_in_order(tmp_path):
    proc = _demo(tmp_path, 0)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    out = proc.stdout
    order = ["ran index.py", "ran train.py", "== retrieve.py --query", "note: the query's note", "query hits",
             "== beyond the paper: fit the re-ranker", "reranker fitted", "== beyond the paper: fit the convex fusion",
             "fusion fitted", "== evaluation on the synthetic test split", "the table"]
    places = [out.find(line) for line in order]
    assert -1 not in places and places == sorted(places), out


def test_a_failed_fit_stops_the_demo_before_the_evaluation(tmp_path):
    proc = _demo(tmp_path, 3)
    assert proc.returncode == 1
    assert "query hits" in proc.stdout and "reranker fitted" in proc.stdout and "fusion fitted" in proc.stdout
    assert "the table" not in proc.stdout
    assert "demo.sh: failed: fusion" in proc.stderr
