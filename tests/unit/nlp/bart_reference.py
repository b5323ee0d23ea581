"""transformers' Flax BART `generate` as an oracle, run in its own process: `python bart_reference.py IN.npz OUT.npy`.

The Flax classes exist only in transformers 4.x. The test set keeps a copy of 4.x in a side directory
(scripts/setup.sh: .venv/oracle-transformers4) that `flax_generate` puts first on the subprocess's PYTHONPATH, so the
project itself may run on transformers 5.x. IN.npz holds model_dir, input_ids, attention_mask and the generation
settings as JSON; the n-gram rule is the project's dense mask (transformers' own fails under current jax).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[3]
ORACLE = Path(os.environ.get("CFIR_TRANSFORMERS4", ROOT / ".venv" / "oracle-transformers4"))


def flax_generate(model_dir, input_ids, attention_mask, settings: dict, tmp_path) -> np.ndarray:
    """Sequences [docs, <= max_length] of transformers' Flax generate, from a subprocess."""
    request, out = Path(tmp_path) / "flax_request.npz", Path(tmp_path) / "flax_out.npy"
    np.savez(request, input_ids=input_ids, attention_mask=attention_mask,
             meta=np.array(json.dumps({"model_dir": str(model_dir), **settings})))
    _run(request, out)
    return np.load(out)


def _run(*args) -> None:
    paths = [str(ORACLE)] if ORACLE.is_dir() else []
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([*paths, str(ROOT), os.environ.get("PYTHONPATH", "")]),
           "JAX_PLATFORMS": "cpu"}
    done = subprocess.run([sys.executable, __file__, *map(str, args)], env=env, capture_output=True, text=True,
                          timeout=3600)
    assert done.returncode == 0, f"Flax reference failed (transformers 4.x at {ORACLE}?):\n{done.stderr[-3000:]}"


def save_flax(model_dir, out_dir) -> None:
    """model_dir's PyTorch weights saved by transformers' Flax BART (flax_model.msgpack) to out_dir."""
    _run("save-flax", model_dir, out_dir)


def _save_flax(model_dir: str, out_dir: str) -> None:
    from transformers import FlaxBartForConditionalGeneration

    FlaxBartForConditionalGeneration.from_pretrained(model_dir, from_pt=True).save_pretrained(out_dir)


def main(request: str, out: str) -> None:
    import jax
    import jax.numpy as jnp
    from transformers import FlaxBartForConditionalGeneration, GenerationConfig
    from transformers.generation.flax_logits_process import FlaxLogitsProcessor, FlaxLogitsProcessorList

    from cfir_jax.nlp.ngram import no_repeat_ngram_mask

    data = np.load(request)
    meta = json.loads(str(data["meta"]))
    model_dir, n = meta.pop("model_dir"), meta.pop("no_repeat_ngram_size")
    model = FlaxBartForConditionalGeneration.from_pretrained(model_dir, from_pt=True, dtype=jnp.float32)
    config = GenerationConfig.from_dict({**model.generation_config.to_dict(), **meta, "do_sample": False,
                                         "no_repeat_ngram_size": 0})

    class NoRepeat(FlaxLogitsProcessor):
        def __call__(self, input_ids, scores, cur_len):
            return jnp.where(no_repeat_ngram_mask(input_ids, cur_len, n, scores.shape[-1]), -jnp.inf, scores)

    processors = FlaxLogitsProcessorList([NoRepeat()] if n else [])
    # The weights are an argument, not constants folded into the program (BART-large's would be copied into it).
    fn = jax.jit(lambda params, ids, mask: model.generate(ids, attention_mask=mask, params=params,
                                                          generation_config=config,
                                                          logits_processor=processors).sequences)
    np.save(out, np.asarray(fn(model.params, data["input_ids"], data["attention_mask"])))


if __name__ == "__main__":
    if sys.argv[1] == "save-flax":
        _save_flax(*sys.argv[2:4])
    else:
        main(*sys.argv[1:3])
