"""Model sizes and the config tree shared by `configs/*.py`.

Every config is an `ml_collections.ConfigDict` with sections `model`, `data`, `index`, `train`, `retrieval`.
`configs/base.py` and `configs/large.py` call `build_config` with their size; a variant string passed after the
colon (`configs/base.py:384`, `configs/large.py:runlocal`) picks the image size or shrinks the run to CPU scale.
"""

from __future__ import annotations

from typing import Sequence

import ml_collections

from cfir_jax.errors import CfirError

# REFERENCE §1. Head dim is 64 for both; the text vocabulary has 64010 rows (64002 used, padded).
MODEL_SIZES = {
    "tiny": dict(embed_dim=64, num_layers=2, num_heads=4, ffn_dim=256),
    "base": dict(embed_dim=768, num_layers=12, num_heads=12, ffn_dim=3072),
    "large": dict(embed_dim=1024, num_layers=24, num_heads=16, ffn_dim=4096),
}


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
        )
    )
    cfg.update(overrides)
    return cfg


def parse_variant(arg: str | None) -> tuple[int | None, set[str]]:
    """'384,runlocal' -> (384, {'runlocal'})."""
    image_size, flags = None, set()
    for token in (arg or "").split(","):
        token = token.strip()
        if not token:
            continue
        if token.isdigit():
            image_size = int(token)
        else:
            flags.add(token)
    unknown = flags - {"runlocal"}
    if unknown:
        raise ValueError(f"unknown config variant(s) {sorted(unknown)}: use an image size (224, 384) or 'runlocal'")
    return image_size, flags


# CFIR's trainable set (REFERENCE §2): every B (language) branch, the B position table and final LayerNorm, the
# language head and the temperature. The token embedding table and the whole vision side stay frozen.
LANGUAGE_EXPERT = [("B/.*|language_head/.*|logit_scale", "train"), (".*", "frozen")]
# No weight decay on biases, LayerNorm scales, position tables, the temperature (REFERENCE §2).
NO_WEIGHT_DECAY = r".*/bias|.*/scale|.*embed_positions|logit_scale|.*cls_token|.*mask_token"


def train_config(runlocal: bool = False) -> ml_collections.ConfigDict:
    """The `train` section: CFIR's recipe (sources in configs/base.py's docstring); runlocal shrinks only the scale."""
    return ml_collections.ConfigDict(
        dict(
            text="summary",  # 'summary' (CFIR), 'document' (ablation) or 'caption' (image-text pretraining)
            max_text_len=64,
            global_batch=16 if runlocal else 512,
            grad_accum_steps=1,  # > 1: exact full-batch gradient in micro-batches (gradient caching)
            num_epochs=1.0 if runlocal else 30.0,
            num_steps=8 if runlocal else 0,  # > 0 overrides num_epochs
            lr=1e-4,
            min_lr=1e-6,
            warmup_epochs=5.0,  # linear warmup from 0, in epochs of the training pairs (-> steps in the trainer)
            warmup_steps=2 if runlocal else 0,  # > 0 overrides warmup_epochs
            weight_decay=0.05,  # decoupled (AdamW), masked by no_weight_decay
            b1=0.9,
            b2=0.999,
            eps=1e-8,
            layer_decay=0.9,  # lr of layer j scaled by layer_decay ** (L + 1 - j) (partition.layer_lr_scales)
            grad_clip=0.0,
            extra_negatives=0,  # extra cache images per batch as negatives (text->image side only)
            negatives="random",  # 'random' or 'hard' (entity candidates of the document)
            trainable=LANGUAGE_EXPERT,
            no_weight_decay=NO_WEIGHT_DECAY,
            seed=0,
            log_every=1 if runlocal else 50,
            eval_every=4 if runlocal else 1000,
            eval_batch=64 if runlocal else 1024,
            checkpoint_every=4 if runlocal else 1000,
            keep_checkpoints=3,
            async_checkpoints=True,
            tensorboard=True,
            init_model="",  # model directory (python -m cfir_jax.convert ...); empty: random init
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


def index_config(runlocal: bool = False) -> ml_collections.ConfigDict:
    """The `index` section: where the corpus comes from and how each offline stage runs (REFERENCE §6-§7)."""
    return ml_collections.ConfigDict(
        dict(
            corpus=dict(
                source="atomic",  # 'atomic' (local parquet files in the HF layout) or 'synthetic'
                texts="",  # AToMiC-Texts-v0.2.1 directory (or parquet files, comma-separated)
                images="",  # AToMiC-Images-v0.2 directory
                qrels="",  # AToMiC-Qrels-v0.2 directory
                setting="base",  # small | base | large (REFERENCE §7)
                # Qrels splits whose topics are the documents; in the small setting also the splits whose judged
                # images form the collection (AToMiC's small setting of one split: splits="test").
                splits="train,validation,test",
                synthetic_size="default",  # 'tiny' or 'default' (synthetic source)
                seed=0,
            ),
            # The frozen encoder: a model directory (python -m cfir_jax.convert on beit3_*_itc_patch16_224.pth),
            # or 'pretrain' (synthetic worlds: train the text tower on captions first, see configs/demo.py).
            encoder="",
            image_cache=dict(
                precomputed="",  # '' encode with the encoder; 'corpus' or a .npy/.parquet of embeddings to import
                dtype="float16",
                compute_dtype="float32",
                batch_size=64 if runlocal else 256,
                shard_size=65536,
            ),
            entities=dict(spacy_model="", batch_size=64, n_process=1, labels=()),  # () = DEFAULT_LABELS
            summaries=dict(
                summarizer="bart",  # 'bart' (facebook/bart-large-cnn, CFIR) or 'extractive'
                # What is summarised (summaries.SUMMARY_INPUTS): 'paper' = page title, section title, page and
                # section descriptions joined with spaces; 'authors' = those plus the section's category, media and
                # hierachy lists, as the authors' released code feeds BART.
                fields="paper",
                bart_model="facebook/bart-large-cnn",
                max_length=64,
                min_length=8,
                num_beams=4,
                length_penalty=2.0,
                no_repeat_ngram_size=3,
                max_input_tokens=1024,
                batch_size=8,
                extractive_tokens=64,
            ),
            entity_index=dict(
                k=10_000,  # candidates per entity (paper: 10,000)
                backend="scann",  # 'scann' (CPU) or 'exact' (blocked matmul + top_k, accelerators)
                max_text_len=16,
                encode_batch=256,
                num_leaves=0,  # 0: derived from the number of images
                num_leaves_to_search=0,
                reorder=0,
                min_rows_for_tree=2000,  # fewer images: no partition tree, AH over all of them
                # Whose entities are indexed: 'train' (the paper: the train qrels' documents; test entities it never
                # saw are unknown at query time) or 'all' documents (the test split then leaks into the index).
                documents="train",
                recall_sample=256,
            ),
            # Beyond the paper (issue 13): every cached image's own text (AToMiC's caption fields) embedded by the
            # frozen text tower into W/image_text, for retrieval.fusion. Built when enabled or when
            # retrieval.fusion.w_txt != 0; skipped (and said) when the corpus' images have no text.
            image_text=dict(
                enabled=False,
                fields=("caption_reference_description", "caption_alt_text_description",
                        "caption_attribution_description"),
                max_text_len=64,
                encode_batch=256,
                chunk_rows=65536,
            ),
        )
    )


def retrieval_config() -> ml_collections.ConfigDict:
    """The `retrieval` section (CFIR's ER + SR stages)."""
    return ml_collections.ConfigDict(
        dict(
            top_k=1000,
            text="summary",  # the query text scored in SR: 'summary' (CFIR) or 'document'
            max_text_len=64,
            unknown_entities="search",  # 'ignore' (the paper) or 'search' (ScaNN over the cache at query time)
            # SR over the union: 'exact' (the paper: every candidate scored in float32) or 'fast' (compact int8 copy,
            # then an exact re-rank of the best sr_shortlist; ~16x faster at 4M images, top-1000 agreement ~0.9998).
            sr="fast",
            eval_sr="exact",  # what --evaluate / --qrels use; 'fast' reports its measured agreement with exact
            sr_shortlist=2560,  # candidates re-scored exactly after the compact pass
            sr_compact_dims=128,
            # 'device': the cache resident on the local devices, jitted exact SR over batches (cfir_jax.sr_device);
            # 'cpu': the two-pass numpy scorer (cfir_jax.sr_scorer); 'auto': device when a GPU or TPU is present.
            sr_backend="auto",
            sr_device_dtype="float16",  # or 'bfloat16'
            sr_device_shard="auto",  # 'auto' (row-shard only when the cache does not fit one device), 'always', 'never'
            sr_buckets=(4096, 16384, 65536, 262144),  # union sizes compiled for (a union is padded to the next one)
            sr_query_batch=8,  # queries per device SR call
            batch_size=256,  # documents per batch in bulk retrieval (retrieve.py --queries / --evaluate)
            entity_workers=2,  # spaCy processes for the entities of a bulk batch (nlp.pipe n_process)
            # Beyond the paper (issue 13): SR scores a candidate by w_img * <q, image> + w_txt * <q, image text>
            # (W/image_text; images without text add 0). The default (1, 0) is the paper's SR. compare_w_txt: the
            # text weight of the fused row of --compare when w_txt is 0.
            fusion=dict(w_img=1.0, w_txt=0.0, compare_w_txt=0.5),
        )
    )


# Text lengths (tokens per sequence, BOS and EOS included) that each command encodes with, by config key.
INDEX_TEXT_LENGTHS = ("index.entity_index.max_text_len", "index.pretrain.max_text_len", "retrieval.max_text_len",
                      "train.max_text_len", "index.image_text.max_text_len")
RETRIEVAL_TEXT_LENGTHS = ("retrieval.max_text_len", "index.entity_index.max_text_len")
TRAIN_TEXT_LENGTHS = ("train.max_text_len",)


def check_text_lengths(config: ml_collections.ConfigDict, keys: Sequence[str], max_text_positions: int) -> None:
    """Refuses, in one line, a text length that the model's text position table cannot hold.

    Positions 0 and 1 are never used (REFERENCE §1: a sequence of L tokens takes rows 2..L+1), so a model with
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


def build_config(size: str, arg: str | None = None) -> ml_collections.ConfigDict:
    """The full config of a model size (see configs/base.py, configs/large.py)."""
    image_size, flags = parse_variant(arg)
    runlocal = "runlocal" in flags
    cfg = ml_collections.ConfigDict()
    cfg.size = size
    cfg.runlocal = runlocal
    # Large: rematerialise layers (18.4 -> 1.7 GiB of activations per device at batch 512 on 8 devices, measured
    # with benchmarks/train_throughput.py); base fits without.
    # The paper's "dropout 0.1" is BEiT-3's drop path (stochastic depth, linspace(0, 0.1, L) over the layers) in the
    # authors' code, which sets no other dropout.
    cfg.model = model_config("tiny" if runlocal else size, image_size or 224, dropout=0.0, drop_path_rate=0.1,
                             remat=size == "large" and not runlocal)
    cfg.tokenizer = ""  # path to beit3.spm; empty: the corpus' own tokenizer.spm
    cfg.train = train_config(runlocal)
    cfg.mesh = mesh_config(size)
    cfg.index = index_config(runlocal)
    cfg.retrieval = retrieval_config()
    return cfg
