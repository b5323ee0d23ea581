"""The workdir layout: one directory holds every store, written by index.py and train.py, read by retrieve.py.

    W/corpus/          the corpus (documents, images, qrels; cfir_jax.data.corpus)
    W/image_cache/     [N, D] image embeddings (cfir_jax.stores.image_cache)
    W/encoder/         the frozen encoder model directory, when index.py made it (synthetic pretraining)
    W/pretrain/        the caption pretraining run that produced W/encoder
    W/entities/        named entities of every document (cfir_jax.nlp.entities)
    W/summaries/       a summary of every document (cfir_jax.stores.summaries)
    W/entity_index/    top-K images of every entity (cfir_jax.stores.entity_index)
    W/image_text/      [N, D] embeddings of each cached image's own text, for fused SR (cfir_jax.stores.image_text)
    W/entity_text_match/  per entity, the images whose own text names it (cfir_jax.stores.entity_text_match)
    W/lexical/         BM25 over each cached image's own text (cfir_jax.stores.lexical)
    W/sr_compact/      compact copy of the cache for summary re-ranking (cfir_jax.search.compact)
    W/sr_compact_fused/  the same for fused SR: a compact copy of the rows [image, image text]
    W/reranker/        the fitted re-ranker of SR's top-N, beyond the paper (cfir_jax.retrieve.reranker)
    W/index.json       what index.py built: the encoder used, stage summaries
    W/train/           training run: checkpoints, metrics.jsonl, config.json, tensorboard
    W/model/           the trained model (vision tower of the encoder + trained language expert)
    W/train_document/  training run of the document baseline (train.py --config.train.text=document)
    W/model_document/  the document baseline's model (the paper's "document only" row, Table 3)
    W/train_full/      training run of D-BEiT-3 Full (train.images="pixels"; cfir_jax/commands/train.py)
    W/model_full/      the Full model (both towers trained; its manifest says trained="full")
    W/image_cache_full/  the image cache re-encoded by W/model_full's vision tower (index.py --stages image_cache_full)

Each store is declared once, by the module that builds it (`cfir_jax.builders.descriptor`, which derives the list of
them); the layout names a store's directory W/<name> for any store name (`is_store_name`).
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
from pathlib import Path

from cfir_jax.core.errors import CfirError


@dataclasses.dataclass(frozen=True)
class Layout:
    root: Path

    @classmethod
    def of(cls, workdir: str | os.PathLike) -> Layout:
        return cls(Path(workdir).absolute())

    def __getattr__(self, name: str) -> Path:
        if is_store_name(name):
            return self.root / name
        raise AttributeError(name)

    def store_dirs(self) -> tuple[str, ...]:
        """The directories of W that hold a store or a run (their names are store names), sorted: what `--verify`
        and the service's verifier check, whichever module declared them."""
        if not self.root.is_dir():
            return ()
        return tuple(sorted(p.name for p in self.root.iterdir() if p.is_dir() and is_store_name(p.name)))

    @property
    def index_json(self) -> Path:
        return self.root / "index.json"

    def full_cache_stale(self) -> str:
        """Why W/image_cache_full no longer stands for W/model_full ('' while it does, or when either is missing):
        train.py re-exported the Full model, so the cache holds the previous vision tower's embeddings."""
        try:
            cache = json.loads((self.image_cache_full / "manifest.json").read_text())["fingerprint"]
            model = json.loads((self.model_full / "manifest.json").read_text())["vision_fingerprint"]
        except (OSError, ValueError, KeyError, TypeError):
            return ""
        return "" if cache == model else "model_full retrained"

    def portable(self, path: str | os.PathLike) -> str:
        """How a workdir records a path: relative to the workdir when inside it (so a copied or moved workdir
        points at its own stores), else absolute."""
        path = Path(path).absolute()
        return path.relative_to(self.root).as_posix() if path.is_relative_to(self.root) else str(path)

    def record_path(self, key: str, path: str | os.PathLike | None) -> dict:
        """{key: the portable path} for index.json, and for a model directory outside the workdir also
        {key_fingerprint: its fingerprints}, which `recorded_path` checks before anything loads it."""
        if path is None:
            return {key: ""}
        entry = {key: self.portable(path)}
        if Path(entry[key]).is_absolute():
            entry[f"{key}_fingerprint"] = _model_fingerprints(Path(path))
        return entry

    def recorded_path(self, info: dict, key: str, config_key: str | None = None) -> Path | None:
        """The path index.json records under `key`, resolved against this workdir; an outside model directory
        that is missing or is not the one recorded is refused in one line (what was expected where, and the config
        key that chose it: `index.<config_key or key>`)."""
        value = info.get(key) or ""
        if not value:
            return None
        path = Path(value)
        if not path.is_absolute():
            return self.root / path
        old_root = _recorded_root(info)  # index.json of older versions: absolute paths into the old workdir
        if old_root is not None and path.is_relative_to(old_root) and old_root != self.root:
            return self.root / path.relative_to(old_root)
        want = info.get(f"{key}_fingerprint")
        if want:
            have = _model_fingerprints(path)
            if have is None:
                raise CfirError(f"{self.index_json}: the {key} at {path} (fingerprint {want['text_fingerprint']}) "
                                f"is missing: put it back there, or rebuild the index with another "
                                f"--config.index.{config_key or key}")
            if have != want:
                raise CfirError(f"{self.index_json}: expected the {key} at {path} to have fingerprints {want} but "
                                f"it has {have}: restore the model the index was built with, or rebuild the index")
        return path


def _model_fingerprints(path: Path) -> dict | None:
    """The fingerprints of a model directory's towers (its manifest), or None when there is no model there."""
    try:
        manifest = json.loads((path / "manifest.json").read_text())
        return {k: manifest[k] for k in ("vision_fingerprint", "text_fingerprint")}
    except (OSError, ValueError, KeyError, TypeError):
        return None


def _recorded_root(info: dict) -> Path | None:
    """The workdir an older index.json was written in (its stages' absolute paths say), or None."""
    for stage in info.get("stages", []):
        path = Path(str(stage.get("path", "")))
        if stage.get("name") == "corpus" and path.is_absolute():
            return path.parent
    return None


# A store's name: its directory W/<name> (lower case, digits, underscores). Temporary and work directories beside
# the stores carry a dot or a leading one, and `work` is a change's own scratch directory (cfir_jax.stores.versions).
_STORE_NAME = re.compile(r"[a-z][a-z0-9_]*")
NOT_STORES = ("work",)


def is_store_name(name: str) -> bool:
    """Whether `name` can name a store of the layout."""
    return bool(_STORE_NAME.fullmatch(name)) and name not in NOT_STORES
