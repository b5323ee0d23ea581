"""Near-duplicate groups (W/duplicates, docs/duplicates.md): a group is a connected component of the threshold graph,
found by a neighbour search of a few neighbours per image (never an [N, N] matmul), equal to brute force; the store
follows a removal (a removed image leaves its group) and a compaction, and refuses impossible labels."""

import types

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from cfir_jax.builders import duplicates as dup
from cfir_jax.core.errors import StoreError
from cfir_jax.stores.duplicates import Duplicates


def _brute_groups(x: np.ndarray, threshold: float, removed=None) -> np.ndarray:
    """Connected components of {(i, j): cos >= threshold} over the live rows by a plain flood fill, each labelled
    by its smallest row; -1 for removed rows."""
    n = len(x)
    removed = np.zeros(n, bool) if removed is None else removed
    near = (x @ x.T) >= threshold
    label = np.full(n, -1)
    for start in range(n):
        if removed[start] or label[start] >= 0:
            continue
        todo, label[start] = [start], start
        while todo:
            i = todo.pop()
            for j in np.flatnonzero(near[i] & ~removed):
                if label[j] < 0:
                    label[j] = start
                    todo.append(j)
    return label


def _planted(seed: int, n: int, groups: int, size: int, dim: int = 16, noise: float = 0.004) -> np.ndarray:
    """n unit rows, of which `groups` sets of `size` are one image's copies with tiny noise."""
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((n, dim)).astype(np.float32)
    rows = rng.permutation(n)[: groups * size].reshape(groups, size) if groups * size <= n else np.zeros((0, size))
    for g in rows:
        x[g[1:]] = x[g[0]] + noise * rng.standard_normal((len(g) - 1, dim))
    return (x / np.linalg.norm(x, axis=1, keepdims=True)).astype(np.float32)


def _exact(x: np.ndarray):
    return dup.searcher(x, "exact", 2)


def _no_ties(x: np.ndarray, threshold: float) -> bool:
    """No cosine within 1e-4 of the threshold: float32 matmuls in another order must not flip a pair."""
    s = x @ x.T
    return not np.any(np.abs(s[~np.eye(len(x), dtype=bool)] - threshold) < 1e-4)


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(seed=st.integers(0, 10_000), n=st.integers(2, 40), groups=st.integers(0, 4), size=st.integers(2, 9),
       threshold=st.sampled_from([0.5, 0.9, 0.98]))
def test_groups_are_the_connected_components_of_the_threshold_graph(seed, n, groups, size, threshold):
    """Two neighbours per row searched, four times as many where all of them were near: as brute force, even for a
    group of nine copies (a clique larger than the first search) and chains at a low threshold."""
    x = _planted(seed, n, groups, size)
    if not _no_ties(x, threshold):
        return
    edges = dup.near_pairs(np.arange(n), n, _exact(x), threshold, neighbours=2, max_neighbours=n)
    assert np.array_equal(dup.groups(edges, n), _brute_groups(x, threshold))


@settings(max_examples=15, deadline=None)
@given(seed=st.integers(0, 10_000), n=st.integers(2, 30), drop=st.integers(0, 2 ** 30))
def test_a_removal_regroups_over_the_live_rows(seed, n, drop):
    """A removed image leaves its group, and a group it alone held together splits (components of the live rows)."""
    x = _planted(seed, n, 2, 3)
    if not _no_ties(x, 0.5):
        return
    removed = np.random.default_rng(drop).random(n) < 0.3
    edges = dup.near_pairs(np.arange(n), n, _exact(x), 0.5, neighbours=2, max_neighbours=n)
    assert np.array_equal(dup.groups(edges, n, removed), _brute_groups(x, 0.5, removed))


def test_planted_copies_form_one_group_by_scann_too():
    x = _planted(0, 3000, 20, 4, dim=64)
    search = dup.searcher(x, "scann", 8)
    label = dup.groups(dup.near_pairs(np.arange(3000), 3000, search, 0.98, 8, 256), 3000)
    assert np.array_equal(label, _brute_groups(x, 0.98)) and (np.bincount(label) == 4).sum() == 20


def _cache(x: np.ndarray, removed=None) -> types.SimpleNamespace:
    n = len(x)
    return types.SimpleNamespace(num_images=n, embeddings=x, ids=[f"img{i}" for i in range(n)],
                                 removed=np.zeros(n, bool) if removed is None else removed,
                                 content_fingerprint="cache-test",
                                 manifest={"removed_sha": None if removed is None else "some"})


SETTINGS = {"threshold": 0.98, "neighbours": 4, "max_neighbours": 64, "backend": "exact"}


def test_the_store_holds_the_groups_and_refuses_impossible_labels(tmp_path):
    x = _planted(1, 50, 3, 3)
    store = dup.build_duplicates(tmp_path / "duplicates", _cache(x), SETTINGS)
    assert np.array_equal(store.group, _brute_groups(x, 0.98))
    assert store.manifest["num_groups"] == 3 and store.manifest["num_folded"] == 6
    members = store.members(int(np.flatnonzero(np.bincount(store.group) == 3)[0]))
    assert len(members) == 3 and store.follows(_cache(x))
    group = store.group.copy()
    group[members[1]] = members[1] + 1  # a label that names no group's smallest row
    np.save(tmp_path / "duplicates" / "group.npy", group)
    with pytest.raises(StoreError, match="group.npy: labels that name no group's smallest row"):
        Duplicates.open(tmp_path / "duplicates")


def test_removing_a_groups_smallest_row_makes_the_next_member_its_label(tmp_path):
    x = _planted(2, 40, 1, 3)
    store = dup.build_duplicates(tmp_path / "a", _cache(x), SETTINGS)
    members = np.flatnonzero(np.bincount(store.group) == 3)
    first = int(members[0])
    rows = np.flatnonzero(store.group == first)
    removed = np.zeros(40, bool)
    removed[first] = True
    after = dup.write_store(tmp_path / "b", store.edges, _cache(x, removed), SETTINGS, 0.0)
    assert after.group[first] == -1 and list(after.group[rows[1:]]) == [rows[1]] * 2
    assert not after.follows(_cache(x)) and after.follows(_cache(x, removed))


@settings(max_examples=15, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(seed=st.integers(0, 10_000), n=st.integers(2, 40), groups=st.integers(0, 4), size=st.integers(2, 6))
def test_the_leaf_self_join_with_every_row_in_every_leaf_is_brute_force(seed, n, groups, size):
    """`partition_pairs` with each row spilled into every leaf scores every pair: exactly the threshold graph."""
    x = _planted(seed, n, groups, size)
    if not _no_ties(x, 0.9):
        return
    edges = dup.partition_pairs(x, 0.9, max_neighbours=n, spill=n)
    assert np.array_equal(dup.groups(edges, n), _brute_groups(x, 0.9))


def test_the_leaf_self_join_finds_the_planted_copies_and_caps_a_burst():
    x = _planted(3, 4000, 30, 3, dim=64)
    edges = dup.partition_pairs(x, 0.98, max_neighbours=256)
    assert np.array_equal(dup.groups(edges, 4000), _brute_groups(x, 0.98))
    burst = np.repeat(x[:1], 600, axis=0) + 1e-4 * np.random.default_rng(0).standard_normal((600, 64))
    burst /= np.linalg.norm(burst, axis=1, keepdims=True)
    capped = dup.partition_pairs(burst.astype(np.float32), 0.98, max_neighbours=8)
    assert len(capped) <= 600 * 8 * dup.SPILL and len(set(dup.groups(capped, 600).tolist())) == 1  # O(N) edges


def test_auto_is_the_leaf_self_join_on_a_cpu_host():
    assert dup.backend_of("auto") == "partition" and dup.backend_of("exact") == "exact"
