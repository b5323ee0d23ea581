"""Reading an older workdir's recorded config with today's code: the fields added since it was recorded are filled in.

The one place this happens: `cli.workdir_config` applies `upgrade` when a workdir's config is read (before overrides
and the lock), and the retriever applies it to a config handed to it directly.
"""

from __future__ import annotations

import copy

import ml_collections

from cfir_jax.core.config import index_config, model_config, retrieval_config, train_config
from cfir_jax.core.config_serve import serve_config
from cfir_jax.core.config_workers import entity_workers_config

# What a workdir recorded before a field existed meant, for the experiment fields that have no default
# (placeholders): SR was the fast scorer, evaluation always scored exactly, documents were embedded whole, entities
# were spaCy's alone.
_LEGACY_VALUES = {"train": {"document_fields": "all"},
                  "retrieval": {"sr": "fast", "eval_sr": "exact", "document_fields": "all"},
                  "index": {"entities": {"sources": "spacy"}}}
# Fields that moved (old -> new): a workdir that recorded the old one keeps its value under the new name, and an
# override of the old one is refused in one line naming the new (`cfir_jax.core.cli`). The spaCy processes' three
# homes became one section (issue 52); the image search's queue is named with the product's one word for images.
MOVED = {"serve.entity_workers": "entity_workers.serve",
         "serve.entity_deadline_ms": "entity_workers.serve_deadline_ms",
         "serve.entity_max_restarts": "entity_workers.max_restarts",
         "serve.entity_restart_window_s": "entity_workers.restart_window_s",
         "retrieval.entity_workers": "entity_workers.bulk",
         "retrieval.entity_deadline_ms": "entity_workers.deadline_ms",
         "index.entities.n_process": "entity_workers.index",
         "serve.picture_queue_size": "serve.image_queue_size"}
# Why the fields of each new section moved, said where an override of an old name is refused.
_WHY = {"entity_workers": "the config's entity_workers section", "serve": "one word for images, issue 58"}


def moved_line(old: str, prefix: str = "") -> str:
    """The one line that refuses an override of the MOVED field `old`: its new name and why it moved."""
    new = MOVED[old]
    return f"{prefix}{old} has moved: use {prefix}{new} ({_WHY[new.split('.')[0]]})"


def upgrade(config: ml_collections.ConfigDict) -> ml_collections.ConfigDict:
    """Fills in the fields an older workdir's recorded config lacks (options added since: fusion, rerank, the SR
    backend...) with their current defaults, recursively, in place; fields it has are never changed. The one place
    this happens: `cli.workdir_config` applies it when a workdir's config is read, before overrides and the lock."""
    runlocal = bool(config.get("runlocal", False))
    # model: the switches added since (remat_policy, ...); a recorded config always has its sizes, which stay.
    sections = {"model": model_config(), "train": train_config(runlocal), "index": index_config(runlocal),
                "retrieval": retrieval_config(),
                "serve": serve_config(), "entity_workers": entity_workers_config()}
    with config.unlocked():
        if "tokenizer" not in config:
            config.tokenizer = ""  # the corpus' own
        _move(config)
        for name, current in sections.items():
            if name not in config:
                config[name] = ml_collections.ConfigDict()
            _fill(config[name], current, _LEGACY_VALUES.get(name, {}))
    return config


def _move(config: ml_collections.ConfigDict) -> None:
    """Each MOVED field the config recorded, under its new name (its value kept) and gone from its old place."""
    for old, new in MOVED.items():
        *parents, leaf = old.split(".")
        node = config
        for part in parents:
            node = node.get(part) if isinstance(node, ml_collections.ConfigDict) else None
        if not isinstance(node, ml_collections.ConfigDict) or leaf not in node:
            continue
        value = node[leaf]
        del node[leaf]
        section, field = new.split(".")
        if section not in config:
            config[section] = ml_collections.ConfigDict()
        config[section][field] = value


def _fill(node: ml_collections.ConfigDict, current: ml_collections.ConfigDict, legacy: dict) -> None:
    for key, value in current.items():
        if key not in node:
            value = legacy.get(key, value)
            if value is not None:  # an experiment placeholder with no legacy meaning stays absent
                node[key] = copy.deepcopy(value)
        elif isinstance(value, ml_collections.ConfigDict) and isinstance(node[key], ml_collections.ConfigDict):
            _fill(node[key], value, legacy.get(key) if isinstance(legacy.get(key), dict) else {})
