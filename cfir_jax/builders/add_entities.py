"""index.py's `--add-entities FILE`: the entity texts of a file, one a line, appended to the built entity index as
one change of the workdir (`cfir_jax.builders.collection_update.add_entities`: staged, committed under the commit lock,
recorded as a version), on process 0 while the others wait."""

from __future__ import annotations

import os
from pathlib import Path

from cfir_jax.builders import collection_update
from cfir_jax.builders.index_encoder import check_cache_encoder, entity_encoder
from cfir_jax.core import hosts
from cfir_jax.core.errors import CfirError
from cfir_jax.data.corpus import Corpus
from cfir_jax.stores.entities import entity_key, normalize_entity
from cfir_jax.stores.entity_index import EntityIndex
from cfir_jax.stores.image_cache import ImageCache
from cfir_jax.stores.layout import Layout


def add_entities(config, workdir, path: str | os.PathLike) -> int:
    """Appends the entity texts of a file (one per line) to an existing entity index without rebuilding it; on
    process 0 alone (an entity list, not a corpus), the others wait and return how many it added."""
    added = _add_entities(config, workdir, path) if hosts.is_main() else 0
    hosts.barrier("entities_added")
    return added


def read_entity_texts(path: Path) -> list[str]:
    """The entity texts of a file, one a line: blank lines skipped, one surface form per key (the first in the
    file: the index would refuse two of one entity), sorted."""
    if not path.is_file():
        raise CfirError(f"{path}: entity file not found")
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except UnicodeDecodeError:
        raise CfirError(f"{path}: not UTF-8 text (expected one entity per line)") from None
    by_key: dict[str, str] = {}
    for line in lines:
        if line.strip():
            by_key.setdefault(entity_key(line), normalize_entity(line))
    if not by_key:
        raise CfirError(f"{path}: no entity texts (expected one entity per line)")
    return sorted(by_key.values())


def _add_entities(config, workdir, path: str | os.PathLike) -> int:
    layout = Layout.of(workdir)
    texts = read_entity_texts(Path(path))
    corpus = Corpus.open(layout.corpus)
    _, fingerprint = entity_encoder(config, layout, corpus)
    cache = ImageCache.open(layout.image_cache, expect_dim=config.model.embed_dim)
    check_cache_encoder(config, layout, cache)
    index = EntityIndex.open(layout.entity_index, expect_fingerprint=fingerprint, expect_dim=cache.dim,
                             expect_n_images=cache.num_images)
    if all(index.row(t) is not None for t in texts):
        return 0
    return int(collection_update.add_entities(config, workdir, texts)["entities_added"])
