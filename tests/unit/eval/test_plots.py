"""Recall@k curves: the values are trec_eval's recall.k, and the PNG is drawn and written atomically."""

import pytest
from PIL import Image as PILImage

from cfir_jax.core.errors import CfirError
from cfir_jax.eval.metrics import evaluate
from cfir_jax.eval.plots import RECALL_KS, plot_recall_curves, recall_curve

QRELS = {"q1": {"a": 1, "b": 1}, "q2": {"c": 1}}
RUN = {"q1": {"x": 3.0, "a": 2.0, "y": 1.0, "b": 0.5}, "q2": {f"n{k}": 100.0 - k for k in range(40)} | {"c": 1.0}}


def test_recall_curve_is_recall_at_each_k():
    curve = recall_curve(RUN, QRELS)
    assert len(curve) == len(RECALL_KS)
    for k, value in zip(RECALL_KS, curve):
        assert value == evaluate(RUN, QRELS, measures=(f"recall@{k}",)).aggregate[f"recall@{k}"]
    assert curve[RECALL_KS.index(2)] == 0.25 and curve[RECALL_KS.index(50)] == 1.0
    assert curve == sorted(curve)


def test_plot_writes_a_png_with_a_line_per_method(tmp_path):
    out = tmp_path / "c.png"
    curves = {"cfir": recall_curve(RUN, QRELS), "other": [v / 2 for v in recall_curve(RUN, QRELS)]}
    plot_recall_curves(curves, out, "test")
    with PILImage.open(out) as im:
        assert im.format == "PNG" and im.size[0] > 400
        colours = set(im.convert("RGB").getdata())
    assert (31, 119, 180) in colours and (255, 127, 14) in colours  # matplotlib's first two line colours
    assert [p.name for p in tmp_path.iterdir()] == ["c.png"]  # no temp file left behind


def test_plot_refuses_a_name_that_is_not_png(tmp_path):
    with pytest.raises(CfirError, match="png"):
        plot_recall_curves({"cfir": [0.0] * len(RECALL_KS)}, tmp_path / "c.pdf", "t")
