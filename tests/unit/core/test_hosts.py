"""Which work items a process of a jax.distributed run takes, and the barrier outside such a run."""

import pytest

from cfir_jax.core import hosts


@pytest.mark.parametrize("num_items,count", [(3, 1), (10, 4), (2, 4)])
def test_contiguous_ranges_cover_every_item_once_and_evenly(num_items, count):
    ranges = [hosts.contiguous(num_items, p, count) for p in range(count)]
    assert [i for r in ranges for i in r] == list(range(num_items))
    assert max(map(len, ranges)) - min(map(len, ranges)) <= 1


@pytest.mark.parametrize("num_items,count", [(7, 1), (7, 2), (3, 4)])
def test_round_robin_owners_cover_every_item_once(num_items, count):
    owners = [[p for p in range(count) if hosts.owns(i, p, count)] for i in range(num_items)]
    assert all(len(o) == 1 for o in owners)
    assert [o[0] for o in owners] == [i % count for i in range(num_items)]


def test_one_process_is_main_and_its_barrier_returns():
    assert hosts.process_count() == 1 and hosts.process_index() == 0 and hosts.is_main()
    hosts.barrier("alone")
    assert list(hosts.contiguous(5)) == [0, 1, 2, 3, 4] and all(hosts.owns(i) for i in range(5))


def test_chunks_of_a_two_process_run_are_reused_by_a_one_process_rerun(tmp_path, monkeypatch):
    """Process 1 of 2 computes chunks 1 and 3 only and yields nothing (process 0 assembles); a rerun with one
    process computes the rest, reuses those two whoever wrote them, and yields every chunk in order."""
    from cfir_jax.index import chunks

    docs = [(f"d{i}", f"text {i}") for i in range(9)]
    computed: list[list[str]] = []

    def process(texts):
        computed.append(list(texts))
        return [t.upper() for t in texts]

    with monkeypatch.context() as m:  # a 2-process job whose barriers are no-ops
        m.setattr(hosts, "process_count", lambda: 2)
        m.setattr(hosts, "barrier", lambda name: None)
        m.setattr(hosts, "process_index", lambda: 0)  # process 0 prepares the partial directory (no documents yet)
        assert list(chunks.iter_chunks(tmp_path / "s", [], process, {"v": 1}, chunk_size=2)) == []
        m.setattr(hosts, "process_index", lambda: 1)
        assert list(chunks.iter_chunks(tmp_path / "s", docs, process, {"v": 1}, chunk_size=2)) == []
    assert computed == [["text 2", "text 3"], ["text 6", "text 7"]]

    computed.clear()
    owned = list(chunks.iter_chunks(tmp_path / "s", docs, process, {"v": 1}, chunk_size=2))
    assert computed == [["text 0", "text 1"], ["text 4", "text 5"], ["text 8"]]
    assert [i for ids, _ in owned for i in ids] == [d for d, _ in docs]
    assert [r for _, results in owned for r in results] == [t.upper() for _, t in docs]


def test_owned_row_chunks_cover_every_row_once(monkeypatch):
    from cfir_jax.core import hosts

    for count in (1, 2, 3):
        spans = []
        for process in range(count):
            monkeypatch.setattr(hosts, "process_index", lambda process=process: process)
            monkeypatch.setattr(hosts, "process_count", lambda count=count: count)
            spans += hosts.owned_row_chunks(10, 3)
        assert sorted(spans) == [(0, 0, 3), (1, 3, 6), (2, 6, 9), (3, 9, 10)]
