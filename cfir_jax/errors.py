"""User-facing errors and the one place command lines turn them into a one-line message and an exit code: 2 for
the user's input and a full disk, 143 for SIGTERM (cfir_jax.faults), 130 for Ctrl-C."""

from __future__ import annotations

import functools
import sys
from collections.abc import Callable
from typing import TypeVar

F = TypeVar("F", bound=Callable)


class CfirError(Exception):
    """An error caused by the user's input (a file, a flag, a store); its message is one line naming the fix."""


def os_error_line(e: OSError) -> str:
    """"PATH: what the OS said" (or the error's own text when it names no file: never "None: None")."""
    if e.filename is None:
        return str(e) or e.__class__.__name__
    return f"{e.filename}: {e.strerror or e}"


def cli_main(fn: F) -> F:
    """Wraps a command-line entry point: a CfirError (or a missing file) becomes `error: ...` on stderr, exit 2."""

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        try:
            return fn(*args, **kwargs)
        except CfirError as e:
            print(f"error: {e}", file=sys.stderr)
            sys.exit(2)
        except KeyboardInterrupt:
            print("interrupted", file=sys.stderr)
            sys.exit(130)
        except BaseException as e:
            from cfir_jax import faults

            described = faults.describe(e)  # a full disk, SIGTERM
            if described is not None:
                message, status = described
                print(message if status == faults.EXIT_SIGTERM else f"error: {message}", file=sys.stderr)
                sys.exit(status)
            if isinstance(e, (FileNotFoundError, IsADirectoryError, PermissionError)):
                print(f"error: {os_error_line(e)}", file=sys.stderr)
                sys.exit(2)
            raise

    return wrapper  # type: ignore[return-value]
