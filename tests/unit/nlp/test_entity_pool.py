"""The supervised spaCy worker pool (`cfir_jax.nlp.entity_pool`): workers killed, stopped or crashing in a loop
never cost an answer, signals to the group are left to the parent, and no worker outlives its parent."""

import os
import signal
import subprocess
import sys
import time

import pytest
from repo import ROOT

from cfir_jax.nlp.entities import EntityExtractor, load_spacy
from cfir_jax.nlp.entity_pool import EntityPool

TEXTS = [f"Ada Lovelace wrote to Charles Babbage from London about the Analytical Engine, letter {i}."
         for i in range(24)] + ["Nothing named here.", "Marie Curie worked in Paris and Warsaw."]


@pytest.fixture(scope="module")
def expected():
    return list(EntityExtractor(load_spacy(None), "all").extract(TEXTS))


@pytest.fixture(scope="module")
def pool():
    p = EntityPool("", "all", workers=2, deadline_s=1.5)
    yield p
    p.close()


def _gone(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(") ", 1)[1][0] == "Z"
    except OSError:
        return True


def test_a_killed_worker_is_replaced_and_its_chunks_parsed_again(pool, expected):
    seen = []
    pool.on_restart = seen.append
    victim = pool.describe()["pids"][0]
    os.kill(victim, signal.SIGKILL)
    assert pool.entities(TEXTS) == expected
    assert seen == ["died"] and pool.restarts["died"] == 1
    assert victim not in pool.describe()["pids"] and pool.state in ("healthy", "restarting")
    assert list(pool.stream(TEXTS, 3)) == expected


def test_a_stopped_worker_is_killed_at_its_deadline_and_replaced(pool, expected):
    victim = pool.describe()["pids"][1]
    os.kill(victim, signal.SIGSTOP)
    t0 = time.monotonic()
    assert list(pool.stream(TEXTS, 2)) == expected
    assert pool.restarts["deadline"] == 1 and time.monotonic() - t0 < 60
    assert victim not in pool.describe()["pids"]
    assert pool.entities(TEXTS) == expected


def test_a_crash_loop_degrades_to_the_calling_thread(expected):
    p = EntityPool("", "all", workers=2, max_restarts=1, restart_window_s=60)
    try:
        for _ in range(3):
            if p.degraded:
                break
            for pid in p.describe()["pids"]:
                os.kill(pid, signal.SIGKILL)
            assert p.entities(TEXTS) == expected
        assert p.state == "degraded" and "retrieval thread" in p.describe()["reason"]
        assert p.describe()["pids"] == [] and p.entities(TEXTS) == expected
    finally:
        p.close()


CHILD = """
import sys, time
from cfir_jax.nlp.entity_pool import EntityPool
if __name__ == "__main__":
    pool = EntityPool("", "all", workers=2)
    print(" ".join(map(str, pool.describe()["pids"])), flush=True)
    time.sleep(600)
"""


def test_workers_ignore_sigterm_and_sigint_and_exit_with_their_parent():
    parent = subprocess.Popen([sys.executable, "-c", CHILD], cwd=ROOT, stdout=subprocess.PIPE, text=True,
                              env={**os.environ, "PYTHONPATH": str(ROOT)})
    try:
        pids = [int(p) for p in parent.stdout.readline().split()]
        assert len(pids) == 2
        for pid in pids:
            os.kill(pid, signal.SIGTERM)
            os.kill(pid, signal.SIGINT)
        time.sleep(1.0)
        assert not any(_gone(p) for p in pids), "a worker died of a signal meant for its parent"
        parent.kill()  # as the OOM killer would: no chance to stop them
        parent.wait()
        until = time.monotonic() + 10
        while time.monotonic() < until and not all(_gone(p) for p in pids):
            time.sleep(0.2)
        assert all(_gone(p) for p in pids), "a worker outlived its parent"
    finally:
        parent.kill()
        parent.wait()
