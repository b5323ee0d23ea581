"""The training tasks' data: the text task's pairs from the index stores ((summary | document | caption) text, cached
image embedding: `load_train_data`), and the Full task's documents' tokens with the image pipeline over W/corpus'
train pairs (`load_full_data`).

CFIR trains the language expert on (summary of a train-split document, one of its relevant images) pairs, the image
side being the frozen cache. The caption variant pairs each image with its own caption: that is how the demo stands
in for BEiT-3's image-text pretraining on a synthetic world that has no pretrained weights. Images removed from
the collection (index.py --remove, the image cache's removed rows) are never a training target, a validation image or
a negative.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import ml_collections
import numpy as np

from cfir_jax.core.config import TRAIN_TEXT_LENGTHS, check_text_lengths
from cfir_jax.core.config_check import TRAIN_TEXTS
from cfir_jax.core.errors import CfirError
from cfir_jax.data.corpus import Corpus, document_text
from cfir_jax.model.tokenizer import Beit3Tokenizer, resolve_tokenizer
from cfir_jax.stores.entities import EntityStore
from cfir_jax.stores.entity_index import EntityIndex
from cfir_jax.stores.image_cache import ImageCache
from cfir_jax.stores.layout import Layout
from cfir_jax.stores.summaries import SummaryStore


def document_texts(layout: Layout, corpus: Corpus, kind: str, fields=None) -> list[str]:
    """One text per corpus document, in corpus row order: its summary, or its text of `fields` (document_text)."""
    if kind == "summary":
        store = SummaryStore.open(layout.summaries)
        if store.doc_ids != corpus.doc_ids:
            raise CfirError(f"{layout.summaries}: summaries were built for other documents than {corpus.path}; "
                            "rebuild them with index.py")
        return list(store.summaries)
    if kind == "document":
        return [document_text(corpus.document(i), fields) for i in range(corpus.num_documents)]
    raise CfirError(f"unknown text kind {kind!r}: use one of {TRAIN_TEXTS}")


def load_train_data(config: ml_collections.ConfigDict, workdir, with_eval: bool = True) -> TrainData:
    """Builds the host-side TrainData of `config.train.text` from the stores of `workdir`."""
    tcfg = config.train  # train.text is one of TRAIN_TEXTS (cfir_jax.core.config_check)
    layout = Layout.of(workdir)
    corpus = Corpus.open(layout.corpus)
    cache = ImageCache.open(layout.image_cache, expect_dim=config.model.embed_dim)
    tokenizer = train_tokenizer(config, corpus)
    row_of = live_row_of(cache)

    if tcfg.text == "caption":
        texts, pair_text, pair_image = [], [], []
        for i, image_id in enumerate(corpus.image_ids):
            if image_id in row_of:
                caption = corpus.image(i).caption
                if caption:
                    pair_text.append(len(texts))
                    texts.append(caption)
                    pair_image.append(row_of[image_id])
        doc_texts = None
    else:
        doc_texts = document_texts(layout, corpus, tcfg.text, tcfg.document_fields)
        texts = doc_texts
        doc_row = {doc_id: i for i, doc_id in enumerate(corpus.doc_ids)}
        pair_text, pair_image = [], []
        for doc_id, rels in sorted(corpus.qrels("train").items()):
            for image_id, rel in sorted(rels.items()):
                if rel > 0 and image_id in row_of and doc_id in doc_row:
                    pair_text.append(doc_row[doc_id])
                    pair_image.append(row_of[image_id])
    ids, mask = tokenizer(texts, tcfg.max_text_len)

    eval_data = None
    if with_eval and "validation" in corpus.splits:
        queries = doc_texts or document_texts(layout, corpus, "document", tcfg.document_fields)
        eval_data = validation_data(corpus, cache, tokenizer, queries, tcfg.max_text_len)
    hard_offsets = hard_rows = None
    if tcfg.extra_negatives > 0 and tcfg.negatives == "hard" and tcfg.text != "caption":
        hard_offsets, hard_rows = entity_candidates_per_doc(layout, corpus, cache.removed)
    live_rows = np.flatnonzero(~cache.removed) if cache.removed.any() else None
    return TrainData(ids, mask, np.asarray(pair_text, np.int64), np.asarray(pair_image, np.int64), cache.embeddings,
                     eval_data, hard_offsets, hard_rows, live_rows)


def train_tokenizer(config: ml_collections.ConfigDict, corpus: Corpus) -> Beit3Tokenizer:
    """The tokenizer a training run encodes with, after refusing (one line) a text length the model's positions
    cannot hold or a vocabulary larger than the model's."""
    check_text_lengths(config, TRAIN_TEXT_LENGTHS, config.model.max_text_positions)
    tokenizer = resolve_tokenizer(config, corpus)
    if tokenizer.vocab_size > config.model.vocab_size:
        raise CfirError(f"tokenizer has {tokenizer.vocab_size} ids but model.vocab_size is {config.model.vocab_size}")
    return tokenizer


@dataclasses.dataclass
class FullData:
    """The Full task's inputs: `batches` (this process's slice of every global batch of the image pipeline) and every
    document's tokens (`ids` int32, `mask` bool [documents, train.max_text_len], in corpus row order: the pipeline's
    doc_rows index them)."""

    batches: Any  # cfir_jax.data.image_pipeline.PairBatches
    ids: np.ndarray
    mask: np.ndarray


def load_full_data(config: ml_collections.ConfigDict, workdir) -> FullData:
    """The train pairs of W/corpus for D-BEiT-3 Full: each pair's document text tokenised (`train.document_fields`,
    as the text task's document baseline) and the image pipeline over the pairs' images. Close `batches` after."""
    layout = Layout.of(workdir)
    if not layout.corpus.is_dir():
        raise CfirError(f"{layout.corpus}: no corpus; build it first with index.py --config CONFIG --workdir "
                        f"{layout.root}")
    tcfg = config.train  # train.text is 'document' (cfir_jax.core.config_check)
    # why: grain (the image pipeline) loads only for the Full task's pixels, not for the text task's cache
    from cfir_jax.data.image_pipeline import PairBatches, train_pairs

    corpus = Corpus.open(layout.corpus)
    tokenizer = train_tokenizer(config, corpus)
    texts = [document_text(corpus.document(i), tcfg.document_fields) for i in range(corpus.num_documents)]
    ids, mask = tokenizer(texts, tcfg.max_text_len)
    batches = PairBatches(corpus, train_pairs(corpus), global_batch=tcfg.global_batch,
                          image_size=config.model.image_size, seed=tcfg.seed, process_index=jax.process_index(),
                          process_count=jax.process_count(), workers=int(tcfg.image_workers),
                          randaug=bool(tcfg.randaug))
    return FullData(batches, ids, mask)


def live_row_of(cache: ImageCache) -> dict[str, int]:
    """Image id -> cache row of every image not removed (index.py --remove): a removed image is no training target,
    no validation image and no negative."""
    removed = cache.removed
    return {image_id: i for i, image_id in enumerate(cache.ids) if not removed[i]}


def validation_data(corpus: Corpus, cache: ImageCache, tokenizer: Beit3Tokenizer, doc_texts: list[str],
                    max_len: int) -> EvalData | None:
    """Validation documents against the images of the validation qrels (the 'small' setting), exact search."""
    qrels = {d: {i: r for i, r in rels.items() if r > 0} for d, rels in corpus.qrels("validation").items()}
    row_of = live_row_of(cache)
    image_ids = sorted({i for rels in qrels.values() for i in rels if i in row_of})
    doc_row = {doc_id: i for i, doc_id in enumerate(corpus.doc_ids)}
    query_ids = sorted(d for d, rels in qrels.items() if rels and d in doc_row)
    if not image_ids or not query_ids:
        return None
    ids, mask = tokenizer([doc_texts[doc_row[d]] for d in query_ids], max_len)
    rows = np.asarray([row_of[i] for i in image_ids])
    return EvalData(ids, mask, query_ids, np.asarray(cache.embeddings[rows], np.float32), image_ids, qrels)


def entity_candidates_per_doc(layout: Layout, corpus: Corpus, removed: np.ndarray | None = None
                              ) -> tuple[np.ndarray, np.ndarray]:
    """CSR over documents of the candidate image rows of their entities (hard negatives), removed rows [N] left
    out."""

    entities = EntityStore.open(layout.entities)
    index = EntityIndex.open(layout.entity_index)
    offsets, rows = [0], []
    for d in range(corpus.num_documents):
        ent_rows = [r for r in (index.row(e) for e in entities.entities_of(d)) if r is not None]
        lists = index.candidates(np.asarray(ent_rows, np.int64))
        cands = np.unique(np.concatenate([c[:64] for c in lists])) if ent_rows else np.zeros(0, np.int64)
        if removed is not None and removed.any():
            cands = cands[~removed[cands]]
        rows.append(cands.astype(np.int64))
        offsets.append(offsets[-1] + len(cands))
    return np.asarray(offsets, np.int64), np.concatenate(rows) if rows else np.zeros(0, np.int64)


@dataclasses.dataclass
class EvalData:
    """Validation queries against the validation images, scored by exact search."""

    ids: np.ndarray  # [Q, L] int32 tokens of the query texts
    padding_mask: np.ndarray  # [Q, L] bool
    query_ids: list[str]  # doc id of each query
    image_embeddings: np.ndarray  # [M, D] the candidate images
    image_ids: list[str]
    qrels: dict[str, dict[str, int]]


@dataclasses.dataclass
class TrainData:
    """Host-side training pairs: text `pair_text[i]` goes with cache row `pair_image[i]`.

    `ids`/`padding_mask` [T, L] are the tokenised texts (summaries, documents or captions); `image_embeddings`
    [N, D] is the image cache (memory-mapped). `hard_offsets`/`hard_rows` (CSR over texts) list hard negative
    image rows per text, e.g. the entity candidates of its document.
    """

    ids: np.ndarray
    padding_mask: np.ndarray
    pair_text: np.ndarray
    pair_image: np.ndarray
    image_embeddings: np.ndarray
    eval: EvalData | None = None
    hard_offsets: np.ndarray | None = None
    hard_rows: np.ndarray | None = None
    live_rows: np.ndarray | None = None  # the rows random negatives are drawn from (None: every row; else not removed)

    def __post_init__(self):
        if len(self.pair_text) != len(self.pair_image):
            raise CfirError("training pairs: texts and images differ in count")
        if len(self.pair_text) == 0:
            raise CfirError("no training pairs: the train qrels share no (text, cached image) pair")

    @property
    def num_pairs(self) -> int:
        return len(self.pair_text)

    def steps_per_epoch(self, global_batch: int) -> int:
        return max(self.num_pairs // global_batch, 1)

    def batch_rows(self, step: int, global_batch: int, seed: int) -> np.ndarray:
        """Pair indices of the global batch at `step`: epoch e is a seeded permutation, batches drop the tail."""
        per_epoch = self.steps_per_epoch(global_batch)
        epoch, offset = divmod(step, per_epoch)
        order = np.random.default_rng([seed, epoch]).permutation(self.num_pairs)
        if self.num_pairs < global_batch:  # tiny corpora: sample with wrap-around
            order = np.resize(order, global_batch)
        return order[offset * global_batch : (offset + 1) * global_batch]

    def negatives(self, step: int, rows: np.ndarray, count: int, kind: str, seed: int) -> np.ndarray:
        """[count, D] extra negative image embeddings for the batch at `step` (same on every process)."""
        rng = np.random.default_rng([seed, step, 7])
        n = len(self.image_embeddings)
        if kind == "hard" and self.hard_offsets is not None:
            pool = np.concatenate([self.hard_rows[self.hard_offsets[t] : self.hard_offsets[t + 1]]
                                   for t in self.pair_text[rows]] + [np.zeros(0, np.int64)])
            pool = np.setdiff1d(pool, self.pair_image[rows])
            picked = rng.choice(pool, min(count, len(pool)), replace=False) if len(pool) else np.zeros(0, np.int64)
            picked = np.concatenate([picked, self._random_rows(rng, n, count - len(picked))])
        elif kind in ("random", "hard"):
            picked = self._random_rows(rng, n, count)
        else:
            raise CfirError(f"unknown negatives kind {kind!r}: use 'random' or 'hard'")
        return np.asarray(self.image_embeddings[np.sort(picked)], np.float32)

    def _random_rows(self, rng: np.random.Generator, n: int, count: int) -> np.ndarray:
        """count uniform rows of the cache [n], removed rows never among them."""
        if self.live_rows is None:
            return rng.integers(0, n, count)
        return self.live_rows[rng.integers(0, len(self.live_rows), count)]
