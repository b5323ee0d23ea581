"""A filtered whole-cache search (the dense methods, CFIR's no-entity fallback, unseen entities) scores only the
rows its filter passes, on the host and on the device (forced on the CPU: JAX's CPU is a device), and answers
exactly as the unfiltered search minus the failing rows: the same rows, scores bit-equal. Before, it searched
every row for k + (failing rows) and dropped the failing ones: at 1M images and a filter passing 10%, 900k
scores sorted per query."""

import types

import numpy as np
import pytest

from cfir_jax.core.config import retrieval_config
from cfir_jax.retrieve import sr
from cfir_jax.search import device_sr
from cfir_jax.search.live_rows import LiveRows

# More rows than one block of the whole search (32,768): several blocks, the last one partial.
N, D, K = 40_000, 16, 25


class CountingRows:
    """An [N, D] array that counts the rows read from it (slices and gathers)."""

    def __init__(self, rows: np.ndarray):
        self.rows, self.shape, self.dtype, self.ndim, self.read = rows, rows.shape, rows.dtype, 2, 0

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, index):
        out = self.rows[index]
        self.read += len(out)
        return out


@pytest.fixture(scope="module")
def rows() -> np.ndarray:
    rng = np.random.default_rng(0)
    rows = rng.normal(size=(N, D)).astype(np.float32)
    return (rows / np.linalg.norm(rows, axis=1, keepdims=True)).astype(np.float16)


def _front(rows, backend: str, removed: np.ndarray | None = None, name: str = "random") -> sr.SRFrontEnd:
    rcfg = retrieval_config()
    rcfg.update(dict(sr="exact", sr_backend=backend, top_k=K, sr_buckets=(32, 128), sr_query_batch=4))
    # the process's device copy is found by the fingerprint: one per array
    cache = types.SimpleNamespace(content_fingerprint=f"filtered-{name}", num_images=N, embeddings=rows)
    stores = types.SimpleNamespace(embeddings=rows, live=LiveRows(removed, N), extra={}, cache=cache)
    return sr.SRFrontEnd(rcfg, stores, (1.0, 0.0), False)


def _queries() -> np.ndarray:
    return np.random.default_rng(1).normal(size=(3, D)).astype(np.float32)


def _minus(scores: np.ndarray, found: np.ndarray, failing: np.ndarray, k: int):
    keep = ~failing[found]
    return scores[keep][:k], found[keep][:k]


@pytest.mark.parametrize("backend", ["cpu", "device"])
@pytest.mark.parametrize("share", [0.1, 0.001])
def test_a_filtered_search_equals_the_unfiltered_one_minus_the_failing_rows(rows, backend, share):
    front = _front(rows, backend)
    passing = np.random.default_rng(2).random(N) < share
    passing[[0, 32_767, 32_768, N - 1]] = True  # block edges
    queries = _queries()
    all_s, all_r = front.exact_search(queries, N, front.stores.live)  # every row, ranked
    filtered = LiveRows(~passing, N)  # a filter's rows: the argument of the search
    assert filtered.scores_live_only(K)
    got_s, got_r = front.exact_search(queries, K, filtered)
    assert got_r.shape == (3, min(K, int(passing.sum())))
    for q in range(len(queries)):
        want_s, want_r = _minus(all_s[q], all_r[q], ~passing, K)
        np.testing.assert_array_equal(got_r[q], want_r)
        np.testing.assert_array_equal(got_s[q], want_s)  # bit-equal: scored in the whole search's block shapes


def test_ties_go_to_the_lower_row_among_the_passing_rows():
    same = np.tile(np.eye(D, dtype=np.float16)[:1], (N, 1))  # every row scores the same
    passing = np.zeros(N, bool)
    passing[::7] = True
    for backend in ("cpu", "device"):
        front = _front(same, backend, name="ties")
        _, got = front.exact_search(np.eye(D, dtype=np.float32)[:1], K, LiveRows(~passing, N))
        assert got[0].tolist() == list(range(0, 7 * K, 7)), backend


def test_on_the_host_a_filtered_search_reads_only_the_passing_rows(rows):
    counted = CountingRows(rows)
    front = _front(counted, "cpu")
    passing = np.zeros(N, bool)
    passing[::10] = True
    front.exact_search(_queries(), K, LiveRows(~passing, N))
    assert counted.read == passing.sum()  # before: every row of the cache (k + 36,000 asked of the whole search)


def test_on_the_device_a_filtered_search_never_asks_the_whole_cache_for_more_than_k(rows, monkeypatch):
    asked = []
    whole = device_sr.DeviceCache.full_topk
    monkeypatch.setattr(device_sr.DeviceCache, "full_topk", lambda self, q, k: asked.append(k) or whole(self, q, k))
    front = _front(rows, "device")
    passing = np.zeros(N, bool)
    passing[::10] = True
    front.exact_search(_queries(), K, LiveRows(~passing, N))
    assert asked == []  # before: one full search asked for K + 36,000 rows


def test_a_few_removed_rows_still_over_fetch_and_no_live_row_is_an_empty_answer(rows):
    removed = np.zeros(N, bool)
    removed[:5] = True
    front = _front(rows, "cpu", removed)
    assert not front.stores.live.scores_live_only(K)
    _, got = front.exact_search(_queries(), K, front.stores.live)
    assert got.shape == (3, K) and got.min() >= 5
    s, r = front.exact_search(_queries(), K, LiveRows(np.ones(N, bool), N))
    assert r.shape == (3, 0) and s.shape == (3, 0)


def test_the_device_groups_each_shard_s_rows_in_a_few_widths():
    cache = device_sr.DeviceCache(np.ones((100, 4), np.float16), k=5, devices=None)
    ids = cache.shard_ids(np.array([3, 50, 99]))
    assert ids.shape == (1, cache.block) and ids[0, :3].tolist() == [3, 50, 99] and (ids[0, 3:] == -1).all()
