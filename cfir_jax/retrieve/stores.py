"""Opening and checking a workdir's stores for retrieval, once, with a one-line refusal for each mismatch.

What a method reads: the corpus, the trained text model (or the index encoder when train.py has not run; the
document-trained model for the document baseline when train.py made one), the image cache built by that model's
vision tower, and for the entity methods the entity index built by the frozen index encoder over this very cache.
Then every store registered by its reader module (`cfir_jax.stores.readers`: the entity-text matches, the image-text
store, the lexical store) that the method or the configuration asks for, into `Stores.extra`. Each check names the
store and the fix; nothing is read twice. The cache's removed images become `Stores.live`, the rows every method may
return (`cfir_jax.search.live_rows`).
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

import ml_collections

from cfir_jax.core.config import RETRIEVAL_TEXT_LENGTHS, check_text_lengths
from cfir_jax.core.errors import CfirError
from cfir_jax.model.tokenizer import resolve_tokenizer
from cfir_jax.search.live_rows import LiveRows
from cfir_jax.stores import readers, versions
from cfir_jax.stores.contract import check_derived
from cfir_jax.stores.entity_index import EntityIndex
from cfir_jax.stores.image_cache import ImageCache
from cfir_jax.stores.layout import Layout


@dataclasses.dataclass
class Stores:
    """The opened stores and encoders of one workdir, for one method."""

    layout: Layout
    corpus: Any  # cfir_jax.data.corpus.Corpus
    cache: Any  # cfir_jax.stores.image_cache.ImageCache
    model: Any  # the text model scoring queries
    model_manifest: dict
    tokenizer: Any
    query_encoder: Any  # TextEncoder at retrieval.max_text_len
    doc_encoder: Any  # TextEncoder of whole documents (dense_document)
    document_model: bool  # the document-trained model (train.text=document) encodes the documents
    full: bool  # D-BEiT-3 Full (W/model_full, retrieval.model="full") scores the queries over its own image cache
    untrained: bool  # no trained model: the index encoder scores queries
    trained_text: str  # what the model was trained on: "summary" or "document"
    entity_index: Any = None  # EntityIndex (cfir, entity_only)
    entity_encoder: Any = None  # TextEncoder of entities (the frozen index encoder)
    encoder_fingerprint: str | None = None  # the index encoder's text tower
    # the stores opened on request, by name (entity_text_match, image_text, lexical: cfir_jax.stores.readers)
    extra: dict[str, Any] = dataclasses.field(default_factory=dict)
    model_dir: Path | None = None  # the model that encodes queries (named when its embeddings are impossible)
    encoder_dir: Path | None = None  # the index encoder that encodes unseen entities
    version: int = 0  # the workdir's version the stores were opened at (index.json; cfir_jax.stores.versions)
    live: LiveRows = dataclasses.field(default_factory=LiveRows)  # the rows a query may return (not removed)
    duplicates: Any = None  # W/duplicates, opened by the first folded search (cfir_jax.retrieve.duplicates)

    @property
    def embeddings(self):
        return self.cache.embeddings


def read_index_json(layout: Layout) -> dict:
    if not layout.index_json.is_file():
        raise CfirError(f"{layout.root}: incomplete index (no index.json); run index.py to finish it")
    try:
        return json.loads(layout.index_json.read_text())
    except (UnicodeDecodeError, json.JSONDecodeError):
        raise CfirError(f"{layout.index_json}: unreadable; run index.py again") from None


def open_stores(config: ml_collections.ConfigDict, workdir, method) -> Stores:
    """Opens what `method` (`cfir_jax.retrieve.methods`) reads: the document-trained model when it encodes the
    document and train.py made one (`reads_document()`), the entity index and its encoder (`uses_entities`), and the
    stores it or the configuration asks for (`open_asked`).
    They are opened under `versions.reading`: all of one version (`Stores.version`)."""
    layout = Layout.of(workdir)
    if not layout.root.is_dir():
        raise CfirError(f"{layout.root}: no index here (missing directory); build it with index.py")
    with versions.reading(layout) as version:  # every store of one version, none of a change being committed
        stores = _open(config, layout, method.reads_document(), method.uses_entities)
        open_asked(config, method, stores)
    stores.version = version
    return stores


def open_asked(config, method, stores) -> None:
    """Opens into `stores.extra` every registered store (`cfir_jax.stores.readers`) that `method` or `config` asks
    for, each checked against the stores opened before it."""
    for reader in readers.optional():
        if reader.asked(config, method):
            stores.extra[reader.name] = reader.open_for(stores)


def opened(stores, name: str):
    """The registered store `name` as `open_asked` opened it, or opened now with the same checks."""
    return stores.extra[name] if name in stores.extra else readers.get(name).open_for(stores)


def _open(config, layout: Layout, reads_document: bool, entities: bool) -> Stores:
    # why: tfds and grain load when a corpus is opened, not on import
    from cfir_jax.data.corpus import Corpus
    from cfir_jax.model import checkpoint

    index_info = read_index_json(layout)
    corpus = Corpus.open(layout.corpus)
    encoder_dir = layout.recorded_path(index_info, "encoder")
    full = _check_model_choice(config, layout)
    # index.encoder named another workdir: its text-trained model, recorded with its fingerprints
    other_model = layout.recorded_path(index_info, "model", config_key="encoder")
    model_dir, document_model, untrained = _model_dir(layout, encoder_dir, reads_document, full, other_model)
    # A Full model keeps its own sizes (its :full config may train at another image size than the workdir's).
    model = checkpoint.load_model(model_dir, None if full else config.model)
    check_text_lengths(config, RETRIEVAL_TEXT_LENGTHS, model.config.max_text_positions)
    model_manifest = checkpoint.read_model_manifest(model_dir)
    cache = _open_cache(config, layout, model, model_dir, model_manifest, full)
    stores = _with_encoders(config, layout, corpus, cache, model, model_manifest, document_model, full, untrained)
    stores.model_dir, stores.encoder_dir = Path(model_dir), Path(encoder_dir) if encoder_dir else Path(model_dir)
    # Removed images: never returned by any method; a filtered call narrows them in its own LiveRows, an argument of
    # the scoring (cfir_jax.search.live_rows).
    stores.live = LiveRows.of(cache)
    if entities:
        _open_entity_index(config, stores, encoder_dir)
    return stores


def _check_model_choice(config, layout: Layout) -> bool:
    """Whether retrieval.model asks for the Full model (refused in one line when it is unknown or not trained)."""
    choice = config.retrieval.model  # '' or 'full' (cfir_jax.core.config_check)
    if choice == "full" and not (layout.model_full / "manifest.json").is_file():
        raise CfirError(f"{layout.model_full}: no Full model; train it with python train.py --config CONFIG:full "
                        f"--workdir {layout.root}")
    return choice == "full"


def _model_dir(layout: Layout, encoder_dir: Path | None, reads_document: bool, full: bool,
               other_model: Path | None = None) -> tuple[Path, bool, bool]:
    """(the model that scores queries, whether it is the document-trained one, whether it is the untrained index
    encoder). `other_model`: the text-trained model of the workdir index.encoder named, used when W has none."""
    if full:
        return layout.model_full, False, False
    # The document baseline of the paper (Table 3): a model trained on documents at 64 tokens, when train.py
    # made one (train.text=document); every method that encodes the document uses it.
    if reads_document and (layout.model_document / "manifest.json").is_file():
        return layout.model_document, True, False
    if (layout.model / "manifest.json").is_file():
        return layout.model, False, False
    if other_model is not None:
        return other_model, False, False
    if encoder_dir is None:
        raise CfirError(f"{layout.root}: no trained model (run train.py) and no index encoder")
    return encoder_dir, False, True


def cache_path(config, layout: Layout) -> Path:
    """The image cache retrieval reads: retrieval.image_cache (an absolute name stays itself), else the own tower's
    (the Full model's with retrieval.model="full")."""
    own = layout.image_cache_full if config.retrieval.model == "full" else layout.image_cache
    named = config.retrieval.image_cache
    return layout.root / named if named else own


def _open_cache(config, layout: Layout, model, model_dir: Path, model_manifest: dict, full: bool):
    """The image cache retrieval.image_cache names (default: the model's own tower's), refused in one line when
    another vision tower built it: both fingerprints and the command that builds the right cache. Imported
    embeddings carry no fingerprint: they stand for the frozen tower, never for a Full model's."""
    own, path = layout.image_cache_full if full else layout.image_cache, cache_path(config, layout)
    if full and not (path / "manifest.json").is_file() and path == own:
        raise CfirError(f"{own}: no image cache of the Full model's vision tower; build it with python index.py "
                        f"--config CONFIG --workdir {layout.root} --stages image_cache_full")
    cache = ImageCache.open(path, expect_dim=model.config.embed_dim)
    want = model_manifest["vision_fingerprint"]
    if cache.fingerprint != want and (full or not cache.fingerprint.startswith("precomputed:")):
        stage = "image_cache_full" if full else "image_cache"
        raise CfirError(f"{path}: image cache built by the vision tower {cache.fingerprint} but the model {model_dir} "
                        f"has the vision tower {want}: use {own} (python index.py --config CONFIG --workdir "
                        f"{layout.root} --stages {stage}) or the model of that cache")
    return cache


def _with_encoders(config, layout, corpus, cache, model, model_manifest, document_model, full, untrained) -> Stores:
    """The query encoder (retrieval.max_text_len tokens) and the document encoder: up to the positions the model
    has with the summary-trained model; a model trained on documents (the document-trained one, the Full model)
    reads them as it was trained."""
    # why: flax loads when a model is opened, not on import
    from cfir_jax.model.text_encoder import TextEncoder

    rcfg = config.retrieval
    tokenizer = resolve_tokenizer(config, corpus)
    doc_len = model.config.max_text_positions - 2
    if document_model or full:
        doc_len = int(model_manifest.get("train_max_text_len") or rcfg.max_text_len)
    trained = model_manifest.get("train_text") or ("document" if document_model or full else "summary")
    return Stores(layout, corpus, cache, model, model_manifest, tokenizer,
                  query_encoder=TextEncoder(model, tokenizer, rcfg.max_text_len, batch_size=32),
                  doc_encoder=TextEncoder(model, tokenizer, doc_len, batch_size=8),
                  document_model=document_model, full=full, untrained=untrained, trained_text=trained)


def _open_entity_index(config, stores: Stores, encoder_dir: Path | None) -> None:
    """The entity index, refused when built by another encoder, over another cache or another number of images."""
    # why: flax loads when a model is opened, not on import
    from cfir_jax.model import checkpoint
    from cfir_jax.model.text_encoder import TextEncoder

    layout, cache, model = stores.layout, stores.cache, stores.model
    enc_model = checkpoint.load_model(encoder_dir, config.model) if encoder_dir else model
    check_text_lengths(config, RETRIEVAL_TEXT_LENGTHS[1:], enc_model.config.max_text_positions)
    stores.encoder_fingerprint = checkpoint.fingerprint(enc_model, "text")
    # retrieval.k cuts every stored list to its first k (0: as built); above the built K is refused.
    index = EntityIndex.open(layout.entity_index, expect_fingerprint=stores.encoder_fingerprint,
                             expect_dim=model.config.embed_dim).with_k(config.retrieval.k)
    if index.manifest.get("n_images") not in (None, cache.num_images):
        raise CfirError(f"{layout.entity_index}: built over {index.manifest['n_images']} images "
                        f"but the cache has {cache.num_images}: rebuild the entity index")
    if "cache_fingerprint" in index.manifest:
        check_derived(index.manifest, layout.entity_index, cache_fingerprint=cache.content_fingerprint)
    stores.entity_index = index
    stores.entity_encoder = TextEncoder(enc_model, stores.tokenizer, config.index.entity_index.max_text_len, 16)
