"""A removal committed to an image cache by hand, as `index.py --remove` records it (for tests that need removed
rows without running the command)."""

import hashlib
import json
from pathlib import Path

from cfir_jax.stores.integrity import write_checksums


def commit_removal(workdir: Path, image_ids: list[str]) -> None:
    """What a removal commits to the image cache: removed.txt, the manifest's count and digest, the checksums."""
    cache = Path(workdir) / "image_cache"
    text = "".join(f"{i}\n" for i in image_ids)
    (cache / "removed.txt").write_text(text)
    manifest = json.loads((cache / "manifest.json").read_text())
    manifest.update(num_removed=len(image_ids), removed_sha=hashlib.sha256(text.encode()).hexdigest()[:16])
    (cache / "manifest.json").write_text(json.dumps(manifest))
    write_checksums(cache)
