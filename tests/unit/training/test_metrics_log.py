"""The training metrics log (cfir_jax.training.monitor.MetricsLog): TensorBoard events written by tensorboardX, which
imports PyTorch whenever it is installed; the log imports it without (torch is never a JAX user's runtime need)."""

import importlib.util
import json
import os
import subprocess
import sys

from repo import ROOT

_LOG_TWO_STEPS = """
import json, sys
from pathlib import Path
from cfir_jax.training.monitor import MetricsLog
log = MetricsLog(Path(sys.argv[1]), 0, tensorboard=True)
log.write(1, {"loss": 2.5})
log.write(2, {"loss": 1.5})
log.close()
print(json.dumps({"torch": "torch" in sys.modules, "writer": log.writer is not None}))
"""


def test_tensorboard_events_are_written_without_importing_torch(tmp_path):
    assert importlib.util.find_spec("torch") is not None  # installed (the test set): tensorboardX would import it
    proc = subprocess.run([sys.executable, "-c", _LOG_TWO_STEPS, str(tmp_path)], cwd=ROOT, capture_output=True,
                          text=True, timeout=300, env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert json.loads(proc.stdout.splitlines()[-1]) == {"torch": False, "writer": True}
    events = list((tmp_path / "tensorboard").glob("events.out.tfevents.*"))
    assert len(events) == 1 and b"loss" in events[0].read_bytes()
    lines = (tmp_path / "metrics.jsonl").read_text().splitlines()
    assert [json.loads(line) for line in lines] == [{"loss": 2.5, "step": 1}, {"loss": 1.5, "step": 2}]
