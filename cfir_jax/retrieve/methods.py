"""The retrieval methods, one small class each: CFIR, the paper's three baselines, and BM25's three (beyond the paper).

A method says what it reads (entities, the summary, the document), how it encodes a batch of queries, and how it
ranks one document given its candidate lists: CFIR leaves the union to SR (batched by the Retriever) and falls back
to the whole cache when the document has no usable entity; `dense_document` and `dense_summary` search the whole
cache exactly with the full document's or the summary's embedding; `entity_only` ranks the union by each image's
best entity score. Beyond the paper, over the images' own text (W/lexical, `cfir_jax.retrieve.lexical`): `bm25`
answers with BM25's ranking of the document; `cfir_bm25` is CFIR with BM25's top M in the union; `cfir_bm25_fused` is
CFIR's ranking fused with BM25's.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from cfir_jax.core.errors import CfirError
from cfir_jax.core.registry import Registry
from cfir_jax.search.live_rows import LiveRows

Ranked = tuple[np.ndarray, np.ndarray]
NO_ENTITY_NOTE = "no usable entity: searched the whole cache with the summary embedding"


class Method:
    """What every method answers. `rank` returns (ranked, note); ranked None means: SR scores the union."""

    name = ""
    cfir = False  # CFIR, alone or with BM25: SR scores ER's union (the options of cfir_jax.stores.readers ask this)
    uses_entities = False  # opens the entity index; extracts the documents' entities
    summarizes = False  # scores the document's summary when retrieval.text="summary"
    uses_lexical = False  # searches W/lexical with the document (BM25)
    lexical_candidates = False  # BM25's top M join the union SR scores
    lexical_fused = False  # the answer is SR's ranking fused with BM25's
    convex = False  # fused by the convex combination of normalised scores (else reciprocal rank)
    text_convex = False  # ER's union ranked by the convex fusion of the image's and its own text's scores
    dot_scores = True  # its scores are dot products of unit vectors (checked against the stores' bound)

    def __init__(self, rcfg):
        self.rcfg = rcfg

    def uses_summary(self) -> bool:
        return self.summarizes and self.rcfg.text == "summary"

    def reads_document(self) -> bool:
        """The document (not a summary) is what gets encoded: the document-trained model is used when there is one."""
        return self.rcfg.text == "document"

    def encode(self, stores, docs: Sequence, summaries: list[str]) -> np.ndarray | None:
        """The batch's query embeddings [Q, D] (None when the method scores without one)."""
        texts = summaries if self.uses_summary() else [d.text for d in docs]
        return stores.query_encoder.encode(texts)

    def warm_up(self, stores) -> None:
        stores.query_encoder.encode(["warm up"])

    def model_label(self, stores) -> str:
        """Which model scored this method's queries (the --compare table)."""
        return f"{model_kind(stores)}, {self.rcfg.max_text_len} tokens"

    def rank(self, retriever, query: np.ndarray | None, lists: list[np.ndarray], used: list[str], live: LiveRows,
             lexical: Ranked | None = None) -> tuple[Ranked | None, str]:
        """live: the rows a whole-cache search may return (the call's: `cfir_jax.search.live_rows`); lexical: the
        document's BM25 ranking, for the methods that search W/lexical."""
        raise NotImplementedError


# Every method, by name: each class below registers itself (`cfir_jax.core.registry`).
METHODS: Registry[type[Method]] = Registry("method", "retrieve/methods")


def model_kind(stores) -> str:
    """'untrained index encoder', 'summary-trained', 'document-trained', or the Full model over its own cache."""
    if stores.untrained:
        return "untrained index encoder"
    if stores.full:
        return f"Full (both towers {stores.trained_text}-trained), {stores.cache.path.name}"
    return f"{stores.trained_text}-trained"


@METHODS.register
class Cfir(Method):
    """Entities -> candidate union -> SR with the summary embedding (or the document's, retrieval.text)."""

    name = "cfir"
    cfir = True
    uses_entities = True
    summarizes = True

    def rank(self, retriever, query, lists, used, live, lexical=None):
        if lists:
            return None, ""
        return retriever.sr.full_search(query, self.rcfg.top_k, live), NO_ENTITY_NOTE


@METHODS.register
class DenseDocument(Method):
    """Exact search of the whole cache with the full document's embedding."""

    name = "dense_document"

    def reads_document(self) -> bool:
        return True

    def encode(self, stores, docs, summaries):
        return stores.doc_encoder.encode([d.text for d in docs])

    def warm_up(self, stores) -> None:
        super().warm_up(stores)
        stores.doc_encoder.encode(["warm up"])

    def model_label(self, stores) -> str:
        return f"{model_kind(stores)}, {stores.doc_encoder.max_len} tokens"

    def rank(self, retriever, query, lists, used, live, lexical=None):
        return retriever.sr.full_search(query, self.rcfg.top_k, live), ""


@METHODS.register
class DenseSummary(Method):
    """Exact search of the whole cache with the summary's embedding."""

    name = "dense_summary"
    summarizes = True

    def rank(self, retriever, query, lists, used, live, lexical=None):
        return retriever.sr.full_search(query, self.rcfg.top_k, live), ""


@METHODS.register
class EntityOnly(Method):
    """The union ranked by each image's best entity score (the frozen index encoder's)."""

    name = "entity_only"
    uses_entities = True

    def encode(self, stores, docs, summaries):
        return None

    def model_label(self, stores) -> str:
        return f"frozen index encoder, {stores.entity_encoder.max_len} tokens"

    def rank(self, retriever, query, lists, used, live, lexical=None):
        return retriever.entities.entity_only_ranking(lists, used, self.rcfg.top_k), ""


@METHODS.register
class Bm25(Method):
    """BM25 of the document over the images' own text: its top retrieval.lexical.top_k, cut to retrieval.top_k (no
    model, no entities)."""

    name = "bm25"
    uses_lexical = True
    dot_scores = False

    def encode(self, stores, docs, summaries):
        return None

    def warm_up(self, stores) -> None:
        pass

    def model_label(self, stores) -> str:
        # why: the methods' table loads no JAX (a query reads `uses_entities` before JAX loads); bm25's own stack does
        from cfir_jax.retrieve.lexical import label

        return label(stores.extra["lexical"], self.rcfg.lexical)

    def rank(self, retriever, query, lists, used, live, lexical=None):
        k = int(self.rcfg.top_k)
        return (lexical[0][:k], lexical[1][:k]), ""


@METHODS.register
class CfirBm25(Cfir):
    """CFIR with each document's top retrieval.lexical.candidates BM25 images in the union SR scores."""

    name = "cfir_bm25"
    uses_lexical = True
    lexical_candidates = True


@METHODS.register
class CfirBm25Fused(Cfir):
    """CFIR's ranking fused with BM25's by reciprocal rank (retrieval.lexical.fuse_weight)."""

    name = "cfir_bm25_fused"
    uses_lexical = True
    lexical_fused = True


@METHODS.register
class CfirBm25Convex(CfirBm25Fused):
    """CFIR's ranking fused with BM25's by the convex combination of their min-max normalised scores, SR's weight
    alpha (retrieval.lexical.alpha, or the one `retrieve.py --fit-fusion` fitted into W/convex_fusion)."""

    name = "cfir_bm25_convex"
    convex = True


@METHODS.register
class CfirTextConvex(Cfir):
    """CFIR with ER's union ranked by alpha * minmax(image) + (1 - alpha) * minmax(image text) over the union, alpha
    the image's weight (retrieval.fusion.alpha, or the one `retrieve.py --fit-fusion` fitted into W/convex_fusion):
    `cfir_jax.retrieve.text_fusion`."""

    name = "cfir_text_convex"
    text_convex = True

    def __init__(self, rcfg):
        super().__init__(rcfg)
        self.fusion = None  # the TextConvex of the stores, made with the first query's
        self.fitted = None

    def scorer(self, stores):
        """The union's ranker over these stores (made once)."""
        if self.fusion is None:
            # why: the methods' table loads no JAX; the fusion's scorer and the fitted store's reader do
            from cfir_jax.retrieve.text_fusion import TextConvex
            from cfir_jax.stores.convex_fusion import fitted

            if not (float(self.rcfg.fusion.alpha) == -1 or 0 <= float(self.rcfg.fusion.alpha) <= 1):
                raise CfirError(f"retrieval.fusion.alpha={self.rcfg.fusion.alpha}: the image's weight in the convex "
                                "fusion, in [0, 1] (-1: the one retrieve.py --fit-fusion fitted)")
            self.fitted = fitted(stores.layout, self, self.rcfg)
            alpha = float(self.rcfg.fusion.alpha) if self.fitted is None else self.fitted.alpha
            self.fusion = TextConvex(stores.embeddings, stores.extra["image_text"].embeddings, alpha)
        return self.fusion

    def model_label(self, stores) -> str:
        fusion = self.scorer(stores)
        where = f"fitted on {self.fitted.split}" if self.fitted is not None else "retrieval.fusion.alpha"
        return f"{super().model_label(stores)}, fused with image text (convex, alpha={fusion.alpha:g}, {where})"

    def rank(self, retriever, query, lists, used, live, lexical=None):
        fusion = self.scorer(retriever.stores)
        if lists:
            return fusion.rank(query, lists, int(self.rcfg.top_k)), ""
        if fusion.kept is not None:  # a fit's documents stay in step with what it keeps
            fusion.kept.append(None)
        return super().rank(retriever, query, lists, used, live, lexical)


def method_of(name: str, rcfg) -> Method:
    """The method called `name`; an unknown name is one line listing the known ones."""
    if name not in METHODS:
        raise CfirError(f"unknown method {name!r}: use one of {', '.join(METHODS)}")
    return METHODS[name](rcfg)
