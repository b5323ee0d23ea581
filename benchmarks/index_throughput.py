"""Throughput of index.py's two heavy stages: building the image cache, and the entity index's top-K search.

    python benchmarks/index_throughput.py                                # everything at full size (1M x 768)
    python benchmarks/index_throughput.py --n-images 100000 --cache-images 64 --sizes tiny
    python benchmarks/index_throughput.py --parts search --k 100,10000

Part `cache` (images/s): synthetic JPEGs of `--width`x`--height` (smooth gradients plus noise, like Wikimedia
thumbnails) in a temporary corpus, for each model size of `--sizes` (random weights). Decoding is timed alone on the
thread pool the build uses; encoding alone on pre-decoded pixels (after one compiling batch); then the full build
(decode overlapped with encode) for each compute dtype. The compilation is shared with the encode-only pass, so
build times exclude it.

Part `search` (entities/s and ScaNN vs exact): a synthetic clustered image cache of `--n-images` x `--dim`
(cfir_jax.search.knn.synthetic_embeddings) and `--entities` entity embeddings drawn from the same distribution.
For each K of `--k`: exact blocked top-K (the `exact` backend) and ScaNN with the default ScannConfig (the `scann`
backend, built for that K as the entity index builds it), entities/s of each, ScaNN's recall@K against exact, and the
speed ratio, all in one run.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import io
import os
import tempfile
import time
from pathlib import Path

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax
import numpy as np
from common import hardware_description
from PIL import Image as PILImage

from cfir_jax.builders.image_encoding import EncodeSettings, build_image_cache
from cfir_jax.core.config import model_config
from cfir_jax.data.corpus import Document, Image
from cfir_jax.data.corpus_writer import write_corpus
from cfir_jax.model.beit3 import create_model
from cfir_jax.model.image_tower import ImageEncoder
from cfir_jax.model.preprocess import decode_image
from cfir_jax.search.knn import ScannConfig, ScannSearcher, recall_at_k, synthetic_embeddings
from cfir_jax.search.topk import exact_topk


def synthetic_jpegs(n: int, width: int, height: int, seed: int = 0) -> list[bytes]:
    """n JPEG files [height, width, 3]: a random colour gradient plus mild noise (decodes like a photo)."""
    rng = np.random.default_rng(seed)
    yy, xx = np.mgrid[0:height, 0:width].astype(np.float32)
    out = []
    for _ in range(n):
        a, b, c = rng.uniform(0, 255, (3, 3))
        img = a + (b - a) * xx[..., None] / width + (c - a) * yy[..., None] / height
        img = np.clip(img + rng.normal(0, 12, img.shape), 0, 255).astype(np.uint8)
        buf = io.BytesIO()
        PILImage.fromarray(img).save(buf, format="JPEG", quality=85)
        out.append(buf.getvalue())
    return out


# ---------------------------------------------------------------------------------------------------- image cache


def cache_throughput(size: str, args: argparse.Namespace, data: list[bytes]) -> None:
    """Prints images/s of decoding, encoding and the full cache build of one model size, fp32 and bf16."""
    cfg = model_config(size, image_size=args.image_size)
    t = time.perf_counter()
    model = create_model(cfg)
    print(f"\n[cache] model {size}: {cfg.embed_dim}d x {cfg.num_layers} layers at {args.image_size} px (created in "
          f"{time.perf_counter() - t:.1f}s); {len(data)} images {args.width}x{args.height} JPEG, batch "
          f"{args.batch_size}, {args.workers} decode threads")
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        corpus = write_corpus(tmp / "corpus", "bench", [Document("d0", "x")],
                              (Image(f"i{k}", image=b) for k, b in enumerate(data)), {})
        t = time.perf_counter()
        with concurrent.futures.ThreadPoolExecutor(args.workers) as pool:
            pixels = list(pool.map(lambda b: decode_image(b, args.image_size), data))
        decode_s = time.perf_counter() - t
        print(f"  decode only:          {len(data) / decode_s:9.1f} images/s ({decode_s:.2f}s)")
        rates = {}
        for compute in ("float32", "bfloat16"):
            enc = ImageEncoder(model, compute, args.batch_size)
            batches = [np.stack(pixels[i : i + enc.batch_size]) for i in range(0, len(pixels), enc.batch_size)]
            batches = [np.pad(b, ((0, enc.batch_size - len(b)), (0, 0), (0, 0), (0, 0))) for b in batches]
            t = time.perf_counter()
            enc(batches[0]).block_until_ready()
            compile_s = time.perf_counter() - t
            t = time.perf_counter()
            jax.block_until_ready([enc(b) for b in batches])
            encode_s = time.perf_counter() - t
            t = time.perf_counter()
            build_image_cache(tmp / f"cache-{compute}", corpus, model,
                              encoding=EncodeSettings(batch_size=args.batch_size, compute_dtype=compute,
                                                      num_workers=args.workers), progress=False)
            build_s = time.perf_counter() - t
            rates[compute] = (len(data) / encode_s, len(data) / build_s)
            # On a CPU-only host decoding and encoding share the cores, so the build time approaches their sum;
            # with an accelerator it approaches the larger of the two.
            print(f"  {compute:9s} encode only: {rates[compute][0]:9.1f} images/s ({encode_s:.2f}s, compile "
                  f"{compile_s:.1f}s); full build {rates[compute][1]:9.1f} images/s ({build_s:.2f}s; decode + encode "
                  f"one after the other {decode_s + encode_s:.2f}s)")
        print(f"  bf16/fp32 speed: encode {rates['bfloat16'][0] / rates['float32'][0]:.2f}x, full build "
              f"{rates['bfloat16'][1] / rates['float32'][1]:.2f}x")


# --------------------------------------------------------------------------------------------------------- search


def search_throughput(args: argparse.Namespace) -> None:
    """Prints entities/s of exact and ScaNN top-K over a synthetic cache, ScaNN's recall@K and the speed ratio."""
    t = time.perf_counter()
    db = synthetic_embeddings(args.n_images, args.dim, seed=0)
    entities = synthetic_embeddings(args.entities, args.dim, seed=1)
    print(f"\n[search] images {args.n_images:,} x {args.dim} float32 ({db.nbytes / 2**30:.1f} GiB, generated in "
          f"{time.perf_counter() - t:.1f}s); {args.entities} entities")
    for k in args.k:
        exact_topk(entities[:8], db[: min(len(db), 65536)], k)  # compile outside the timed call
        t = time.perf_counter()
        _, exact = exact_topk(entities, db, k)
        exact_s = time.perf_counter() - t
        t = time.perf_counter()
        searcher = ScannSearcher.build(db, k, ScannConfig())
        build_s = time.perf_counter() - t
        searcher.search(entities[:8], k)  # first call allocates ScaNN's per-thread buffers
        t = time.perf_counter()
        _, approx = searcher.search(entities, k)
        scann_s = time.perf_counter() - t
        c = searcher.config
        print(f"  K={k:,}: ScaNN leaves {c.num_leaves_to_search}/{c.num_leaves}, reorder {c.reorder:,}, "
              f"dims_per_block {c.dims_per_block}, built in {build_s:.1f}s")
        print(f"    exact (blocked JAX matmul + top_k): {args.entities / exact_s:9.1f} entities/s ({exact_s:.2f}s)")
        print(f"    ScaNN:                              {args.entities / scann_s:9.1f} entities/s ({scann_s:.2f}s)  "
              f"recall@{k} {recall_at_k(approx, exact):.4f}  -> {exact_s / scann_s:.1f}x faster than exact")
        del searcher


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--parts", default="cache,search", help="comma-separated: cache, search")
    p.add_argument("--sizes", default="tiny,base", help="model sizes for the cache part")
    p.add_argument("--image-size", type=int, default=224)
    p.add_argument("--cache-images", type=int, default=128, help="images encoded per model size")
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--width", type=int, default=500)
    p.add_argument("--height", type=int, default=375)
    p.add_argument("--workers", type=int, default=min(32, os.cpu_count() or 1))
    p.add_argument("--n-images", type=int, default=1_000_000, help="image cache rows for the search part")
    p.add_argument("--dim", type=int, default=768)
    p.add_argument("--entities", type=int, default=256, help="entity embeddings searched")
    p.add_argument("--k", type=lambda s: [int(x) for x in s.split(",")], default=[100, 1000, 10000])
    args = p.parse_args()
    parts = {x for x in args.parts.split(",") if x}
    if parts - {"cache", "search"}:
        p.error(f"--parts: unknown {sorted(parts - {'cache', 'search'})}; use cache, search")
    print(f"hardware: {hardware_description()}")
    if "cache" in parts:
        data = synthetic_jpegs(args.cache_images, args.width, args.height)
        for size in args.sizes.split(","):
            cache_throughput(size, args, data)
    if "search" in parts:
        search_throughput(args)


if __name__ == "__main__":
    main()
