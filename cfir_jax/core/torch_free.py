"""Libraries that import PyTorch whenever it is installed, imported as on a machine without it.

spaCy (through thinc) and tensorboardX import torch at their own import when it is installed, and then use it only
for what this project never asks of them (a transformer pipeline's layers; a torch tensor's conversion). torch's
import is seconds of a command's start, and a JAX user's command never imports it: `without_torch` makes `import
torch` fail as it does where torch is not installed, for the length of the block. A torch already imported is left
as it is, and torch can be imported as usual after the block (the libraries keep working without it).
"""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Iterator


@contextlib.contextmanager
def without_torch(needed: bool = False) -> Iterator[None]:
    """Within the block, `import torch` raises ImportError, unless `needed` or torch is imported already."""
    if needed or "torch" in sys.modules:
        yield
        return
    sys.modules["torch"] = None  # `import torch` raises ImportError, as where it is not installed
    try:
        yield
    finally:
        if "torch" in sys.modules and sys.modules["torch"] is None:
            del sys.modules["torch"]
