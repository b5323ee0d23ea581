"""What index.py did, stage by stage: contents, size on disk and time, and whether the store was reused.

`StageRunner` runs one stage the way every stage runs (all processes start it together, it is timed, and it counts
as reused when its store's manifest was left untouched); `report_table` is the closing table index.py prints.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable
from pathlib import Path

from cfir_jax import hosts


@dataclasses.dataclass
class StageReport:
    name: str
    count: str
    seconds: float
    path: Path
    reused: bool = False  # the store was complete and current: nothing was (re)built

    @property
    def size_bytes(self) -> int:
        if not self.path.exists():
            return 0
        if self.path.is_file():
            return self.path.stat().st_size
        return sum(p.stat().st_size for p in self.path.rglob("*") if p.is_file())


def _human(n: float) -> str:
    for unit in ("B", "KB", "MB", "GB", "TB"):
        if n < 1024 or unit == "TB":
            return f"{n:.1f} {unit}" if unit != "B" else f"{int(n)} B"
        n /= 1024
    return str(n)


def report_table(reports: list[StageReport]) -> str:
    rows = [("stage", "contents", "on disk", "time")]
    rows += [(r.name, r.count, _human(r.size_bytes), "reused" if r.reused else f"{r.seconds:.1f} s")
             for r in reports]
    widths = [max(len(row[i]) for row in rows) for i in range(4)]
    lines = ["  ".join(cell.ljust(w) for cell, w in zip(row, widths)).rstrip() for row in rows]
    lines.insert(1, "  ".join("-" * w for w in widths))
    if reports and all(r.reused for r in reports):
        lines.append("index: every stage current, nothing to do")
    return "\n".join(lines)


def store_stamp(path: Path) -> int | None:
    """When the store's manifest was last written (every store, models included, is published with one)."""
    try:
        return (path / "manifest.json").stat().st_mtime_ns
    except OSError:
        return None


class StageRunner:
    """Runs the stages of one build and collects their reports; log: where progress lines go (process 0 only)."""

    def __init__(self, log: Callable[[str], None] = print):
        self.reports: list[StageReport] = []
        self.say = log if hosts.is_main() else (lambda line: None)

    def run(self, name: str, fn: Callable, describe: Callable[[object], str], path: Path):
        """fn() builds (or opens) the stage's store at path; describe(result) is its contents column."""
        # Every process starts a stage together: no process is still writing the previous store, so all of them
        # read the same manifests and agree whether this stage is current (none skips a stage another runs).
        hosts.barrier(f"stage:{name}")
        t = time.time()
        self.say(f"[{name}] ...")
        before = store_stamp(path)
        result = fn()
        # A stage that only opened its complete, current store (or had none to make) left the manifest untouched.
        reused = store_stamp(path) == before
        report = StageReport(name, describe(result), time.time() - t, path, reused)
        self.reports.append(report)
        self.say(f"[{name}] {report.count} " + ("(current, reused)" if reused else f"({report.seconds:.1f} s)"))
        return result
