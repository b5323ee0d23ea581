"""BART-large-CNN's summaries on this host: transformers' Flax `generate` (4.x) against the project's own BART
(nlp.bart_generate, what BartSummarizer runs), in one process and one run, on the same random-weight model and
the same token ids: ms per lone document and summaries/s at the index's batch, float32, 4 beams, <= 64 tokens.

    flock /tmp/cfir-bench.lock python benchmarks/bart_generate.py --docs 8 --tokens 1024

transformers 5.x has no Flax BART: then the side copy of 4.x that the test set installs (scripts/setup.sh,
.venv/oracle-transformers4, or --oracle) is put first on sys.path for the reference.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(1, str(REPO))
os.environ.setdefault("JAX_PLATFORMS", "cpu")

SETTINGS = dict(max_length=64, min_length=8, num_beams=4, length_penalty=2.0, no_repeat_ngram_size=3)


def _timed(fn, *args):
    """(the result, its wall-clock seconds)."""
    t = time.perf_counter()
    out = fn(*args)
    out = out.block_until_ready() if hasattr(out, "block_until_ready") else out
    return out, time.perf_counter() - t


def flax_reference(model_dir: str):
    """transformers' Flax generate with CFIR's settings (the dense n-gram rule as its processor), jitted."""
    import jax
    import jax.numpy as jnp
    from transformers import FlaxBartForConditionalGeneration, GenerationConfig
    from transformers.generation.flax_logits_process import FlaxLogitsProcessor, FlaxLogitsProcessorList

    from cfir_jax.nlp.ngram import no_repeat_ngram_mask

    model = FlaxBartForConditionalGeneration.from_pretrained(model_dir, from_pt=True, dtype=jnp.float32)
    config = GenerationConfig.from_dict({**model.generation_config.to_dict(), **SETTINGS, "do_sample": False,
                                         "no_repeat_ngram_size": 0})

    class NoRepeat(FlaxLogitsProcessor):
        def __call__(self, input_ids, scores, cur_len):
            mask = no_repeat_ngram_mask(input_ids, cur_len, SETTINGS["no_repeat_ngram_size"], scores.shape[-1])
            return jnp.where(mask, -jnp.inf, scores)

    fn = jax.jit(lambda p, ids, mask: model.generate(ids, attention_mask=mask, params=p, generation_config=config,
                                                     logits_processor=FlaxLogitsProcessorList([NoRepeat()]))
                 .sequences)
    return fn, model.params


def own(model_dir: str):
    """The summarizer's generation function (one device)."""
    import jax
    import numpy as np
    from flax import nnx

    from cfir_jax.nlp import bart as bart_lib
    from cfir_jax.nlp import bart_generate
    from cfir_jax.nlp import summarizer as summarizer_lib

    raw = bart_lib.read_config(Path(model_dir))
    settings = summarizer_lib.generation_settings(raw, None, **SETTINGS)
    graphdef, state = nnx.split(bart_lib.load_bart(Path(model_dir)))
    mesh = jax.sharding.Mesh(np.array(jax.devices()[:1]), ("data",))
    return summarizer_lib.data_parallel(bart_generate.make_generate(graphdef, settings), mesh), state


def write_random_bart(directory: Path) -> None:
    import jax.numpy as jnp
    from flax import nnx

    from cfir_jax.nlp import bart as bart_lib
    from cfir_jax.nlp.bart_summarizer import published_config

    config = published_config("facebook/bart-large-cnn")
    model = bart_lib.Bart(bart_lib.BartConfig.from_dict(config), jnp.float32, nnx.Rngs(0))
    bart_lib.save_bart(model, directory, config)


def measure(name: str, make, docs, lone) -> tuple[dict, object]:
    """Load, compile (ahead of time, not timed) and time one call of one path: the lone document, then the batch."""
    t = time.perf_counter()
    fn, params = make()
    row = {"path": name, "load_s": round(time.perf_counter() - t, 1)}
    out = None
    for what, (ids, mask) in (("lone", lone), ("batch", docs)):
        t = time.perf_counter()
        compiled = fn.lower(params, ids, mask).compile()
        row[f"{what}_compile_s"] = round(time.perf_counter() - t, 1)
        out, seconds = _timed(compiled, params, ids, mask)
        row[f"{what}_s"] = round(seconds, 2)
    row["batch"] = int(docs[0].shape[0])
    row["lone_ms"] = round(row["lone_s"] * 1000)
    row["summaries_s"] = round(row["batch"] / row["batch_s"], 3)
    print(json.dumps(row), flush=True)
    return row, out


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--docs", type=int, default=8, help="the index's batch (index.summaries.batch_size)")
    parser.add_argument("--tokens", type=int, default=1024)
    parser.add_argument("--oracle", default=str(REPO / ".venv" / "oracle-transformers4"))
    parser.add_argument("--json", default="")
    args = parser.parse_args()
    if int(importlib.metadata.version("transformers").split(".")[0]) >= 5:
        sys.path.insert(0, args.oracle)
    import numpy as np

    uptime = lambda: subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip()  # noqa: E731
    print("load before:", uptime(), flush=True)
    rng = np.random.default_rng(0)
    ids = rng.integers(4, 50264, (args.docs, args.tokens)).astype(np.int32)
    ids[:, 0], ids[:, -1] = 0, 2
    mask = np.ones_like(ids)
    with tempfile.TemporaryDirectory() as tmp:
        write_random_bart(Path(tmp))  # random weights, BART-large-CNN's shape
        rows, outs = [], []
        for name, make in (("transformers Flax generate", lambda: flax_reference(tmp)),
                           ("own BART (nlp.bart_generate)", lambda: own(tmp))):
            row, out = measure(name, make, (ids, mask), (ids[:1], mask[:1]))
            rows.append(row)
            outs.append(np.asarray(out))
    same = sum(a.tolist() == b.tolist() for a, b in zip(*outs))
    result = {"rows": rows, "same_tokens": f"{same}/{args.docs}", "load_after": uptime(), "tokens": args.tokens,
              **SETTINGS}
    print(json.dumps(result), flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
