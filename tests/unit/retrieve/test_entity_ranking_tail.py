import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import shutil
from types import SimpleNamespace

import ml_collections
import numpy as np

from cfir_jax.builders.entity_index_build import EntityIndexSettings, build_entity_index
from cfir_jax.builders.entity_index_update import StageSettings, stage_images_added
from cfir_jax.retrieve.entity_ranking import EntityRanking
from cfir_jax.search.knn import synthetic_embeddings
from cfir_jax.search.live_rows import LiveRows
from cfir_jax.stores.entity_index import EntityIndex


def test_unseen_entities_search_the_tree_and_the_appended_tail_without_removed_rows(tmp_path):
    """An unseen entity is searched by the tree over the rows it was built on plus exact search over the rows added
    since; removed rows never come back; the tree is loaded with the index, so a later swap of the directory does
    not reach a ranking already open."""
    n_old, n = 2500, 2800
    images = synthetic_embeddings(n, 32, seed=1)
    unseen = synthetic_embeddings(1, 32, seed=2)[0]
    images[n_old + 11] = unseen  # the planted image, in the tail the tree does not cover
    images[n_old + 12] = unseen  # its twin, removed
    images = images.astype(np.float16)
    ents = synthetic_embeddings(30, 32, seed=3)
    build_entity_index(tmp_path / "old", [f"e{i}" for i in range(30)], ents, images[:n_old], EntityIndexSettings(10,
                       backend="scann"), model_fingerprint="fp")
    (tmp_path / "new").mkdir()
    stage_images_added(EntityIndex.open(tmp_path / "old"), tmp_path / "new", images, n_old,
                       settings=StageSettings(cache_fingerprint="c"))
    removed = np.zeros(n, bool)
    removed[n_old + 12] = True
    encoder = SimpleNamespace(encode=lambda texts: np.stack([unseen for _ in texts]))
    stores = SimpleNamespace(entity_index=EntityIndex.open(tmp_path / "new"), entity_encoder=encoder,
                             extra={}, embeddings=images, encoder_dir=tmp_path, layout=None,
                             cache=SimpleNamespace(removed=removed), live=LiveRows(removed))
    config = ml_collections.ConfigDict(dict(retrieval=dict(unknown_entities="search")))
    ranking = EntityRanking(config, stores, exact_search=None)
    shutil.rmtree(tmp_path / "new" / "scann")  # an update replaced the directory after the ranking opened it
    lists, scores, used, unknown = ranking.candidates(["never indexed"], stores.live)
    assert unknown == used == ["never indexed"] and len(lists[0]) == 10
    assert lists[0][0] == n_old + 11 and n_old + 12 not in lists[0]
    assert np.all(np.diff(scores[0]) <= 0)
