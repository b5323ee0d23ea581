import concurrent.futures
import importlib
import importlib.util
import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax
import numpy as np
import pytest

from cfir_jax.core.errors import CfirError, StoreError
from cfir_jax.search.compact import CompactCache, build_compact, compact_in_memory
from cfir_jax.search.cpu_sr import SRScorer, StageTimes
from cfir_jax.search.knn import synthetic_embeddings
from cfir_jax.search.topk import exact_top_k, exact_topk, unique_sorted


@pytest.fixture(scope="module")
def setting():
    """A clustered float16 cache and one document: 8 entities' top-1500 lists and a summary near them."""
    cache = synthetic_embeddings(40_000, 128, seed=0, dtype=np.float16)
    rng = np.random.default_rng(1)
    ents = cache[rng.integers(0, len(cache), 8)].astype(np.float32)
    ents += 0.05 * rng.standard_normal(ents.shape).astype(np.float32)
    _, cand = exact_topk(ents / np.linalg.norm(ents, axis=1, keepdims=True), cache, 1500)
    query = ents.mean(0) / np.linalg.norm(ents.mean(0))
    return cache, compact_in_memory(cache, dims=32), cand.ravel(), query


def _exact(cache, query, candidates, k):
    ids = np.unique(candidates)
    scores = np.asarray(cache[ids], np.float32) @ query
    return ids[np.argsort(-scores)[:k]]


def test_top_k_agrees_with_exact_scoring(setting):
    cache, compact, cand, query = setting
    scorer = SRScorer(cache, compact, shortlist=2048, k=1000)
    scores, ids = scorer.score(query, cand)
    ref = _exact(cache, query, cand, 1000)
    assert len(np.unique(cand)) > 2048  # the approximate pass really ran
    assert len(np.intersect1d(ids, ref)) >= 990
    np.testing.assert_allclose(scores, np.asarray(cache[ids], np.float32) @ query, rtol=1e-5, atol=1e-5)
    assert np.all(np.diff(scores) <= 0)


def test_results_are_deduplicated(setting):
    cache, compact, cand, query = setting
    _, ids = SRScorer(cache, compact, shortlist=2048, k=1000).score(query, np.concatenate([cand, cand[:500]]))
    assert len(np.unique(ids)) == len(ids) == 1000


def test_planted_best_candidate_is_always_first(setting):
    cache, compact, cand, query = setting
    scorer = SRScorer(cache, compact, shortlist=1024, k=100)
    rng = np.random.default_rng(2)
    for target in rng.choice(np.unique(cand), 5, replace=False):
        planted = np.asarray(cache[target], np.float32)
        _, ids = scorer.score(planted / np.linalg.norm(planted), cand)
        assert ids[0] == target


def test_every_candidate_count_returns_the_exact_top_k(setting):
    cache, compact, cand, query = setting
    scorer = SRScorer(cache, compact, shortlist=1024, k=100)
    # Below k, between k and the shortlist, above it, and above the size where the work splits over two threads.
    for m in [3, 100, 129, 200, 511, 700, 1000, 1024, 1500, 5000, len(cand)]:
        scores, ids = scorer.score(query, cand[:m])
        ref = _exact(cache, query, cand[:m], 100)
        assert len(ids) == min(100, len(np.unique(cand[:m])))
        assert len(np.intersect1d(ids, ref)) >= 0.99 * len(ref)
        np.testing.assert_allclose(scores, np.asarray(cache[ids], np.float32) @ query, rtol=1e-5, atol=1e-5)


def test_one_and_two_threads_give_the_same_result(setting):
    cache, compact, cand, query = setting
    assert len(np.unique(cand)) > 4096  # above the size where the approximate pass splits over threads
    s1, i1 = SRScorer(cache, compact, shortlist=2048, k=1000, threads=1).score(query, cand)
    s2, i2 = SRScorer(cache, compact, shortlist=2048, k=1000, threads=2).score(query, cand)
    np.testing.assert_array_equal(i1, i2)
    np.testing.assert_allclose(s1, s2, rtol=1e-6)


def test_float32_cache_scores_exactly(setting):
    cache, compact, cand, query = setting
    cache32 = np.asarray(cache, np.float32)
    scores, ids = SRScorer(cache32, compact, shortlist=2048, k=1000).score(query, cand)
    assert len(np.intersect1d(ids, _exact(cache32, query, cand, 1000))) >= 990
    np.testing.assert_allclose(scores, cache32[ids] @ query, rtol=1e-5, atol=1e-5)


def test_stage_times_record_every_stage_of_every_call(setting):
    cache, compact, cand, query = setting
    times = StageTimes()
    SRScorer(cache, compact, shortlist=1024, k=100).score_batch(np.stack([query, -query]), [cand, cand[:50]], times)
    assert all(len(v) == 2 for v in (times.dedup, times.approximate, times.shortlist, times.exact))
    assert times.approximate[0] > 0 and times.approximate[1] == 0  # 50 candidates fit the shortlist: no approx pass
    assert set(times.p50_ms()) == {"dedup", "approximate", "shortlist", "exact"}


def test_fewer_candidates_than_k_returns_all_of_them(setting):
    cache, compact, _, query = setting
    scores, ids = SRScorer(cache, compact, shortlist=256, k=100).score(query, np.array([5, 9, 5, 2], np.int32))
    assert sorted(ids.tolist()) == [2, 5, 9] and len(scores) == 3


def test_out_of_range_candidate_is_a_cfir_error(setting):
    cache, compact, _, query = setting
    with pytest.raises(CfirError, match="candidate ids"):
        SRScorer(cache, compact, shortlist=256, k=10).score(query, np.array([1, len(cache)]))


def test_approximate_scores_track_exact_scores(setting):
    cache, compact, cand, query = setting
    ids = np.unique(cand)
    scorer = SRScorer(cache, compact, shortlist=1024, k=100)
    approx = scorer.approximate_scores(query, ids)
    exact = scorer.exact_scores(query, ids[:1024])
    np.testing.assert_allclose(exact, np.asarray(cache[ids[:1024]], np.float32) @ query, rtol=1e-5, atol=1e-5)
    assert np.corrcoef(approx[:1024], exact)[0, 1] > 0.9


def test_public_stage_methods_reject_out_of_range_ids(setting):
    cache, compact, _, query = setting
    scorer = SRScorer(cache, compact, shortlist=256, k=10)
    for method in (scorer.approximate_scores, scorer.exact_scores):
        with pytest.raises(CfirError, match="candidate ids"):
            method(query, np.array([0, len(cache)]))


def test_int64_id_beyond_int32_is_a_cfir_error_not_wrapped(setting):
    cache, compact, _, query = setting
    with pytest.raises(CfirError, match="candidate ids"):
        SRScorer(cache, compact, shortlist=256, k=10).score(query, np.array([1, 2**32 + 1], np.int64))


def test_float_candidate_ids_are_a_cfir_error(setting):
    cache, compact, _, query = setting
    with pytest.raises(CfirError, match="integer"):
        SRScorer(cache, compact, shortlist=256, k=10).score(query, np.array([1.0, 2.0]))


def test_shortlist_smaller_than_k_is_a_cfir_error(setting):
    cache, compact, _, _ = setting
    with pytest.raises(CfirError, match="shortlist"):
        SRScorer(cache, compact, shortlist=50, k=100)


def test_build_compact_round_trips_and_is_memory_mapped(tmp_path, setting):
    cache = setting[0][:5000]
    built = build_compact(cache, tmp_path / "compact", dims=32, chunk_rows=1000)
    assert isinstance(built.codes, np.memmap) and built.codes.dtype == np.int8 and built.codes.shape == (5000, 32)
    ref = compact_in_memory(cache, dims=32)
    # Chunked matmuls round differently in the last bit: codes may differ by one step, never more.
    assert np.abs(built.codes.astype(np.int32) - ref.codes).max() <= 1
    assert built.scales.shape == (32,)
    approx = (built.codes.astype(np.float32) * built.scales) @ built.rotation.T
    rel = np.linalg.norm(approx - np.asarray(cache, np.float32)) / np.linalg.norm(np.asarray(cache, np.float32))
    assert rel < 0.6  # 32 of 128 dims on a slowly decaying spectrum keep most of the energy
    with pytest.raises(StoreError, match="n="):
        CompactCache.open(tmp_path / "compact", expect_n=4999)


def test_unique_sorted_matches_numpy_unique():
    x = np.random.default_rng(0).integers(0, 100, 1000).astype(np.int32)
    np.testing.assert_array_equal(unique_sorted(x), np.unique(x))


def test_float16_cast_without_torch_is_exact(monkeypatch):
    """The exact pass works without PyTorch (JAX users): the cast equals numpy's astype bit for bit."""
    import cfir_jax.search.topk as sr

    src = np.random.default_rng(0).normal(size=(70, 33)).astype(np.float16)
    src[0, :4] = [0.0, -0.0, np.float16(6e-8), np.inf]  # zeros, a subnormal, inf
    # torch is in the test set: the cast takes it once a process has loaded it
    torch = importlib.import_module("torch") if importlib.util.find_spec("torch") else None
    for torch_module in (None, torch):
        monkeypatch.setattr(sr, "_torch", lambda module=torch_module: module)
        dst = np.empty(src.shape, np.float32)
        sr.cast_f16(src, dst)
        np.testing.assert_array_equal(dst, src.astype(np.float32))


def _cast_in_thread(src: np.ndarray) -> np.ndarray:
    import cfir_jax.search.topk as sr

    dst = np.full(src.shape, np.nan, np.float32)
    sr.cast_f16(src, dst)
    return dst


def test_float16_cast_is_numpys_for_every_bit_pattern_on_every_thread(monkeypatch):
    """Every one of the 65,536 float16 bit patterns, cast without torch, has numpy's float32 bits: the 63,488 finite
    ones (subnormals and both zeros included) by the integer passes, and a chunk with an infinity or a NaN (payloads
    kept) by the lookup table; in the calling thread and in a scorer's worker thread after a jitted computation ran,
    and inside a host callback of a jitted computation, where XLA has the CPU read subnormal inputs as zero (the
    passes' multiply would zero the 2,046 nonzero subnormals there)."""
    import cfir_jax.search.topk as sr

    monkeypatch.setattr(sr, "_torch", lambda: None)
    jax.jit(lambda x: x * 2)(np.ones(8, np.float32)).block_until_ready()
    patterns = np.arange(1 << 16, dtype=np.uint32).astype(np.uint16)
    special = (patterns & 0x7C00) == 0x7C00
    finite = patterns[~special].view(np.float16).reshape(-1, 64)
    chunks = [finite, patterns.view(np.float16).reshape(512, 128), patterns[special].view(np.float16)[None]]
    assert finite.size == 63488 and np.count_nonzero(finite.view(np.uint16) & 0x7C00 == 0) == 2048
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        for src in chunks:
            in_callback = jax.jit(lambda x, src=src: jax.pure_callback(
                lambda _: _cast_in_thread(src), jax.ShapeDtypeStruct(src.shape, np.float32), x))
            for dst in (_cast_in_thread(src), pool.submit(_cast_in_thread, src).result(),
                        np.asarray(in_callback(np.float32(0)))):
                np.testing.assert_array_equal(dst.view(np.uint32), src.astype(np.float32).view(np.uint32))


def test_float16_cast_into_memory_it_reads_or_another_shape(monkeypatch):
    """A dst over src's own bytes (the widening would overwrite what it has yet to read) takes the lookup table, which
    reads before it writes; a dst of another shape is refused rather than broadcast."""
    import cfir_jax.search.topk as sr

    monkeypatch.setattr(sr, "_torch", lambda: None)
    values = np.array([1.5, -2.0, 6e-8, np.inf, 0.25, -0.0, 3.0, 65504.0], np.float16)
    for half, finite in ((slice(0, 8), values), (slice(8, 16), values), (slice(0, 8), np.nan_to_num(values))):
        buffer = np.zeros(8, np.float32)
        src = buffer.view(np.float16)[half]
        src[...] = finite
        want = src.astype(np.float32)
        sr.cast_f16(src, buffer)
        np.testing.assert_array_equal(buffer.view(np.uint32), want.view(np.uint32))
    with pytest.raises(ValueError, match="differ"):
        sr.cast_f16(values, np.empty((2, 8), np.float32))


@pytest.mark.parametrize("width", [768, 1536])
def test_float16_cast_stays_under_torchs_parallel_threshold(monkeypatch, width):
    """torch parallelises a copy above 32,768 values, and its thread pool then fights the scorer's threads (a fused
    row is 1536 wide: 32 rows at a time crossed it). Every copy must stay at or under the threshold, and be exact."""
    import cfir_jax.search.topk as sr

    torch = pytest.importorskip("torch", reason="PyTorch is not installed: the lookup-table cast has no thread pool")
    assert sr._torch() is torch  # a process that loaded torch casts with it
    sizes = []
    real = torch.from_numpy

    def recording(array):
        sizes.append(array.size)
        return real(array)

    monkeypatch.setattr(torch, "from_numpy", recording)
    src = np.random.default_rng(0).normal(size=(128, width)).astype(np.float16)
    dst = np.empty(src.shape, np.float32)
    sr.cast_f16(src, dst)
    np.testing.assert_array_equal(dst, src.astype(np.float32))
    assert sizes and max(sizes) <= 32768, max(sizes)


def test_exact_top_k_is_the_papers_sr_over_the_whole_union(setting):
    """Every candidate scored in float32 (gathered in chunks smaller than the union), best first."""
    cache, _, candidates, query = setting
    ids = unique_sorted(candidates)
    scores, top = exact_top_k(cache, query, ids, 1000, chunk_rows=777)
    want = np.asarray(cache[ids], np.float32) @ query
    order = np.argsort(-want, kind="stable")[:1000]
    np.testing.assert_array_equal(top, ids[order])
    np.testing.assert_allclose(scores, want[order], rtol=1e-6)
    assert top.dtype == np.int32


@pytest.mark.parametrize("shortlist", [64, 4096])  # the union re-scored through the approximate pass, or exactly
def test_damaged_rows_warn_nothing_before_their_one_line_refusal(shortlist):
    """Random bytes in float16 rows hold inf and NaN: their dot products must not print numpy's RuntimeWarning (a
    second and third line before the refusal); the scores' check refuses them, in one line."""
    import warnings

    from cfir_jax.stores.integrity import CorruptStore, check_scores

    rng = np.random.default_rng(0)
    cache = (rng.standard_normal((3000, 32)) / 6).astype(np.float16)
    compact = compact_in_memory(cache, dims=8)
    damaged = cache.copy()
    damaged.view(np.uint16)[5:40] = rng.integers(0, 65535, (35, 32), dtype=np.uint16)
    query = np.full(32, 1 / np.sqrt(32), np.float32)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        scores, _ = SRScorer(damaged, compact, shortlist=shortlist, k=10, threads=2).score(query, np.arange(3000))
    with pytest.raises(CorruptStore, match="^W/image_cache: an impossible score NaN: the store is damaged"):
        check_scores(scores, 1.0, "W/image_cache")
