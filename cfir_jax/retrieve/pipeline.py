"""The CFIR retrieval pipeline and its baselines, as a library.

CFIR: document -> named entities -> the union of their candidate lists from the entity index (entity
ranking, ER) -> the document's summary embedded by the trained text tower -> the union scored by dot product with
the cached image embeddings (summary re-ranking, SR, `cfir_jax.retrieve.sr_scorer`) -> top-k.

Entities the index has never seen are dropped (`unknown_entities="ignore"`, the paper) or encoded by the frozen
entity encoder and searched over the cache at query time (`"search"`, the default: no entity is lost). A document
with no usable entity falls back to searching the whole cache with its summary embedding, and says so.

SR scores the union exactly, as the paper does (`retrieval.sr="exact"`), or through the compact int8 copy and an
exact re-rank of a shortlist (`"fast"`, ~16x faster at 4M images, top-1000 agreement ~0.9998). Evaluation uses
`retrieval.eval_sr` ("exact" by default); with "fast" it measures the agreement with exact scoring per query
(`Retriever(measure_agreement=True)`, outside the timed region). Every store and the compact copy are opened or
built when the Retriever is constructed, so per-query times measure queries: `er` (candidate lists and their union),
`score` (SR, or the baselines' whole-cache search / entity ranking) and `hits` (which entities brought each hit in).

Beyond the paper (off by default): with `retrieval.fusion` weights other than (1, 0), SR scores a
candidate by w_img * <q, image> + w_txt * <q, image text> (`cfir_jax.index.image_text`: the image's own text embedded by
the frozen text tower; images without text add 0), exactly, on either backend: both caches are read as one
[N, 2D] matrix (`FusedRows`) against the query [w_img q, w_txt q]. The CPU fast path scores them through a compact
copy of those [N, 2D] rows (W/sr_compact_fused, rebuilt when either store changes) and an exact re-rank.

With `retrieval.entity_text_match` (off by default), each known entity's candidate list also holds the images whose
own text names it (`cfir_jax.index.entity_text_match`, W/entity_text_match); SR scores them like any candidate.

Beyond the paper (off by default): with `retrieval.rerank.enabled` a third stage re-scores SR's top-N with the head
fitted into `W/reranker` (`cfir_jax.retrieve.reranker`, features in `cfir_jax.retrieve.rerank_features`): per-query
times add `rerank_encode` (the document's encoding with its late interaction, batched) and `rerank` (features and
head). It applies to CFIR only.

Baselines through the same code, for the paper's comparisons: `dense_document` and `dense_summary` (exact search of
the whole cache with the full document's or the summary's embedding) and `entity_only` (the union ranked by each
image's best entity score).
"""

from __future__ import annotations

import copy
import dataclasses
import json
import time
from collections.abc import Iterator, Sequence
from pathlib import Path

import ml_collections
import numpy as np

from cfir_jax.config import RETRIEVAL_TEXT_LENGTHS, check_text_lengths, retrieval_config
from cfir_jax.data.corpus import document_text
from cfir_jax.errors import CfirError
from cfir_jax.layout import Layout
from cfir_jax.progress import bar as progress_bar

METHODS = ("cfir", "dense_document", "dense_summary", "entity_only")
SR_MODES = ("exact", "fast")


@dataclasses.dataclass
class Hit:
    rank: int
    image_id: str
    score: float
    row: int  # row of the image cache
    entities: tuple[str, ...] = ()  # the document entities whose candidate lists brought this image in


@dataclasses.dataclass
class Result:
    hits: list[Hit]
    entities: list[str]  # entities found in the document (normalised)
    unknown_entities: list[str]  # of those, the ones the index had not seen
    summary: str
    note: str = ""  # e.g. the fallback taken
    num_candidates: int = 0  # size of the candidate union
    times_ms: dict[str, float] = dataclasses.field(default_factory=dict)
    sr_agreement: float | None = None  # fast SR's top-k overlap with exact scoring (when measured)
    rerank_features: np.ndarray | None = None  # [n, F] of SR's top-n, when the retriever collects them (fitting)


@dataclasses.dataclass
class DocumentInput:
    """A document to retrieve for; entities/summary given when the index already computed them."""

    text: str
    doc_id: str = "query"
    entities: list[str] | None = None
    summary: str | None = None


class Retriever:
    """Loads the stores of a workdir once; `retrieve(doc)` runs one query, `retrieve_many(docs)` a batch.

    measure_agreement: with fast SR, also score each union exactly (untimed) and record the top-k overlap.
    rerank_features: compute the re-ranker's features of SR's top-N into each Result (fitting the re-ranker).
    """

    def __init__(self, config: ml_collections.ConfigDict, workdir, method: str = "cfir", load_nlp: bool = True,
                 measure_agreement: bool = False, rerank_features: bool = False):
        from cfir_jax.data.corpus import Corpus
        from cfir_jax.index.entity_index import EntityIndex
        from cfir_jax.index.image_cache import ImageCache
        from cfir_jax.model import checkpoint
        from cfir_jax.model.text_encoder import TextEncoder
        from cfir_jax.model.tokenizer import resolve_tokenizer

        if method not in METHODS:
            raise CfirError(f"unknown method {method!r}: use one of {', '.join(METHODS)}")
        self.config, self.method = config, method
        self.rcfg = config.retrieval
        self._defaults = retrieval_config()  # for keys that a workdir's recorded config predates
        if self.rcfg.unknown_entities not in ("ignore", "search"):
            raise CfirError(f"retrieval.unknown_entities={self.rcfg.unknown_entities!r}: use 'ignore' or 'search'")
        self.sr_mode = self.rcfg.get("sr", "fast")
        if self.sr_mode not in SR_MODES:
            raise CfirError(f"retrieval.sr={self.sr_mode!r}: use 'exact' (the paper) or 'fast'")
        self.notes: list[str] = []  # what the retriever decided that the user should know (printed by retrieve.py)
        layout = self.layout = Layout.of(workdir)
        if not layout.root.is_dir():
            raise CfirError(f"{layout.root}: no index here (missing directory); build it with index.py")
        index_info = _read_index_json(layout)
        self.corpus = Corpus.open(layout.corpus)
        model_dir = layout.model if (layout.model / "manifest.json").is_file() else None
        # The document baseline of the paper (Table 3): a model trained on documents at 64 tokens, when train.py
        # made one (train.text=document); every method that encodes the document uses it.
        self.document_model = (layout.model_document / "manifest.json").is_file() and (
            method == "dense_document" or self.rcfg.text == "document")
        if self.document_model:
            model_dir = layout.model_document
        encoder_dir = Path(index_info["encoder"]) if index_info.get("encoder") else None
        if model_dir is None:
            if encoder_dir is None:
                raise CfirError(f"{layout.root}: no trained model (run train.py) and no index encoder")
            model_dir, self.note_model = encoder_dir, "untrained: the index encoder scores summaries (run train.py)"
        else:
            self.note_model = ""
        model = checkpoint.load_model(model_dir, config.model)
        check_text_lengths(config, RETRIEVAL_TEXT_LENGTHS, model.config.max_text_positions)
        model_manifest = checkpoint.read_model_manifest(model_dir)
        self.cache = ImageCache.open(layout.image_cache, expect_dim=model.config.embed_dim)
        if not self.cache.fingerprint.startswith("precomputed:") and \
                self.cache.fingerprint != model_manifest["vision_fingerprint"]:
            raise CfirError(f"{layout.image_cache}: image cache was built by {self.cache.fingerprint} but the model "
                            f"{model_dir} has {model_manifest['vision_fingerprint']}: rebuild the cache or use its "
                            "model")
        tokenizer = resolve_tokenizer(config, self.corpus)
        self.query_encoder = TextEncoder(model, tokenizer, self.rcfg.max_text_len, batch_size=32)
        # Without a document-trained model, dense_document encodes the whole document (up to the positions the
        # model has) with the summary-trained one; the document-trained model reads documents as it was trained.
        doc_len = model.config.max_text_positions - 2
        if self.document_model:
            doc_len = int(model_manifest.get("train_max_text_len") or self.rcfg.max_text_len)
        self.doc_encoder = TextEncoder(model, tokenizer, doc_len, batch_size=8)
        trained = model_manifest.get("train_text") or ("document" if self.document_model else "summary")
        kind = "untrained index encoder" if self.note_model else f"{trained}-trained"
        tokens = doc_len if method == "dense_document" else self.rcfg.max_text_len
        self.model_used = f"{kind}, {tokens} tokens"  # which model scored this method's queries (the --compare table)
        self.embeddings = self.cache.embeddings
        self.image_ids = self.cache.ids
        self.entity_index = self.entity_encoder = None
        if method in ("cfir", "entity_only"):
            enc_model = checkpoint.load_model(encoder_dir, config.model) if encoder_dir else model
            check_text_lengths(config, RETRIEVAL_TEXT_LENGTHS[1:], enc_model.config.max_text_positions)
            fingerprint = checkpoint.fingerprint(enc_model, "text")
            # retrieval.k cuts every stored list to its first k (0: as built); above the built K is refused.
            self.entity_index = EntityIndex.open(layout.entity_index, expect_fingerprint=fingerprint,
                                                 expect_dim=model.config.embed_dim).with_k(self.rcfg.get("k", 0))
            if self.entity_index.manifest.get("n_images") not in (None, self.cache.num_images):
                raise CfirError(f"{layout.entity_index}: built over {self.entity_index.manifest['n_images']} images "
                                f"but the cache has {self.cache.num_images}: rebuild the entity index")
            if "cache_fingerprint" in self.entity_index.manifest:
                from cfir_jax.store import check_derived

                check_derived(self.entity_index.manifest, layout.entity_index,
                              cache_fingerprint=self.cache.content_fingerprint)
            self.entity_encoder = TextEncoder(enc_model, tokenizer, config.index.entity_index.max_text_len, 16)
            if method == "entity_only":
                self.model_used = f"frozen index encoder, {self.entity_encoder.max_len} tokens"
        self.text_match = None  # beyond the paper: images whose own text names an entity join its list
        if method == "cfir" and self.setting("entity_text_match"):
            from cfir_jax.index.entity_text_match import EntityTextMatch
            from cfir_jax.store import manifest_digest

            self.text_match = EntityTextMatch.open(layout.entity_text_match,
                                                   entity_index=manifest_digest(self.entity_index.manifest),
                                                   cache_fingerprint=self.cache.content_fingerprint)
            self.model_used += ", entities matched in image text"
        fusion = self.setting("fusion")
        self.fusion = (float(fusion["w_img"]), float(fusion["w_txt"]))
        self.fused = method == "cfir" and self.fusion != (1.0, 0.0)
        self.sr_rows = self.embeddings  # what SR and the device cache score: [N, D], or [N, 2D] when fused
        if self.fused:
            from cfir_jax.index.image_text import FusedRows, ImageTextCache

            self.image_text = ImageTextCache.open(layout.image_text, expect_fingerprint=fingerprint,
                                                  expect_cache_fingerprint=self.cache.content_fingerprint)
            self.sr_rows = FusedRows(self.embeddings, self.image_text.embeddings)
            self.model_used += f", fused with image text (w_img={self.fusion[0]:g}, w_txt={self.fusion[1]:g})"
        self.measure_agreement = measure_agreement and self.sr_mode == "fast"
        self.reranker = None
        self.collect_features = rerank_features and method == "cfir"
        self.rerank_encoder = None  # set when the third stage runs (re-ranking or collecting its features)
        if method == "cfir" and (rerank_features or self.setting("rerank")["enabled"]):
            self._set_up_rerank(model, tokenizer, model_manifest["text_fingerprint"], fingerprint)
        self._nlp = self._summarizer = self._sr = self._device_cache = None
        self._load_nlp = load_nlp
        self._caption_cache: dict[int, tuple[str, str]] = {}
        if method == "cfir" and (self.sr_mode == "fast" or self.sr_backend() == "device"):
            # The compact copy (or the device copy) is built now (minutes at scale), not in the first query's timing.
            self.sr_scorer()

    def _set_up_rerank(self, model, tokenizer, text_fingerprint: str, encoder_fingerprint: str) -> None:
        """The third stage's inputs: a document encoder at rerank.max_text_len tokens, the entity index's stored
        scores, the image-text store when the features use it; and the fitted head when retrieval.rerank.enabled
        (refused in one line when fitted for another model, against changed stores or with other settings)."""
        from cfir_jax.model.text_encoder import TextEncoder
        from cfir_jax.retrieve.rerank_features import feature_names
        from cfir_jax.retrieve.reranker import Reranker

        rerank = self.setting("rerank")
        self.rerank_settings = {key: int(rerank[key]) for key in ("top_n", "max_text_len", "li_top")}
        check_text_lengths(ml_collections.ConfigDict({"retrieval": {"rerank": self.rerank_settings}}),
                           ("retrieval.rerank.max_text_len",), model.config.max_text_positions)
        if not self.entity_index.manifest.get("has_scores"):
            raise CfirError(f"{self.layout.entity_index}: kept no candidate scores, which the re-ranker's ER features "
                            "read; rebuild it with index.py (scores are kept by default)")
        self.rerank_encoder = TextEncoder(model, tokenizer, self.rerank_settings["max_text_len"], batch_size=8)
        if rerank["enabled"]:
            self.reranker = Reranker.open(self.layout.reranker)
            with_text = "txt" in self.reranker.features
        else:  # collecting features to fit: the image text joins them when index.py built it
            with_text = (self.layout.image_text / "manifest.json").is_file()
        self.rerank_text = None
        if with_text and self.fused:
            self.rerank_text = self.image_text
        elif with_text:
            from cfir_jax.index.image_text import ImageTextCache

            self.rerank_text = ImageTextCache.open(self.layout.image_text, expect_fingerprint=encoder_fingerprint,
                                                   expect_cache_fingerprint=self.cache.content_fingerprint)
        self.rerank_feature_names = feature_names(with_text)
        self._text_fingerprint = text_fingerprint
        if self.reranker is not None:
            if self.reranker.features != self.rerank_feature_names:
                raise CfirError(f"{self.layout.reranker}: fitted on features {', '.join(self.reranker.features)} but "
                                f"this code computes {', '.join(self.rerank_feature_names)}; fit it again")
            self.reranker.check(self.rerank_sources(), self.rerank_settings)
            fitted = tuple(self.reranker.manifest.get("sr_fusion", (1.0, 0.0)))
            if fitted != (self.fusion if self.fused else (1.0, 0.0)):
                self.notes.append(f"the re-ranker was fitted on SR lists with fusion (w_img, w_txt) = {fitted}, "
                                  f"and re-ranks lists of fusion {self.fusion if self.fused else (1.0, 0.0)}")
            self.model_used += f", re-ranked top {self.reranker.top_n}"

    def rerank_sources(self) -> dict[str, str | None]:
        """What the re-ranker's features are computed from: the text model, the image cache build, the entity
        index and image-text store manifests (digests); a fitted store records them and is refused when they change."""
        from cfir_jax.store import manifest_digest

        return dict(text_fingerprint=self._text_fingerprint, cache_fingerprint=self.cache.content_fingerprint,
                    entity_index=manifest_digest(self.entity_index.manifest),
                    image_text=manifest_digest(self.rerank_text.manifest) if self.rerank_text is not None else None)

    # ----------------------------------------------------------------------------------------- lazy components
    def extractor(self):
        if self._nlp is None:
            from cfir_jax.index.entities import EntityExtractor, load_spacy

            e = self.config.index.entities
            self._nlp = EntityExtractor(load_spacy(e.spacy_model or None), e.labels)
        return self._nlp

    def summarizer(self):
        if self._summarizer is None:
            from cfir_jax.index.summarizer import make_summarizer

            self._summarizer = make_summarizer(self.config)
        return self._summarizer

    def setting(self, key: str):
        """retrieval.<key>, with the current default for workdirs whose recorded config predates the key."""
        return self.rcfg.get(key, self._defaults[key])

    def sr_backend(self) -> str:
        """'device' or 'cpu' (retrieval.sr_backend; 'auto' is device when a GPU or TPU is present)."""
        backend = self.setting("sr_backend")
        if backend not in ("auto", "device", "cpu"):
            raise CfirError(f"retrieval.sr_backend={backend!r}: use auto, device or cpu")
        if backend == "auto":
            from cfir_jax.index.device_cache import has_accelerator

            backend = "device" if has_accelerator() else "cpu"
        return backend

    def device_cache(self):
        """The image cache resident on the local devices (loaded once; SR and exact searches share it)."""
        if self._device_cache is None:
            from cfir_jax.index.device_cache import DeviceCache

            shard = {"auto": None, "always": True, "never": False}.get(self.setting("sr_device_shard"), "bad")
            if shard == "bad":
                raise CfirError(f"retrieval.sr_device_shard={self.setting('sr_device_shard')!r}: "
                                "use auto, always or never")
            self._device_cache = DeviceCache(
                self.sr_rows, k=self.rcfg.top_k, dtype=self.setting("sr_device_dtype"), shard=shard,
                buckets=tuple(self.setting("sr_buckets")), query_batch=self.setting("sr_query_batch"))
        return self._device_cache

    def sr_scorer(self):
        """The SR scorer of the configured backend; both have score_batch(queries [Q, D], unions) -> [(s, rows)]."""
        if self.sr_backend() == "device":
            return self.device_cache()
        if self._sr is None:
            from cfir_jax.retrieve.sr_scorer import SRScorer, build_compact

            # Fused, the compact copy is made of the [N, 2D] rows [image, image text], so it serves any weights.
            compact_dir = self.layout.sr_compact_fused if self.fused else self.layout.sr_compact
            source = self.cache.content_fingerprint
            if self.fused:
                from cfir_jax.store import manifest_digest

                source += f"+text-{manifest_digest(self.image_text.manifest)}"
            dim = self.sr_rows.shape[1]
            dims = min(self.rcfg.sr_compact_dims, dim)
            try:
                from cfir_jax.retrieve.sr_scorer import CompactCache

                CompactCache.open(compact_dir, expect_n=self.cache.num_images, expect_dim=dim, expect_cache=source,
                                  expect_dims=dims)
            except CfirError:  # derived data: missing, or made from another cache (or dims), is rebuilt
                build_compact(self.sr_rows, compact_dir, dims=dims, cache_fingerprint=source)
            self._sr = SRScorer(self.sr_rows, compact_dir, shortlist=self.rcfg.sr_shortlist, k=self.rcfg.top_k)
        return self._sr

    # ------------------------------------------------------------------------------------------------- stages
    def _entity_stream(self, docs: Sequence[DocumentInput]) -> Iterator[list[str]]:
        """The entities of each document in order, lazily: one spaCy nlp.pipe over all documents that need them,
        with retrieval.entity_workers processes when there are many, so the workers parse ahead of encoding and SR."""
        if self.method not in ("cfir", "entity_only"):
            return iter([[] for _ in docs])
        missing = [d.text for d in docs if d.entities is None]
        found: Iterator[list[str]] = iter(())
        if missing:
            extractor = self.extractor()
            if len(missing) >= 2 * self.setting("batch_size") and self.setting("entity_workers") > 1:
                extractor = copy.copy(extractor)
                extractor.n_process = int(self.setting("entity_workers"))
            found = extractor.extract(missing)
        return (d.entities if d.entities is not None else next(found) for d in docs)

    def _summaries(self, docs: Sequence[DocumentInput]) -> list[str]:
        missing = [i for i, d in enumerate(docs) if d.summary is None]
        made = self.summarizer().summarize([docs[i].text for i in missing]) if missing else []
        out = [d.summary for d in docs]
        for i, s in zip(missing, made):
            out[i] = s
        return out

    def _exact_search(self, queries: np.ndarray, k: int, weights: tuple[float, float] = (1.0, 0.0)
                      ) -> tuple[np.ndarray, np.ndarray]:
        """Exact top-k over the whole cache, queries [Q, D] -> [Q, k'] each: on the devices when SR runs there.

        weights: (w_img, w_txt) of a fused retriever's search; the default scores the images alone.
        """
        from cfir_jax.index.knn import exact_topk

        rows = self.embeddings
        if self.fused and (self.sr_backend() == "device" or weights != (1.0, 0.0)):
            from cfir_jax.index.image_text import fused_queries

            # The device holds the fused matrix only: an image-only search is the query [q, 0] against it.
            queries, rows = fused_queries(queries, *weights), self.sr_rows
        if self.sr_backend() == "device":
            return self.device_cache().full_topk(queries, k)
        return exact_topk(queries, rows, min(k, len(rows)))

    def _full_search(self, query: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
        scores, rows = self._exact_search(query[None], k, self.fusion if self.fused else (1.0, 0.0))
        return scores[0], rows[0]

    def _candidates(self, entities: list[str]) -> tuple[list[np.ndarray], list[str], list[str]]:
        """Candidate lists per usable entity, the usable entities, and the unknown ones."""
        lists, _, used, unknown = self._scored_candidates(entities, with_scores=False)
        return lists, used, unknown

    def _scored_candidates(self, entities: list[str], with_scores: bool = True
                           ) -> tuple[list[np.ndarray], list[np.ndarray] | None, list[str], list[str]]:
        """As `_candidates`, with each list's entity-image scores [k_j] (stored by the index; the query-time
        search's for unseen entities) when with_scores, else None: (lists, scores, used, unknown)."""
        known_rows, known, unknown = [], [], []
        for e in entities:
            r = self.entity_index.row(e)
            if r is None:
                unknown.append(e)
            else:
                known_rows.append(r)
                known.append(e)
        rows_known = np.asarray(known_rows, np.int64)
        lists = self.entity_index.candidates(rows_known) if known_rows else []
        scores = (self.entity_index.scores(rows_known) if known_rows else []) if with_scores else None
        if self.text_match is not None and known_rows:
            # Matched images the embedding search missed go after the entity's own top-K (its order is kept); their
            # entity-image score, which the index never computed, is taken as the list's lowest.
            extra = [np.setdiff1d(m, c).astype(np.int32) for c, m in zip(lists, self.text_match.rows_of(known_rows))]
            if scores is not None:
                scores = [np.concatenate([s, np.full(len(x), s.min() if len(s) else 0.0, np.float32)])
                          for s, x in zip(scores, extra)]
            lists = [np.concatenate([c, x]) for c, x in zip(lists, extra)]
        searched: list[str] = []
        if unknown and self.rcfg.unknown_entities == "search":
            emb = self.entity_encoder.encode(unknown)
            k = self.entity_index.k
            from cfir_jax.index.knn import drop_padding

            if self.entity_index.manifest.get("has_searcher"):
                found, rows = self.entity_index.searcher().search(emb, k)
            else:
                found, rows = self._exact_search(emb, k)
            lists += drop_padding(rows)  # ScaNN may find fewer than K: its padding never reaches the union
            if with_scores:
                scores += [np.asarray(s[r >= 0], np.float32) for s, r in zip(found, np.asarray(rows))]
            searched = unknown
        return lists, scores, known + searched, unknown

    def retrieve_many(self, docs: Sequence[DocumentInput], progress: bool = False) -> list[Result]:
        """Runs the configured method for every document, retrieval.batch_size documents at a time (entities,
        summaries, encoding and SR batched); progress: a progress bar with documents/s (where bars are shown at all,
        see cfir_jax.progress)."""

        self._warm_up()
        size = max(1, int(self.setting("batch_size")))
        entities = self._entity_stream(docs)
        results: list[Result] = []
        with progress_bar(total=len(docs), unit="doc", desc=f"retrieve ({self.method})",
                          show=None if progress else False) as bar:
            for b0 in range(0, len(docs), size):
                batch = docs[b0 : b0 + size]
                t0 = time.perf_counter()
                batch_entities = [next(entities) for _ in batch]
                results += self._retrieve_batch(batch, batch_entities, time.perf_counter() - t0)
                bar.update(len(batch))
        return results

    def _retrieve_batch(self, docs: Sequence[DocumentInput], entities: list[list[str]], entity_s: float
                        ) -> list[Result]:
        """One batch: summaries and encoding batched, candidate unions per document, then SR over the batch."""
        k = self.rcfg.top_k
        t1 = time.perf_counter()
        use_summary = self.method in ("cfir", "dense_summary") and self.rcfg.text == "summary"
        summaries = self._summaries(docs) if use_summary else [""] * len(docs)
        t2 = time.perf_counter()
        if self.method == "dense_document":
            queries = self.doc_encoder.encode([d.text for d in docs])
        elif self.method == "entity_only":
            queries = None
        else:
            queries = self.query_encoder.encode(summaries if use_summary else [d.text for d in docs])
        t3 = time.perf_counter()
        per_doc_ms = {"entities": 1e3 * entity_s / len(docs), "summary": 1e3 * (t2 - t1) / len(docs),
                      "encode": 1e3 * (t3 - t2) / len(docs)}
        ranked, er_s, score_s = [None] * len(docs), [0.0] * len(docs), [0.0] * len(docs)
        prepared, er_scores = [], []
        for i in range(len(docs)):
            t_start = time.perf_counter()
            note, lists, used, unknown, union, scores = "", [], [], [], None, None
            if self.method in ("cfir", "entity_only"):
                lists, scores, used, unknown = self._scored_candidates(entities[i], self.rerank_encoder is not None)
                if lists:
                    from cfir_jax.retrieve.sr_scorer import unique_sorted

                    # The union once, de-duplicated and sorted (the scorers' gathers want sorted ids anyway).
                    union = unique_sorted(np.concatenate(lists).astype(np.int32, copy=False))
            t_er = time.perf_counter()
            er_s[i] = t_er - t_start
            if self.method in ("dense_document", "dense_summary") or (self.method == "cfir" and not lists):
                if self.method == "cfir":
                    note = "no usable entity: searched the whole cache with the summary embedding"
                ranked[i] = self._full_search(queries[i], k)
            elif self.method == "entity_only":
                ranked[i] = self._entity_ranking(lists, used, k)
            score_s[i] = time.perf_counter() - t_er
            prepared.append((note, lists, used, unknown, union))
            er_scores.append(scores)
        sr = [i for i in range(len(docs)) if ranked[i] is None]
        if sr:  # SR of every union of the batch at once: the device scorer pads them into one jitted call
            t_sr = time.perf_counter()
            scored = self._score_unions(queries[sr], [prepared[i][4] for i in sr])
            share = (time.perf_counter() - t_sr) / len(sr)
            for i, pair in zip(sr, scored):
                ranked[i] = pair
                score_s[i] += share
        sr_ranked = list(ranked)
        rerank_ms, features = [{}] * len(docs), [None] * len(docs)
        if self.rerank_encoder is not None:
            rerank_ms, features = self._rerank(docs, queries, [p[1] for p in prepared], er_scores, ranked)
        results = []
        for i, (note, lists, used, unknown, union) in enumerate(prepared):
            t_hits = time.perf_counter()
            hits = self._hits(*ranked[i], lists, used)
            times = dict(per_doc_ms, er=1e3 * er_s[i], score=1e3 * score_s[i],
                         hits=1e3 * (time.perf_counter() - t_hits), **rerank_ms[i])
            agreement = None
            if self.measure_agreement and self.method == "cfir" and union is not None:
                from cfir_jax.index.image_text import fused_queries
                from cfir_jax.retrieve.sr_scorer import exact_top_k

                query = fused_queries(queries[i : i + 1], *self.fusion)[0] if self.fused else queries[i]
                _, exact_rows = exact_top_k(self.sr_rows, query, union, k)
                agreement = len(np.intersect1d(sr_ranked[i][1], exact_rows)) / max(len(exact_rows), 1)
            num = len(union) if union is not None else len(self.embeddings)
            results.append(Result(hits, list(entities[i]), unknown, summaries[i], note, num, times, agreement,
                                  features[i]))
        return results

    def _rerank(self, docs: Sequence[DocumentInput], queries: np.ndarray, lists: list[list[np.ndarray]],
                scores: list[list[np.ndarray] | None], ranked: list[tuple[np.ndarray, np.ndarray]]
                ) -> tuple[list[dict[str, float]], list[np.ndarray]]:
        """The third stage over one batch: the documents encoded together, their tokens compared with their own top-N
        on the device (late interaction), then per query the features of SR's top-N and, with a fitted head, their
        new order (`ranked` is updated in place). Returns per query its times (ms): `rerank_encode` (the batched
        encoding and late interaction, per document) and `rerank` (gathers, features, head); and its features [n, F]."""
        from cfir_jax.retrieve.rerank_features import EntityEvidence, candidate_features
        from cfir_jax.retrieve.reranker import rerank_order

        top_n, dim = self.rerank_settings["top_n"], self.embeddings.shape[1]
        gather_s, images = [], np.zeros((len(docs), top_n, dim), np.float32)  # each list padded to N for one shape
        for i in range(len(docs)):
            t_start = time.perf_counter()
            top = np.asarray(ranked[i][1][:top_n], np.int64)
            images[i, : len(top)] = self.embeddings[top]
            gather_s.append(time.perf_counter() - t_start)
        t0 = time.perf_counter()
        doc_emb, best, top_mean = self.rerank_encoder.encode_against([d.text for d in docs], images,
                                                                     self.rerank_settings["li_top"])
        encode_ms = 1e3 * (time.perf_counter() - t0) / len(docs)
        times, features = [], []
        for i in range(len(docs)):
            t_start = time.perf_counter()
            sr_scores, rows = ranked[i]
            n = min(top_n, len(rows))
            top = np.asarray(rows[:n], np.int64)
            evidence = EntityEvidence(lists[i], scores[i], self.entity_index.k) if lists[i] else None
            text = {}
            if self.rerank_text is not None:
                text = dict(query=queries[i], texts=self.rerank_text.embeddings[top],
                            has_text=self.rerank_text.has_text[top])
            late = np.stack([best[i, :n], top_mean[i, :n]], axis=1)
            f = candidate_features(top, sr_scores[:n], images[i, :n], doc_emb[i], late, evidence, **text)
            if self.reranker is not None:
                ranked[i] = rerank_order(sr_scores, rows, self.reranker.logits(f))
            features.append(f if self.collect_features else None)
            rerank_s = time.perf_counter() - t_start + gather_s[i]
            times.append({"rerank_encode": encode_ms, "rerank": 1e3 * rerank_s})
        return times, features

    def _score_unions(self, queries: np.ndarray, unions: list[np.ndarray]) -> list[tuple[np.ndarray, np.ndarray]]:
        """SR of sorted unique unions ([Q, D] queries, Q unions [M_i]): (scores [k'], cache rows [k']) per query.

        The device backend is exact by construction; on the CPU, `retrieval.sr="exact"` scores every candidate
        (the paper's SR) and "fast" runs the two-pass scorer. Fused, both score [w_img q, w_txt q] against
        `FusedRows` (the CPU exactly).
        """
        if self.fused:
            from cfir_jax.index.image_text import fused_queries

            queries = fused_queries(queries, *self.fusion)
        if self.sr_mode == "exact" and self.sr_backend() == "cpu":
            from cfir_jax.retrieve.sr_scorer import exact_top_k

            return [exact_top_k(self.sr_rows, q, u, self.rcfg.top_k) for q, u in zip(queries, unions)]
        return self.sr_scorer().score_batch(queries, unions)

    def _warm_up(self) -> None:
        """Loads the models and compiles the encoders once, so per-query times measure queries."""
        if getattr(self, "_warm", False):
            return
        if self.method in ("cfir", "entity_only"):
            self.extractor()
            self.entity_encoder.encode(["warm up"])
            if self.rcfg.unknown_entities == "search" and self.entity_index.manifest.get("has_searcher"):
                self.entity_index.searcher()  # loads the ScaNN searcher before the first query's timing
        if self.method in ("cfir", "dense_summary") and self.rcfg.text == "summary":
            self.summarizer()
        self.query_encoder.encode(["warm up"])
        if self.method == "dense_document":
            self.doc_encoder.encode(["warm up"])
        if self.rerank_encoder is not None:
            shape = (1, self.rerank_settings["top_n"], self.embeddings.shape[1])
            self.rerank_encoder.encode_against(["warm up"], np.zeros(shape, np.float32), self.rerank_settings["li_top"])
            if self.reranker is not None:
                self.reranker.logits(np.zeros((1, len(self.reranker.features)), np.float32))
        self._warm = True

    def retrieve(self, doc: DocumentInput | str) -> Result:
        return self.retrieve_many([doc if isinstance(doc, DocumentInput) else DocumentInput(doc)])[0]

    def _entity_ranking(self, lists, used, k) -> tuple[np.ndarray, np.ndarray]:
        """Entity-only baseline: each candidate scored by its best entity-candidate similarity."""
        rows = np.concatenate(lists) if lists else np.zeros(0, np.int32)
        if not len(rows):
            return np.zeros(0, np.float32), np.zeros(0, np.int32)
        emb = self.entity_encoder.encode(used)
        scores = np.concatenate([np.asarray(self.embeddings[np.asarray(lst)], np.float32) @ emb[j]
                                 for j, lst in enumerate(lists)])
        order = np.lexsort((rows, -scores))
        rows, scores = rows[order], scores[order]
        _, first = np.unique(rows, return_index=True)
        keep = np.sort(first)[:k]
        return scores[keep], rows[keep]

    def _hits(self, scores, rows, lists, used) -> list[Hit]:
        rows = np.asarray(rows, np.int64)
        # Which entity lists hold each hit: binary search in each sorted list (~0.1 ms per 10,000-candidate list;
        # Python sets or np.isin cost ~1 ms per list).
        members = []
        for lst in lists:
            ordered = np.sort(np.asarray(lst, np.int64))
            at = np.minimum(np.searchsorted(ordered, rows), len(ordered) - 1)
            members.append(ordered[at] == rows)
        hits = []
        for i, (s, r) in enumerate(zip(scores, rows)):
            brought = tuple(e for e, m in zip(used, members) if m[i])
            hits.append(Hit(i + 1, self.image_ids[int(r)], float(s), int(r), brought))
        return hits

    def describe_image(self, image_id: str) -> tuple[str, str]:
        """(caption, url) of an image of the corpus ('' when unknown)."""
        if not hasattr(self, "_corpus_row"):
            self._corpus_row = {i: n for n, i in enumerate(self.corpus.image_ids)}
        n = self._corpus_row.get(image_id)
        if n is None:
            return "", ""
        if n not in self._caption_cache:
            image = self.corpus.image(n)
            self._caption_cache[n] = (image.caption, image.url)
        return self._caption_cache[n]

    # ----------------------------------------------------------------------------------------------- corpus docs
    def corpus_documents(self, split: str) -> list[DocumentInput]:
        """The documents of a qrels split with the entities and summaries the index computed for them."""
        from cfir_jax.index.entity_store import EntityStore
        from cfir_jax.index.summary_store import SummaryStore

        qrels = self.corpus.qrels(split)
        row_of = {d: i for i, d in enumerate(self.corpus.doc_ids)}
        # Stores computed from other documents than the corpus now holds are refused (one line): rerun index.py.
        fp = self.corpus.documents_fingerprint
        entities = EntityStore.open(self.layout.entities, corpus_fingerprint=fp) \
            if self.method in ("cfir", "entity_only") else None
        summaries = SummaryStore.open(self.layout.summaries, corpus_fingerprint=fp) \
            if self.method in ("cfir", "dense_summary") else None
        # A method that embeds the document reads retrieval.document_fields of it (entities and summaries come from
        # the stores, so the text is read for nothing else).
        embeds_document = self.method == "dense_document" or self.rcfg.text == "document"
        fields = self.rcfg.get("document_fields") if embeds_document else "all"
        docs = []
        for doc_id in sorted(qrels):
            if doc_id not in row_of:
                continue
            i = row_of[doc_id]
            docs.append(DocumentInput(
                document_text(self.corpus.document(i), fields), doc_id,
                entities=entities.entities_of(i) if entities is not None else None,
                summary=summaries.summary(i) if summaries is not None else None))
        return docs


def _read_index_json(layout: Layout) -> dict:
    if not layout.index_json.is_file():
        raise CfirError(f"{layout.root}: incomplete index (no index.json); run index.py to finish it")
    try:
        return json.loads(layout.index_json.read_text())
    except (UnicodeDecodeError, json.JSONDecodeError):
        raise CfirError(f"{layout.index_json}: unreadable; run index.py again") from None


def run_of(results: Sequence[Result], docs: Sequence[DocumentInput]) -> dict[str, list[tuple[str, float]]]:
    """A TREC run {doc_id: [(image_id, score), ...]} from the results."""
    return {d.doc_id: [(h.image_id, h.score) for h in r.hits] for d, r in zip(docs, results)}
