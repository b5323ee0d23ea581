"""Small workdirs the tests make by hand: real stores (a manifest and checksums, as `contract.atomic_dir` writes them)
beside a training run's directory, without building anything."""

from __future__ import annotations

import json
from pathlib import Path

from repo import run_script

from cfir_jax.stores import contract


def write_store(root: Path, name: str, payload: bytes = b"rows") -> Path:
    """W/<name>: one data file, its manifest and its checksums."""
    with contract.atomic_dir(root / name) as tmp:
        (tmp / "data.bin").write_bytes(payload)
        contract.write_manifest(tmp, name, 1)
    return root / name


def full_trained(root: Path) -> Path:
    """A workdir where D-BEiT-3 Full training ran: the index's corpus, W/train_full (the run: checkpoints, metrics,
    its config; no manifest) and W/model_full (the exported model, a store)."""
    root.mkdir(parents=True, exist_ok=True)
    (root / "index.json").write_text(json.dumps({"version": 1}))
    write_store(root, "corpus")
    write_store(root, "model_full")
    run = root / "train_full"
    (run / "checkpoints" / "4" / "state").mkdir(parents=True)
    (run / "checkpoints" / "4" / "state" / "array").write_bytes(b"\0" * 64)
    (run / "metrics.jsonl").write_text('{"step": 4, "loss": 1.0}\n')
    (run / "config.json").write_text("{}")
    return root


def index_collection(w: Path, config: str, model_workdir: Path, collection: Path, *flags: str):
    """`index.py` over a collection folder (documents.jsonl, images.jsonl, qrels: `examples/collection/make.py`'s)
    into `w`, with the models of `model_workdir` (index.encoder) and `flags` (more `--config.x=y`); its process."""
    return run_script("index.py", "--config", config, "--workdir", str(w), f"--config.index.encoder={model_workdir}",
                      f"--config.index.corpus.documents={collection / 'documents.jsonl'}",
                      f"--config.index.corpus.images={collection / 'images.jsonl'}",
                      f"--config.index.corpus.qrels={collection / 'qrels'}", *flags)
