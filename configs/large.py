"""CFIR-L: Decoupling-BEiT-3 large (1024 dims, 24 layers), 224 px images (`:384` for the released retrieval models).

  python train.py --config configs/large.py --workdir W
  python train.py --config configs/large.py:runlocal --workdir W
  python train.py --config configs/large.py:authors --workdir W  # the authors' stage-2 command (configs/base.py)

The training recipe is configs/base.py's (its docstring gives each value's source); large differs only in the mesh
(FSDP over every device) and rematerialised layers.
"""

from configs.base import experiment


def get_config(arg=None):
    return experiment("large", arg)
