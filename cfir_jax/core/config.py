"""The config tree under every experiment in `configs/*.py`: model sizes, sections and their non-experiment defaults.

Every config is an `ml_collections.ConfigDict` with sections `model`, `mesh`, `index`, `train`, `retrieval`, `serve`,
`entity_workers`.
`defaults()` fills in what is not a choice of the experiment (architecture facts, engineering knobs) and leaves each
experiment choice a typed placeholder; `configs/base.py` sets them (the paper's CFIR), `configs/large.py` and
`configs/demo.py` start from it. `serve` is `cfir_jax.core.config_serve`'s, `entity_workers` `config_workers`'s.
`cfir_jax.core.variants.parse_arg` reads the variant after the colon (`configs/base.py:384,runlocal`);
`cfir_jax.core.config_check.check` checks each section once, where a config is loaded.
"""

from __future__ import annotations

from collections.abc import Sequence

import ml_collections
from ml_collections import config_dict

from cfir_jax.core.config_serve import serve_config
from cfir_jax.core.config_workers import entity_workers_config
from cfir_jax.core.errors import CfirError
from cfir_jax.core.languages import languages_config

# BEiT-3's sizes. Head dim is 64 for both; the text vocabulary has 64010 rows (64002 used, padded).
MODEL_SIZES = {
    "tiny": dict(embed_dim=64, num_layers=2, num_heads=4, ffn_dim=256),
    "base": dict(embed_dim=768, num_layers=12, num_heads=12, ffn_dim=3072),
    "large": dict(embed_dim=1024, num_layers=24, num_heads=16, ffn_dim=4096),
}

# AToMiC's image-side text columns, what an image says about itself: defined here, on the floor, once; the AToMiC
# reader (cfir_jax.data.atomic.CAPTION_FIELDS), the synthetic world and the image-text store take them from here.
IMAGE_TEXT_FIELDS = ("caption_reference_description", "caption_alt_text_description", "caption_attribution_description")


def model_config(size: str = "base", image_size: int = 224, **overrides) -> ml_collections.ConfigDict:
    """The `model` section: architecture, precision and compilation switches."""
    cfg = ml_collections.ConfigDict(
        dict(
            **MODEL_SIZES[size],
            vocab_size=64010,
            image_size=image_size,
            patch_size=16,
            in_chans=3,
            max_text_positions=1024,
            layernorm_eps=1e-5,
            # Regularisation, active only when a dropout rng is passed (training).
            dropout=0.0,
            drop_path_rate=0.0,
            # Compute dtype (activations, matmuls); parameters stay in param_dtype.
            dtype="float32",
            param_dtype="float32",
            # jax.lax.scan over the stacked layers: one compiled layer (fast compiles for 24 layers).
            scan_layers=True,
            # Rematerialise each layer in the backward pass (activation memory / compute trade).
            remat=False,
            # What a rematerialised layer keeps for the backward pass: "nothing" (only its input; every op is
            # recomputed) or "projections" (the outputs of its six weight matmuls; the attention scores, softmax,
            # GELU, LayerNorms and dropout are recomputed).
            remat_policy="nothing",
        )
    )
    cfg.update(overrides)
    return cfg


# CFIR's trainable set: every B (language) branch, the B position table and final LayerNorm, the
# language head and the temperature. The token embedding table and the whole vision side stay frozen.
LANGUAGE_EXPERT = [("B/.*|language_head/.*|logit_scale", "train"), (".*", "frozen")]
# The authors' `--tune_text_only` (GLA-IR/CFIR): the token embedding table, the language branch of every feed-forward
# block (its pre-FFN LayerNorm `final_layer_norm`, fc1, the inner `ffn_layernorm`, fc2); attention, positions, the
# head and the temperature stay frozen. 105,921,024 parameters at base (tests/unit/model/test_model.py), the
# paper's count is the language expert's.
AUTHORS_TEXT_ONLY = [("text_embed/embedding|B/layers/(final_layer_norm|fc1|ffn_layernorm|fc2)/.*", "train"),
                     (".*", "frozen")]
# D-BEiT-3 Full (the paper's whole-model fine-tuning baseline): both experts, both heads, the temperature, the patch
# embedding with its CLS token, the token embedding table. Only BEiT-3's masked-image-modelling `mask_token` stays:
# retrieval never reads it (the reference's AdamW skips it, having no gradient, so it never moves there either).
FULL = [("vision_embed/mask_token", "frozen"), (".*", "train")]
# `train.trainable` is one of these names or a rule list of its own.
TRAINABLE_SETS = {"language_expert": LANGUAGE_EXPERT, "authors": AUTHORS_TEXT_ONLY, "full": FULL}
# No weight decay on biases, LayerNorm scales, position tables, the temperature.
NO_WEIGHT_DECAY = r".*/bias|.*/scale|.*embed_positions|logit_scale|.*cls_token|.*mask_token"


def _experiment(kind: type) -> ml_collections.FieldReference:
    """A field the experiment config (configs/*.py) must set: typed, None until set."""
    return config_dict.placeholder(kind)


def train_config(runlocal: bool = False) -> ml_collections.ConfigDict:
    """The `train` section: how training runs; the recipe itself (placeholders here) is set by configs/base.py."""
    return ml_collections.ConfigDict(
        dict(
            text=_experiment(str),  # 'summary' (CFIR), 'document' (ablation) or 'caption' (image-text pretraining)
            # Where the image side comes from: 'cache' (CFIR: the frozen cache's embeddings, only the text tower on
            # the accelerators) or 'pixels' (D-BEiT-3 Full: the whole model, each batch's images encoded by the
            # vision expert in the step; cfir_jax/training/full_step.py).
            images="cache",
            # images='pixels': grain worker processes decoding and augmenting the images (0: in the training
            # process; the batches are the same for any count, cfir_jax/data/image_pipeline.py).
            image_workers=0,
            # images='pixels': BEiT-3's RandAugment(2, 7) after the crop and flip (its retrieval fine-tuning passes
            # --randaug); False is crop and flip alone, as the authors' command (no --randaug, retrieval.py:102).
            randaug=True,
            # The document fields of text='document' (cfir_jax.data.corpus.document_text): a tuple of AToMiC's text
            # fields in order, or 'all' (the whole assembled text).
            document_fields=_experiment(object),
            max_text_len=_experiment(int),
            global_batch=_experiment(int),
            num_epochs=_experiment(float),
            num_steps=0,  # > 0 overrides num_epochs
            lr=_experiment(float),
            min_lr=_experiment(float),
            warmup_epochs=_experiment(float),  # linear warmup from 0, in epochs of the pairs (-> steps in the trainer)
            warmup_steps=0,  # > 0 overrides warmup_epochs
            weight_decay=_experiment(float),  # decoupled (AdamW), masked by no_weight_decay
            b1=_experiment(float),
            b2=_experiment(float),
            eps=_experiment(float),
            layer_decay=_experiment(float),  # lr of layer j scaled by layer_decay ** (L + 1 - j)
            # A name of TRAINABLE_SETS ('language_expert', 'authors') or (regex over parameter paths,
            # 'train' | 'frozen') pairs, first match wins.
            trainable=_experiment(object),
            no_weight_decay=NO_WEIGHT_DECAY,
            grad_clip=0.0,
            extra_negatives=0,  # extra cache images per batch as negatives (text->image side only)
            negatives="random",  # 'random' or 'hard' (entity candidates of the document)
            grad_accum_steps=1,  # > 1: exact full-batch gradient in micro-batches (gradient caching)
            seed=0,
            log_every=1 if runlocal else 50,
            eval_every=4 if runlocal else 1000,
            eval_batch=64 if runlocal else 1024,
            checkpoint_every=4 if runlocal else 1000,
            keep_checkpoints=3,
            async_checkpoints=True,
            tensorboard=True,
            init_model="",  # model directory (python -m cfir_jax.model.convert ...); empty: random init
            export_model="",  # where the exported model takes its vision tower from: a model dir or 'scratch'
        )
    )


# Logical axis names of the model's parameters (`model.axes`) -> mesh axis or None (replicated), in priority order
# as MaxText's logical_axis_rules. Base replicates (87M trained parameters fit anywhere). Large is FSDP: FFN
# weights split on 'mlp' (4096), everything else on 'embed' (1024); both divide by any power-of-two fsdp size,
# the vocabulary (64010 rows) does not, so the token table is split on its 'embed' axis.
REPLICATED_RULES = [("layers", None), ("embed", None), ("heads", None), ("mlp", None), ("vocab", None),
                    ("positions", None), ("joint", None)]
FSDP_RULES = [("mlp", "fsdp"), ("embed", "fsdp")] + [(n, None) for n, _ in REPLICATED_RULES
                                                    if n not in ("mlp", "embed")]


def mesh_config(size: str) -> ml_collections.ConfigDict:
    """The `mesh` section: ('data', 'fsdp') axis sizes and the logical -> mesh axis rules of the parameters."""
    fsdp_large = size == "large"
    return ml_collections.ConfigDict(
        dict(
            data=1 if fsdp_large else -1,
            fsdp=-1 if fsdp_large else 1,
            logical_axis_rules=list(FSDP_RULES if fsdp_large else REPLICATED_RULES),
        )
    )


# recipe: over 60 lines, read top to bottom: a single ConfigDict literal, one commented setting a line.
def index_config(runlocal: bool = False) -> ml_collections.ConfigDict:
    """The `index` section: where the corpus comes from and how each offline stage runs."""
    return ml_collections.ConfigDict(
        dict(
            corpus=dict(
                # 'atomic' (local parquet files in the HF layout), 'synthetic', or 'files' (your own collection:
                # documents, images and optional qrels from plain files, cfir_jax/data/files.py, docs/collection.md)
                source="atomic",
                texts="",  # AToMiC-Texts-v0.2.1 directory (or parquet files, comma-separated)
                images="",  # AToMiC-Images-v0.2 directory; files: a directory tree of images or .jsonl/.parquet
                qrels="",  # AToMiC-Qrels-v0.2 directory; files: a directory of <split>.qrels (optional)
                documents="",  # files: a .jsonl or .parquet of rows id, text, [title, metadata fields]
                setting=_experiment(str),  # small | base | large (AToMiC's settings: see cfir_jax/data/atomic.py)
                # Qrels splits whose topics are the documents; in the small setting also the splits whose judged
                # images form the collection (AToMiC's small setting of one split: splits="test").
                splits=_experiment(str),
                synthetic_size="default",  # 'tiny' or 'default' (synthetic source)
                synthetic_languages="",  # synthetic source: shares of other languages, 'fr:0.15,id:0.1' (English: '')
                seed=0,
            ),
            # The frozen encoder: a model directory (python -m cfir_jax.model.convert on beit3_*_itc_patch16_224.pth),
            # 'pretrain' (synthetic worlds: train the text tower on captions first, see configs/demo.py), or another
            # workdir: the index encoder its index.json records (and its corpus' tokenizer when it ships one).
            encoder="",
            image_cache=dict(
                precomputed="",  # '' encode with the encoder; 'corpus' or a .npy/.parquet of embeddings to import
                dtype="float16",
                compute_dtype="float32",
                batch_size=64 if runlocal else 256,
                shard_size=65536,
            ),
            # labels: "all", "picturable" or a tuple (entities.resolve_labels); chunk_size: documents per resumable
            # chunk (the unit split over the hosts of a jax.distributed run); its processes: entity_workers.index
            # sources: "spacy" (the named entities of the text, the paper's), "spacy+categories" (plus the section's
            # category names, as the paper's Figure 7 shows) or "categories" (cfir_jax.nlp.entity_sources)
            entities=dict(spacy_model="", batch_size=64, labels=_experiment(object), chunk_size=10_000,
                          sources=_experiment(str)),
            summaries=dict(
                summarizer=_experiment(str),  # 'bart' (facebook/bart-large-cnn, CFIR) or 'extractive'
                # What is summarised (nlp.summarizer.SUMMARY_INPUTS): 'paper' = page title, section title, page and
                # section descriptions joined with spaces; 'authors' = those plus the section's category, media and
                # hierachy lists, as the authors' released code feeds BART.
                fields=_experiment(str),
                bart_model=_experiment(str),
                max_length=_experiment(int),
                min_length=_experiment(int),
                num_beams=_experiment(int),
                length_penalty=_experiment(float),
                no_repeat_ngram_size=_experiment(int),
                max_input_tokens=_experiment(int),
                batch_size=8,  # rows per generation call and device (data parallel over a host's devices)
                dtype="float32",  # BART's compute dtype: float32 (the paper) or bfloat16 (docs/real-size.md)
                extractive_tokens=64,
                chunk_size=1_000,  # documents per resumable chunk (the unit split over hosts)
            ),
            entity_index=dict(
                k=_experiment(int),  # candidates per entity
                # 'auto': exact where a GPU or TPU is present, ScaNN on CPU hosts (candidate_search.resolve_backend;
                # the manifest records the backend used and this setting); 'exact' (the paper's exact top-K,
                # blocked matmul + top_k, on the devices when present) or 'scann' (approximate, for CPU hosts).
                backend="auto",
                max_text_len=_experiment(int),
                encode_batch=256,
                num_leaves=0,  # 0: derived from the number of images
                num_leaves_to_search=0,
                reorder=0,
                min_rows_for_tree=2000,  # fewer images: no partition tree, AH over all of them
                # Whose entities are indexed: 'train' (the paper: the train qrels' documents; test entities it never
                # saw are unknown at query time) or 'all' documents (the test split then leaks into the index).
                documents=_experiment(str),
                recall_sample=256,
                chunk_size=4096,  # entities encoded and searched per resumable chunk (the unit split over hosts)
            ),
            # Beyond the paper: every cached image's own text (AToMiC's caption fields) embedded by the
            # frozen text tower into W/image_text, for retrieval.fusion. Built when enabled or when
            # retrieval.fusion.w_txt != 0; skipped (and said) when the corpus' images have no text.
            image_text=dict(enabled=False, fields=IMAGE_TEXT_FIELDS, max_text_len=64, encode_batch=256,
                            chunk_rows=65536),
            # Beyond the paper: for every entity of the entity index, the images whose own text names it (whole
            # words, case-folded) into W/entity_text_match. Built when enabled or when retrieval.entity_text_match;
            # a name in more than max_matches images' text is left out (it says little about any one of them).
            entity_text_match=dict(
                enabled=False,
                fields=IMAGE_TEXT_FIELDS,
                max_matches=1000,
                max_words=8,
                chunk_rows=65536,
            ),
            # Beyond the paper: BM25 over every cached image's own text into W/lexical (cfir_jax.stores.lexical:
            # bm25s's scores, its splitter and English stop words, PyStemmer's `stemmer`, '' for none), for the
            # methods bm25, cfir_bm25 and cfir_bm25_fused. Built when enabled; skipped when no image has text. A files
            # collection's `caption` is kept as the first field. method: robertson | lucene | atire.
            lexical=dict(
                enabled=False,
                fields=IMAGE_TEXT_FIELDS,
                method="robertson",
                k1=1.2,
                b=0.75,
                stemmer="english",
            ),
            # The images' own fields (W/image_fields, docs/filters.md): the IANA zone ('UTC', 'America/New_York') a
            # date without an offset is read in, in the rows and the filters; a change rebuilds W/image_fields.
            fields=dict(timezone="UTC"),
            # Beyond the paper: images at cosine >= threshold grouped into W/duplicates (docs/duplicates.md)
            duplicates=dict(threshold=0.98, neighbours=8, max_neighbours=256, backend="auto"),
            # Each document's and caption's language and what it gets (NER, stemmer, summarizer): docs/languages.md.
            languages=languages_config(),
        )
    )


# recipe: over 60 lines, read top to bottom: a single ConfigDict literal, one commented setting a line.
def retrieval_config() -> ml_collections.ConfigDict:
    """The `retrieval` section (CFIR's ER + SR stages)."""
    return ml_collections.ConfigDict(
        dict(
            top_k=_experiment(int),
            # Candidates per entity read from the index (a query-time cut of its best-first lists, Table 4's K);
            # 0: as built (index.entity_index.k). Above the built K is refused.
            k=0,
            # The model that scores queries: '' (the text-trained W/model, W/model_document for document text, else
            # the index encoder) or 'full' (D-BEiT-3 Full, W/model_full: both towers trained).
            model="",
            # The image cache it searches: '' (its own tower's: W/image_cache_full for 'full', else W/image_cache) or
            # a store directory (in W, or a path). A cache built by another vision tower is refused in one line.
            image_cache="",
            # The summary of a query document: '' (index.summaries' summarizer, the paper: BART) or 'extractive'
            # (its leading sentences at query time, while the index keeps BART's; a cheaper option, docs/real-size.md)
            summarizer="",
            text=_experiment(str),  # the query text scored in SR: 'summary' (CFIR) or 'document'
            # The document fields a document embedding reads (the document-only and entities + document rows):
            # as train.document_fields; None (configs written before it existed) is 'all'.
            document_fields=_experiment(object),
            max_text_len=_experiment(int),
            # 'ignore' (the paper, and --compare's paper rows) or 'search' (the authors' code searches the test
            # documents' entities directly; here over the cache at query time)
            unknown_entities=_experiment(str),
            # SR over the union: 'exact' (the paper: every candidate scored in float32) or 'fast' (compact int8 copy,
            # then an exact re-rank of the best sr_shortlist; ~16x faster at 4M images, top-1000 agreement ~0.9998).
            sr=_experiment(str),
            eval_sr=_experiment(str),  # what --evaluate / --qrels use; 'fast' reports its measured agreement with exact
            # The metric of --evaluate / --qrels (retrieve.py --measures): 'trec_eval' (per text, trec_eval -c: a
            # judged topic without hits scores 0; the default), 'trec_eval_no_c' (the mean over topics with hits
            # only, trec_eval without -c), 'authors' (the authors' code: per qrels line, chunk means;
            # cfir_jax.eval.metrics.authors_measures) or 'both' (the authors' figures printed under trec_eval -c's).
            measures="trec_eval",
            sr_shortlist=2560,  # candidates re-scored exactly after the compact pass
            sr_compact_dims=128,
            # 'device': the cache resident on the local devices, jitted exact SR over batches
            # (cfir_jax.search.device_sr); 'cpu': the two-pass numpy scorer (cfir_jax.search.cpu_sr);
            # 'auto': device when a GPU or TPU is present.
            sr_backend="auto",
            sr_device_dtype="float16",  # or 'bfloat16'
            sr_device_shard="auto",  # 'auto' (row-shard only when the cache does not fit one device), 'always', 'never'
            sr_buckets=(4096, 16384, 65536, 262144),  # union sizes compiled for (a union is padded to the next one)
            sr_query_batch=8,  # queries per device SR call
            batch_size=256,  # documents per batch in bulk retrieval (retrieve.py --queries / --evaluate)
            caption_cache=10000,  # (caption, url) pairs Retriever.describe_image keeps, least recently used out
            # Beyond the paper: SR scores a candidate by w_img * <q, image> + w_txt * <q, image text>
            # (W/image_text; images without text add 0). The default (1, 0) is the paper's SR. compare_w_txt: the
            # text weight of the fused row of --compare when w_txt is 0. alpha: the image's weight in the convex
            # fusion alpha * minmax(<q, image>) + (1 - alpha) * minmax(<q, image text>) over ER's union (method
            # cfir_text_convex); -1: the weight retrieve.py --fit-fusion fitted on the train split into W/convex_fusion.
            fusion=dict(w_img=1.0, w_txt=0.0, compare_w_txt=0.5, alpha=-1.0),
            # Beyond the paper: each known entity's candidates also include the images whose own text names it
            # (W/entity_text_match, cfir_jax.stores.entity_text_match).
            entity_text_match=False,
            # Beyond the paper: BM25 over the images' own text (W/lexical), the document as the query. top_k: BM25's
            # list (the bm25 method's answer, and what fusion reads). candidates: M, each document's top M BM25 images
            # joining CFIR's union (method cfir_bm25). fuse_weight: BM25's weight in the reciprocal-rank fusion
            # w_sr / (rrf_k + rank_sr) + fuse_weight / (rrf_k + rank_bm25) (method cfir_bm25_fused; SR's weight is 1;
            # chosen on the validation split, docs/retrieval.md). max_terms / max_postings: the query's rarest terms
            # read, and the postings read before no more terms are (0: all, exact BM25; cfir_jax.search.bm25).
            # alpha: SR's weight in the convex fusion alpha * minmax(SR) + (1 - alpha) * minmax(BM25) (method
            # cfir_bm25_convex); -1: the weight retrieve.py --fit-fusion fitted on the train split into W/convex_fusion.
            lexical=dict(top_k=1000, candidates=100, fuse_weight=1.0, rrf_k=60, max_terms=32, max_postings=2000000,
                         alpha=-1.0),
            # Beyond the paper: a third stage re-scores SR's top_n with a small list-wise head over features SR
            # throws away (cfir_jax.retrieve.reranker; fitted by retrieve.py --fit-reranker into W/reranker). Off by
            # default: the paper's SR order stands. top_n, max_text_len (the document's tokens for its embedding and
            # late interaction) and li_top (late interaction's mean of the best token similarities) define the
            # features, so a store answers only to the values it was fitted with; the rest is how it is fitted.
            rerank=dict(enabled=False, top_n=100, max_text_len=512, li_top=8, hidden=32, lr=3e-3, weight_decay=1e-4,
                        batch_lists=64, max_epochs=200, patience=15, heldout=0.1, max_train_docs=20000, seed=0),
        )
    )


# Text lengths (tokens per sequence, BOS and EOS included) that each command encodes with, by config key.
INDEX_TEXT_LENGTHS = ("index.entity_index.max_text_len", "index.pretrain.max_text_len", "retrieval.max_text_len",
                      "train.max_text_len", "index.image_text.max_text_len")
RETRIEVAL_TEXT_LENGTHS = ("retrieval.max_text_len", "index.entity_index.max_text_len")
TRAIN_TEXT_LENGTHS = ("train.max_text_len",)


def check_text_lengths(config: ml_collections.ConfigDict, keys: Sequence[str], max_text_positions: int) -> None:
    """Refuses, in one line, a text length that the model's text position table cannot hold.

    Positions 0 and 1 are never used (fairseq's convention: a sequence of L tokens takes rows 2..L+1), so a model with
    `max_text_positions` P encodes at most P - 2 tokens. Checked when a command is configured, not when the first
    over-long batch reaches the encoder hours later. Keys absent from the config are skipped.
    """
    usable = max_text_positions - 2
    for key in keys:
        node = config
        for part in key.split("."):
            node = node.get(part) if hasattr(node, "get") else None
            if node is None:
                break
        if node is not None and int(node) > usable:
            raise CfirError(f"{key}={node} exceeds the {usable} text positions the model can use "
                            f"(max_text_positions={max_text_positions}, minus 2): set --config.{key}={usable}")


def defaults(size: str, image_size: int = 224, runlocal: bool = False) -> ml_collections.ConfigDict:
    """The config tree with what is not an experiment choice filled in (architecture of the size, mesh, engineering
    knobs) and every experiment choice a typed placeholder that `configs/*.py` sets.

    `runlocal` shrinks the model to the tiny size and the run's bookkeeping (logging, checkpoints) to CPU scale.
    """
    cfg = ml_collections.ConfigDict()
    cfg.size = size
    cfg.runlocal = runlocal
    cfg.model = model_config("tiny" if runlocal else size, image_size)
    cfg.tokenizer = ""  # path to beit3.spm; empty: the corpus' own tokenizer.spm
    cfg.train = train_config(runlocal)
    cfg.mesh = mesh_config(size)
    cfg.index = index_config(runlocal)
    cfg.retrieval = retrieval_config()
    cfg.serve = serve_config()
    cfg.entity_workers = entity_workers_config()
    return cfg
