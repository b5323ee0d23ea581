"""User-facing errors and the one place command lines turn them into a one-line message and exit code 2."""

from __future__ import annotations

import functools
import sys
from collections.abc import Callable
from typing import TypeVar

F = TypeVar("F", bound=Callable)


class CfirError(Exception):
    """An error caused by the user's input (a file, a flag, a store); its message is one line naming the fix."""


def cli_main(fn: F) -> F:
    """Wraps a command-line entry point: a CfirError (or a missing file) becomes `error: ...` on stderr, exit 2."""

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        try:
            return fn(*args, **kwargs)
        except CfirError as e:
            print(f"error: {e}", file=sys.stderr)
            sys.exit(2)
        except (FileNotFoundError, IsADirectoryError, PermissionError) as e:
            print(f"error: {e.filename}: {e.strerror}", file=sys.stderr)
            sys.exit(2)
        except KeyboardInterrupt:
            print("interrupted", file=sys.stderr)
            sys.exit(130)

    return wrapper  # type: ignore[return-value]
