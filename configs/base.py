"""CFIR-B: Decoupling-BEiT-3 base (768 dims, 12 layers), 224 px images (`:384` for the released retrieval models).

  python train.py --config configs/base.py --workdir W          # the recipe below
  python train.py --config configs/base.py:runlocal --workdir W # CPU smoke run: tiny model, batch 16, 8 steps
                                                                # (2 warmup), the same regularisation and lr decay
  python train.py --config configs/base.py:res=384 --workdir W  # the released retrieval models' 384 px (or :384)
  python train.py --config configs/base.py:authors --workdir W  # the authors' documented stage-2 command (below)
  python train.py --config configs/base.py:full --compile-only --topology v4-8   # D-BEiT-3-B-Full (below)

The training recipe, each value with its source: the CFIR paper where it is explicit, the authors' released code
(GLA-IR/CFIR) where the paper is silent or ambiguous, BEiT-3's fine-tuning code (microsoft/unilm beit3) for the
optimiser details neither states. configs/large.py uses the same values; tests/unit/core/test_config.py checks this
table against both configs.

  key                  value   source
  model.image_size     224     authors' code: --input_size 224 (retrieval.py:51, the README command's)
  train.max_text_len   64      authors' code: --num_max_bpe_tokens 64 (retrieval.py:61, the README command's)
  train.global_batch   512     paper
  train.num_epochs     30      paper
  train.lr             1e-4    paper: Adam, lr 1e-4 (the authors' code's optimiser is AdamW, retrieval.py:68)
  train.weight_decay   0.05    paper: weight decay 0.05 (decoupled, AdamW, as the authors' code)
  model.drop_path_rate 0.1     authors' code: the paper's "dropout 0.1" is BEiT-3's drop path (linspace(0, 0.1, L))
  model.dropout        0.0     authors' code: no other dropout
  train.warmup_epochs  5       authors' code: linear warmup over 5 epochs (steps = 5 x pairs / batch)
  train.layer_decay    0.9     authors' code: layer-wise lr decay 0.9 (layer j of L: 0.9 ** (L + 1 - j))
  train.b1             0.9     BEiT-3 fine-tuning code: AdamW betas
  train.b2             0.999   BEiT-3 fine-tuning code
  train.eps            1e-8    BEiT-3 fine-tuning code
  train.min_lr         1e-6    BEiT-3 fine-tuning code: cosine decay to 1e-6

The paper says it follows BEiT-3's fine-tuning setup and its values are the table above (with the authors' code
defaults where it is silent). The authors' README documents a different stage-2 command; `:authors` (combinable:
`:authors,384`) sets it instead, value by value (docs/protocol.md gives both sources):

  key                  paper            :authors
  train.lr             1e-4             2e-4
  train.global_batch   512              512    (4 x 128: README.md:7 "can be evaluated using 4 A6000-48GB", and
                                                --batch_size 128 per GPU, README.md:30; that note's own example,
                                                8 x 128 = 1,024, is another GPU count)
  train.warmup_epochs  5                3
  train.layer_decay    0.9              0.65   (layer 1 of 12: lr x 0.28 under 0.9, x 0.006 under 0.65)
  model.drop_path_rate 0.1              0.2
  train.trainable      language_expert  authors (--tune_text_only's set, retrieval.py:253,390-397: the
                                                temperature and the language head frozen)
  train.randaug        True             False  (no --randaug in the command; retrieval.py:102; read by :full)
  train.weight_decay   0.05             0.05
  train.num_epochs     30               30
  train.max_text_len   64               64

`train.global_batch` is global here: on D devices each takes global_batch / D (the authors' 128 per GPU is their
512 only on 4 GPUs; on 8 their note's 8 x 128 = 1,024 is a different recipe, which
`--config.train.global_batch=1024` sets). Their mixed precision (fp16 autocast with a loss scaler,
beit3_tools/engine_for_finetuning.py:858) is one flag here, `--config.model.dtype=bfloat16` (bf16 compute, no loss
scaling; parameters and Adam moments stay float32); `:authors` keeps float32, the precision every number of this
project was measured in.

`:full` is the paper's strongest baseline, D-BEiT-3-B-Full (Table 1's D-BEiT-3-B/L-Full rows; Table 2's
D-BEiT-3-L full, 0.038 MRR@10 / 43.37 R@1000, with configs/large.py:full): the whole model fine-tuned, images
encoded from pixels by the vision expert in every step (`train.images="pixels"`, cfir_jax/training/full_step.py). It
changes, and only changes:

  - train.trainable: "full" (both experts, both heads, logit_scale, the patch and token embeddings)
  - train.images: "pixels" (the image tower is trained, so there is no cache: each batch's 224 px images encoded)
  - train.text: "document" (the authors' document model: train.document_fields, from their code)
  - model.remat: True, model.remat_policy: "nothing" (both towers' layers rematerialised, each keeping only its
    input: activations of 197 image + 64 text tokens)
  - model.dtype: "bfloat16" (compute; parameters and Adam moments stay float32)

with the recipe above (the paper trains its baselines with it). Its command is
`python train.py --config configs/base.py:full --workdir W --config.train.init_model=BEIT3_DIR` (issue 22): it
trains in W/train_full from W/corpus's pixels and exports the whole model to W/model_full (README, "D-BEiT-3
Full"); `--compile-only --topology T` compiles its step.

Only the language expert is trained (CFIR): the one rule in `train.trainable`. Besides the recipe this file sets every
other experiment choice (index: AToMiC base, K = 10,000, BART-large-CNN summaries; retrieval: top 1000, exact SR for
evaluation); cfir_jax/core/config.py holds only what is not a choice (architecture, engineering knobs).
"""

from cfir_jax.core.config import LANGUAGE_EXPERT, defaults
from cfir_jax.core.variants import parse_arg

# The authors' stage-2 command: --batch_size 128, which BEiT-3's fine-tuning code applies per GPU (their README.md:30),
# on the 4 GPUs their README.md:7 names: a global batch of 512, the paper's.
AUTHORS_BATCH_PER_GPU = 128
AUTHORS_GPUS = 4


def experiment(size: str, arg: str | None = None):
    """CFIR as the paper runs it, at `size`; the variant `arg` picks the image size (`res`) and CPU scale."""
    arg = parse_arg(arg, res=224, runlocal=False, authors=False, full=False)
    c = defaults(size, arg.res, arg.runlocal)

    # The model: BEiT-3's drop path is the paper's "dropout 0.1". Both sizes rematerialise their layers (the loss and
    # gradients are the same; docs/compile-only.md, "The train step's memory"): large keeps only each layer's input
    # (18.4 -> 1.7 GiB of activations per device at batch 512 on 8 devices, benchmarks/train_throughput.py); base
    # keeps its six weight matmuls' outputs and recomputes the rest (the float32 GELU, LayerNorm and softmax
    # intermediates it stored were most of its memory), for no extra FLOPs.
    c.model.update(dropout=0.0, drop_path_rate=0.1, remat=not arg.runlocal,
                   remat_policy="nothing" if size == "large" else "projections")

    # Training: the recipe of the docstring.
    c.train.update(text="summary", max_text_len=64, global_batch=16 if arg.runlocal else 512,
                   num_epochs=1.0 if arg.runlocal else 30.0, num_steps=8 if arg.runlocal else 0,
                   lr=1e-4, min_lr=1e-6, warmup_epochs=5.0, warmup_steps=2 if arg.runlocal else 0,
                   weight_decay=0.05, b1=0.9, b2=0.999, eps=1e-8, layer_decay=0.9, trainable=LANGUAGE_EXPERT)
    if arg.authors:  # the authors' documented stage-2 command, where it differs from the paper (the docstring)
        c.model.drop_path_rate = 0.2
        c.train.update(lr=2e-4, warmup_epochs=3.0, layer_decay=0.65, trainable="authors", randaug=False,
                       global_batch=16 if arg.runlocal else AUTHORS_GPUS * AUTHORS_BATCH_PER_GPU)

    # The document text of the dense baselines (the paper is silent): the authors' code trains the document model on
    # page title, section title and section description, and its test queries read the page title alone
    # (atomic/atomic_dataset.py, AtoMicDataset and AtoMicDatasetquery's text_features).
    c.train.document_fields = ("page_title", "section_title", "context_section_description")

    if arg.full:  # D-BEiT-3 Full: both towers trained from pixels on the authors' document text (the docstring)
        c.model.update(remat=True, remat_policy="nothing", dtype="float32" if arg.runlocal else "bfloat16")
        c.train.update(trainable="full", images="pixels", text="document")

    # The offline index: AToMiC's base setting (documents of every qrels split, the images they judge), entities of
    # the train documents only (the paper's protocol), K = 10,000 candidates per entity, BART-large-CNN summaries
    # with CFIR's generation settings over the paper's four text fields.
    c.index.corpus.update(setting="base", splits="train,validation,test")
    c.index.entities.labels = "all"  # the paper's spaCy named entities ('picturable': the 11 of entities.py)
    # The entities of the paper's text: spaCy's named entities. Its Figure 7 lists category names ("Annual events in
    # New York City", "Searchlights") as a document's entities; 'spacy+categories' adds the section's category field
    # (docs/protocol.md, "entities").
    c.index.entities.sources = "spacy"
    c.index.summaries.update(summarizer="bart", fields="paper", bart_model="facebook/bart-large-cnn", max_length=64,
                             min_length=8, num_beams=4, length_penalty=2.0, no_repeat_ngram_size=3,
                             max_input_tokens=1024)
    c.index.entity_index.update(k=10_000, max_text_len=16, documents="train")

    # Retrieval: the top 1000 (R@1000); the summary embedding scores the union; entities the index never saw are
    # searched over the cache for a user's queries (the authors' code searches every test entity; the paper drops
    # them, 'ignore', which --compare's paper rows use); SR is fast for queries, exact for evaluation.
    c.retrieval.update(top_k=1000, text="summary", max_text_len=64, unknown_entities="search", sr="fast",
                       eval_sr="exact", document_fields=("page_title",))
    return c


def get_config(arg=None):
    return experiment("base", arg)
