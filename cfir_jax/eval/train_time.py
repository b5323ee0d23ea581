"""Training time per epoch (the paper's T-t column) from a training run's timing log, with the hardware it ran on.

The trainer appends to `RUN/timing.jsonl` one line when a process starts training (`{"step": s, "elapsed_s": 0,
"hardware": ..., "steps_per_epoch": n}`) and one per logged step (`{"step": s, "elapsed_s": t}`, wall seconds since
that start, compiles and validation included). A resumed run starts a new segment; the time of each segment is its
last line's elapsed seconds over its steps: the gap before a resume is never counted, and steps redone after the
last checkpoint are timed again (they were paid for twice). The metrics log stays free of timings (a resumed run's
metrics equal an uninterrupted run's).
"""

from __future__ import annotations

import dataclasses
import json
import os
import time
from pathlib import Path

TIMING_FILE = "timing.jsonl"


@dataclasses.dataclass(frozen=True)
class TrainTime:
    seconds_per_epoch: float
    hardware: str  # the hardware of the segments, "a; b" when a resume ran elsewhere
    steps: int  # the timed steps the figure is from

    def label(self) -> str:
        """'1.25 h (8 x TPU v4)', minutes under an hour, seconds under a minute (a demo epoch is '0.0 min' else)."""
        hours, seconds = self.seconds_per_epoch / 3600, self.seconds_per_epoch
        value = f"{hours:.2f} h" if hours >= 1 else f"{seconds / 60:.1f} min" if seconds >= 60 else f"{seconds:.1f} s"
        return f"{value} ({self.hardware})"


def hardware_label(devices) -> str:
    """'8 x TPU v4', '1 x cpu (2 cores)': the device kind of `devices` and how many."""
    kinds = sorted({d.device_kind for d in devices})
    label = f"{len(devices)} x {'/'.join(kinds)}"
    if all(d.platform == "cpu" for d in devices):
        label += f" ({os.cpu_count()} cores)"
    return label


class SegmentTimer:
    """One process's segment of the log: started with `start_segment`, then `log(step)` at every logged step; a
    disabled timer (another process, nothing left to train) writes nothing."""

    def __init__(self, run_dir: Path, step: int, hardware: str, steps_per_epoch: int, enabled: bool = True):
        self.run_dir, self.enabled = Path(run_dir), enabled
        if enabled:
            start_segment(self.run_dir, step, hardware, steps_per_epoch)
        self.t0 = time.time()

    def log(self, step: int) -> None:
        if self.enabled:
            log_step(self.run_dir, step, time.time() - self.t0)


def start_segment(run_dir: Path, step: int, hardware: str, steps_per_epoch: int) -> None:
    _append(run_dir, {"step": step, "elapsed_s": 0.0, "hardware": hardware, "steps_per_epoch": steps_per_epoch})


def log_step(run_dir: Path, step: int, elapsed_s: float) -> None:
    _append(run_dir, {"step": step, "elapsed_s": round(elapsed_s, 3)})


def _append(run_dir: Path, record: dict) -> None:
    with open(Path(run_dir) / TIMING_FILE, "a") as f:
        f.write(json.dumps(record) + "\n")


def train_time(run_dir: Path) -> TrainTime | None:
    """Seconds per epoch of the run in `run_dir` (None when it has no timing log or no timed step)."""
    path = Path(run_dir) / TIMING_FILE
    if not path.is_file():
        return None
    segments: list[list[dict]] = []
    try:
        for line in path.read_text().splitlines():
            if line.strip():
                record = json.loads(line)
                if "hardware" in record or not segments:
                    segments.append([])
                segments[-1].append(record)
    except (json.JSONDecodeError, UnicodeDecodeError):
        return None
    seconds = steps = 0.0
    hardware, per_epoch = [], None
    for segment in segments:
        first, last = segment[0], segment[-1]
        if last["step"] <= first["step"]:
            continue
        seconds += last["elapsed_s"] - first["elapsed_s"]
        steps += last["step"] - first["step"]
        per_epoch = first.get("steps_per_epoch", per_epoch)
        if first.get("hardware") and first["hardware"] not in hardware:
            hardware.append(first["hardware"])
    if not steps or not per_epoch:
        return None
    return TrainTime(seconds / steps * per_epoch, "; ".join(hardware) or "unknown hardware", int(steps))
