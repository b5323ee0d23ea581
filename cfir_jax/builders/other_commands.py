"""The stores of the workdir that other commands make (train.py, retrieve.py, the caption pretraining of a synthetic
world's encoder), declared where the index reads them (`cfir_jax.builders.descriptor`): a rebuild links the models a
stage reads, and the closing table marks the model and the re-ranker stale, with the command that refreshes each,
when a store they are made from was rebuilt. The index never imports what makes them (`training/`, `rerank/`)."""

from __future__ import annotations

from cfir_jax.builders.descriptor import Store, declare

_RETRAIN = "train.py --config CONFIG --workdir W (after removing W/train, or it resumes the old run)"

declare(Store("pretrain", order=35, linked=True))  # the caption pretraining run that produced W/encoder
declare(Store("train", order=200))
declare(Store("model", order=201, made_from=("summaries", "image_cache", "encoder"), linked=True, refresh=_RETRAIN))
declare(Store("train_document", order=202))
declare(Store("model_document", order=203))
declare(Store("train_full", order=204))
declare(Store("model_full", order=205, linked=True))  # W/image_cache_full is encoded by its vision tower
declare(Store("reranker", order=210, made_from=("entity_index", "image_text", "model"),
              refresh="retrieve.py --index W --fit-reranker"))
