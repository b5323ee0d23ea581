"""Shared helpers of the encoder and training benchmarks: the machine, interleaved timing, the torchscale side.

The benchmark scripts run as `python benchmarks/<name>.py`, so this module is imported as `common` (the script's
directory is first on sys.path; an unrelated `benchmarks` package is installed in the venv, so it is not imported
as `benchmarks.common`).

Machines running these are shared with other jobs, so every comparison is interleaved: one iteration of each
implementation in turn, repeated, and medians compared. A load spike then hits both sides alike.
"""

from __future__ import annotations

import dataclasses
import os
import platform
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:  # `configs/` (the shipped configs) is imported from the repository root
    sys.path.insert(1, str(REPO))

# torchscale's trainable set equivalent to the config's LANGUAGE_EXPERT rule: every B branch of the multiway
# modules (layers, the B position table, the final B LayerNorm), the language head and the temperature.
TORCH_TRAINABLE = (".B.", "language_head.", "logit_scale")


def cpu_flags() -> set[str]:
    """The vector ISA extensions that decide whether bf16 runs natively (avx512_bf16, amx_bf16) or is emulated."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return set()
    for line in text.splitlines():
        if line.startswith("flags"):
            flags = set(line.split(":", 1)[1].split())
            return {f for f in flags if f.startswith(("avx", "amx", "fma"))}
    return set()


def hardware_description() -> str:
    """One line: CPU model, cores, vector ISA, load, and the library versions being compared."""
    model = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
    isa = ",".join(sorted(cpu_flags())) or "?"
    parts = [f"{model}, {os.cpu_count()} cpus, isa {isa}, load {load:.1f}"]
    import jax

    parts.append(f"jax {jax.__version__} on {jax.devices()[0].platform} x{jax.device_count()}")
    if "torch" in sys.modules:
        torch = sys.modules["torch"]
        parts.append(f"torch {torch.__version__} ({torch.get_num_threads()} threads)")
    flags = os.environ.get("XLA_FLAGS")
    if flags:
        parts.append(f"XLA_FLAGS={flags}")
    return "; ".join(parts)


@dataclasses.dataclass
class Timings:
    """Seconds of each timed iteration of one implementation."""

    name: str
    seconds: list[float]

    @property
    def median(self) -> float:
        return statistics.median(self.seconds)

    def spread(self) -> str:
        """'median (min-max)' in seconds."""
        return f"{self.median:.3f}s ({min(self.seconds):.3f}-{max(self.seconds):.3f})"


def interleaved(runners: dict[str, Callable[[], Any]], steps: int, warmup: int = 1) -> dict[str, Timings]:
    """Times each runner `steps` times, alternating between them; `warmup` untimed calls each first (compiles).

    A runner must block until its work is done (`jax.block_until_ready`, or torch's synchronous CPU ops).
    """
    for fn in runners.values():
        for _ in range(warmup):
            fn()
    out = {name: Timings(name, []) for name in runners}
    for i in range(steps):
        # Alternate the order too, so neither side always runs right after the other's cache-evicting step.
        names = list(runners) if i % 2 == 0 else list(reversed(runners))
        for name in names:
            t = time.perf_counter()
            runners[name]()
            out[name].seconds.append(time.perf_counter() - t)
    return out


def random_text_batch(batch: int, seq: int, vocab: int, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """(ids [batch, seq] int32, padding_mask [batch, seq] bool, True = pad): BOS first, lengths in [seq/2, seq]."""
    rng = np.random.default_rng(seed)
    ids = rng.integers(4, vocab, size=(batch, seq)).astype(np.int32)
    ids[:, 0] = 0
    lengths = rng.integers(max(seq // 2, 2), seq + 1, size=batch)
    mask = np.arange(seq)[None, :] >= lengths[:, None]
    ids[mask] = 1
    return ids, mask


def random_unit_embeddings(n: int, dim: int, seed: int = 0) -> np.ndarray:
    """[n, dim] float32 rows of unit L2 norm (stand-ins for cached image embeddings)."""
    x = np.random.default_rng(seed).normal(size=(n, dim)).astype(np.float32)
    return x / np.linalg.norm(x, axis=1, keepdims=True)


# ----------------------------------------------------------------------------------------------------- torchscale


def load_torch_reference():
    """The `tests/helpers/torch_reference.py` module (torchscale with its timm stand-in), threads set to all cores."""
    sys.path.insert(0, str(REPO / "tests" / "helpers"))
    try:
        import torch_reference
    except ImportError as e:  # torchscale is an optional extra
        raise SystemExit(f"the PyTorch side needs torch and torchscale ({e}): pip install -e '.[torch]' and "
                         "torchscale/fairscale with --no-deps (see .ci/run)") from e
    import torch

    torch.set_num_threads(os.cpu_count() or 1)
    return torch_reference


def torch_model(model_cfg, dropout: float = 0.0, full: bool = False):
    """torchscale BEiT3 + retrieval heads in train mode with only the language expert trainable, or with `full`
    everything the config's "full" set trains (both experts, both heads, the embeddings, the temperature; not the
    unused mask token).

    `dropout` is put on each layer's residual-branch dropout, the two places the JAX Block drops (torchscale's
    other dropouts, on the embedding, inside the FFN and on the attention probabilities, stay at 0).
    Returns (model, trainable parameters).
    """
    ref = load_torch_reference()
    model = ref.TorchRetrieval(model_cfg).train()
    for layer in model.beit3.encoder.layers:
        layer.dropout_module.p = dropout
    trainable = []
    for name, p in model.named_parameters():
        p.requires_grad_("mask_token" not in name if full else any(t in name for t in TORCH_TRAINABLE))
        if p.requires_grad:
            trainable.append(p)
    return model, trainable


def torch_contrastive_loss(text, image, logit_scale):
    """The symmetric InfoNCE of `cfir_jax.training.loss.contrastive_loss` (float32 logits), in torch, on the device
    of its inputs (the labels are made there: a CPU tensor beside CUDA logits stops cross_entropy)."""
    import torch
    import torch.nn.functional as F

    logits = logit_scale.float().exp() * text.float() @ image.float().T
    labels = torch.arange(text.shape[0], device=logits.device)
    return 0.5 * (F.cross_entropy(logits, labels) + F.cross_entropy(logits.T, labels))


def torch_adamw_step(trainable, loss_fn: Callable[[], Any], bf16: bool, lr: float = 1e-4,
                     weight_decay: float = 0.05) -> Callable[[], float]:
    """A closure running one torch.optim.AdamW step of `trainable` on `loss_fn()`'s loss; returns the loss.

    bf16 runs the forward pass (and the loss) under `torch.autocast("cpu", torch.bfloat16)`; the backward pass
    follows autocast's recorded casts, parameters and optimizer state stay float32.
    """
    import torch

    opt = torch.optim.AdamW(trainable, lr=lr, weight_decay=weight_decay)

    def step() -> float:
        opt.zero_grad(set_to_none=True)
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
            loss = loss_fn()
        loss.backward()
        opt.step()
        return float(loss.detach())

    return step


def torch_train_step(model, trainable, ids: np.ndarray, mask: np.ndarray, images: np.ndarray, bf16: bool,
                     **adamw) -> Callable[[], float]:
    """One AdamW step of the language expert on a fixed batch against fixed image embeddings (`torch_adamw_step`)."""
    import torch

    t_ids, t_mask, t_img = torch.from_numpy(ids).long(), torch.from_numpy(mask), torch.from_numpy(images)

    def loss():
        emb, _ = model.encode_text(t_ids, t_mask)
        return torch_contrastive_loss(emb, t_img, model.logit_scale)

    return torch_adamw_step(trainable, loss, bf16, **adamw)


def torch_full_step(model, trainable, pixels: np.ndarray, ids: np.ndarray, mask: np.ndarray, bf16: bool,
                    **adamw) -> Callable[[], float]:
    """One AdamW step of the whole model (D-BEiT-3 Full) on a fixed batch (`torch_adamw_step`): as the JAX Full step,
    uint8 NHWC pixels are normalised to [-1, 1] inside the step and encoded by the vision expert, the texts by the
    language expert, then the symmetric contrastive loss."""
    import torch

    t_pix = torch.from_numpy(pixels).permute(0, 3, 1, 2).contiguous()
    t_ids, t_mask = torch.from_numpy(ids).long(), torch.from_numpy(mask)

    def loss():
        image, _ = model.encode_image((t_pix.float() / 255.0 - 0.5) / 0.5)
        text, _ = model.encode_text(t_ids, t_mask)
        return torch_contrastive_loss(text, image, model.logit_scale)

    return torch_adamw_step(trainable, loss, bf16, **adamw)


def torch_encoder(model, ids: np.ndarray, mask: np.ndarray, bf16: bool) -> Callable[[], Any]:
    """A closure encoding a fixed batch of texts without gradients: [batch, dim] embeddings."""
    import torch

    t_ids, t_mask = torch.from_numpy(ids).long(), torch.from_numpy(mask)

    def encode():
        with torch.inference_mode(), torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
            return model.encode_text(t_ids, t_mask)[0]

    return encode


def ratio_line(label: str, jax_t: Timings, torch_t: Timings, items: int, unit: str) -> str:
    """'label: jax X unit/s (median s), torch Y unit/s, jax/torch = R x' from per-iteration timings."""
    j, t = items / jax_t.median, items / torch_t.median
    return (f"{label:<34} jax {j:8.1f} {unit}/s [{jax_t.spread()}]   torch {t:8.1f} {unit}/s "
            f"[{torch_t.spread()}]   jax/torch {j / t:5.2f}x")


def spacy_pipe_rate(entities_config, texts: list[str], n_process: int, start: str) -> tuple[float, list]:
    """Documents/s of spaCy's own `nlp.pipe` over `texts` with the index's pipeline and labels (`entities_config`:
    a config's index.entities), and the entities EntityExtractor reads from each document. With n_process > 1,
    spaCy's own worker processes, started by `start` ("fork": after the model loaded here; "forkserver": each
    loads it again, as a process that has started JAX must)."""
    import multiprocessing

    import spacy.language

    from cfir_jax.nlp.entities import EntityExtractor, load_spacy

    extractor = EntityExtractor(load_spacy(entities_config.spacy_model or None), entities_config.labels)
    list(extractor.extract(texts[:8]))  # warm
    spacy.language.mp = multiprocessing.get_context(start)
    t0 = time.perf_counter()
    found = [extractor.entities_of_doc(d) for d in extractor.nlp.pipe(texts, batch_size=extractor.batch_size,
                                                                       n_process=n_process)]
    return len(texts) / (time.perf_counter() - t0), found
