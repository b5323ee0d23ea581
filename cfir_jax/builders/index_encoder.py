"""The frozen index encoder: where it is, its text positions, loading it, its entity-text encoder and the checks
that the stores it made belong together (entity texts and images from one model). Declares the encoder stage
(`encoder_stage`): a synthetic world's encoder trained on its captions, or the summary of the configured one.
"""

from __future__ import annotations

import json
from pathlib import Path

from cfir_jax.builders.descriptor import Build, Stage, StageRun, declare
from cfir_jax.core.config import INDEX_TEXT_LENGTHS, check_text_lengths
from cfir_jax.core.errors import CfirError
from cfir_jax.model.tokenizer import resolve_tokenizer
from cfir_jax.search.knn import ScannConfig
from cfir_jax.stores.contract import check_manifest
from cfir_jax.stores.layout import Layout


def encoder_dir(config, layout: Layout) -> Path | None:
    """The frozen encoder's model directory: the configured one, W/encoder for 'pretrain', or for another workdir
    (a directory with an index.json and no model manifest) the index encoder that workdir records."""
    enc = config.index.encoder
    if enc == "pretrain":
        return layout.encoder
    if not enc:
        return None
    other = other_workdir(config)
    if other is None:
        return Path(enc)
    try:
        info = json.loads(other.index_json.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError):
        raise CfirError(f"{other.index_json}: unreadable; finish that workdir's index.py run first "
                        "(index.encoder names it)") from None
    path = other.recorded_path(info, "encoder")
    if path is None:
        raise CfirError(f"{other.index_json}: records no index encoder; point index.encoder at a model directory")
    return path


def other_workdir(config) -> Layout | None:
    """The workdir index.encoder names, when it names one (an index.json there, no model manifest), else None."""
    enc = config.index.encoder
    if not enc or enc == "pretrain":
        return None
    path = Path(enc)
    if (path / "manifest.json").is_file() or not (path / "index.json").is_file():
        return None
    return Layout.of(path)


def other_model(config) -> Path | None:
    """The text-trained model (W/model) of the workdir index.encoder names, when it has one: retrieval scores queries
    with it when this workdir trains none (`retrieve.stores`)."""
    other = other_workdir(config)
    if other is None or not (other.model / "manifest.json").is_file():
        return None
    return other.model


def encoder_tokenizer(config) -> Path | None:
    """The tokenizer that goes with an encoder taken from another workdir: the one its corpus ships (a synthetic
    world's), unless the config names one (`tokenizer`, BEiT-3's beit3.spm); None otherwise."""
    other = other_workdir(config)
    if config.tokenizer or other is None:
        return None
    spm = other.corpus / "tokenizer.spm"
    return spm if spm.is_file() else None


def text_positions(config, layout: Layout) -> int:
    """max_text_positions of the encoder when it already exists (its own, whatever the config says), else the
    config's (the model the 'pretrain' stage will create)."""
    # why: flax loads when a model is opened, not on import
    from cfir_jax.model import checkpoint

    path = encoder_dir(config, layout)
    if path is not None and (path / "manifest.json").is_file():
        return int(checkpoint.read_model_manifest(path)["model_config"]["max_text_positions"])
    return int(config.model.max_text_positions)


def load_encoder(config, layout: Layout):
    # why: flax loads when a model is opened, not on import
    from cfir_jax.model import checkpoint

    path = encoder_dir(config, layout)
    if path is None:
        raise CfirError("no encoder: set --config.index.encoder=MODEL_DIR (python -m cfir_jax.model.convert "
                        "--checkpoint beit3_base_itc_patch16_224.pth ...) or 'pretrain' for synthetic corpora")
    return checkpoint.load_model(path, config.model)


def entity_encoder(config, layout: Layout, corpus):
    """The frozen text encoder for entity texts (16 tokens), and its fingerprint."""
    # why: flax loads when a model is opened, not on import
    from cfir_jax.model import checkpoint
    from cfir_jax.model.text_encoder import TextEncoder

    model = load_encoder(config, layout)
    check_text_lengths(config, INDEX_TEXT_LENGTHS[:1], model.config.max_text_positions)
    ei = config.index.entity_index
    encoder = TextEncoder(model, resolve_tokenizer(config, corpus), ei.max_text_len, ei.encode_batch)
    return encoder, checkpoint.fingerprint(model, "text")


def scann_config(config):
    ei = config.index.entity_index
    return ScannConfig(num_leaves=ei.num_leaves or None, num_leaves_to_search=ei.num_leaves_to_search or None,
                       reorder=ei.reorder or None, min_rows_for_tree=ei.min_rows_for_tree)


def check_cache_encoder(config, layout: Layout, cache) -> None:
    """Entity texts and images must come from one model: a cache encoded by another model is refused (one line)."""
    # why: flax loads when a model is opened, not on import
    from cfir_jax.model import checkpoint

    if cache.manifest.get("source") == "model":  # imported embeddings carry no model fingerprint to compare
        vision = checkpoint.read_model_manifest(encoder_dir(config, layout))["vision_fingerprint"]
        check_manifest(cache.manifest, cache.path, fingerprint=vision)


def encoder_stage(run: StageRun) -> str:
    """The encoder stage: the summary of the model the index encodes text with. Synthetic worlds
    (index.encoder='pretrain') train it on captions first, through `run.pretrain` (the caption pretraining of
    `cfir_jax.training.pretrain`, which the index command passes in), unless W/encoder is already there."""
    # why: flax loads when a model is opened, not on import
    from cfir_jax.model import checkpoint

    config, layout = run.config, run.layout
    if config.index.encoder != "pretrain":
        path = encoder_dir(config, layout)
        if path is None:
            if config.index.image_cache.precomputed:
                raise CfirError("index.encoder is empty: set it to a converted BEiT-3 model directory, or 'pretrain'")
            return "-"
        return checkpoint.model_summary(checkpoint.read_model_manifest(path))
    try:
        return checkpoint.model_summary(checkpoint.read_model_manifest(layout.encoder))
    except CfirError:
        pass
    if run.pretrain is None:
        raise CfirError("index.encoder='pretrain' trains W/encoder on captions: build with index.py (its command, "
                        "cfir_jax.commands.build, runs the caption pretraining)")
    run.pretrain(config, layout)
    return checkpoint.model_summary(checkpoint.read_model_manifest(layout.encoder))


# A configured model, or W/encoder trained once by the caption pretraining (its stage keeps it).
declare(Stage("encoder", build=Build(encoder_stage, str,
                                     path=lambda run: encoder_dir(run.config, run.layout) or run.layout.encoder)))
