"""CFIR-L: Decoupling-BEiT-3 large (1024 dims, 24 layers), 224 px images (`:384` for the released retrieval models).

  python train.py --config configs/large.py --workdir W
  python train.py --config configs/large.py:runlocal --workdir W
  python train.py --config configs/large.py:authors --workdir W  # the authors' stage-2 command (configs/base.py)
  python train.py --config configs/large.py:full --compile-only --topology v5p-64   # D-BEiT-3-L-Full

`:full` is D-BEiT-3-L-Full, the paper's whole-model baseline (Table 1's D-BEiT-3-L-Full row; Table 2's D-BEiT-3-L
full, 0.038 MRR@10 / 43.37 R@1000, in AToMiC's large setting): configs/base.py's `:full` values, with FSDP over every
chip (the mesh below) for both towers' parameters and Adam moments.

The training recipe is configs/base.py's (its docstring gives each value's source); large differs only in the mesh
(FSDP over every device) and rematerialised layers.
"""

from configs.base import experiment


def get_config(arg=None):
    return experiment("large", arg)
