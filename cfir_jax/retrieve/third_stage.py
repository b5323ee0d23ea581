"""The optional third stage (beyond the paper, off by default): re-score SR's top-N with the fitted head.

With `retrieval.rerank.enabled` SR's top-N are re-scored by the head fitted into W/reranker
(`cfir_jax.retrieve.reranker`, features in `cfir_jax.retrieve.rerank_features`); collecting the features without a
head is how it is fitted (`cfir_jax.rerank.fit`). Per-query times add `rerank_encode` (the document's
encoding with its late interaction, batched) and `rerank` (features and head). CFIR only.
"""

from __future__ import annotations

import time
from collections.abc import Sequence

import ml_collections
import numpy as np

from cfir_jax.core.config import check_text_lengths
from cfir_jax.core.errors import CfirError
from cfir_jax.retrieve.rerank_features import EntityEvidence, TextEvidence, candidate_features, feature_names
from cfir_jax.retrieve.stores import opened
from cfir_jax.stores.contract import manifest_digest

Ranked = tuple[np.ndarray, np.ndarray]


class ThirdStage:
    """The third stage's inputs: a document encoder at rerank.max_text_len tokens, the entity index's stored scores,
    the image-text store when the features use it; and the fitted head when retrieval.rerank.enabled (refused in one
    line when fitted for another model, against changed stores or with other settings).

    stores: the opened `Stores`; sr_fusion: the (w_img, w_txt) of the SR lists it re-ranks; collect: keep each
    query's features in its Result (fitting). `notes` and `model_note` say what the user should know.
    """

    def __init__(self, rcfg, stores, sr_fusion: tuple[float, float], collect: bool):
        # why: flax loads when a model is opened, not on import
        from cfir_jax.model.text_encoder import TextEncoder
        from cfir_jax.retrieve.reranker import Reranker

        rerank = rcfg.rerank
        self.stores, self.collect, self.notes, self.model_note = stores, collect, [], ""
        self.settings = {key: int(rerank[key]) for key in ("top_n", "max_text_len", "li_top")}
        check_text_lengths(ml_collections.ConfigDict({"retrieval": {"rerank": self.settings}}),
                           ("retrieval.rerank.max_text_len",), stores.model.config.max_text_positions)
        if not stores.entity_index.manifest.get("has_scores"):
            raise CfirError(f"{stores.layout.entity_index}: kept no candidate scores, which the re-ranker's ER "
                            "features read; rebuild it with index.py (scores are kept by default)")
        self.encoder = TextEncoder(stores.model, stores.tokenizer, self.settings["max_text_len"], batch_size=8)
        self.reranker = None
        if rerank.enabled:
            self.reranker = Reranker.open(stores.layout.reranker)
            with_text = "txt" in self.reranker.features
        else:  # collecting features to fit: the image text joins them when index.py built it
            with_text = (stores.layout.image_text / "manifest.json").is_file()
        self.text = None
        if with_text:
            self.text = opened(stores, "image_text")
        self.feature_names = feature_names(with_text)
        if self.reranker is not None:
            self._check_head(sr_fusion)

    def _check_head(self, sr_fusion: tuple[float, float]) -> None:
        if self.reranker.features != self.feature_names:
            raise CfirError(f"{self.stores.layout.reranker}: fitted on features {', '.join(self.reranker.features)} "
                            f"but this code computes {', '.join(self.feature_names)}; fit it again")
        self.reranker.check(self.sources(), self.settings)
        fitted = tuple(self.reranker.manifest.get("sr_fusion", (1.0, 0.0)))
        if fitted != sr_fusion:
            self.notes.append(f"the re-ranker was fitted on SR lists with fusion (w_img, w_txt) = {fitted}, "
                              f"and re-ranks lists of fusion {sr_fusion}")
        self.model_note = f", re-ranked top {self.reranker.top_n}"

    def sources(self) -> dict[str, str | None]:
        """What the re-ranker's features are computed from: the text model, the image cache build, the entity
        index and image-text store manifests (digests); a fitted store records them and is refused when they change."""
        s = self.stores
        return dict(text_fingerprint=s.model_manifest["text_fingerprint"],
                    cache_fingerprint=s.cache.content_fingerprint,
                    entity_index=manifest_digest(s.entity_index.manifest),
                    image_text=manifest_digest(self.text.manifest) if self.text is not None else None)

    def warm_up(self) -> None:
        shape = (1, self.settings["top_n"], self.stores.embeddings.shape[1])
        self.encoder.encode_against(["warm up"], np.zeros(shape, np.float32), self.settings["li_top"])
        if self.reranker is not None:
            self.reranker.logits(np.zeros((1, len(self.reranker.features)), np.float32))

    def run(self, docs: Sequence, queries: np.ndarray, lists: list[list[np.ndarray]],
            scores: list[list[np.ndarray] | None], ranked: list[Ranked]) -> tuple[list[dict[str, float]], list]:
        """The third stage over one batch: the documents encoded together, their tokens compared with their own top-N
        on the device (late interaction), then per query the features of SR's top-N and, with a fitted head, their
        new order (`ranked` is updated in place). Returns per query its times (ms): `rerank_encode` (the batched
        encoding and late interaction, per document) and `rerank` (gathers, features, head); and its features [n, F]
        (None unless collecting)."""
        top_n, embeddings = self.settings["top_n"], self.stores.embeddings
        gather_s, images = [], np.zeros((len(docs), top_n, embeddings.shape[1]), np.float32)  # padded to N
        for i in range(len(docs)):
            t_start = time.perf_counter()
            top = np.asarray(ranked[i][1][:top_n], np.int64)
            images[i, : len(top)] = embeddings[top]
            gather_s.append(time.perf_counter() - t_start)
        t0 = time.perf_counter()
        doc_emb, best, top_mean = self.encoder.encode_against([d.text for d in docs], images, self.settings["li_top"])
        encode_ms = 1e3 * (time.perf_counter() - t0) / len(docs)
        times, features = [], []
        for i in range(len(docs)):
            t_start = time.perf_counter()
            f = self._features(i, queries[i], lists[i], scores[i], ranked[i], images[i], doc_emb[i], best, top_mean)
            if self.reranker is not None:
                ranked[i] = _rerank_order(ranked[i], self.reranker.logits(f))
            features.append(f if self.collect else None)
            times.append({"rerank_encode": encode_ms, "rerank": 1e3 * (time.perf_counter() - t_start + gather_s[i])})
        return times, features

    def _features(self, i, query, lists, scores, ranked, images, doc_emb, best, top_mean) -> np.ndarray:
        """Features [n, F] of one query's SR top-n."""
        sr_scores, rows = ranked
        n = min(self.settings["top_n"], len(rows))
        top = np.asarray(rows[:n], np.int64)
        evidence = EntityEvidence(lists, scores, self.stores.entity_index.k) if lists else None
        text = None
        if self.text is not None:
            text = TextEvidence(query, self.text.embeddings[top], self.text.has_text[top])
        late = np.stack([best[i, :n], top_mean[i, :n]], axis=1)
        return candidate_features(top, sr_scores[:n], images[:n], doc_emb, late, evidence, text)


def _rerank_order(ranked: Ranked, logits: np.ndarray) -> Ranked:
    # why: flax loads only when the third stage is enabled
    from cfir_jax.retrieve.reranker import rerank_order

    return rerank_order(ranked[0], ranked[1], logits)
