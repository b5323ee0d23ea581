"""Every accelerator measurement in one run (`bash benchmarks/accelerator.sh`): train step vs torchscale on the same
device, text and image encoding throughput, device SR ms/query, BART summaries/s, peak device memory of each.

On a GPU (or TPU) host: base and large train steps in bfloat16 at batch --batch (torchscale's step on the same GPU,
interleaved, ratio printed), encoders at batch 256, device SR over a 4M x 768 float16 cache with ~60k-row unions
(one query per call and 64 per call) beside the paper's 4.7 ms, BART-large-CNN summaries/s. On a host without an
accelerator it says so and runs the same code paths at tiny sizes (CI runs it so; its figures are not accelerator
figures). Writes --out/accelerator.json and --out/accelerator.md.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
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


FULL = Sizes(("base", "large"), 512, 10, 256, 4_000_000, 768, 60_000, 64, "facebook/bart-large-cnn", 64)
TINY = Sizes(("tiny",), 16, 3, 8, 20_000, 64, 3_000, 8, "tiny", 4)


def peak_bytes() -> int | None:
    import jax

    stats = jax.local_devices()[0].memory_stats() or {}
    return stats.get("peak_bytes_in_use")


def _model_config(size: str):
    from cfir_jax.core.cli import load_config_file

    cfg = load_config_file("configs/base.py:runlocal" if size == "tiny" else f"configs/{size}.py")
    cfg.model.dtype = "bfloat16"
    return cfg


def train_rows(sizes: Sizes, device: str) -> list[dict]:
    """The trainer's own step (bfloat16 compute) against torchscale's AdamW step on the same device, interleaved."""
    import jax
    import torch

    rows = []
    for size in sizes.train:
        rows.append(_train_row(size, sizes, device))
        if device.startswith("cuda"):
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats()
        jax.clear_caches()
    return rows


def _train_row(size: str, sizes: Sizes, device: str) -> dict:
    import torch
    from common import interleaved, random_text_batch, random_unit_embeddings, torch_contrastive_loss, torch_model

    from cfir_jax.train.data import TrainData
    from cfir_jax.train.state import init_state, make_setup
    from cfir_jax.train.step import global_batch_arrays, make_train_step

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
    return {"what": f"train step {size} bf16", "batch": b, "jax_seq_s": b / t["jax"].median,
            "torch_seq_s": b / t["torch"].median, "ratio": t["torch"].median / t["jax"].median,
            "jax_peak_bytes": peak_bytes(), "torch_peak_bytes": torch_peak}


def encode_rows(sizes: Sizes) -> list[dict]:
    """Text (eval encoder) and image (image-cache encoding step) throughput of the largest size measured."""
    import jax
    from common import interleaved, random_text_batch

    from cfir_jax.index.image_encoding import ImageEncoder
    from cfir_jax.model import beit3 as model_lib
    from cfir_jax.train.state import init_state, make_setup
    from cfir_jax.train.step import make_encoder

    size = sizes.train[-1]
    cfg = _model_config(size)
    b = sizes.encode_batch
    cfg.train.global_batch = b
    setup = make_setup(cfg, 1000, None, 10)
    state, frozen = init_state(cfg, setup, None)
    encoder = make_encoder(cfg, setup)
    ids, mask = random_text_batch(b, cfg.train.max_text_len, cfg.model.vocab_size)
    text = lambda: jax.block_until_ready(encoder(state["params"], frozen, ids, mask))  # noqa: E731
    model = model_lib.create_model(cfg.model)
    images = ImageEncoder(model, "bfloat16", b)
    pixels = np.random.default_rng(0).normal(size=(images.batch_size, images.image_size, images.image_size, 3))
    pixels = pixels.astype(np.float32)
    image = lambda: jax.block_until_ready(images(pixels))  # noqa: E731
    t = interleaved({"text": text, "image": image}, sizes.steps, warmup=1)
    return [{"what": f"text encoding {size} bf16", "batch": b, "jax_seq_s": b / t["text"].median,
             "jax_peak_bytes": peak_bytes()},
            {"what": f"image encoding {size} bf16 {images.image_size}px", "batch": images.batch_size,
             "jax_seq_s": images.batch_size / t["image"].median, "jax_peak_bytes": peak_bytes()}]


def sr_rows(sizes: Sizes) -> list[dict]:
    """Device SR ms/query over a resident float16 cache: one query per call, and sizes.sr_queries per call."""
    from common import random_unit_embeddings

    from cfir_jax.search.device_sr import DeviceCache

    rng = np.random.default_rng(0)
    cache = np.empty((sizes.cache_rows, sizes.cache_dim), np.float16)
    for start in range(0, sizes.cache_rows, 262_144):  # in blocks: a float32 copy of 4M x 768 would be 12 GB
        stop = min(start + 262_144, sizes.cache_rows)
        cache[start:stop] = random_unit_embeddings(stop - start, sizes.cache_dim, start)
    dc = DeviceCache(cache, k=1000, dtype="float16", query_batch=sizes.sr_queries)
    n_q = sizes.sr_queries
    queries = random_unit_embeddings(n_q, sizes.cache_dim, 7)
    unions = [np.unique(rng.integers(0, sizes.cache_rows, sizes.union)) for _ in range(n_q)]
    dc.score_batch(queries[:1], unions[:1])  # compile both shapes
    dc.score_batch(queries, unions)
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
                     "jax_peak_bytes": peak_bytes()})
    return rows


def _tiny_bart(directory: str) -> str:
    """A random 1-layer BART with a byte-level tokenizer (the CPU mode's stand-in for BART-large-CNN)."""
    import torch
    from transformers import BartConfig, BartForConditionalGeneration, BartTokenizer
    from transformers.models.gpt2.tokenization_gpt2 import bytes_to_unicode

    vocab = {"<s>": 0, "<pad>": 1, "</s>": 2, "<unk>": 3}
    for symbol in sorted(set(bytes_to_unicode().values())):
        vocab[symbol] = len(vocab)
    vocab["<mask>"] = len(vocab)
    Path(directory, "vocab.json").write_text(json.dumps(vocab))
    Path(directory, "merges.txt").write_text("#version: 0.2\n")
    BartTokenizer(f"{directory}/vocab.json", f"{directory}/merges.txt").save_pretrained(directory)
    torch.manual_seed(0)
    config = BartConfig(vocab_size=len(vocab), d_model=32, encoder_layers=1, decoder_layers=1,
                        encoder_attention_heads=2, decoder_attention_heads=2, encoder_ffn_dim=32, decoder_ffn_dim=32,
                        max_position_embeddings=160, forced_bos_token_id=0, forced_eos_token_id=2)
    BartForConditionalGeneration(config).save_pretrained(directory)
    return directory


def bart_rows(sizes: Sizes) -> list[dict]:
    """BART's summaries/s at the index's batch (8 rows per device, data parallel) and ms per lone query document (one
    row per device: a served query's summary stage), float32 (the paper's) and bfloat16. On an accelerator: BART-large-
    CNN's architecture with random weights (benchmarks/realsize.py; nothing downloaded): time and memory only."""
    import jax

    from cfir_jax.nlp.bart import BartSummarizer

    texts = [f"Document {i} about the history of the city, its rivers, bridges and people. " * 60
             for i in range(sizes.bart_docs)]
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        if sizes.bart == "tiny":
            name = _tiny_bart(tmp)
        else:
            from realsize import BART_SHAPES, write_bart

            name = f"{tmp}/bart-large-cnn"
            write_bart(Path(name), BART_SHAPES["large"]["bart-large-cnn"], texts)
        max_input = 128 if sizes.bart == "tiny" else 1024
        for dtype in ("float32", "bfloat16"):
            s = BartSummarizer(name, max_length=64 if sizes.bart != "tiny" else 16, min_length=8, num_beams=4,
                               max_input_tokens=max_input, batch_size=8, dtype=dtype)
            s.summarize(texts[: s.rows_per_call])  # compile the index's batch
            t = time.perf_counter()
            s.summarize(texts)
            seconds = time.perf_counter() - t
            rows.append({"what": f"BART summaries ({sizes.bart}, 4 beams, {dtype}, {len(jax.local_devices())} "
                                 "devices)", "batch": s.rows_per_call, "summaries_s": sizes.bart_docs / seconds,
                         "jax_peak_bytes": peak_bytes()})
            s.summarize(texts[:1])  # compile the lone query's row bucket
            lone = []
            for text in texts[1:4]:
                t = time.perf_counter()
                s.summarize([text])
                lone.append(time.perf_counter() - t)
            rows.append({"what": f"BART one query document ({sizes.bart}, {dtype}): a served query's summary",
                         "batch": 1, "ms_per_doc": 1e3 * float(np.median(lone)), "jax_peak_bytes": peak_bytes()})
    return rows


def markdown(result: dict) -> str:
    lines = [f"{result['mode']}", "", f"{result['hardware']}", "",
             "| measurement | batch | jax | torchscale | jax/torch | peak device memory (jax / torch) |",
             "|---|---|---|---|---|---|"]
    gib = lambda b: "-" if b is None else f"{b / 2**30:.2f} GiB"  # noqa: E731
    for r in result["rows"]:
        if "ms_per_query" in r:
            jax_cell = f"{r['ms_per_query']:.2f} ms/query (paper {r['paper_ms']} ms)"
        elif "ms_per_doc" in r:
            jax_cell = f"{r['ms_per_doc']:.1f} ms/document"
        elif "summaries_s" in r:
            jax_cell = f"{r['summaries_s']:.1f} summaries/s"
        else:
            jax_cell = f"{r['jax_seq_s']:.1f} seq/s"
        torch_cell = f"{r['torch_seq_s']:.1f} seq/s" if "torch_seq_s" in r else "-"
        ratio = f"{r['ratio']:.2f}x" if "ratio" in r else "-"
        lines.append(f"| {r['what']} | {r.get('batch', '-')} | {jax_cell} | {torch_cell} | {ratio} | "
                     f"{gib(r.get('jax_peak_bytes'))} / {gib(r.get('torch_peak_bytes'))} |")
    lines += ["", f"total {result['seconds']:.0f} s", "",
              "The served query at the paper's sizes (spaCy, BART, the base text tower, SR over 4M rows, over HTTP): "
              "`python benchmarks/realsize.py build --out /tmp/rs --size base` (about 11 min on 2 CPU cores, 10 GB "
              "of disk), then `python benchmarks/realsize.py serve --out /tmp/rs` (docs/real-size.md)."]
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="benchmarks/accelerator_results")
    parser.add_argument("--tiny", action="store_true", help="tiny sizes even on an accelerator (a smoke run)")
    args = parser.parse_args()
    start = time.perf_counter()
    import jax
    import torch
    from common import hardware_description

    backend = jax.default_backend()
    accelerated = backend in ("gpu", "cuda", "rocm", "tpu")
    if accelerated and not args.tiny:
        sizes, mode = FULL, f"accelerator measurements on {jax.devices()[0].device_kind} ({backend})"
    else:
        sizes = TINY
        mode = ("no accelerator on this host (jax backend: cpu): the same code paths at tiny sizes; these figures "
                "are NOT accelerator figures" if not accelerated else "tiny smoke run (--tiny) on the accelerator")
    print(mode, flush=True)
    device = "cuda" if backend in ("gpu", "cuda") and torch.cuda.is_available() else "cpu"
    rows = []
    for name, section in (("train", lambda: train_rows(sizes, device)), ("encoding", lambda: encode_rows(sizes)),
                          ("device SR", lambda: sr_rows(sizes)), ("BART", lambda: bart_rows(sizes))):
        t = time.perf_counter()
        rows += section()
        print(f"{name}: done in {time.perf_counter() - t:.0f} s (total {time.perf_counter() - start:.0f} s)",
              flush=True)
    result = {"mode": mode, "accelerator": accelerated and not args.tiny, "hardware": hardware_description(),
              "rows": rows, "seconds": time.perf_counter() - start}
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "accelerator.json").write_text(json.dumps(result, indent=1) + "\n")
    (out / "accelerator.md").write_text(markdown(result))
    print(markdown(result))
    print(f"wrote {out}/accelerator.json and accelerator.md", file=sys.stderr)


if __name__ == "__main__":
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    main()
