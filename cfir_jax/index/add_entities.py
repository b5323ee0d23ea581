"""Appending entities to an existing entity index without rebuilding it: the store operation (`append_entities`) and
index.py's `--add-entities FILE` (`add_entities`: the entity texts of a file, encoded by the index encoder)."""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from cfir_jax.core import hosts
from cfir_jax.core.errors import CfirError
from cfir_jax.data.corpus import Corpus
from cfir_jax.index.entity_index_build import check_inputs
from cfir_jax.index.entity_index_update import Encode, stage_entities_added
from cfir_jax.index.index_encoder import check_cache_encoder, entity_encoder
from cfir_jax.stores.contract import atomic_dir
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


def _add_entities(config, workdir, path: str | os.PathLike) -> int:
    layout = Layout.of(workdir)
    path = Path(path)
    if not path.is_file():
        raise CfirError(f"{path}: entity file not found")
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except UnicodeDecodeError:
        raise CfirError(f"{path}: not UTF-8 text (expected one entity per line)") from None
    # One surface form per key (the first in the file): the index would refuse two of one entity.
    by_key: dict[str, str] = {}
    for line in lines:
        if line.strip():
            by_key.setdefault(entity_key(line), normalize_entity(line))
    texts = sorted(by_key.values())
    if not texts:
        raise CfirError(f"{path}: no entity texts (expected one entity per line)")
    corpus = Corpus.open(layout.corpus)
    encoder, fingerprint = entity_encoder(config, layout, corpus)
    cache = ImageCache.open(layout.image_cache, expect_dim=config.model.embed_dim)
    check_cache_encoder(config, layout, cache)
    return append_entities(layout.entity_index, texts, encoder.encode(texts), cache.embeddings,
                           expect_fingerprint=fingerprint, removed=getattr(cache, "removed", None),
                           encode=encoder.encode, chunk_size=int(config.index.entity_index.chunk_size))


def append_entities(
    directory: str | os.PathLike,
    new_texts: Sequence[str],
    new_embeddings: np.ndarray,
    image_embeddings: np.ndarray,
    *,
    expect_fingerprint: str | None = None,
    removed: np.ndarray | None = None,
    encode: Encode | None = None,
    chunk_size: int | None = None,
) -> int:
    """Adds entities to an existing index without rebuilding it; texts already indexed are skipped.

    new_embeddings [E', D] f32 rows of new_texts; removed bool [N]: image rows never listed; encode: the index
    encoder, for an index built before it kept its entity embeddings. The old directory is replaced atomically by
    the one `stage_entities_added` writes (old rows first). Returns how many entities were added.
    """
    directory = Path(directory)
    index = EntityIndex.open(directory, expect_fingerprint=expect_fingerprint, expect_dim=image_embeddings.shape[1],
                             expect_n_images=image_embeddings.shape[0])
    check_inputs(new_texts, new_embeddings, image_embeddings)
    if all(index.row(t) is not None for t in new_texts):
        return 0
    with atomic_dir(directory) as tmp:
        manifest = stage_entities_added(index, tmp, new_texts, new_embeddings, image_embeddings, removed,
                                        encode=encode, chunk_size=chunk_size)
    return int(manifest["added_entities"])
