"""Appending entities to an existing entity index without rebuilding it: the store operation (`append_entities`) and
index.py's `--add-entities FILE` (`add_entities`: the entity texts of a file, encoded by the index encoder)."""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from cfir_jax.core import hosts
from cfir_jax.core.errors import CfirError
from cfir_jax.data.corpus import Corpus
from cfir_jax.index.candidate_search import make_searcher
from cfir_jax.index.entity_index_build import check_inputs, write_csr
from cfir_jax.index.index_encoder import check_cache_encoder, entity_encoder, scann_config
from cfir_jax.search.knn import ScannConfig
from cfir_jax.stores.contract import atomic_dir, write_manifest
from cfir_jax.stores.entities import entity_key, normalize_entity
from cfir_jax.stores.entity_index import KIND, VERSION, EntityIndex
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
                           expect_fingerprint=fingerprint, scann_config=scann_config(config))


def _link_or_copy(src: Path, dst: Path) -> None:
    """Hard-links a file tree (cheap, the old index stays valid until the rename), copying where links fail."""
    if src.is_dir():
        dst.mkdir()
        for child in src.iterdir():
            _link_or_copy(child, dst / child.name)
        return
    try:
        os.link(src, dst)
    except OSError:
        shutil.copy2(src, dst)


def append_entities(
    directory: str | os.PathLike,
    new_texts: Sequence[str],
    new_embeddings: np.ndarray,
    image_embeddings: np.ndarray,
    *,
    expect_fingerprint: str | None = None,
    scann_config: ScannConfig | None = None,
    chunk_size: int = 4096,
) -> int:
    """Adds entities to an existing index without rebuilding it; texts already indexed are skipped.

    new_embeddings [E', D] f32 rows of new_texts. The old directory is replaced atomically by one holding old and
    new rows (old rows first), the manifest written last. Returns how many entities were added.
    """
    directory = Path(directory)
    index = EntityIndex.open(directory, expect_fingerprint=expect_fingerprint, expect_dim=image_embeddings.shape[1],
                             expect_n_images=image_embeddings.shape[0])
    check_inputs(new_texts, new_embeddings, image_embeddings)
    fresh = [i for i, t in enumerate(new_texts) if index.row(t) is None]
    if not fresh:
        return 0
    texts = [new_texts[i] for i in fresh]
    emb = np.asarray(new_embeddings, np.float32)[fresh]
    m = index.manifest
    has_searcher = bool(m.get("has_searcher"))
    search = make_searcher(m["backend"], image_embeddings, index.k, scann_config,
                            directory / "scann" if has_searcher else None)
    e_old, e_new = len(index), len(texts)
    # The new rows' padded search results are held in memory: appending is for entity lists, not whole corpora.
    blocks = []
    for a in range(0, e_new, chunk_size):
        scores, rows = search(emb[a : a + chunk_size])
        blocks.append((rows, scores))
    with atomic_dir(directory) as tmp:
        n_candidates = write_csr(tmp, blocks, bool(m.get("has_scores")), prefix=index)
        if has_searcher:
            _link_or_copy(directory / "scann", tmp / "scann")
        (tmp / "vocab.json").write_text(json.dumps(index.vocab + texts, ensure_ascii=False))
        fields = {key: v for key, v in m.items() if key not in ("kind", "format_version", "created")}
        fields.update(n_entities=e_old + e_new, n_candidates=n_candidates, appended=int(m.get("appended", 0)) + e_new)
        write_manifest(tmp, KIND, VERSION, **fields)
    return e_new
