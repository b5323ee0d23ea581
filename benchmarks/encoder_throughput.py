"""Text encoder throughput and language-expert training step time: this JAX model vs torchscale, same run.

    python benchmarks/encoder_throughput.py                         # base, batch 32 x 64 tokens, fp32 and bf16
    python benchmarks/encoder_throughput.py --size tiny --steps 3   # smoke run
    python benchmarks/encoder_throughput.py --jax scan,unrolled,scan+remat --precision fp32   # layouts side by side
    XLA_FLAGS=--xla_cpu_use_onednn=true python benchmarks/encoder_throughput.py   # try an XLA:CPU switch

Two measurements per precision, each interleaved iteration by iteration with the PyTorch reference so that load
from other jobs hits both alike (compare the ratios):
  encode  deterministic text encoding of a fixed batch (sequences/s), no gradients;
  train   one AdamW step of the language expert (every B branch, the B positions and final B LayerNorm, the language
          head, logit_scale; the token table and the vision side frozen) with the symmetric contrastive loss
          against fixed unit image embeddings (s/step).
Precisions: fp32 against fp32; bf16 compute with float32 parameters (`model_config(dtype="bfloat16")`) against
`torch.autocast("cpu", dtype=torch.bfloat16)`. Both sides use random weights (speed does not depend on them), the
same token batch (lengths between seq/2 and seq, padding masked) and `os.cpu_count()` threads.
"""

from __future__ import annotations

import argparse
import os
import time

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax
import jax.numpy as jnp
import numpy as np
import optax
from common import (
    hardware_description,
    interleaved,
    random_text_batch,
    random_unit_embeddings,
    ratio_line,
    torch_encoder,
    torch_model,
    torch_train_step,
)
from flax import nnx

from cfir_jax.core.config import LANGUAGE_EXPERT, model_config
from cfir_jax.model.beit3 import create_model
from cfir_jax.training.loss import contrastive_loss
from cfir_jax.training.optim import trainable_filter

GOAL = 1.5  # the jax/torch speed ratio the project aims for at each precision


class JaxTextSide:
    """The text tower split into trainable params and frozen (pure dicts), with a jitted encoder and AdamW step."""

    def __init__(self, cfg, ids: np.ndarray, mask: np.ndarray, images: np.ndarray, lr: float = 1e-4,
                 weight_decay: float = 0.05):
        tower = create_model(cfg).text_tower()
        graphdef, params, frozen = nnx.split(tower, trainable_filter(LANGUAGE_EXPERT), ...)
        self.params, self.frozen = nnx.to_pure_dict(params), nnx.to_pure_dict(frozen)
        # The same optimizer as the torch side: AdamW with decay on every trainable tensor.
        tx = optax.adamw(lr, weight_decay=weight_decay)
        self.opt_state = tx.init(self.params)
        self.ids, self.mask, self.images = jnp.asarray(ids), jnp.asarray(mask), jnp.asarray(images)

        def encode(params, frozen, ids, mask):
            return nnx.merge(graphdef, params, frozen).encode_text(ids, mask)

        def step(params, opt_state, frozen, ids, mask, images):
            def loss_fn(p):
                emb = encode(p, frozen, ids, mask)
                return contrastive_loss(emb, images, p["logit_scale"])[0]

            loss, grads = jax.value_and_grad(loss_fn)(params)
            updates, opt_state = tx.update(grads, opt_state, params)
            return optax.apply_updates(params, updates), opt_state, loss

        self._encode = jax.jit(encode)
        self._step = jax.jit(step, donate_argnums=(0, 1))

    def compile(self) -> tuple[float, float]:
        """Ahead-of-time compiles both functions; returns their compile seconds (encode, train)."""
        t = time.perf_counter()
        self._encode = self._encode.lower(self.params, self.frozen, self.ids, self.mask).compile()
        t_enc = time.perf_counter() - t
        t = time.perf_counter()
        self._step = self._step.lower(self.params, self.opt_state, self.frozen, self.ids, self.mask,
                                      self.images).compile()
        return t_enc, time.perf_counter() - t

    def encode(self) -> jax.Array:
        return jax.block_until_ready(self._encode(self.params, self.frozen, self.ids, self.mask))

    def train_step(self) -> float:
        self.params, self.opt_state, loss = self._step(self.params, self.opt_state, self.frozen, self.ids,
                                                       self.mask, self.images)
        return float(loss)  # blocks until the step is done


def parse_variants(text: str) -> list[tuple[str, bool, bool]]:
    """'scan,unrolled+remat' -> [(name, scan_layers, remat)]."""
    out = []
    for name in [v.strip() for v in text.split(",") if v.strip()]:
        layout, _, extra = name.partition("+")
        if layout not in ("scan", "unrolled") or extra not in ("", "remat"):
            raise SystemExit(f"--jax unknown variant {name!r}: use scan, unrolled, scan+remat or unrolled+remat")
        out.append((name, layout == "scan", extra == "remat"))
    if not out:
        raise SystemExit("--jax needs at least one variant")
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--size", choices=("tiny", "base", "large"), default="base")
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--seq", type=int, default=64)
    p.add_argument("--steps", type=int, default=5, help="timed iterations of each side (median reported)")
    p.add_argument("--warmup", type=int, default=1, help="untimed iterations after compilation")
    p.add_argument("--precision", choices=("fp32", "bf16", "both"), default="both")
    p.add_argument("--what", choices=("encode", "train", "both"), default="both")
    p.add_argument("--jax", default="scan", help="JAX variants timed side by side: comma-separated of scan, "
                   "unrolled, scan+remat, unrolled+remat (scan_layers / remat of the model config)")
    p.add_argument("--no-torch", action="store_true", help="time the JAX side alone")
    args = p.parse_args()

    if args.seq + 2 > 1024:
        raise SystemExit(f"--seq {args.seq} exceeds the 1022 text positions")
    precisions = ("fp32", "bf16") if args.precision == "both" else (args.precision,)
    whats = ("encode", "train") if args.what == "both" else (args.what,)
    variants = parse_variants(args.jax)
    base_cfg = model_config(args.size)
    ids, mask = random_text_batch(args.batch, args.seq, base_cfg.vocab_size)
    images = random_unit_embeddings(args.batch, base_cfg.embed_dim, seed=1)

    t_model = None
    if not args.no_torch:
        t_model, t_trainable = torch_model(base_cfg)
        n_train = sum(p.numel() for p in t_trainable)
        print(f"torch trainable parameters: {n_train / 1e6:.1f}M")
    print(hardware_description())
    print(f"size {args.size}, batch {args.batch} x {args.seq} tokens; median of {args.steps} interleaved "
          f"iterations after {args.warmup} warmup")

    results = []
    for precision in precisions:
        dtype = "bfloat16" if precision == "bf16" else "float32"
        sides = {}
        for name, scan, remat in variants:
            sides[name] = JaxTextSide(model_config(args.size, dtype=dtype, scan_layers=scan, remat=remat),
                                      ids, mask, images)
            t_enc, t_train = sides[name].compile()
            print(f"[{precision}] jax {name} compile: encode {t_enc:.1f}s, train step {t_train:.1f}s")
        bf16 = precision == "bf16"
        for what in whats:
            runners = {f"jax {name}": (side.encode if what == "encode" else side.train_step)
                       for name, side in sides.items()}
            if t_model is not None:
                runners["torch"] = (torch_encoder(t_model, ids, mask, bf16) if what == "encode" else
                                    torch_train_step(t_model, t_trainable, ids, mask, images, bf16))
            timings = interleaved(runners, args.steps, args.warmup)
            for name in sides:
                label = f"[{precision}] {what} {name}"
                j = timings[f"jax {name}"]
                if "torch" not in timings:
                    print(f"{label:<34} jax {args.batch / j.median:8.1f} seq/s [{j.spread()}]")
                    continue
                print(ratio_line(label, j, timings["torch"], args.batch, "seq"))
                results.append((label, timings["torch"].median / j.median))
        del sides

    if results:
        print(f"\nsummary (jax speed / torch speed; goal >= {GOAL:.1f}x):")
        for label, ratio in results:
            print(f"  {label:<34} {ratio:5.2f}x  {'met' if ratio >= GOAL else 'NOT met'}")


if __name__ == "__main__":
    main()
