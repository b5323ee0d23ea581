"""CFIR-B: Decoupling-BEiT-3 base (768 dims, 12 layers), 224 px images (`:384` for the released retrieval models).

  python train.py --config configs/base.py --workdir W          # paper recipe
  python train.py --config configs/base.py:runlocal --workdir W # CPU-sized smoke run (tiny model)
"""

from cfir_jax.config import build_config


def get_config(arg=None):
    return build_config("base", arg)
