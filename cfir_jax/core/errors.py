"""User-facing errors: `CfirError` (one line naming the fix), `first_line` (any error in one line), and the quieting
of what an abandoned orbax restore leaves behind. `cfir_jax.core.cli.cli_main` turns them into a one-line message and
an exit code."""

from __future__ import annotations

import logging
import os
import sys
import warnings


class CfirError(Exception):
    """An error caused by the user's input (a file, a flag, a store); its message is one line naming the fix."""


class StoreError(CfirError):
    """A store is missing, incomplete, or was built for something else."""


def first_line(e: BaseException | str, limit: int | None = None) -> str:
    """An error in one line: the first line of its message (a remote error's cause's, as Ray's errors carry it in
    `cause`, not the traceback around it; or of a message given as text, a service's error line), at most `limit`
    characters; its type's name when it says nothing. The one place a message is cut to a line."""
    e = getattr(e, "cause", None) or e
    text = str(e).strip()
    line = text.splitlines()[0].strip() if text else type(e).__name__
    return line if limit is None else line[:limit]


def os_error_line(e: OSError) -> str:
    """"PATH: what the OS said" (or the error's own text when it names no file: never "None: None")."""
    if e.filename is None:
        return str(e) or e.__class__.__name__
    return f"{e.filename}: {e.strerror or e}"


# Set once an orbax restore has failed in this process (`abandoned_restore`): from then on the reads it abandoned
# may report from any thread or finaliser, in forms that vary run to run, until the process exits on its one line.
_restore_failed = False


def _abandoned_async_work(u) -> bool:
    """Whether an unraisable report (`sys.unraisablehook`'s argument) is work a failure abandoned: orbax's other
    reads of a checkpoint that failed to restore, finalised later as coroutines that never finished, or their
    tensorstore callbacks finding orbax's event loop closed; after a failed restore, any report."""
    if _restore_failed:
        return True
    code = getattr(u.object, "cr_code", None)
    if code is not None and f"{os.sep}orbax{os.sep}" in code.co_filename:
        return True
    return isinstance(u.exc_value, RuntimeError) and str(u.exc_value) == "Event loop is closed"


def _abandoned_task_record(record) -> bool:
    """asyncio's log record of a task or future that failed with no one left to await it: orbax's, or any after a
    failed restore (its gathering futures name no file)."""
    text = record.getMessage()
    return "exception was never retrieved" in text and (_restore_failed or f"{os.sep}orbax{os.sep}" in text)


def quiet_abandoned_async_work() -> None:
    """Drops the reports of `_abandoned_async_work` and asyncio's records of `_abandoned_task_record` (a damaged
    model's one-line error was followed by up to ~1,000 lines of "Exception ignored in <coroutine ...>" tracebacks);
    every other unraisable report goes to the hook before, every other asyncio record is logged."""
    previous = sys.unraisablehook
    if getattr(previous, "cfir_quiet", False):
        return
    logging.getLogger("asyncio").addFilter(lambda record: not _abandoned_task_record(record))

    def hook(u) -> None:
        if not _abandoned_async_work(u):
            previous(u)

    hook.cfir_quiet = True  # type: ignore[attr-defined]
    sys.unraisablehook = hook


def abandoned_restore() -> None:
    """Called when an orbax restore failed, before its one-line error is raised: what it abandoned is kept quiet
    from now on (`_restore_failed`), and so are its reads never started, which Python reports as "coroutine ... was
    never awaited" RuntimeWarnings when they are collected."""
    global _restore_failed
    _restore_failed = True
    warnings.filterwarnings("ignore", message=r"coroutine '.*' was never awaited", category=RuntimeWarning)
    quiet_abandoned_async_work()
