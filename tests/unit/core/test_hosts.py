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


def test_owned_row_chunks_cover_every_row_once(monkeypatch):
    from cfir_jax.core import hosts

    for count in (1, 2, 3):
        spans = []
        for process in range(count):
            monkeypatch.setattr(hosts, "process_index", lambda process=process: process)
            monkeypatch.setattr(hosts, "process_count", lambda count=count: count)
            spans += hosts.owned_row_chunks(10, 3)
        assert sorted(spans) == [(0, 0, 3), (1, 3, 6), (2, 6, 9), (3, 9, 10)]
