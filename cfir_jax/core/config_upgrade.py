"""Reading an older workdir's recorded config with today's code: the fields added since it was recorded are filled in.

The one place this happens: `cli.workdir_config` applies `upgrade` when a workdir's config is read (before overrides
and the lock), and the retriever applies it to a config handed to it directly.
"""

from __future__ import annotations

import copy

import ml_collections

from cfir_jax.core.config import index_config, model_config, retrieval_config, train_config
from cfir_jax.core.config_serve import serve_config

# What a workdir recorded before a field existed meant, for the experiment fields that have no default
# (placeholders): SR was the fast scorer, evaluation always scored exactly, documents were embedded whole, entities
# were spaCy's alone.
_LEGACY_VALUES = {"train": {"document_fields": "all"},
                  "retrieval": {"sr": "fast", "eval_sr": "exact", "document_fields": "all"},
                  "index": {"entities": {"sources": "spacy"}}}


def upgrade(config: ml_collections.ConfigDict) -> ml_collections.ConfigDict:
    """Fills in the fields an older workdir's recorded config lacks (options added since: fusion, rerank, the SR
    backend...) with their current defaults, recursively, in place; fields it has are never changed. The one place
    this happens: `cli.workdir_config` applies it when a workdir's config is read, before overrides and the lock."""
    runlocal = bool(config.get("runlocal", False))
    # model: the switches added since (remat_policy, ...); a recorded config always has its sizes, which stay.
    sections = {"model": model_config(), "train": train_config(runlocal), "index": index_config(runlocal),
                "retrieval": retrieval_config(),
                "serve": serve_config()}
    with config.unlocked():
        if "tokenizer" not in config:
            config.tokenizer = ""  # the corpus' own
        for name, current in sections.items():
            if name not in config:
                config[name] = ml_collections.ConfigDict()
            _fill(config[name], current, _LEGACY_VALUES.get(name, {}))
    return config


def _fill(node: ml_collections.ConfigDict, current: ml_collections.ConfigDict, legacy: dict) -> None:
    for key, value in current.items():
        if key not in node:
            value = legacy.get(key, value)
            if value is not None:  # an experiment placeholder with no legacy meaning stays absent
                node[key] = copy.deepcopy(value)
        elif isinstance(value, ml_collections.ConfigDict) and isinstance(node[key], ml_collections.ConfigDict):
            _fill(node[key], value, legacy.get(key) if isinstance(legacy.get(key), dict) else {})
