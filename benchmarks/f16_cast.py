"""The float16 -> float32 cast of SR's exact pass (`cfir_jax.search.topk.cast_f16`), interleaved in one process:
the integer passes it makes without torch, the lookup table it made before, numpy's own `astype`, and torch's F16C
loop where torch is installed (the cast takes it only where a process loaded torch).

    python benchmarks/f16_cast.py [--rows 128] [--dim 768] [--calls 200]

Each is timed on the same chunk of random unit-scale float16 values (the exact pass casts 128 x 768 at a time), each
call `--calls` times in a step, the steps alternated; it prints the median per call and the ratio to the lookup table.
"""

from __future__ import annotations

import argparse
import importlib.util

import numpy as np
from common import hardware_description, interleaved

from cfir_jax.search import topk


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rows", type=int, default=128)
    p.add_argument("--dim", type=int, default=768)
    p.add_argument("--calls", type=int, default=200)
    p.add_argument("--steps", type=int, default=21)
    args = p.parse_args()
    print(hardware_description())
    src = (np.random.default_rng(0).standard_normal((args.rows, args.dim)) / np.sqrt(args.dim)).astype(np.float16)
    dst = np.empty(src.shape, np.float32)
    real_torch = topk._torch

    def repeated(fn):
        def run():
            for _ in range(args.calls):
                fn()
        return run

    def integer_passes():
        topk._torch = lambda: None
        try:
            topk.cast_f16(src, dst)
        finally:
            topk._torch = real_torch

    runners = {
        "integer passes (cast_f16 without torch)": repeated(integer_passes),
        "lookup table (before)": repeated(lambda: np.take(topk._F16_TO_F32, src.view(np.uint16), out=dst)),
        "numpy astype": repeated(lambda: np.copyto(dst, src)),
    }
    if importlib.util.find_spec("torch") is not None:
        import torch

        runners["torch F16C copy"] = repeated(lambda: torch.from_numpy(dst).copy_(torch.from_numpy(src)))
    integer_passes()
    assert np.array_equal(dst.view(np.uint32), src.astype(np.float32).view(np.uint32)), "cast is not numpy's"
    times = interleaved(runners, args.steps)
    table = times["lookup table (before)"].median
    print(f"{args.rows} x {args.dim} float16 per call, {args.calls} calls a step, {args.steps} steps, median per call:")
    for name, t in times.items():
        print(f"  {name:42s} {t.median / args.calls * 1e6:8.1f} us   {table / t.median:5.2f}x the lookup table")


if __name__ == "__main__":
    main()
