"""The workdir layout: one directory holds every store, written by index.py and train.py, read by retrieve.py.

    W/corpus/          the corpus (documents, images, qrels; cfir_jax.data.corpus)
    W/image_cache/     [N, D] image embeddings (cfir_jax.index.image_cache)
    W/encoder/         the frozen encoder model directory, when index.py made it (synthetic pretraining)
    W/pretrain/        the caption pretraining run that produced W/encoder
    W/entities/        named entities of every document (cfir_jax.index.entities)
    W/summaries/       a summary of every document (cfir_jax.index.summary_store)
    W/entity_index/    top-K images of every entity (cfir_jax.index.entity_index)
    W/image_text/      [N, D] embeddings of each cached image's own text, for fused SR (cfir_jax.index.image_text)
    W/entity_text_match/  per entity, the images whose own text names it (cfir_jax.index.entity_text_match)
    W/sr_compact/      compact copy of the cache for summary re-ranking (cfir_jax.search.compact)
    W/sr_compact_fused/  the same for fused SR: a compact copy of the rows [image, image text]
    W/reranker/        the fitted re-ranker of SR's top-N, beyond the paper (cfir_jax.retrieve.reranker)
    W/index.json       what index.py built: the encoder used, stage summaries
    W/train/           training run: checkpoints, metrics.jsonl, config.json, tensorboard
    W/model/           the trained model (vision tower of the encoder + trained language expert)
    W/train_document/  training run of the document baseline (train.py --config.train.text=document)
    W/model_document/  the document baseline's model (the paper's "document only" row, Table 3)
"""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path


@dataclasses.dataclass(frozen=True)
class Layout:
    root: Path

    @classmethod
    def of(cls, workdir: str | os.PathLike) -> Layout:
        return cls(Path(workdir).absolute())

    def __getattr__(self, name: str) -> Path:
        if name in STORES:
            return self.root / name
        raise AttributeError(name)

    @property
    def index_json(self) -> Path:
        return self.root / "index.json"


STORES = ("corpus", "image_cache", "encoder", "pretrain", "entities", "summaries", "entity_index", "image_text",
          "entity_text_match", "sr_compact", "sr_compact_fused", "reranker", "train", "model", "train_document",
          "model_document")
