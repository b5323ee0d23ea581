"""The measured units of benchmarks/accelerator.py, each run in its own process by `accelerator.py --unit PART:WHICH`:
the train step of one size against torchscale's, one encoder, the device SR, BART in one dtype, the served query
(benchmarks/accelerator_serve.py); and the probe of what the host's jax sees. Every row carries its process's id and
(but the served query's, whose servers are processes of their own) peak device memory."""

from __future__ import annotations

import dataclasses
import os
import tempfile
import time
from pathlib import Path

import common  # noqa: F401  (puts the repository root on sys.path)
import numpy as np

PAPER_SR_MS = 4.7  # CFIR-L per query, AToMiC base (paper, table 3)


@dataclasses.dataclass
class Sizes:
    train: tuple[str, ...]
    batch: int
    steps: int
    encode_batch: int
    cache_rows: int
    cache_dim: int
    union: int
    sr_queries: int
    bart: str  # 'facebook/bart-large-cnn' or 'tiny'
    bart_docs: int
    serve_size: str  # the served workdir: benchmarks/realsize.py's size (base, large, tiny)
    serve_rows: int  # its image cache rows
    serve_words: int  # query documents lengthened to this many words (0: as they are)
    serve_c1: int  # requests at concurrency 1
    serve_c16: int  # requests at concurrency 16


FULL = Sizes(("base", "large"), 512, 5, 256, 4_000_000, 768, 60_000, 64, "facebook/bart-large-cnn", 64,
             "base", 4_000_000, 900, 8, 48)
TINY = Sizes(("tiny",), 16, 3, 8, 20_000, 64, 3_000, 8, "tiny", 4, "tiny", 2_000, 0, 3, 16)


def peak_bytes() -> int | None:
    import jax

    stats = jax.local_devices()[0].memory_stats() or {}
    return stats.get("peak_bytes_in_use")


def _model_config(size: str):
    from cfir_jax.core.cli import load_config_file

    cfg = load_config_file("configs/base.py:runlocal" if size == "tiny" else f"configs/{size}.py")
    cfg.model.dtype = "bfloat16"
    return cfg


def _torch_device() -> str:
    import jax
    import torch

    return "cuda" if jax.default_backend() in ("gpu", "cuda") and torch.cuda.is_available() else "cpu"


def _train_row(size: str, sizes: Sizes, device: str) -> dict:
    """The trainer's own step (bfloat16 compute) against torchscale's AdamW step on the same device, interleaved."""
    import torch
    from common import interleaved, random_text_batch, random_unit_embeddings, torch_contrastive_loss, torch_model

    from cfir_jax.training.data import TrainData
    from cfir_jax.training.state import init_state, make_setup
    from cfir_jax.training.step import global_batch_arrays, make_train_step

    cfg = _model_config(size)
    cfg.train.global_batch = sizes.batch
    b, seq, dim = sizes.batch, cfg.train.max_text_len, cfg.model.embed_dim
    ids, mask = random_text_batch(4 * b, seq, cfg.model.vocab_size)
    images = random_unit_embeddings(4 * b, dim, 1)
    data = TrainData(ids, mask, np.arange(4 * b), np.arange(4 * b), images)
    setup = make_setup(cfg, 1000, None, data.steps_per_epoch(b))
    state, frozen = init_state(cfg, setup, None)
    step_fn = make_train_step(cfg, setup)
    holder = {"state": state, "step": 0}

    def jax_step():
        batch = global_batch_arrays(data, holder["step"], cfg, setup.mesh)
        holder["state"], metrics = step_fn(holder["state"], frozen, batch)
        holder["step"] += 1
        return float(metrics["loss"])

    model, trainable = torch_model(cfg.model)
    model = model.to(device)
    opt = torch.optim.AdamW(trainable, lr=cfg.train.lr, weight_decay=cfg.train.weight_decay)
    t_ids = torch.from_numpy(ids[:b]).long().to(device)
    t_mask, t_img = torch.from_numpy(mask[:b]).to(device), torch.from_numpy(images[:b]).to(device)

    def torch_step():
        opt.zero_grad(set_to_none=True)
        with torch.autocast(device.split(":")[0], dtype=torch.bfloat16):
            emb, _ = model.encode_text(t_ids, t_mask)
            loss = torch_contrastive_loss(emb, t_img, model.logit_scale)
        loss.backward()
        opt.step()
        return float(loss.detach())

    t = interleaved({"jax": jax_step, "torch": torch_step}, sizes.steps, warmup=2)
    torch_peak = torch.cuda.max_memory_allocated() if device.startswith("cuda") else None
    remat = f"{cfg.model.remat}" + (f", {cfg.model.remat_policy}" if cfg.model.remat else "")
    return {"what": f"train step {size} bf16 (remat={remat})", "batch": b,
            "jax_seq_s": b / t["jax"].median, "torch_seq_s": b / t["torch"].median,
            "ratio": t["torch"].median / t["jax"].median, "torch_peak_bytes": torch_peak}


def _encode_row(which: str, sizes: Sizes) -> dict:
    """Text (the eval encoder) or image (the image-cache encoding step) throughput of the largest train size."""
    import jax
    from common import interleaved, random_text_batch

    size, b = sizes.train[-1], sizes.encode_batch
    cfg = _model_config(size)
    if which == "text":
        from cfir_jax.training.state import init_state, make_setup
        from cfir_jax.training.step import make_encoder

        cfg.train.global_batch = b
        setup = make_setup(cfg, 1000, None, 10)
        state, frozen = init_state(cfg, setup, None)
        encoder = make_encoder(cfg, setup)
        ids, mask = random_text_batch(b, cfg.train.max_text_len, cfg.model.vocab_size)
        t = interleaved({which: lambda: jax.block_until_ready(encoder(state["params"], frozen, ids, mask))},
                        sizes.steps, warmup=1)
        return {"what": f"text encoding {size} bf16", "batch": b, "jax_seq_s": b / t[which].median}
    from cfir_jax.model import beit3 as model_lib
    from cfir_jax.model.image_tower import ImageEncoder

    images = ImageEncoder(model_lib.create_model(cfg.model), "bfloat16", b)
    pixels = np.random.default_rng(0).normal(size=(images.batch_size, images.image_size, images.image_size, 3))
    pixels = pixels.astype(np.float32)
    t = interleaved({which: lambda: jax.block_until_ready(images(pixels))}, sizes.steps, warmup=1)
    return {"what": f"image encoding {size} bf16 {images.image_size}px", "batch": images.batch_size,
            "jax_seq_s": images.batch_size / t[which].median}


# A device's free memory as a dry run's BART unit states it (the CPU reports none): small enough that the rows per
# device are sized down, as on a GPU whose memory is taken.
DRY_RUN_FREE_BYTES = 8 << 20


def sr_rows(sizes: Sizes, forced: bool = False) -> list[dict]:
    """Device SR ms/query over a resident float16 cache: one query per call, and sizes.sr_queries per call. The cache
    is one random block of unit rows repeated (the timing does not depend on the values; filling 4M x 768 with fresh
    random numbers took longer than the measurement). Two queries' answers are held to numpy's exact SR (ids equal,
    scores within 1e-5). forced (the dry run): the cache sharded over every local device."""
    from common import random_unit_embeddings

    from cfir_jax.search.device_sr import DeviceCache
    from cfir_jax.search.topk import exact_top_k

    rng = np.random.default_rng(0)
    block = random_unit_embeddings(min(sizes.cache_rows, 262_144), sizes.cache_dim, 0).astype(np.float16)
    cache = np.empty((sizes.cache_rows, sizes.cache_dim), np.float16)
    for start in range(0, sizes.cache_rows, len(block)):
        cache[start : start + len(block)] = block[: sizes.cache_rows - start]
    dc = DeviceCache(cache, k=1000, dtype="float16", query_batch=sizes.sr_queries, shard=True if forced else None)
    n_q = sizes.sr_queries
    queries = random_unit_embeddings(n_q, sizes.cache_dim, 7)
    unions = [np.unique(rng.integers(0, sizes.cache_rows, sizes.union)) for _ in range(n_q)]
    dc.score_batch(queries[:1], unions[:1])  # compile both shapes
    for q, u, (s, r) in zip(queries[:2], unions[:2], dc.score_batch(queries, unions)[:2]):
        want_s, want_r = exact_top_k(cache, q, u, 1000)
        if not (np.array_equal(r, want_r) and np.allclose(s, want_s, rtol=0, atol=1e-5)):
            raise SystemExit(f"device SR differs from numpy's exact SR over the same union ({dc.shards} shards)")
    rows = []
    for per_call in (1, n_q):
        times = []
        for _ in range(3):
            t = time.perf_counter()
            for q0 in range(0, n_q, per_call):
                dc.score_batch(queries[q0 : q0 + per_call], unions[q0 : q0 + per_call])
            times.append((time.perf_counter() - t) / n_q * 1000)
        rows.append({"what": f"device SR {sizes.cache_rows:,} x {sizes.cache_dim} f16, union ~{sizes.union:,}, "
                     f"{per_call} query/call", "ms_per_query": float(np.median(times)), "paper_ms": PAPER_SR_MS,
                     "shards": dc.shards, "equal_to_cpu": True})
    return rows


def bart_rows(sizes: Sizes, dtype: str, scratch: str | None = None, forced: bool = False) -> list[dict]:
    """BART's summaries/s at the index's batch (8 rows per device, data parallel) and ms per lone query document (one
    row per device: a served query's summary stage), in `dtype` (float32 is the paper's). On an accelerator: BART-
    large-CNN's architecture with random weights (benchmarks/realsize.py; nothing downloaded): time and memory only.
    The model directory is written once into `scratch` (the run's folder) and read by the other dtype's unit.
    forced (the dry run): the rows per device sized to DRY_RUN_FREE_BYTES of free memory, as a GPU's report sizes
    them."""
    import jax

    from cfir_jax.nlp.summarizer import BartSummarizer

    texts = [f"Document {i} about the history of the city, its rivers, bridges and people. " * 60
             for i in range(sizes.bart_docs)]
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        name = str(Path(scratch or tmp, "bart-tiny" if sizes.bart == "tiny" else "bart-large-cnn"))
        if not Path(name, "config.json").exists():
            from realsize import BART_SHAPES, write_bart

            shapes = BART_SHAPES["tiny" if sizes.bart == "tiny" else "large"]
            write_bart(Path(name), shapes["bart-large-cnn"], texts)
        max_input = 128 if sizes.bart == "tiny" else 1024
        s = BartSummarizer(name, max_length=64 if sizes.bart != "tiny" else 16, min_length=8, num_beams=4,
                           max_input_tokens=max_input, batch_size=8, dtype=dtype,
                           free_bytes=DRY_RUN_FREE_BYTES if forced else None)
        s.summarize(texts[: s.rows_per_call])  # compile the index's batch
        t = time.perf_counter()
        s.summarize(texts)
        seconds = time.perf_counter() - t
        rows.append({"what": f"BART summaries ({sizes.bart}, 4 beams, {dtype}, {len(jax.local_devices())} devices)",
                     "batch": s.rows_per_call, "summaries_s": sizes.bart_docs / seconds,
                     "rows_per_device": s.batch_size})
        s.summarize(texts[:1])  # compile the lone query's row bucket
        lone = []
        for text in texts[1:4]:
            t = time.perf_counter()
            s.summarize([text])
            lone.append(time.perf_counter() - t)
        rows.append({"what": f"BART one query document ({sizes.bart}, {dtype}): a served query's summary",
                     "batch": 1, "ms_per_doc": 1e3 * float(np.median(lone))})
    return rows


def run_unit(unit: str, sizes: Sizes, scratch: str | None = None, serve: dict | None = None,
             forced: bool = False) -> list[dict]:
    """The rows of one unit ('part:which'), each with this process's peak device memory, its id and its device
    count. serve: where the served query's workdir is (accelerator_serve.run's options); forced: a dry run's unit
    (every device branch taken on the CPU)."""
    import jax

    part, which = unit.split(":", 1)
    if part == "serve":  # its servers hold the device, never this process: no peak here
        import accelerator_serve

        return [{**r, "unit": unit, "pid": os.getpid()} for r in accelerator_serve.run(which, sizes, **serve)]
    if part == "train":
        rows = [_train_row(which, sizes, _torch_device())]
    elif part == "encode":
        rows = [_encode_row(which, sizes)]
    elif part == "sr":
        rows = sr_rows(sizes, forced)
    else:
        rows = bart_rows(sizes, which, scratch, forced)
    peak = peak_bytes()
    return [{**r, "unit": unit, "pid": os.getpid(), "jax_peak_bytes": peak, "devices": jax.local_device_count()}
            for r in rows]


def probe() -> dict:
    """What this host's jax sees (run in its own process: the driver never initialises the accelerator)."""
    import jax
    import torch  # noqa: F401  (named in the hardware line)
    from common import hardware_description

    backend = jax.default_backend()
    return {"backend": backend, "accelerated": backend in ("gpu", "cuda", "rocm", "tpu"),
            "device_kind": jax.devices()[0].device_kind, "hardware": hardware_description()}
