"""Image cache throughput: images/s of building the cache, split into decoding and encoding, fp32 vs bf16 compute.

    python benchmarks/cache_throughput.py                          # base: 768d, 224 px, random weights
    python benchmarks/cache_throughput.py --size tiny --n-images 512

Images are synthetic JPEGs of `--width`x`--height` (smooth gradients plus noise, like Wikimedia thumbnails) in a
temporary corpus. Decoding is timed alone on the thread pool the build uses; encoding alone on pre-decoded pixels
(after one compiling batch); then the full build (decode overlapped with encode) for each compute dtype. The
compilation is shared with the encode-only pass, so build times exclude it.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import io
import os
import platform
import tempfile
import time
from pathlib import Path

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax
import numpy as np
from PIL import Image as PILImage

from cfir_jax.config import model_config
from cfir_jax.corpus import Document, Image, write_corpus
from cfir_jax.image_cache import ImageEncoder, build_image_cache
from cfir_jax.images import decode_image
from cfir_jax.model import create_model


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


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--size", choices=("tiny", "base"), default="base")
    p.add_argument("--image-size", type=int, default=224)
    p.add_argument("--n-images", type=int, default=128)
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--width", type=int, default=500)
    p.add_argument("--height", type=int, default=375)
    p.add_argument("--workers", type=int, default=min(32, os.cpu_count() or 1))
    args = p.parse_args()
    devices = jax.local_devices()
    print(f"hardware: {len(devices)} x {devices[0].device_kind} ({devices[0].platform}); cpus={os.cpu_count()}; "
          f"{platform.machine()} {platform.processor() or platform.platform()}; jax {jax.__version__}")

    cfg = model_config(args.size, image_size=args.image_size)
    t = time.perf_counter()
    model = create_model(cfg)
    print(f"model {args.size}: {cfg.embed_dim}d x {cfg.num_layers} layers at {args.image_size} px, "
          f"created in {time.perf_counter() - t:.1f}s; {args.n_images} images {args.width}x{args.height} JPEG, "
          f"batch {args.batch_size}, {args.workers} decode threads")
    data = synthetic_jpegs(args.n_images, args.width, args.height)

    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        corpus = write_corpus(tmp / "corpus", "bench", [Document("d0", "x")],
                              (Image(f"i{k}", image=b) for k, b in enumerate(data)), {})

        t = time.perf_counter()
        with concurrent.futures.ThreadPoolExecutor(args.workers) as pool:
            pixels = list(pool.map(lambda b: decode_image(b, args.image_size), data))
        decode_s = time.perf_counter() - t
        print(f"decode only:  {args.n_images / decode_s:9.1f} images/s ({decode_s:.2f}s)")

        rates = {}
        for compute in ("float32", "bfloat16"):
            enc = ImageEncoder(model, compute, args.batch_size)
            batches = [np.stack(pixels[i : i + enc.batch_size]) for i in range(0, len(pixels), enc.batch_size)]
            batches = [np.pad(b, ((0, enc.batch_size - len(b)), (0, 0), (0, 0), (0, 0))) for b in batches]
            t = time.perf_counter()
            enc(batches[0]).block_until_ready()
            compile_s = time.perf_counter() - t
            t = time.perf_counter()
            outs = [enc(b) for b in batches]
            jax.block_until_ready(outs)
            encode_s = time.perf_counter() - t
            t = time.perf_counter()
            build_image_cache(tmp / f"cache-{compute}", corpus, model, batch_size=args.batch_size,
                              compute_dtype=compute, num_workers=args.workers, progress=False)
            build_s = time.perf_counter() - t
            rates[compute] = (args.n_images / encode_s, args.n_images / build_s)
            # On a CPU-only host decoding and encoding share the cores, so the build approaches their sum; with an
            # accelerator it approaches the larger of the two.
            print(f"{compute:9s} encode only: {rates[compute][0]:9.1f} images/s ({encode_s:.2f}s, compile "
                  f"{compile_s:.1f}s); full build: {rates[compute][1]:9.1f} images/s ({build_s:.2f}s; decode + "
                  f"encode one after the other: {decode_s + encode_s:.2f}s)")
        print(f"bf16/fp32 speed ratio: encode {rates['bfloat16'][0] / rates['float32'][0]:.2f}x, "
              f"full build {rates['bfloat16'][1] / rates['float32'][1]:.2f}x")


if __name__ == "__main__":
    main()
