"""Progress bars and library log levels: what a user sees while a long stage runs.

Bars (tqdm, on stderr, with rate and ETA) are shown on a terminal and left out of logs and captured test output
(tqdm's `disable=None`); `CFIR_PROGRESS=1` forces them on (a CI log that wants them, the tests of the bars),
`CFIR_PROGRESS=0` off.
"""

from __future__ import annotations

import logging
import os
import sys
from collections.abc import Callable, Iterable, Sequence
from typing import TypeVar

T = TypeVar("T")
R = TypeVar("R")

# Libraries that log every checkpoint save/restore step at INFO (orbax through absl: ~150 lines per training run).
_CHATTY = ("absl", "orbax", "jax._src", "tensorstore")


def disabled() -> bool | None:
    """tqdm's `disable` argument: None (on when stderr is a terminal) unless CFIR_PROGRESS says otherwise."""
    flag = os.environ.get("CFIR_PROGRESS", "").strip()
    if flag in ("1", "true", "yes"):
        return False
    if flag in ("0", "false", "no"):
        return True
    return None


def shown() -> bool:
    """Whether bars are shown now (for code that takes a `progress: bool`)."""
    hide = disabled()
    return sys.stderr.isatty() if hide is None else not hide


def _terminal_sized() -> bool:
    """Whether stderr is a terminal that reports its size (columns and lines both > 0)."""
    try:
        size = os.get_terminal_size(sys.stderr.fileno())
    except (OSError, ValueError, AttributeError):
        return False
    return size.columns > 0 and size.lines > 0


def bar(iterable: Iterable[T] | None = None, show: bool | None = None, **kwargs):
    """A tqdm bar on stderr, shown when `show` says so, by default according to `disabled()`; only on process 0
    of a multi-host run."""
    # why: tqdm loads only when a bar is drawn (the floor stays light)
    from tqdm.auto import tqdm

    hide = disabled() if show is None else not show
    if _process_index() > 0:
        hide = True
    # A terminal of 0 x 0 (a pty nobody sized: `script`, some CI runners) makes tqdm hide every bar (its position is
    # past the last of 0 lines); draw a 100-column bar there instead of none.
    if _terminal_sized():
        return tqdm(iterable, disable=hide, dynamic_ncols=True, **kwargs)
    return tqdm(iterable, disable=hide, ncols=100, nrows=50, **kwargs)


def map_chunks(fn: Callable[[Sequence[T]], list[R]], items: Sequence[T], desc: str, chunk: int = 64,
               unit: str = "it") -> list[R]:
    """`fn(items)` computed `chunk` items at a time under a bar; the same list as one call (fn is per-item pure)."""
    out: list[R] = []
    with bar(total=len(items), desc=desc, unit=unit) as b:
        for start in range(0, len(items), chunk):
            part = fn(items[start : start + chunk])
            out.extend(part)
            b.update(len(part))
    return out


def set_log_levels(verbosity: int) -> None:
    """0: warnings only; 1 (-v): this project's INFO logs; 2 (-vv): the libraries' INFO logs too."""
    logging.basicConfig(level=logging.INFO if verbosity else logging.WARNING, format="%(message)s")
    logging.getLogger().setLevel(logging.INFO if verbosity else logging.WARNING)
    for name in _CHATTY:
        logging.getLogger(name).setLevel(logging.INFO if verbosity >= 2 else logging.WARNING)
    try:
        # why: absl's logging loads only when its verbosity is set
        from absl import logging as absl_logging

        absl_logging.set_verbosity("info" if verbosity >= 2 else "warning")
    except ImportError:  # absl comes with orbax; without it there is nothing to quiet
        pass


def _process_index() -> int:
    if "jax" not in sys.modules:  # do not import jax (seconds) just to draw a bar in a numpy-only stage
        return 0
    return sys.modules["jax"].process_index()
