"""Images of an evaluation: recall@k curves of every method on one split, for a reader who would rather look."""

from __future__ import annotations

import os
from collections.abc import Mapping

from cfir_jax.core.errors import CfirError
from cfir_jax.stores.atomic_write import atomic_file

# Cut-offs of the curve: log-spaced from 1 to the 1,000 hits a run holds (trec_eval's recall.k at each).
RECALL_KS = (1, 2, 3, 5, 7, 10, 15, 20, 30, 50, 70, 100, 150, 200, 300, 500, 700, 1000)


def recall_curve(run: Mapping, qrels: Mapping, ks: tuple[int, ...] = RECALL_KS) -> list[float]:
    """Mean recall@k over the judged topics, one value per k in `ks` (trec_eval's recall.k)."""
    # why: pytrec_eval loads only for a curve, not for retrieve.py's flag check (check_png_name)
    from cfir_jax.eval.metrics import evaluate

    result = evaluate(run, qrels, measures=tuple(f"recall@{k}" for k in ks))
    return [result.aggregate[f"recall@{k}"] for k in ks]


def check_png_name(path: str | os.PathLike) -> None:
    """The plot is a PNG: refuse another file name in one line."""
    if not os.fspath(path).lower().endswith(".png"):
        raise CfirError(f"--plot {os.fspath(path)}: give a .png file name")


def plot_recall_curves(curves: Mapping[str, list[float]], path: str | os.PathLike, title: str,
                       ks: tuple[int, ...] = RECALL_KS) -> None:
    """Draws recall@k against k (log axis), one line per method, into a PNG (written to a temp name, renamed)."""
    # why: matplotlib loads only when a plot is drawn (--plot)
    import matplotlib

    matplotlib.use("Agg")  # files only: no display needed (and none on a server)
    # why: pyplot loads only after the Agg backend is chosen
    import matplotlib.pyplot as plt
    import matplotlib.ticker

    check_png_name(path)
    path = os.fspath(path)
    fig, ax = plt.subplots(figsize=(7, 4.5), dpi=120)
    for method, values in curves.items():
        ax.plot(ks, values, marker="o", markersize=3, label=method, linewidth=2 if method == "cfir" else 1.2)
    ax.set_xscale("log")
    ax.xaxis.set_major_formatter(matplotlib.ticker.FuncFormatter(lambda x, _: f"{x:,.0f}"))
    ax.set_xlabel("k (images returned)")
    ax.set_ylabel("recall@k")
    ax.set_ylim(0, 1)
    ax.set_title(title)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(loc="upper left", fontsize="small")  # recall is low at small k: the upper left stays empty
    fig.tight_layout()
    try:
        with atomic_file(path) as f:
            fig.savefig(f, format="png")
    except OSError as e:
        raise CfirError(f"--plot {path}: cannot write ({e.strerror})") from None
    finally:
        plt.close(fig)
