"""The convex fusion of the image and its own text (method cfir_text_convex): ER's union ranked by alpha *
minmax(<q, image>) + (1 - alpha) * minmax(<q, image text>), both scored over the whole union; its weight read from
W/convex_fusion's pair image_text (a store of bm25's alone, as older ones were, still reads for bm25), and the
--compare row when that pair is fitted."""

import json
import types

import numpy as np
import pytest

from cfir_jax.core.config import retrieval_config
from cfir_jax.core.errors import CfirError
from cfir_jax.eval import comparison
from cfir_jax.retrieve.methods import method_of
from cfir_jax.retrieve.text_fusion import TextConvex
from cfir_jax.stores.contract import write_manifest
from cfir_jax.stores.convex_fusion import FORMAT_VERSION, KIND, FusionWeight, fitted
from cfir_jax.stores.layout import Layout

N, D = 200, 8
GRID = {"0": 0.1, "0.5": 0.3, "1": 0.2}


def _unit(rng, n):
    rows = rng.normal(size=(n, D)).astype(np.float32)
    return (rows / np.linalg.norm(rows, axis=1, keepdims=True)).astype(np.float16)


def test_the_union_is_ranked_by_the_convex_combination_written_out():
    rng = np.random.default_rng(0)
    images, texts, query = _unit(rng, N), _unit(rng, N), rng.normal(size=D).astype(np.float32)
    lists = [np.array([5, 17, 90], np.int32), np.array([17, 3, 150, 42], np.int32)]
    fusion = TextConvex(images, texts, 0.3)
    fusion.kept = []
    scores, rows = fusion.rank(query, lists, 4)
    union = np.array([3, 5, 17, 42, 90, 150])
    img = images[union].astype(np.float32) @ query
    txt = texts[union].astype(np.float32) @ query
    want = 0.3 * (img - img.min()) / np.ptp(img) + 0.7 * (txt - txt.min()) / np.ptp(txt)
    order = np.lexsort((union, -want))[:4]
    assert rows.tolist() == union[order].tolist()
    np.testing.assert_allclose(scores, want[order], rtol=1e-5)
    kept_union, kept_img, kept_txt = fusion.kept[0]
    assert kept_union.tolist() == union.tolist() and np.allclose(kept_img, img) and np.allclose(kept_txt, txt)


def _store(path, **manifest):
    path.mkdir(parents=True)
    write_manifest(path, KIND, FORMAT_VERSION, **manifest)


def _fit(alpha):
    return {"alpha": alpha, "split": "train", "documents": 40, "mrr10": GRID}


def test_a_store_of_bm25_alone_as_older_ones_reads_for_bm25_and_names_the_missing_pair(tmp_path):
    _store(tmp_path / "convex_fusion", **_fit(0.65), cache_fingerprint="c")
    layout, rcfg = Layout.of(tmp_path), retrieval_config()
    assert fitted(layout, method_of("cfir_bm25_convex", rcfg), rcfg).alpha == 0.65
    assert FusionWeight.open(layout.convex_fusion).pairs() == {"bm25": _fit(0.65)}
    with pytest.raises(CfirError, match="holds no weight for the image_text pair.*--fit-fusion"):
        fitted(layout, method_of("cfir_text_convex", rcfg), rcfg)
    rcfg.fusion.alpha = 0.4  # a configured weight needs no store
    assert fitted(layout, method_of("cfir_text_convex", rcfg), rcfg) is None


def test_a_store_of_several_pairs_gives_each_method_its_own_weight(tmp_path):
    _store(tmp_path / "convex_fusion", **_fit(0.65), pairs={"bm25": _fit(0.65), "image_text": _fit(0.35)},
           cache_fingerprint="c")
    layout, rcfg = Layout.of(tmp_path), retrieval_config()
    text = fitted(layout, method_of("cfir_text_convex", rcfg), rcfg)
    assert (text.alpha, text.split) == (0.35, "train")
    assert fitted(layout, method_of("cfir_bm25_convex", rcfg), rcfg).alpha == 0.65
    assert fitted(layout, method_of("cfir", rcfg), rcfg) is None


def _rows(tmp_path, pairs):
    for store in ("image_text", "lexical"):
        (tmp_path / store).mkdir(parents=True, exist_ok=True)
        (tmp_path / store / "manifest.json").write_text("{}")
    if pairs is not None:
        manifest = {**({} if "bm25" not in pairs else _fit(0.5)), "pairs": {p: _fit(0.5) for p in pairs}}
        _store(tmp_path / "convex_fusion", **manifest, cache_fingerprint="c")
    config = types.SimpleNamespace(retrieval=retrieval_config())
    return [r.name for r in comparison.comparison_rows(config, tmp_path)]


def test_compare_gains_the_image_text_convex_row_when_that_pair_is_fitted(tmp_path):
    assert "image_text_convex" in _rows(tmp_path / "a", ["bm25", "image_text"])
    names = _rows(tmp_path / "b", ["bm25"])
    assert "bm25_convex" in names and "image_text_convex" not in names
    names = _rows(tmp_path / "c", None)
    assert "bm25_convex" not in names and "image_text_convex" not in names and "image_text" in names


def test_an_alpha_out_of_range_is_one_line():
    rcfg = retrieval_config()
    rcfg.fusion.alpha = 1.5
    stores = types.SimpleNamespace(layout=None, embeddings=None, extra={})
    with pytest.raises(CfirError, match=r"retrieval.fusion.alpha=1.5: .* in \[0, 1\]"):
        method_of("cfir_text_convex", rcfg).scorer(stores)


def test_the_manifest_the_fit_writes_keeps_bm25_at_the_top_level(tmp_path):
    """What older readers (and tests/e2e/test_fusion_fit.py) read: alpha, split, mrr10 at the top."""
    _store(tmp_path / "convex_fusion", **_fit(0.65), pairs={"bm25": _fit(0.65)}, cache_fingerprint="c")
    manifest = json.loads((tmp_path / "convex_fusion" / "manifest.json").read_text())
    assert manifest["alpha"] == 0.65 and FusionWeight.open(tmp_path / "convex_fusion").of("bm25").alpha == 0.65
