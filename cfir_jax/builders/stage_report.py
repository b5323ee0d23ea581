"""What index.py did, stage by stage: contents, size on disk and time, and whether the store was reused.

`StageRunner` runs one stage the way every stage runs (all processes start it together, it is timed, and it counts
as reused when its store's manifest was left untouched); `report_table` is the closing table index.py prints. Which
stores a rebuild makes stale, and how the stores other commands make are refreshed, are read from the stores'
declarations (`cfir_jax.builders.descriptor`: the one dependency graph).
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable
from pathlib import Path

from cfir_jax.builders import descriptor
from cfir_jax.core import faults, hosts


@dataclasses.dataclass
class StageReport:
    name: str
    count: str
    seconds: float
    path: Path
    reused: bool = False  # the store was complete and current: nothing was (re)built
    stale_because: str = ""  # not run now, but a store it is derived from was rebuilt: what was

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


def report_table(reports: list[StageReport], stages: tuple[str, ...] = ()) -> str:
    """The closing table; stale rows (`stale_reports`) read STALE, with the commands that refresh them below."""
    rows = [("stage", "contents", "on disk", "time")]
    rows += [(r.name, r.count, _human(r.size_bytes), "STALE" if r.stale_because else
              "reused" if r.reused else f"{r.seconds:.1f} s") for r in reports]
    widths = [max(len(row[i]) for row in rows) for i in range(4)]
    lines = ["  ".join(cell.ljust(w) for cell, w in zip(row, widths)).rstrip() for row in rows]
    lines.insert(1, "  ".join("-" * w for w in widths))
    stale = [r for r in reports if r.stale_because]
    built = [r for r in reports if not r.stale_because]
    if built and all(r.reused for r in built) and not stale:
        lines.append("index: every stage current, nothing to do")
    later = descriptor.later()
    index_stale = [r for r in stale if r.name not in later]
    if index_stale:
        lines.append(f"stale: {', '.join(f'{r.name} ({r.stale_because})' for r in index_stale)}; refresh with: "
                     f"python index.py --config CONFIG --workdir {index_stale[0].path.parent} --stages "
                     + ",".join(r.name for r in index_stale))
    for r in stale:
        if r.name in later:
            lines.append(f"stale: W/{r.name} ({r.stale_because}); refresh with: python "
                         + later[r.name].replace("W", str(r.path.parent)))
    return "\n".join(lines)


def stale_reports(layout, reports: list[StageReport], stages: tuple[str, ...]) -> list[StageReport]:
    """Rows for the stores not (re)built now that a store rebuilt now is a source of (or, for W/image_cache_full, that
    W/model_full no longer has its tower): stale until refreshed."""
    rebuilt = {r.name for r in reports if not r.reused}
    ran = {r.name for r in reports}
    out: list[StageReport] = []
    if "image_cache_full" in stages and "image_cache_full" not in ran and (why := layout.full_cache_stale()):
        out.append(StageReport("image_cache_full", "-", 0.0, layout.image_cache_full, stale_because=why))
    graph = descriptor.graph()
    for name in [*stages, *descriptor.later()]:
        path = layout.root / name
        if name in ran or name not in graph or not (path / "manifest.json").is_file() or \
                name in {o.name for o in out}:
            continue
        sources = [d for d in graph[name] if d in rebuilt or d in {o.name for o in out}]
        if sources:
            out.append(StageReport(name, "-", 0.0, path, stale_because=f"{', '.join(sources)} rebuilt"))
    return out


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
        # The stage is marked before it is announced: a SIGTERM sent on seeing "[name] ..." names the stage.
        with faults.stage(name, path):  # a full disk or SIGTERM names the stage and its store
            self.say(f"[{name}] ...")
            before = store_stamp(path)
            result = fn()
        # A stage that only opened its complete, current store (or had none to make) left the manifest untouched.
        reused = store_stamp(path) == before
        report = StageReport(name, describe(result), time.time() - t, path, reused)
        self.reports.append(report)
        self.say(f"[{name}] {report.count} " + ("(current, reused)" if reused else f"({report.seconds:.1f} s)"))
        return result
