"""A training run's fingerprint, to check a change to the loop leaves training the same to the digit: run it at two
commits and compare the two JSON files.

    PYTHONPATH=. python benchmarks/train_fingerprint.py /tmp/fp_a     # at commit A (then B into /tmp/fp_b)
    python -c "import json,sys; a,b=(json.load(open(f'/tmp/fp_{x}/fingerprint.json')) for x in 'ab'); \
print({k: a[k] == b[k] for k in a})"

Two tiny runs on the CPU (the tests' configs, tests/train_fixtures.py): the text task with 4 random extra
negatives, gradient caching in 2 micro-batches and an export; the Full task over a stand-in pipeline that serves
seeded batches. The fingerprint: a hash of the trained and frozen parameters, metrics.jsonl as written, the last
metrics, each checkpoint's data item, the exported model's files, and timing.jsonl without its times.
"""

from __future__ import annotations

import hashlib
import json
import shutil
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))  # the tests' tiny configs and planted data

import jax  # noqa: E402
import numpy as np  # noqa: E402
from train_fixtures import full_batch, full_config, planted_data, tiny_config  # noqa: E402

from cfir_jax.training import loop  # noqa: E402
from cfir_jax.training.tasks import FullTask, TextTask  # noqa: E402


def _hash(tree) -> str:
    digest = hashlib.sha256()
    for leaf in jax.tree.leaves(jax.device_get(tree)):
        digest.update(np.ascontiguousarray(np.asarray(leaf)).tobytes())
    return digest.hexdigest()[:16]


class SeededBatches:
    """The image pipeline's interface (PairBatches) over seeded tiny batches."""

    steps_per_epoch, skipped = 3, 0

    def __init__(self):
        self.served = 0

    def __next__(self) -> dict:
        self.served += 1
        batch = full_batch(seed=self.served)
        return {"pixels": batch["pixels"], "valid": batch["valid"], "doc_rows": np.arange(8)}

    def get_state(self) -> dict:
        return {"served": self.served}

    def set_state(self, state: dict) -> None:
        self.served = state["served"]


def _run_record(run: Path, result) -> dict:
    timing = [{k: v for k, v in json.loads(line).items() if k != "elapsed_s"}
              for line in (run / "timing.jsonl").read_text().splitlines()]
    return {"params": _hash(result.params), "frozen": _hash(result.frozen),
            "metrics_jsonl": (run / "metrics.jsonl").read_text(), "last": sorted(result.metrics.items()),
            "data_items": [p.read_text() for p in sorted((run / "checkpoints").glob("*/data/metadata"))],
            "checkpoints": sorted(p.name for p in (run / "checkpoints").iterdir()), "timing": timing}


def main(out: Path) -> dict:
    shutil.rmtree(out, ignore_errors=True)
    out.mkdir(parents=True)
    text_cfg = tiny_config(extra_negatives=4, negatives="random", grad_accum_steps=2, export_model="scratch")
    text = loop.run(text_cfg, out / "text", TextTask(planted_data()), progress=False)
    tokens = full_batch(seed=0)
    full = loop.run(full_config(), out / "full", FullTask(SeededBatches(), tokens["ids"], tokens["mask"]),
                    progress=False)
    record = {"text": _run_record(out / "text", text), "full": _run_record(out / "full", full),
              "text_export": sorted(p.name for p in (out / "text" / "model").iterdir())}
    (out / "fingerprint.json").write_text(json.dumps(record, indent=1, default=str))
    return record


if __name__ == "__main__":
    record = main(Path(sys.argv[1] if len(sys.argv) > 1 else "/tmp/train_fingerprint"))
    print(json.dumps({k: v["params"] for k, v in record.items() if isinstance(v, dict)}))
