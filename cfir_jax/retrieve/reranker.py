"""The third retrieval stage (beyond the paper, off by default): a small list-wise head re-scores SR's top-N.

SR ranks the candidate union by one dot product with the summary. The re-ranker takes SR's top-N (`top_n`, 100 by
default) of a document and scores each candidate from features SR throws away (`cfir_jax.retrieve.rerank_features`:
the whole document's embedding, late interaction of its tokens with the image, ER evidence, the image's own text),
seeing the list as a whole: every feature also enters relative to the list's mean and maximum. It is fitted on the
train split's SR lists (`cfir_jax.rerank.fit`) and stored in `W/reranker`:

  params.npz      the head's parameters and the feature standardisation, keyed by '/'-joined path
  manifest.json   kind "reranker", format version, the feature list, N, the document's token budget, li_top, hidden
                  size, the sources it was fitted against (the text model's fingerprint, the image cache build, the
                  entity index and image-text store manifests' digests), SR's fusion weights, and the fit's figures

A store fitted for another text model, or against sources that changed since, is refused in one line; so is a run
whose `retrieval.rerank` settings differ from the store's. Re-ranked hits are ordered by the head's logit; SR's hits
after the top-N keep their order after them (their scores shifted below, see `rerank_order`).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from cfir_jax.core.errors import CfirError, StoreError
from cfir_jax.model.rerank_head import RerankHead
from cfir_jax.stores.contract import read_manifest

KIND = "reranker"
FORMAT_VERSION = 1
FIT_HINT = "python retrieve.py --index W --fit-reranker"
# The retrieval.rerank settings that define what the head sees: a store answers only to the ones it was fitted with.
FEATURE_SETTINGS = ("top_n", "max_text_len", "li_top")


def rerank_order(scores: np.ndarray, rows: np.ndarray, logits: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """SR's ranking (scores [k], rows [k], best first) with its first n = len(logits) re-ordered by the logits [n].

    The re-ranked hits carry their logits; when SR's tail (ranks n+1..k) follows, the logits are shifted by one
    constant per query so that the last re-ranked hit scores 1 above the tail's best: a run file is ordered by score
    (trec_eval), so the scores must fall with the rank. Ties keep SR's order.
    """
    n = len(logits)
    order = np.argsort(-np.asarray(logits, np.float32), kind="stable")
    top = np.asarray(logits, np.float32)[order]
    tail = np.asarray(scores[n:], np.float32)
    if len(tail):
        top = top + np.float32(tail[0] - top[-1] + 1.0)
    return np.concatenate([top, tail]), np.concatenate([np.asarray(rows[:n])[order], np.asarray(rows[n:])])


def _unflatten(flat: dict[str, np.ndarray]) -> dict:
    tree: dict = {}
    for name, value in flat.items():
        node = tree
        *parents, leaf = name.split("/")
        for part in parents:
            node = node.setdefault(int(part) if part.isdigit() else part, {})
        node[leaf] = value
    return tree


class Reranker:
    """A fitted head opened for scoring: `logits(features [n, F]) -> [n]`, one compilation (lists padded to N)."""

    def __init__(self, path: Path, manifest: dict, head: RerankHead):
        self.path, self.manifest = path, manifest
        self.features = tuple(manifest["features"])
        self.top_n = int(manifest["top_n"])
        graphdef, state = nnx.split(head)
        self._state = state

        @jax.jit
        def apply(state, features, valid):
            return nnx.merge(graphdef, state)(features, valid)

        self._apply = apply

    @classmethod
    def open(cls, path: str | os.PathLike) -> Reranker:
        """Reads a complete store; a missing or damaged one is a one-line StoreError saying how to fit it."""
        path = Path(path)
        if not (path / "manifest.json").is_file():
            raise StoreError(f"{path}: no fitted re-ranker here (retrieval.rerank.enabled needs one); fit it: "
                             f"{FIT_HINT}")
        manifest = read_manifest(path, KIND, FORMAT_VERSION)
        try:
            with np.load(path / "params.npz") as stored:
                flat = {k: stored[k] for k in stored.files}
            features, hidden = manifest["features"], int(manifest["hidden"])
            abstract = nnx.eval_shape(lambda: RerankHead(len(features), hidden, rngs=nnx.Rngs(0)))
            graphdef, state = nnx.split(abstract)
            nnx.replace_by_pure_dict(state, jax.tree.map(jnp.asarray, _unflatten(flat)))
        except (OSError, ValueError, KeyError, TypeError) as e:
            raise StoreError(f"{path}: damaged re-ranker store ({e.__class__.__name__}); fit it again: "
                             f"{FIT_HINT}") from None
        return cls(path, manifest, nnx.merge(graphdef, state))

    def check(self, sources: dict[str, Any], settings: dict[str, Any]) -> None:
        """Refuses (one line) a store fitted for another text model, against sources that changed since, or with
        other retrieval.rerank settings than this run's."""
        fitted = self.manifest.get("sources", {})
        if fitted.get("text_fingerprint") != sources["text_fingerprint"]:
            raise StoreError(f"{self.path}: fitted on the lists of text model {fitted.get('text_fingerprint')} but "
                             f"this index's model is {sources['text_fingerprint']} (another model); fit it again: "
                             f"{FIT_HINT}")
        for key, now in sources.items():
            if fitted.get(key) != now:
                raise StoreError(f"{self.path}: stale, fitted when {key} was {fitted.get(key)!r} but it is now "
                                 f"{now!r}; fit it again: {FIT_HINT}")
        for key in FEATURE_SETTINGS:
            if int(self.manifest[key]) != int(settings[key]):
                raise CfirError(f"{self.path}: fitted with retrieval.rerank.{key}={self.manifest[key]} but this run "
                                f"sets {settings[key]}: use --config.retrieval.rerank.{key}={self.manifest[key]} "
                                "or fit it again")

    def logits(self, features: np.ndarray) -> np.ndarray:
        """features [n <= N, F] of one list -> [n] float32 logits."""
        n = len(features)
        if n > self.top_n:
            raise CfirError(f"{n} candidates but the re-ranker was fitted on lists of {self.top_n}")
        padded = np.zeros((1, self.top_n, len(self.features)), np.float32)
        padded[0, :n] = features
        valid = np.zeros((1, self.top_n), bool)
        valid[0, :n] = True
        return np.asarray(self._apply(self._state, padded, valid))[0, :n]
