"""The verify command (`index.py --verify --workdir W`): every store of W re-read against the checksums recorded when
it was built (`cfir_jax.stores.integrity.verify_workdir`). A reader: no config, no lock, no JAX."""

from __future__ import annotations

import os
import sys
from pathlib import Path

from cfir_jax.stores.integrity import verify_workdir
from cfir_jax.stores.layout import Layout


def run(workdir: str | os.PathLike, out=None) -> int:
    """One line per damaged file (stderr) and a summary; returns 0 when every store is intact, else 2."""
    root = Path(workdir)
    if not root.is_dir():
        print(f"error: {root}: no workdir here (missing directory)", file=sys.stderr)
        return 2
    intact, problems = verify_workdir(root, Layout.of(root).store_dirs())
    for line in problems:
        print(f"damaged: {line}", file=sys.stderr)
    print(f"verify: {len(intact)} store(s) intact" + (f" ({', '.join(intact)})" if intact else "")
          + (f"; {len(problems)} problem(s): rebuild the stores named above with index.py (--stages ...)"
             if problems else ""), file=out or sys.stdout)
    return 2 if problems else 0
