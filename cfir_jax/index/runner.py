"""index.py as a library: builds, in order, every store that training and retrieval read.

Stages (each writes one directory of the workdir layout, see cfir_jax.stores.layout):
  corpus        AToMiC parquet files -> the corpus format (tfds array_record, read with grain); or a synthetic world;
                or your own collection from plain files (index.corpus.source='files', cfir_jax/data/files.py)
  image_cache   every image encoded once by the frozen vision tower (or precomputed embeddings imported)
  image_cache_full  the same images re-encoded by the D-BEiT-3 Full model's trained vision tower (W/model_full, made
                by train.py with a :full config) into W/image_cache_full; built when W/model_full exists
  encoder       synthetic worlds only: the text tower trained on captions, standing in for BEiT-3's itc weights
  entities      spaCy NER over every document
  summaries     BART-large-CNN (or extractive) summary of every document
  entity_index  every entity text encoded by the frozen text tower, its top-K images by ScaNN (or exact search)
  image_text    beyond the paper: each cached image's own text embedded by the frozen text tower (fused SR);
                built when index.image_text.enabled or retrieval.fusion.w_txt != 0, skipped when no image has text
  entity_text_match  beyond the paper: per entity of the entity index, the images whose own text names it; built
                when index.entity_text_match.enabled or retrieval.entity_text_match, skipped when no image has text
  lexical       beyond the paper: BM25 over each cached image's own text (cfir_jax.index.lexical); built when
                index.lexical.enabled, skipped when no image has text

A stage is skipped when its store is complete and current (each stage module checks its own manifest), resumes
where it stopped when interrupted, and refuses stores built by another model. A closing table gives counts, size on
disk and time per stage.

Several hosts: run the same command on every host of a jax.distributed job (a TPU slice, a SLURM or MPI GPU job, or
JAX_COORDINATOR_ADDRESS / JAX_NUM_PROCESSES / JAX_PROCESS_ID set by hand), as train.py is run; the workdir, the
encoder and the corpus inputs must be on a file system every host sees. Every stage starts with all processes
together (`hosts.barrier`), so all agree whether it is current. The corpus is converted by process 0 alone while
the others wait (a format conversion, not model work); the image cache is split in contiguous shard ranges, the
entities, summaries, entity index and image text in chunks owned round-robin (`hosts.owns`); each process writes
its own shards or chunks into the shared work directory, and process 0 alone assembles and commits the store once
all exist, then every process opens it. spaCy also fans out over `index.entities.n_process` worker processes on
each host. Logs and the closing table come from process 0. When a host dies the others stop at their next barrier
(or by the runtime's heartbeat): restart the whole job; finished shards and chunks are reused, by whichever process
owns them now (another process count included).
"""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path

import ml_collections

from cfir_jax.core import hosts
from cfir_jax.core.config import INDEX_TEXT_LENGTHS, check_text_lengths
from cfir_jax.core.errors import CfirError
from cfir_jax.core.progress import shown
from cfir_jax.data import synthetic
from cfir_jax.data.corpus import Corpus
from cfir_jax.data.files import build_files_corpus
from cfir_jax.index import entity_index_build, entity_text_match, image_text, lexical, rebuild
from cfir_jax.index.candidate_search import resolve_backend
from cfir_jax.index.entities import build_entity_store, entity_extractor
from cfir_jax.index.entity_index_build import indexed_entities, texts_digest
from cfir_jax.index.index_encoder import (
    check_cache_encoder,
    encoder_dir,
    encoder_tokenizer,
    entity_encoder,
    load_encoder,
    scann_config,
    text_positions,
)
from cfir_jax.index.stage_report import StageReport, StageRunner, stale_reports
from cfir_jax.index.summaries import build_summary_store
from cfir_jax.model.tokenizer import resolve_tokenizer
from cfir_jax.nlp.entity_sources import categories_of, check_sources
from cfir_jax.nlp.summarizer import make_summarizer, summary_input
from cfir_jax.stores.contract import read_manifest
from cfir_jax.stores.entities import ENTITY_FORMAT_VERSION, EntityStore
from cfir_jax.stores.entity_index import VERSION, EntityIndex
from cfir_jax.stores.image_cache import ImageCache
from cfir_jax.stores.layout import Layout
from cfir_jax.stores.summaries import SUMMARY_FORMAT_VERSION, SummaryStore

# The caption pretraining of a synthetic world's encoder (config, layout) -> None: training, so it comes from train/.
Pretrain = Callable[[ml_collections.ConfigDict, Layout], None]

STAGES = ("corpus", "image_cache", "image_cache_full", "encoder", "entities", "summaries", "entity_index",
          "image_text", "entity_text_match", "lexical")


# ---------------------------------------------------------------------------------------------------------- stages


def build_corpus(config, layout: Layout):
    """The corpus stage: written by process 0 alone while the others wait (a format conversion, not model work:
    splitting it over hosts would buy little), then opened by every process."""
    if hosts.is_main():
        _write_corpus(config, layout)
    hosts.barrier("corpus_written")
    return Corpus.open(layout.corpus)


def _write_corpus(config, layout: Layout):
    c = config.index.corpus
    if c.source == "synthetic":
        return synthetic.generate(layout.corpus, synthetic.SyntheticConfig.named(c.synthetic_size, seed=c.seed))
    if c.source == "atomic":
        # why: pyarrow loads for an AToMiC build only
        from cfir_jax.data.atomic import build_atomic_corpus

        if not (c.texts and c.images and c.qrels):
            if layout.corpus.is_dir():
                return Corpus.open(layout.corpus)
            raise CfirError("AToMiC corpus: set --config.index.corpus.texts=..., .images=..., .qrels=... (local "
                            "copies of TREC-AToMiC/AToMiC-Texts-v0.2.1, AToMiC-Images-v0.2, AToMiC-Qrels-v0.2)")
        split = lambda s: [p for p in s.split(",") if p] if "," in s else s  # noqa: E731
        splits = tuple(p.strip() for p in c.splits.split(",") if p.strip())
        return build_atomic_corpus(split(c.texts), split(c.images), c.qrels, layout.corpus, setting=c.setting,
                                   splits=splits)
    if c.source == "files":
        return build_files_corpus(c.documents, c.images, c.qrels or None, layout.corpus,
                                  tokenizer_spm=encoder_tokenizer(config))
    raise CfirError(f"index.corpus.source={c.source!r}: use 'atomic', 'synthetic' or 'files'")


def build_image_cache(config, layout: Layout, corpus):
    # why: flax loads when a stage encodes, not when index.py reads STAGES to parse flags
    from cfir_jax.index.image_encoding import build_image_cache as build

    ic = config.index.image_cache
    if ic.precomputed:
        return build(layout.image_cache, corpus, precomputed=ic.precomputed, dtype=ic.dtype)
    model = load_encoder(config, layout)
    return build(layout.image_cache, corpus, model, batch_size=ic.batch_size, shard_size=ic.shard_size,
                 dtype=ic.dtype, compute_dtype=ic.compute_dtype)


def full_cache_wanted(layout: Layout, stages: tuple[str, ...]) -> bool:
    """Whether this run builds W/image_cache_full: when W/model_full exists; named in --stages without it, one line
    naming the command that trains it."""
    if "image_cache_full" not in stages:
        return False
    if (layout.model_full / "manifest.json").is_file():
        return True
    if stages != STAGES:
        raise CfirError(f"{layout.model_full}: no Full model to re-encode the images with; train it first: python "
                        f"train.py --config CONFIG:full --workdir {layout.root}")
    return False


def build_image_cache_full(config, layout: Layout, corpus):
    """W/image_cache_full: every image encoded by the Full model's own vision tower (the image cache's format and
    checks; its manifest records that tower's vision fingerprint). The model keeps its own sizes (a :full config may
    train at another image size than the index config's)."""
    # why: flax loads when a stage encodes, not when index.py reads STAGES to parse flags
    from cfir_jax.index.image_encoding import build_image_cache as build
    from cfir_jax.model import checkpoint

    ic = config.index.image_cache
    model = checkpoint.load_model(layout.model_full)
    return build(layout.image_cache_full, corpus, model, batch_size=ic.batch_size, shard_size=ic.shard_size,
                 dtype=ic.dtype, compute_dtype=ic.compute_dtype)


def encoder_stage(config, layout: Layout, pretrain: Pretrain | None) -> str:
    """The encoder stage: the summary of the model the index encodes text with. Synthetic worlds
    (index.encoder='pretrain') train it on captions first, through `pretrain` (the caption pretraining of
    `cfir_jax.train.pretrain`, which the index command passes in), unless W/encoder is already there."""
    # why: flax loads when a model is opened, not on import
    from cfir_jax.model import checkpoint

    if config.index.encoder != "pretrain":
        path = encoder_dir(config, layout)
        if path is None:
            if config.index.image_cache.precomputed:
                raise CfirError("index.encoder is empty: set it to a converted BEiT-3 model directory, or 'pretrain'")
            return "-"
        manifest = checkpoint.read_model_manifest(path)
        return checkpoint.model_summary(manifest)
    try:
        return checkpoint.model_summary(checkpoint.read_model_manifest(layout.encoder))
    except CfirError:
        pass
    if pretrain is None:
        raise CfirError("index.encoder='pretrain' trains W/encoder on captions: build with index.py (its command, "
                        "cfir_jax.commands.index, runs the caption pretraining)")
    pretrain(config, layout)
    return checkpoint.model_summary(checkpoint.read_model_manifest(layout.encoder))


def build_entities(config, layout: Layout, corpus):
    e = config.index.entities
    sources = check_sources(e.get("sources") or "spacy")
    extractor = entity_extractor(config)
    # Current only when computed from these very documents (their content, not just their number) by this NER, from
    # these sources (a plain spaCy store records none).
    if _current(layout.entities, "entities", ENTITY_FORMAT_VERSION, corpus_fingerprint=corpus.documents_fingerprint,
                labels=list(extractor.extractor.labels), sources=extractor.settings.get("sources")):
        return EntityStore.open(layout.entities)
    if sources != "spacy" and corpus.num_documents and not any(
            categories_of(corpus.document(i)) for i in range(min(corpus.num_documents, 1000))):
        raise CfirError(f"{corpus.path}: its documents carry no category names (index.entities.sources={sources!r}); "
                        "use --config.index.entities.sources=spacy or a corpus with AToMiC's category field")
    docs = ((corpus.doc_ids[i], extractor.item(doc.text, categories_of(doc)))
            for i in range(corpus.num_documents) for doc in (corpus.document(i),))
    build_entity_store(layout.entities, docs, extractor, num_docs=corpus.num_documents, chunk_size=e.chunk_size,
                       corpus_fingerprint=corpus.documents_fingerprint)
    return EntityStore.open(layout.entities)


def build_summaries(config, layout: Layout, corpus):
    s = config.index.summaries
    summary_input(corpus.document(0), s.fields)  # an unknown choice, or fields the corpus lacks: one line, now
    if _current(layout.summaries, "summaries", SUMMARY_FORMAT_VERSION, corpus_fingerprint=corpus.documents_fingerprint,
                summarizer=s.summarizer, input_fields=s.fields):
        return SummaryStore.open(layout.summaries)
    summarizer = make_summarizer(config)
    docs = ((corpus.doc_ids[i], summary_input(corpus.document(i), s.fields)) for i in range(corpus.num_documents))
    build_summary_store(layout.summaries, docs, summarizer, num_docs=corpus.num_documents, chunk_size=s.chunk_size,
                        input_fields=s.fields, corpus_fingerprint=corpus.documents_fingerprint)
    return SummaryStore.open(layout.summaries)


def build_entity_index(config, layout: Layout, corpus, entities, cache):
    encoder, fingerprint = entity_encoder(config, layout, corpus)
    check_cache_encoder(config, layout, cache)
    ei = config.index.entity_index
    texts = indexed_entities(config, corpus, entities)
    # What the index is derived from: the selected entity texts and this build of the image cache.
    sources = dict(documents=ei.documents, entities_sha=texts_digest(texts),
                   cache_fingerprint=cache.content_fingerprint)
    # 'auto' (the default): exact on a GPU or TPU, ScaNN on a CPU host. The manifest records the backend used and
    # the setting that chose it; an index is current when it was built with the backend this machine resolves to.
    backend = resolve_backend(ei.backend)
    if _current(layout.entity_index, "entity_index", VERSION, model_fingerprint=fingerprint, k_requested=ei.k,
                backend=backend, **sources):
        return EntityIndex.open(layout.entity_index, expect_fingerprint=fingerprint)
    # Each process encodes only the entity texts of the chunks it searches.
    entity_index_build.build_entity_index(
        layout.entity_index, texts, encoder.encode, cache.embeddings, ei.k, model_fingerprint=fingerprint,
        backend=backend, scann_config=scann_config(config), recall_sample=ei.recall_sample,
        chunk_size=ei.chunk_size, progress=_show_progress(), sources={**sources, "backend_setting": ei.backend})
    return EntityIndex.open(layout.entity_index, expect_fingerprint=fingerprint)


def image_text_wanted(config) -> bool:
    """Whether index.py builds W/image_text: asked for (index.image_text.enabled) or needed (fusion.w_txt != 0)."""
    return bool(config.index.image_text.enabled) or float(config.retrieval.fusion.w_txt) != 0.0


def build_image_text(config, layout: Layout, corpus, cache):
    """Stage image_text: None (skipped) when the corpus' images carry no text, else the opened store."""
    # why: flax loads when a model is opened, not on import
    from cfir_jax.model import checkpoint
    from cfir_jax.model.text_encoder import TextEncoder

    if not corpus.manifest.get("images_with_text"):
        return None
    it = config.index.image_text
    model = load_encoder(config, layout)
    check_cache_encoder(config, layout, cache)
    encoder = TextEncoder(model, resolve_tokenizer(config, corpus), it.max_text_len, it.encode_batch)
    return image_text.build_image_text(layout.image_text, corpus, cache, encoder, checkpoint.fingerprint(model, "text"),
                                       fields=tuple(it.fields), chunk_rows=it.chunk_rows, progress=_show_progress())


def entity_text_match_wanted(config) -> bool:
    """Whether index.py builds W/entity_text_match: asked for, or needed by retrieval.entity_text_match."""
    return bool(config.index.entity_text_match.enabled) or bool(config.retrieval.entity_text_match)


def build_entity_text_match(config, layout: Layout, corpus, cache):
    """Stage entity_text_match: None (skipped) when the corpus' images carry no text, else the opened store."""
    if not corpus.manifest.get("images_with_text"):
        return None
    m = config.index.entity_text_match
    return entity_text_match.build_entity_text_match(
        layout.entity_text_match, corpus, cache, EntityIndex.open(layout.entity_index), fields=tuple(m.fields),
        max_matches=m.max_matches, max_words=m.max_words, chunk_rows=m.chunk_rows, progress=_show_progress())


def _current(directory: Path, kind: str, version: int, **expected) -> bool:
    """Whether `directory` holds a complete store of this format whose manifest has the `expected` fields."""
    try:
        manifest = read_manifest(directory, kind, version)
    except CfirError:
        return False
    return all(manifest.get(k) == v for k, v in expected.items())


def _show_progress() -> bool:
    return shown()


# ------------------------------------------------------------------------------------------------------------ main


def build_index(config: ml_collections.ConfigDict, workdir: str | os.PathLike, stages: tuple[str, ...] = STAGES,
                log: Callable[[str], None] = print, pretrain: Pretrain | None = None) -> list[StageReport]:
    """Runs the stages in order (each skipped when current); returns the per-stage report. `pretrain` trains the
    synthetic world's encoder on captions (`cfir_jax.train.pretrain.pretrain_encoder`, passed by the index command).
    A rebuild of a built workdir runs in its staging directory and commits what it built as one version
    (`cfir_jax.index.rebuild`)."""
    unknown = set(stages) - set(STAGES)
    if unknown:
        raise CfirError(f"unknown stage(s) {sorted(unknown)}: choose from {', '.join(STAGES)}")
    layout = Layout.of(workdir)
    check_text_lengths(config, INDEX_TEXT_LENGTHS, text_positions(config, layout))
    layout.root.mkdir(parents=True, exist_ok=True)
    staged = rebuild.staged_layout(layout)
    reports = _run_stages(config, staged or layout, stages, log, pretrain)
    reports = rebuild.record(config, layout, staged, reports)
    hosts.barrier("index_done")
    return reports


# recipe: the stages in order, each a `run` of the stage runner
def _run_stages(config, layout: Layout, stages: tuple[str, ...], log: Callable[[str], None],
                pretrain: Pretrain | None) -> list[StageReport]:
    stages_run = StageRunner(log)
    run, reports = stages_run.run, stages_run.reports
    corpus = run("corpus", lambda: build_corpus(config, layout) if "corpus" in stages else Corpus.open(layout.corpus),
                 lambda c: f"{c.num_documents:,} documents, {c.num_images:,} images", layout.corpus)
    cache = run("image_cache", lambda: build_image_cache(config, layout, corpus) if "image_cache" in stages
                else ImageCache.open(layout.image_cache),
                lambda c: f"{c.num_images:,} x {c.dim} {c.dtype}, {c.manifest.get('num_skipped', 0)} skipped",
                layout.image_cache)
    if cache.dim != config.model.embed_dim:
        raise CfirError(f"{layout.image_cache}: embeddings have dim {cache.dim} but model.embed_dim is "
                        f"{config.model.embed_dim}")
    if full_cache_wanted(layout, stages):
        run("image_cache_full", lambda: build_image_cache_full(config, layout, corpus),
            lambda c: f"{c.num_images:,} x {c.dim} {c.dtype} by W/model_full's vision tower",
            layout.image_cache_full)
    if "encoder" in stages:
        run("encoder", lambda: encoder_stage(config, layout, pretrain), str,
            encoder_dir(config, layout) or layout.encoder)
    entities = run("entities", lambda: build_entities(config, layout, corpus) if "entities" in stages else None,
                   lambda s: "-" if s is None else f"{len(s.vocab):,} entities, {s.num_without_entities} docs without",
                   layout.entities)
    if "summaries" in stages:
        run("summaries", lambda: build_summaries(config, layout, corpus),
            lambda s: f"{s.num_docs:,} summaries ({config.index.summaries.summarizer})", layout.summaries)
    if "entity_index" in stages:
        if entities is None:
            entities = EntityStore.open(layout.entities, corpus_fingerprint=corpus.documents_fingerprint)
        run("entity_index", lambda: build_entity_index(config, layout, corpus, entities, cache),
            lambda ix: f"{len(ix):,} entities x K={ix.k}, recall@K {ix.manifest.get('recall_at_k')}",
            layout.entity_index)
    if "image_text" in stages and image_text_wanted(config):
        run("image_text", lambda: build_image_text(config, layout, corpus, cache),
            lambda t: "skipped: the corpus' images have no text" if t is None else
            f"{t.num_with_text:,} of {len(t.has_text):,} images with text", layout.image_text)
    if "entity_text_match" in stages and entity_text_match_wanted(config):
        run("entity_text_match", lambda: build_entity_text_match(config, layout, corpus, cache),
            lambda t: "skipped: the corpus' images have no text" if t is None else
            f"{t.manifest['num_pairs']:,} (entity, image) pairs, {t.manifest['entities_matched']:,} entities matched, "
            f"{t.manifest['too_common']:,} too common", layout.entity_text_match)
    if "lexical" in stages and lexical.lexical_wanted(config):
        run("lexical", lambda: lexical.build_stage(config, layout, corpus, cache, _show_progress()),
            lexical.stage_summary, layout.lexical)
    reports += stale_reports(layout, reports, STAGES)
    return reports
