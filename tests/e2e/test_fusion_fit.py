"""The convex fusions as a user runs them: `retrieve.py --fit-fusion` fits alpha on the train split into
W/convex_fusion for each pair (SR and BM25; the image and its own text) and says so, the methods cfir_bm25_convex and
cfir_text_convex read it (or retrieval.lexical.alpha), --compare gains their rows with alpha and where it was fitted,
and the existing rows stay as they were."""

import json
import shutil

import pytest
from repo import run_script


@pytest.fixture(scope="module")
def fitted(workdir, tmp_path_factory):
    w = tmp_path_factory.mktemp("fusion") / "W"
    shutil.copytree(workdir, w)
    before = run_script("retrieve.py", "--index", str(w), "--evaluate", "test", "--compare").stdout
    fit = run_script("retrieve.py", "--index", str(w), "--fit-fusion")
    return w, before, fit.stdout


def test_the_fit_writes_alpha_and_says_where(fitted):
    w, _, said = fitted
    manifest = json.loads((w / "convex_fusion" / "manifest.json").read_text())
    assert 0 <= manifest["alpha"] <= 1 and manifest["split"] == "train" and len(manifest["mrr10"]) == 21
    best = manifest["mrr10"][f"{manifest['alpha']:g}"]
    assert best == max(manifest["mrr10"].values())
    assert f"fusion: alpha={manifest['alpha']:g} (SR's weight) fitted on" in said


def _rows(table: str) -> dict[str, str]:
    return {line[:26].strip(): line for line in table.splitlines() if line[:26].strip()}


@pytest.fixture(scope="module")
def compared(fitted):
    return run_script("retrieve.py", "--index", str(fitted[0]), "--evaluate", "test", "--compare").stdout


def test_the_fit_also_fits_the_image_and_its_text_and_compare_gains_that_row(fitted, compared):
    w, _, said = fitted
    manifest = json.loads((w / "convex_fusion" / "manifest.json").read_text())
    assert set(manifest["pairs"]) == {"bm25", "image_text"} and manifest["pairs"]["bm25"]["alpha"] == manifest["alpha"]
    text = manifest["pairs"]["image_text"]
    assert text["split"] == "train" and len(text["mrr10"]) == 21
    assert text["mrr10"][f"{text['alpha']:g}"] == max(text["mrr10"].values())
    assert f"fusion: alpha={text['alpha']:g} (the image's weight, against its own text's) fitted on" in said
    row = _rows(compared)["CFIR + image text convex"]
    assert f"fused with image text (convex, alpha={text['alpha']:g}, fitted on train)" in row


def test_compare_gains_the_convex_row_and_keeps_the_others(fitted, compared):
    w, before, _ = fitted
    alpha = json.loads((w / "convex_fusion" / "manifest.json").read_text())["alpha"]
    after = compared
    rows_before, rows_after = _rows(before), _rows(after)
    assert f"fused with BM25 (convex, alpha={alpha:g}, fitted on train)" in rows_after["CFIR + BM25 convex"]
    measured = [label for label in rows_before if label in rows_after and label not in ("row", "")
                and rows_before[label][26:].split()[:1] != ["------"] and "." in rows_before[label][26:33]]
    assert len(measured) >= 5 and "CFIR + BM25 fused" in measured
    for label in measured:  # MRR@10, R@10, R@100, R@1000, S@1000: to the digit
        assert rows_after[label][26:].split()[:5] == rows_before[label][26:].split()[:5], label


def test_the_config_alpha_overrides_the_fitted_one(fitted):
    w, _, _ = fitted
    one = run_script("retrieve.py", "--index", str(w), "--evaluate", "test", "--method", "cfir_bm25_convex",
                     "--config.retrieval.lexical.alpha=1.0").stdout
    assert "convex, alpha=1, retrieval.lexical.alpha" in one
