"""The verify command (`index.py --verify --workdir W`): every store of W re-read against the checksums recorded when
it was built (`cfir_jax.api.operations.verify`, over `cfir_jax.stores.integrity.verify_workdir`). A reader: no config,
no lock, no JAX."""

from __future__ import annotations

import os
import sys

from cfir_jax.api import operations as api
from cfir_jax.core.errors import CfirError


def run(workdir: str | os.PathLike, out=None) -> int:
    """One line per damaged file (stderr) and a summary; returns 0 when every store is intact, else 2."""
    try:
        found = api.verify(workdir)
    except CfirError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    for line in found.problems:
        print(f"damaged: {line}", file=sys.stderr)
    intact, problems = found.intact, found.problems
    print(f"verify: {len(intact)} store(s) intact" + (f" ({', '.join(intact)})" if intact else "")
          + (f"; {len(problems)} problem(s): rebuild the stores named above with index.py (--stages ...)"
             if problems else ""), file=out or sys.stdout)
    return 2 if problems else 0
