"""JSON lines read with one-line errors per line: every line one JSON object, blank lines skipped.

The collection's files (`cfir_jax.data.files`) and the query documents (`cfir_jax.retrieve.queries`) read them here, so
a bad line is named the same way wherever it sits: `FILE:LINE: not UTF-8 text ...` or `FILE:LINE: not a JSON object`.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable, Iterator
from typing import Any

from cfir_jax.core.errors import CfirError


def json_objects(path: str | os.PathLike, lines: Iterable[bytes | str]) -> Iterator[tuple[str, dict[str, Any]]]:
    """(where: "FILE:LINE", the object) for each non-blank line of `lines` (the text of `path`, bytes decoded as
    UTF-8), in order; a line that is not UTF-8 or not one JSON object is one CfirError naming FILE:LINE."""
    for n, raw in enumerate(lines, 1):
        where = f"{path}:{n}"
        try:
            line = raw.decode("utf-8") if isinstance(raw, bytes) else raw
        except UnicodeDecodeError as e:
            raise CfirError(f"{where}: not UTF-8 text (byte {e.start}); re-encode the file as UTF-8") from None
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as e:
            raise CfirError(f"{where}: not a JSON object ({e.msg}); one JSON object a line") from None
        if not isinstance(row, dict):
            raise CfirError(f"{where}: not a JSON object; one JSON object a line")
        yield where, row


def read_json_lines(path: str | os.PathLike) -> Iterator[tuple[str, dict[str, Any]]]:
    """`json_objects` of the file at `path`, read a line at a time (a file of any size)."""
    with open(path, "rb") as f:
        yield from json_objects(path, f)
