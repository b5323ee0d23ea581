"""CFIR-B: Decoupling-BEiT-3 base (768 dims, 12 layers), 224 px images (`:384` for the released retrieval models).

  python train.py --config configs/base.py --workdir W          # the recipe below
  python train.py --config configs/base.py:runlocal --workdir W # CPU smoke run: tiny model, batch 16, 8 steps
                                                                # (2 warmup), the same regularisation and lr decay

The training recipe, each value with its source: the CFIR paper where it is explicit, the authors' released code
(GLA-IR/CFIR) where the paper is silent or ambiguous, BEiT-3's fine-tuning code (microsoft/unilm beit3) for the
optimiser details neither states. configs/large.py uses the same values; tests/test_config.py checks this table
against both configs.

  key                  value   source
  model.image_size     224     paper: 224 x 224 images
  train.max_text_len   64      paper: 64 text tokens
  train.global_batch   512     paper
  train.num_epochs     30      paper
  train.lr             1e-4    paper: Adam(W), lr 1e-4
  train.weight_decay   0.05    paper: weight decay 0.05 (decoupled, AdamW, as the authors' code)
  model.drop_path_rate 0.1     authors' code: the paper's "dropout 0.1" is BEiT-3's drop path (linspace(0, 0.1, L))
  model.dropout        0.0     authors' code: no other dropout
  train.warmup_epochs  5       authors' code: linear warmup over 5 epochs (steps = 5 x pairs / batch)
  train.layer_decay    0.9     authors' code: layer-wise lr decay 0.9 (layer j of L: 0.9 ** (L + 1 - j))
  train.b1             0.9     BEiT-3 fine-tuning code: AdamW betas
  train.b2             0.999   BEiT-3 fine-tuning code
  train.eps            1e-8    BEiT-3 fine-tuning code
  train.min_lr         1e-6    BEiT-3 fine-tuning code: cosine decay to 1e-6

Only the language expert is trained (the one rule in `train.trainable`); the values live in cfir_jax/config.py.
"""

from cfir_jax.config import build_config


def get_config(arg=None):
    return build_config("base", arg)
