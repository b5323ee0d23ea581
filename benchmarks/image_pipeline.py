"""Throughput of the Full fine-tuning image pipeline (cfir_jax.data.image_pipeline.PairBatches) on this CPU.

    python benchmarks/image_pipeline.py                       # 256 JPEGs 500x375, batch 32, 224 px, workers 0 and 2
    python benchmarks/image_pipeline.py --workers 0,4 --batches 20

Synthetic JPEGs of `--width`x`--height` (the image-cache benchmark's photo-like gradients, about Wikimedia thumbnail
size) in a temporary corpus, one (document, image) pair per image. For each worker count of `--workers`, with
BEiT-3's training augmentation (decode, random resized crop, flip, RandAugment) and once without it (decode and the
eval resize, in process): the first batches (grain's worker processes start, and fill their buffers) are excluded,
then `--batches` batches are timed; the configurations alternate over `--rounds` rounds and each one's best round is
reported as images/s.
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time

import numpy as np
from common import hardware_description
from index_throughput import synthetic_jpegs

from cfir_jax.data.corpus import Document, Image
from cfir_jax.data.corpus_writer import write_corpus
from cfir_jax.data.image_pipeline import PairBatches


def pipeline_throughput(corpus, pairs: np.ndarray, *, workers: int, augment: bool, batch: int, image_size: int,
                        batches: int, seed: int = 0) -> float:
    """Images/s of `batches` batches of PairBatches in the steady state: the first 2 * workers + 2 batches (worker
    start-up, and the batches the workers' buffers filled meanwhile) are not timed."""
    stream = PairBatches(corpus, pairs, global_batch=batch, image_size=image_size, seed=seed, augment=augment,
                         workers=workers)
    try:
        for _ in range(2 * workers + 2):
            next(stream)
        t = time.perf_counter()
        for _ in range(batches):
            next(stream)
        return batches * batch / (time.perf_counter() - t)
    finally:
        stream.close()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--images", type=int, default=256)
    p.add_argument("--width", type=int, default=500)
    p.add_argument("--height", type=int, default=375)
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--image-size", type=int, default=224)
    p.add_argument("--batches", type=int, default=12, help="timed batches per configuration and round")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--workers", type=lambda s: [int(x) for x in s.split(",")], default=[0, 2])
    args = p.parse_args()
    print(f"hardware: {hardware_description()}")
    data = synthetic_jpegs(args.images, args.width, args.height)
    with tempfile.TemporaryDirectory() as tmp:
        corpus = write_corpus(os.path.join(tmp, "c"), "bench", [Document(f"d{i}", "x") for i in range(len(data))],
                              [Image(f"i{i}", image=b) for i, b in enumerate(data)], {})
        pairs = np.stack([np.arange(len(data))] * 2, axis=1)
        configs = [(w, True) for w in args.workers] + [(0, False)]
        best = dict.fromkeys(configs, 0.0)
        for r in range(args.rounds):
            for workers, augment in configs:
                rate = pipeline_throughput(corpus, pairs, workers=workers, augment=augment, batch=args.batch,
                                           image_size=args.image_size, batches=args.batches, seed=r)
                best[workers, augment] = max(best[workers, augment], rate)
        print(f"{len(data)} JPEG {args.width}x{args.height} -> {args.image_size} px, batch {args.batch}, "
              f"{args.batches} batches x {args.rounds} rounds (best round):")
        for (workers, augment), rate in best.items():
            what = "train augmentation" if augment else "eval resize only  "
            print(f"  {what}  workers {workers}: {rate:7.1f} images/s")


if __name__ == "__main__":
    main()
