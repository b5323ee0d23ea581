"""Where the suite's time goes, by tier, for one or more runs: the seconds its tests took (setup, call and teardown,
as pytest's JUnit XML reports them) summed per tier, and each run's wall time.

    bash scripts/test.sh --junitxml=/tmp/after.xml      # a run of the whole suite (or CI's), its XML kept
    python benchmarks/suite_tiers.py before=/tmp/before.xml after=/tmp/after.xml

Tiers as docs/testing.md names them: quick (tests/unit/, not marked slow: `scripts/test.sh --quick`), the unit
tests marked slow, and the end-to-end runs (tests/e2e/). Which tests are marked slow is read from this checkout
(`pytest --collect-only -m slow`). With two xdist workers, a tier's seconds are worker-seconds: the run's wall time
is about their sum over two. The heaviest files of the last run are listed after the table.
"""

from __future__ import annotations

import argparse
import collections
import subprocess
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
TIERS = ("quick", "unit, slow", "e2e")


def slow_tests() -> set[str]:
    """Node ids ("tests/unit/x/test_y.py::test_z[param]") of the tests marked slow in this checkout."""
    out = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q", "-m", "slow", "-p", "no:xdist"],
                         cwd=REPO, capture_output=True, text=True, check=False).stdout
    return {line.strip() for line in out.splitlines() if "::" in line}


def node_id(case: ET.Element) -> str:
    """The pytest node id of a JUnit testcase (classname "tests.unit.x.test_y", or "...test_y.Class")."""
    parts = case.get("classname", "").split(".")
    cls = [parts.pop()] if parts and parts[-1][:1].isupper() else []
    return "::".join(["/".join(parts) + ".py", *cls, case.get("name", "")])


def read_run(path: Path, slow: set[str]) -> tuple[dict[str, float], dict[str, int], float, dict[str, float]]:
    """(seconds per tier, tests per tier, the run's wall time, seconds per file) of one JUnit XML."""
    root = ET.parse(path).getroot()
    suite = root if root.tag == "testsuite" else root.find("testsuite")
    seconds, counts, files = collections.Counter(), collections.Counter(), collections.Counter()
    for case in suite.iter("testcase"):
        node, took = node_id(case), float(case.get("time", 0))
        tier = "e2e" if node.startswith("tests/e2e/") else "unit, slow" if node in slow else "quick"
        seconds[tier] += took
        counts[tier] += 1
        files[node.split("::")[0]] += took
    return seconds, counts, float(suite.get("time", 0)), files


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("runs", nargs="+", metavar="NAME=JUNIT.xml")
    args = parser.parse_args()
    slow = slow_tests()
    runs = {}
    for spec in args.runs:
        name, _, path = spec.rpartition("=")
        runs[name or path] = read_run(Path(path), slow)
    print(f"{'tier':<12}" + "".join(f"{name:>22}" for name in runs))
    for tier in TIERS:
        print(f"{tier:<12}" + "".join(f"{s[tier]:>11.0f} s ({c[tier]:>4} t)" for s, c, _, _ in runs.values()))
    print(f"{'sum':<12}" + "".join(f"{sum(s.values()):>11.0f} s ({sum(c.values()):>4} t)"
                                   for s, c, _, _ in runs.values()))
    print(f"{'wall':<12}" + "".join(f"{wall:>11.0f} s{'':9}" for _, _, wall, _ in runs.values()))
    last = list(runs)[-1]
    print(f"\nthe heaviest files of {last}:")
    for file, took in runs[last][3].most_common(12):
        print(f"  {took:8.0f} s  {file}")


if __name__ == "__main__":
    main()
