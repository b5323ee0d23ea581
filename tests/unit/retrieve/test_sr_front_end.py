"""The SR front end's device side, forced on the CPU (JAX's CPU is a device): its warm-up compiles every shape a
served batch sends, every method of a process shares one device copy, a front that scores elsewhere builds none,
and the words the report prints name what scored. Each compares the device side with the CPU side."""

import gc
import types

import ml_collections
import numpy as np
import pytest

from cfir_jax.core.config import retrieval_config
from cfir_jax.retrieve import report, sr
from cfir_jax.retrieve.results import Result
from cfir_jax.search.live_rows import LiveRows
from cfir_jax.serve import resident

N, D = 300, 16


def _rows(seed: int = 0) -> np.ndarray:
    rng = np.random.default_rng(seed)
    rows = rng.normal(size=(N, D)).astype(np.float32)
    return (rows / np.linalg.norm(rows, axis=1, keepdims=True)).astype(np.float16)


def _stores(rows: np.ndarray, fingerprint: str = "cache-a"):
    cache = types.SimpleNamespace(content_fingerprint=fingerprint, num_images=len(rows), embeddings=rows)
    return types.SimpleNamespace(embeddings=rows, live=LiveRows(None, len(rows)), extra={}, cache=cache)


def _rcfg(**values) -> ml_collections.ConfigDict:
    rcfg = retrieval_config()
    rcfg.update({**dict(sr="exact", sr_backend="device", top_k=10, sr_buckets=(32, 128), sr_query_batch=4), **values})
    return rcfg


def _front(rows, backend="device", fingerprint="cache-a", **values) -> sr.SRFrontEnd:
    return sr.SRFrontEnd(_rcfg(sr_backend=backend, **values), _stores(rows, fingerprint), (1.0, 0.0), False)


def _unions(sizes, seed=3) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    return [np.sort(rng.choice(N, m, replace=False)).astype(np.int32) for m in sizes]


def _same_as_cpu(device: sr.SRFrontEnd, cpu: sr.SRFrontEnd, queries, unions) -> None:
    for (ds, dr), (cs, cr) in zip(device.score_unions(queries, unions), cpu.score_unions(queries, unions)):
        np.testing.assert_array_equal(dr, cr)
        np.testing.assert_allclose(ds, cs, atol=1e-5)


def test_warm_up_compiles_every_bucket_at_every_query_batch_so_no_query_compiles():
    rows = _rows(1)
    device, cpu = _front(rows, fingerprint="warm"), _front(rows, "cpu")
    device.warm_up(max_batch=3)  # batches of 1, 2, 3 documents: query batches padded to 1, 2 and 4
    cache = device.device_cache()
    assert cache.traces == 2 * 3  # buckets 32 and 128 (unions of 300 rows go past 128: one more, never warmed)
    rng = np.random.default_rng(0)
    for batch in (1, 2, 3, 1, 3):
        sizes = rng.integers(1, 129, size=batch)
        queries = rng.normal(size=(batch, D)).astype(np.float32)
        _same_as_cpu(device, cpu, queries, _unions(sizes, seed=int(sizes.sum())))
    assert cache.traces == 6, "a query after the warm-up compiled"


def test_warm_up_stops_at_the_configured_query_batch_and_at_the_buckets_a_small_cache_can_reach():
    device = _front(_rows(2), fingerprint="small", sr_buckets=(8, 64, 4096, 16384), sr_query_batch=2)
    device.warm_up(max_batch=16)
    # unions of at most 300 rows reach buckets 8, 64 and 4096, never 16384; query batches 1 and 2
    assert device.device_cache().traces == 3 * 2


def test_warm_up_does_nothing_on_the_cpu_backend():
    cpu = _front(_rows(), "cpu")
    cpu.warm_up(8)
    assert cpu._device is None


class _ServedIndex:
    """What resident.warm_up drives, through `Index`'s verbs: a method's batches (recorded here) and its SR front
    end, on the device."""

    def __init__(self, front: sr.SRFrontEnd):
        self.sr, self.batches = front, []

    def sample_text(self) -> None:
        return None  # no corpus

    def retrieve(self, docs, method):
        self.batches.append(len(docs))
        return [Result("q", (), ("an entity",))]

    def warm_scoring(self, max_batch: int, method: str) -> None:
        self.sr.warm_up(max_batch)


def test_the_service_warm_up_compiles_the_device_sr_of_a_device_retriever():
    """`retrieve.py --serve` with sr_backend=device died here (AttributeError: 'Retriever' object has no attribute
    'sr_rows')."""
    retriever = _ServedIndex(_front(_rows(4), fingerprint="served"))
    resident.warm_up(retriever, "cfir", max_batch=4)
    assert retriever.batches == [1, 2, 4, 1, 1]  # the parse, batches of 2 and 4, the fallback, the unknown entities
    assert retriever.sr.device_cache().traces == 2 * 3  # buckets 32 and 128 at query batches 1, 2 and 4


def test_every_method_of_a_process_scores_on_one_device_copy_of_a_cache():
    rows = _rows(5)
    fronts = [_front(rows, fingerprint="shared") for _ in range(3)]  # three served methods over one cache
    copies = {id(f.device_cache()) for f in fronts}
    assert len(copies) == 1
    other = _front(_rows(6), fingerprint="another cache")
    assert other.device_cache() is not fronts[0].device_cache()
    bf16 = _front(rows, fingerprint="shared", sr_device_dtype="bfloat16")  # another copy: other values on the device
    assert bf16.device_cache() is not fronts[0].device_cache()
    key = [k for k in sr._RESIDENT if k[0] == "shared"]
    assert len(key) == 2
    del fronts, bf16, other
    gc.collect()
    assert not [k for k in sr._RESIDENT if k[0] in ("shared", "another cache")], "a copy outlived its front ends"


def _line(front: sr.SRFrontEnd, **agreement) -> str:
    front.score_unions(np.ones((1, D), np.float32), _unions([20]))
    return report.sr_line([front.scored_by()], [[Result("q", (), **agreement)]])


def test_the_report_names_the_device_and_the_dtype_of_its_copy():
    rows = _rows(8)
    exact = _line(_front(rows, fingerprint="label"))
    assert exact.startswith("SR: exact float32 dot product over the whole candidate union on the device (cpu x1, "
                            "a float16 copy of the cache) (the paper's)")
    rounded = _line(_front(rows, fingerprint="label", sr_device_dtype="bfloat16"))
    assert "a bfloat16 copy" in rounded and "rows rounded from the stored float16: not the paper's" in rounded
    assert "(the paper's)" not in rounded
    # evaluation with eval_sr=fast on the device: still exact scoring, and no fast scorer's agreement claimed
    fast = _line(_front(rows, fingerprint="label", sr="fast"), sr_agreement=1.0)
    assert "int8" not in fast and "agreement" not in fast and "the device scores every candidate" in fast
    cpu = _line(_front(rows, "cpu"))
    assert cpu == "SR: exact float32 dot product over the whole candidate union (the paper's), on the CPU"


@pytest.mark.parametrize("platform, backend", [("gpu", "device"), ("tpu", "device"), ("cuda", "device"),
                                               ("rocm", "device"), ("cpu", "cpu")])
def test_auto_is_the_device_where_jax_computes_on_a_gpu_or_tpu(monkeypatch, platform, backend):
    """retrieval.sr_backend='auto' (the default) asks JAX's platform name: a faked GPU or TPU name takes the device
    side, which answers as the CPU side does."""
    import jax

    monkeypatch.setattr(jax, "default_backend", lambda: platform)
    rows = _rows(9)
    auto, cpu = _front(rows, "auto", fingerprint=f"auto-{platform}"), _front(rows, "cpu")
    assert auto.backend() == backend
    queries = np.random.default_rng(1).normal(size=(3, D)).astype(np.float32)
    _same_as_cpu(auto, cpu, queries, _unions([5, 40, 120]))
    assert (auto._device is not None) == (backend == "device")
