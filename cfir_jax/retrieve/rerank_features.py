"""What the re-ranker sees of a document and each of SR's top-N candidates: the features SR throws away.

SR keeps one number per candidate (the summary's dot product with the image). The third stage
(`cfir_jax.retrieve.reranker`) looks at the document and the candidate together through these per-candidate
features, in this order (`feature_names`):

  sr          SR's score (fused with the image text when SR is)
  doc         the whole document's embedding (the trained text tower at `retrieval.rerank.max_text_len` tokens) . image
  li_max      late interaction: the best similarity of one document token (through the language head, L2-normalised)
              with the image
  li_top      the mean of the `li_top` best token similarities
  er_lists    how many of the document's entity lists (ER) hold the candidate
  er_frac     that count over the number of lists
  er_rank     its best position in those lists, log1p(position) / log1p(K); 1 when no list holds it
  er_score    its best entity-image score in those lists (the entity index's stored scores, or the query-time search's
              for unseen entities); 0 when no list holds it
  txt         the summary embedding . the image's own text embedding (W/image_text; only when that store exists)
  has_txt     1 when the image has text, else 0 (only with txt)

The late interaction runs with the document's encoding on the device (`TextEncoder.encode_against`: tokens x N
dot products, only [N] maxima and means come back); the rest is numpy on the host: N gathered image rows, two
dot products per candidate and one sorted search over the document's concatenated entity lists.
"""

from __future__ import annotations

import dataclasses

import numpy as np

BASE_FEATURES = ("sr", "doc", "li_max", "li_top", "er_lists", "er_frac", "er_rank", "er_score")
TEXT_FEATURES = ("txt", "has_txt")


def feature_names(with_text: bool) -> tuple[str, ...]:
    """The feature columns, in order: the base ones, then the image-text pair when the image-text store is used."""
    return BASE_FEATURES + (TEXT_FEATURES if with_text else ())


@dataclasses.dataclass
class EntityEvidence:
    """The ER stage of one document: per usable entity its candidate rows [k_j] (best first) and their scores [k_j]."""

    lists: list[np.ndarray]
    scores: list[np.ndarray]
    k: int  # the entity index's K: positions are normalised by it


def entity_features(rows: np.ndarray, evidence: EntityEvidence) -> np.ndarray:
    """rows [n] unique cache rows -> [n, 4] (er_lists, er_frac, er_rank, er_score), as the module docstring says.

    One pass over the concatenated lists: each list entry is looked up among the n sorted candidates (M log n), so
    the cost does not depend on sorting lists of K = 10,000.
    """
    n = len(rows)
    out = np.zeros((n, 4), np.float32)
    out[:, 2] = 1.0
    if n == 0 or not evidence.lists:
        return out
    flat = np.concatenate(evidence.lists).astype(np.int64, copy=False)
    positions = np.concatenate([np.arange(len(lst)) for lst in evidence.lists])
    scores = np.concatenate(evidence.scores).astype(np.float32, copy=False)
    order = np.argsort(rows, kind="stable")
    ordered = np.asarray(rows, np.int64)[order]
    at = np.minimum(np.searchsorted(ordered, flat), n - 1)
    found = ordered[at] == flat
    which = order[at[found]]  # the candidate each matching list entry is
    count = np.bincount(which, minlength=n).astype(np.float32)
    best_position = np.full(n, np.inf)
    np.minimum.at(best_position, which, positions[found])
    best_score = np.full(n, -np.inf, np.float32)
    np.maximum.at(best_score, which, scores[found])
    held = count > 0
    out[:, 0] = count
    out[:, 1] = count / len(evidence.lists)
    out[held, 2] = np.log1p(best_position[held]) / np.log1p(max(evidence.k, 1))
    out[held, 3] = best_score[held]
    return out


@dataclasses.dataclass(frozen=True)
class TextEvidence:
    """The image-text side of one document's candidates, when used: `query` [D], its summary embedding; `texts`
    [n, D], the candidates' image-text rows; `has_text` [n], whether each candidate has a text."""

    query: np.ndarray
    texts: np.ndarray
    has_text: np.ndarray


def candidate_features(rows: np.ndarray, sr_scores: np.ndarray, images: np.ndarray, document: np.ndarray,
                       late: np.ndarray, evidence: EntityEvidence | None, text: TextEvidence | None = None
                       ) -> np.ndarray:
    """The feature matrix [n, F] of one document's top-n candidates (columns: `feature_names(text is not None)`).

    rows [n]: their cache rows (unique); sr_scores [n]: SR's scores; images [n, D]: their image embeddings;
    document [D]: the document's embedding; late [n, 2]: late interaction's best and top-mean token similarities
    (`TextEncoder.encode_against`); evidence: its ER lists (None: no usable entity, the whole cache was searched);
    text: the image-text side (None: not used).
    """
    images = np.asarray(images, np.float32)
    parts = [np.asarray(sr_scores, np.float32)[:, None], (images @ np.asarray(document, np.float32))[:, None],
             np.asarray(late, np.float32), entity_features(rows, evidence or EntityEvidence([], [], 1))]
    if text is not None:
        parts += [(np.asarray(text.texts, np.float32) @ np.asarray(text.query, np.float32))[:, None],
                  np.asarray(text.has_text, np.float32)[:, None]]
    return np.concatenate(parts, axis=1)
