"""Staging the image cache for --add, --remove and --compact: equal to a cache built over the result in one go."""

from __future__ import annotations

import io
import json

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import pytest
from atomic_fixtures import CORRUPT
from flax import nnx
from PIL import Image as PILImage

from cfir_jax.builders import index_encoder
from cfir_jax.builders.corpus_update import stage_corpus_addition, stage_corpus_removal
from cfir_jax.builders.image_cache_update import stage_cache_addition, stage_cache_compaction, stage_cache_removal
from cfir_jax.builders.image_encoding import EncodeSettings, Precomputed, build_image_cache
from cfir_jax.builders.sr_compact_update import stage_compact_addition, stage_compact_selection
from cfir_jax.core.config import model_config
from cfir_jax.core.errors import CfirError
from cfir_jax.data.corpus import Corpus, Document, Image
from cfir_jax.data.corpus_writer import write_corpus
from cfir_jax.model.beit3 import abstract_model, param_path
from cfir_jax.search.compact import CompactCache, build_compact, quantize_rows
from cfir_jax.stores.image_cache import ImageCache
from cfir_jax.stores.layout import Layout

DIM, SIZE, BATCH, SHARD = 8, 32, 4, 4


def _config(precomputed: str = "") -> ml_collections.ConfigDict:
    return ml_collections.ConfigDict({"index": {"image_cache": {
        "precomputed": precomputed, "dtype": "float16", "batch_size": BATCH, "shard_size": SHARD,
        "compute_dtype": "float32"}}})


def _emb_images(ids):
    return [Image(i, embedding=np.random.default_rng(k).standard_normal(DIM).astype(np.float32))
            for k, i in enumerate(ids)]


@pytest.fixture
def emb_world(tmp_path):
    """A corpus with precomputed embeddings, its imported cache, and the corpus grown by an addition."""
    ids = [f"e{k}" for k in range(7)]
    base = write_corpus(tmp_path / "base", "emb", [Document("d0", "x")], _emb_images(ids)[:5], {})
    cache = build_image_cache(tmp_path / "cache", base, precomputed=Precomputed("corpus"), dtype="float16")
    add = tmp_path / "add.jsonl"
    add.write_text("".join(json.dumps({"id": img.image_id, "bytes": "", "embedding": img.embedding.tolist()}) + "\n"
                           for img in _emb_images(ids)[5:]))
    stage_corpus_addition(base, tmp_path / "grown", add)
    return base, cache, Corpus.open(tmp_path / "grown")


def _same_cache(a: ImageCache, b: ImageCache, keys=("fingerprint", "dim", "dtype", "corpus_images", "corpus_ids_sha",
                                                    "num_encoded", "num_skipped")):
    assert a.ids == b.ids and [tuple(s.__dict__.values()) for s in a.skipped()] == \
        [tuple(s.__dict__.values()) for s in b.skipped()]
    np.testing.assert_array_equal(np.asarray(a.embeddings), np.asarray(b.embeddings))
    assert a.embeddings.dtype == b.embeddings.dtype
    assert {k: a.manifest.get(k) for k in keys} == {k: b.manifest.get(k) for k in keys}


def test_precomputed_addition_equals_an_import_of_the_union(tmp_path, emb_world):
    base, cache, grown = emb_world
    out = tmp_path / "staged"
    out.mkdir()
    info = stage_cache_addition(_config("corpus"), Layout.of(tmp_path), cache, grown, out, tmp_path / "work")
    assert info == {"images_encoded": 2, "images_skipped": 0}
    whole = build_image_cache(tmp_path / "whole", grown, precomputed=Precomputed("corpus"), dtype="float16")
    _same_cache(ImageCache.open(out), whole, keys=("fingerprint", "dim", "dtype", "corpus_images", "corpus_ids_sha",
                                                   "num_encoded", "num_skipped", "max_row_norm", "allow_missing"))


def test_addition_of_documents_alone_keeps_the_cache(tmp_path, emb_world):
    base, cache, _ = emb_world
    add = tmp_path / "docs"
    add.mkdir()
    (add / "documents.jsonl").write_text('{"id": "d9", "text": "new"}\n')
    stage_corpus_addition(base, tmp_path / "c2", add)
    out = tmp_path / "staged"
    out.mkdir()
    info = stage_cache_addition(_config("corpus"), Layout.of(tmp_path), cache, Corpus.open(tmp_path / "c2"), out,
                                tmp_path / "work")
    assert info["images_encoded"] == 0
    _same_cache(ImageCache.open(out), cache)


def test_addition_refuses_a_cache_of_other_images(tmp_path, emb_world):
    base, _, grown = emb_world
    other = write_corpus(tmp_path / "other", "emb", [Document("d0", "x")], _emb_images(["z0", "z1"]), {})
    cache = build_image_cache(tmp_path / "c", other, precomputed=Precomputed("corpus"), dtype="float16")
    with pytest.raises(CfirError, match="built from other images"):
        stage_cache_addition(_config("corpus"), Layout.of(tmp_path), cache, grown, tmp_path / "s", tmp_path / "w")


def test_removal_masks_rows_and_keeps_the_content_fingerprint(tmp_path, emb_world):
    _, cache, _ = emb_world
    info = stage_cache_removal(cache, tmp_path / "s1", ["e1", "e3", "not-cached"])
    once = ImageCache.open(tmp_path / "s1")
    assert info == {"rows_removed": 2, "num_removed": 2, "not_cached": 1}
    assert once.removed.tolist() == [False, True, False, True, False] and once.num_live == 3
    assert once.content_fingerprint == cache.content_fingerprint and not cache.removed.any()
    assert (tmp_path / "s1" / "embeddings.npy").stat().st_ino == (cache.path / "embeddings.npy").stat().st_ino
    stage_cache_removal(once, tmp_path / "s2", ["e0"])
    twice = ImageCache.open(tmp_path / "s2")
    assert twice.removed_ids == ["e0", "e1", "e3"] and twice.manifest["num_removed"] == 3


def test_compaction_drops_removed_rows_and_maps_old_rows(tmp_path, emb_world):
    base, cache, _ = emb_world
    stage_cache_removal(cache, tmp_path / "s1", ["e1", "e3"])
    removed = ImageCache.open(tmp_path / "s1")
    out = tmp_path / "compact"
    out.mkdir()
    info, row_map = stage_cache_compaction(removed, out)
    assert info == {"rows_before": 5, "rows_after": 3}
    assert row_map.dtype == np.int64 and row_map.tolist() == [0, -1, 1, -1, 2]
    compact = ImageCache.open(out)
    np.testing.assert_array_equal(compact.embeddings, np.asarray(cache.embeddings)[[0, 2, 4]])
    assert compact.num_live == 3 and not compact.removed.any()
    # A cache built from scratch over the corpus with those images removed is the same cache.
    stage_corpus_removal(base, tmp_path / "corpus_removed", ["e1", "e3"], [])
    whole = build_image_cache(tmp_path / "whole", Corpus.open(tmp_path / "corpus_removed"),
                              precomputed=Precomputed("corpus"), dtype="float16")
    _same_cache(compact, whole)
    assert {s.image_id: s.reason for s in whole.skipped()} == {"e1": "removed", "e3": "removed"}


# ---------------------------------------------------------------------------------------------------- model path


def _png(seed: int) -> bytes:
    buf = io.BytesIO()
    PILImage.fromarray(np.random.default_rng(seed).integers(0, 256, (20, 24, 3), dtype=np.uint8)).save(buf, "PNG")
    return buf.getvalue()


def _random_model():
    graphdef, state = nnx.split(abstract_model(model_config("tiny", image_size=SIZE, vocab_size=300,
                                                            max_text_positions=40)))
    rng = np.random.default_rng(0)

    def init(path, leaf):
        return jnp.asarray((1.0 if "scale" in param_path(path) else 0.0) + rng.normal(0, 0.05, leaf.shape),
                           leaf.dtype)

    return nnx.merge(graphdef, jax.tree_util.tree_map_with_path(init, state))


def test_model_addition_equals_a_cache_built_over_the_union(tmp_path, monkeypatch):
    model = _random_model()
    monkeypatch.setattr(index_encoder, "load_encoder", lambda config, layout: model)
    images = [Image(f"p{k}", image=_png(k)) for k in range(5)]
    base = write_corpus(tmp_path / "base", "pics", [Document("d0", "x")], images, {})
    cache = build_image_cache(tmp_path / "cache", base, model, encoding=EncodeSettings(batch_size=BATCH,
                              shard_size=SHARD))
    add = tmp_path / "add"
    add.mkdir()
    for k in (5, 6):
        (add / f"p{k}.png").write_bytes(_png(k))
    (add / "p7.png").write_bytes(CORRUPT)
    stage_corpus_removal(base, tmp_path / "removed", ["p2"], [])  # a removal before the addition is kept
    stage_cache_removal(cache, tmp_path / "cache_removed", ["p2"])
    stage_corpus_addition(Corpus.open(tmp_path / "removed"), tmp_path / "grown", add)
    grown = Corpus.open(tmp_path / "grown")
    out = tmp_path / "staged"
    out.mkdir()
    info = stage_cache_addition(_config(), Layout.of(tmp_path), ImageCache.open(tmp_path / "cache_removed"), grown,
                                out, tmp_path / "work")
    assert info == {"images_encoded": 2, "images_skipped": 1}
    staged = ImageCache.open(out)
    assert staged.removed_ids == ["p2"] and staged.num_live == 6
    assert not (tmp_path / "work" / "image_cache").exists()
    # From scratch over the union without the removal (a from-scratch build would skip p2).
    stage_corpus_addition(base, tmp_path / "grown_all", add)
    whole = build_image_cache(tmp_path / "whole", Corpus.open(tmp_path / "grown_all"), model,
                              encoding=EncodeSettings(batch_size=BATCH, shard_size=SHARD))
    assert staged.ids == whole.ids and staged.manifest["corpus_ids_sha"] == whole.manifest["corpus_ids_sha"]
    np.testing.assert_array_equal(np.asarray(staged.embeddings), np.asarray(whole.embeddings))
    assert [s.image_id for s in staged.skipped()] == ["p7"]
    # A cache built from scratch over the grown corpus skips the removed image, and lists it.
    fresh = build_image_cache(tmp_path / "fresh", grown, model, encoding=EncodeSettings(batch_size=BATCH,
                              shard_size=SHARD))
    assert {s.image_id: s.reason for s in fresh.skipped()}["p2"] == "removed" and "p2" not in fresh.ids


# ---------------------------------------------------------------------------------------------------- sr_compact


def test_compact_copy_follows_an_addition_and_a_compaction(tmp_path, emb_world):
    _, cache, grown = emb_world
    build_compact(cache.embeddings, tmp_path / "sr_compact", dims=4, cache_fingerprint=cache.content_fingerprint)
    staged = tmp_path / "cache2"
    staged.mkdir()
    stage_cache_addition(_config("corpus"), Layout.of(tmp_path), cache, grown, staged, tmp_path / "work")
    grown_cache = ImageCache.open(staged)
    out = tmp_path / "compact2"
    out.mkdir()
    info = stage_compact_addition(tmp_path / "sr_compact", grown_cache.embeddings[5:], out,
                                  grown_cache.content_fingerprint)
    assert info == {"rows_before": 5, "rows_after": 7}
    old, new = CompactCache.open(tmp_path / "sr_compact"), CompactCache.open(
        out, expect_n=7, expect_dim=DIM, expect_cache=grown_cache.content_fingerprint, expect_dims=4)
    np.testing.assert_array_equal(new.codes[:5], old.codes)
    want = quantize_rows(np.asarray(grown_cache.embeddings[5:], np.float32) @ old.rotation, old.scales)
    np.testing.assert_array_equal(new.codes[5:], want)
    row_map = np.array([0, -1, 1, 2, -1, 3, 4])
    out3 = tmp_path / "compact3"
    out3.mkdir()
    assert stage_compact_selection(out, row_map, out3, "cache-x") == {"rows_before": 7, "rows_after": 5}
    np.testing.assert_array_equal(CompactCache.open(out3, expect_n=5, expect_cache="cache-x").codes,
                                  new.codes[[0, 2, 3, 5, 6]])
