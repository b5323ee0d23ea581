"""The background verification of a served workdir: every store re-read against its `checksums.json` at a bounded
rate (`serve.verify_mb_per_s`), one pass every `serve.verify_interval_s`, by the same code as `index.py --verify`
(`integrity.verify_workdir`). A mismatch is logged in one line and makes GET /readyz 503 with the file and block.
"""

from __future__ import annotations

import logging
import threading
import time

from cfir_jax.stores import integrity
from cfir_jax.stores.layout import Layout

log = logging.getLogger("cfir_jax.serve")


def store_problems(workdir: str, throttle: integrity.Throttle | None = None) -> list[str]:
    """`index.py --verify`'s lines of damage for a workdir (stores built before checksums are not damage)."""
    _, problems = integrity.verify_workdir(workdir, Layout.of(workdir).store_dirs(), throttle)
    return [p for p in problems if "cannot verify" not in p]


class BackgroundVerifier:
    """A daemon thread verifying `workdir()` (the workdir being served) pass after pass, paced to mb_per_s."""

    def __init__(self, workdir, mb_per_s: float, interval_s: float):
        self._workdir = workdir
        self.rate = float(mb_per_s) * 1e6
        self.interval = max(0.0, float(interval_s))
        self.problems: list[str] = []
        self.passes = 0
        self.last_pass: dict | None = None
        self.running = False
        self._stop, self._wake = threading.Event(), threading.Event()
        self._thread = None
        if self.rate > 0:
            self._thread = threading.Thread(target=self._run, name="cfir-verify", daemon=True)
            self._thread.start()

    def describe(self) -> dict:
        if self._thread is None:
            return {"state": "off"}
        state = "damaged" if self.problems else ("verifying" if self.running and not self.passes else "intact")
        return {"state": state, "passes": self.passes, "mb_per_s": self.rate / 1e6, "running": self.running,
                "last_pass": self.last_pass, **({"problems": self.problems} if self.problems else {})}

    def reset(self) -> None:
        """A new index was swapped in (verified before): forget the old one's damage and verify again."""
        self.problems = []
        self._wake.set()

    def stop(self) -> None:
        self._stop.set()
        self._wake.set()

    def _run(self) -> None:
        while not self._stop.is_set():
            workdir = self._workdir()
            self.running = True
            t0 = time.monotonic()
            try:
                problems = store_problems(workdir, integrity.Throttle(self.rate, self._stop))
                if problems and problems != self.problems:  # confirmed by a second read: a store index.py was
                    again = store_problems(workdir, integrity.Throttle(self.rate, self._stop))  # renaming in
                    problems = [p for p in problems if p in again]  # place mid-pass is not damage
            except InterruptedError:
                return
            except OSError as e:  # a store vanished mid-pass (a rebuild): said as damage until a pass is clean
                problems = [f"{e.filename or workdir}: unreadable ({e.strerror})"]
            finally:
                self.running = False
            if workdir != self._workdir():
                continue
            if problems and problems != self.problems:
                log.error("store damaged, /readyz now 503: %s%s", problems[0],
                          f" (and {len(problems) - 1} more)" if len(problems) > 1 else "")
            elif not problems and self.problems:
                log.warning("stores intact again: %s", workdir)
            self.problems = problems
            self.passes += 1
            self.last_pass = {"at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
                              "seconds": round(time.monotonic() - t0, 2), "problems": len(problems)}
            self._wake.wait(self.interval)
            self._wake.clear()
