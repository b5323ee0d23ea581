"""Device-resident SR: equal to exact numpy scoring on 8 fake devices (sharded), one compilation per bucket."""

import json
import os
import subprocess
import sys

import numpy as np
import pytest
import sr_device_worker
from repo import ROOT

from cfir_jax.core.errors import CfirError
from cfir_jax.search.device_sr import DeviceCache, bucket_size

WORKER = str(ROOT / "tests" / "helpers" / "sr_device_worker.py")
CHECKS = sorted(n for n in vars(sr_device_worker) if n.startswith("check_"))


@pytest.fixture(scope="module")
def eight_device_results(tmp_path_factory) -> dict:
    """Every check of sr_device_worker.py, run once in one process with 8 CPU devices."""
    out = tmp_path_factory.mktemp("sr_device") / "results.json"
    env = dict(os.environ, JAX_PLATFORMS="cpu", XLA_FLAGS="--xla_force_host_platform_device_count=8")
    proc = subprocess.run([sys.executable, WORKER, str(out)], env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(out.read_text())


@pytest.mark.parametrize("check", CHECKS)
def test_on_eight_devices(eight_device_results, check):
    assert check in eight_device_results
    assert eight_device_results[check] == "", eight_device_results[check]


def test_a_cache_fits_one_device_unless_the_device_reports_too_little_memory():
    """The decision of sr_device_shard='auto' from a device's memory report (a GPU's or TPU's; the CPU reports
    none): the cache may take half of bytes_limit."""
    from types import SimpleNamespace

    from cfir_jax.search.device_sr import _fits_one_device

    gpu = SimpleNamespace(memory_stats=lambda: {"bytes_limit": 80 << 30, "bytes_in_use": 0})
    assert _fits_one_device(40 << 30, gpu) and not _fits_one_device((40 << 30) + 1, gpu)
    assert _fits_one_device(1 << 40, SimpleNamespace(memory_stats=lambda: None))  # nothing reported: one device
    assert _fits_one_device(1 << 40, object())  # no report at all


def test_bucket_size_rounds_up_to_a_few_shapes():
    assert [bucket_size(m, (8, 64)) for m in (1, 8, 9, 64, 65, 200)] == [8, 8, 64, 64, 128, 256]


def test_out_of_range_candidates_are_refused():
    dc = DeviceCache(sr_device_worker.grid_cache(), k=3, buckets=(16,))
    with pytest.raises(CfirError, match="candidate ids must be in"):
        dc.score_batch(np.zeros((1, sr_device_worker.D), np.float32), [np.array([0, sr_device_worker.N])])


def test_bad_settings_are_refused():
    cache = sr_device_worker.grid_cache()
    with pytest.raises(CfirError, match="float16 or bfloat16"):
        DeviceCache(cache, dtype="int8")
    with pytest.raises(CfirError, match="increasing positive buckets"):
        DeviceCache(cache, buckets=(64, 8))


def test_cache_is_an_argument_not_a_compiled_constant():
    """Closed over, the cache would be embedded in every compiled program (a second copy, minutes at 6 GB)."""
    cache = sr_device_worker.grid_cache(n=20_000)  # 640 KB: as a constant, over a megabyte of program text
    dc = DeviceCache(cache, k=3, buckets=(16,), query_batch=1)
    q, ids = np.zeros((1, sr_device_worker.D), np.float32), np.zeros((1, 16), np.int32)
    assert len(dc._sr.lower(dc.cache, q, ids).as_text()) < cache.nbytes / 4
    assert len(dc._full.lower(dc.cache, q, k=3).as_text()) < cache.nbytes / 4
