"""The service as a process manager and a failing machine treat it, each case against the real server in a
subprocess on 127.0.0.1, bounded in time: an entity worker SIGKILLed (the OOM killer) or SIGSTOPped (stuck) under
load, SIGTERM / SIGINT to the whole process group with requests in flight, a store damaged on disk while serving,
and a reload to a damaged workdir."""

import concurrent.futures
import os
import shutil
import signal
import time

import pytest
from test_serve import Server

CONCURRENCY = 8


@pytest.fixture(scope="module")
def texts(workdir):
    from cfir_jax.data.corpus import Corpus

    corpus = Corpus.open(workdir / "corpus")
    return [corpus.document(i).text for i in range(min(16, len(corpus.doc_ids)))]


def _load(server: Server, texts: list[str], rounds: int = 2, during=None) -> list[int]:
    """`rounds` x len(texts) searches at concurrency 8; `during()` runs once the first requests are in flight.
    The status of each answer."""
    with concurrent.futures.ThreadPoolExecutor(CONCURRENCY) as pool:
        futures = [pool.submit(server.search, t) for t in texts * rounds]
        if during is not None:
            time.sleep(0.5)
            during()
        return [f.result().status_code for f in futures]


def _ready(server: Server) -> dict:
    return server.client.get("/readyz").json()


def _wait_for(predicate, seconds: float, what: str):
    until = time.monotonic() + seconds
    while time.monotonic() < until:
        value = predicate()
        if value:
            return value
        time.sleep(0.25)
    raise AssertionError(f"not within {seconds:g} s: {what}")


def _stop_clean(server: Server) -> str:
    code, log = server.stop()
    assert code == 0, log[-3000:]
    assert "Traceback" not in log, log[-3000:]
    return log


@pytest.mark.slow
def test_a_killed_worker_is_replaced_and_every_request_answered(workdir, texts):
    server = Server(workdir)
    try:
        pids = _ready(server)["entity_pool"]["pids"]
        assert len(pids) == 2
        statuses = _load(server, texts, during=lambda: os.kill(pids[0], signal.SIGKILL))
        assert statuses == [200] * len(statuses)
        _wait_for(lambda: server.metric('cfir_entity_worker_restarts_total{reason="died"}') >= 1, 30,
                  "the restart counted in /metrics")
        assert _load(server, texts, rounds=1) == [200] * len(texts)  # and later requests too
        pool = _wait_for(lambda: (p := _ready(server)["entity_pool"])["state"] == "healthy" and p, 60,
                         "the pool healthy again")
        assert pids[0] not in pool["pids"] and pool["restarts"] >= 1
        assert server.metric('cfir_requests_total{endpoint="/v1/search",status="500"}') == 0
    finally:
        log = _stop_clean(server)
    assert "exited with SIGKILL; replaced by pid" in log


@pytest.mark.slow
def test_a_stopped_worker_passes_its_deadline_and_is_replaced(workdir, texts):
    server = Server(workdir, "--config.entity_workers.serve_deadline_ms=1500")
    try:
        pids = _ready(server)["entity_pool"]["pids"]
        os.kill(pids[1], signal.SIGSTOP)
        statuses = _load(server, texts)
        assert statuses == [200] * len(statuses)
        assert server.metric('cfir_entity_worker_restarts_total{reason="deadline"}') >= 1
        assert _load(server, texts, rounds=1) == [200] * len(texts)
        assert pids[1] not in _ready(server)["entity_pool"]["pids"]
    finally:
        log = _stop_clean(server)
    assert "past its deadline of 1.5 s; replaced by pid" in log


@pytest.mark.slow
@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "SIGINT"])
def test_a_signal_to_the_process_group_answers_every_request_in_flight(workdir, texts, sig):
    # A deadline long enough that a busy CI machine never turns a slow drain into 504s: this test is about the signal.
    server = Server(workdir, "--config.serve.deadline_ms=120000", group=True)
    pgid = os.getpgid(server.proc.pid)
    assert pgid == server.proc.pid and pgid != os.getpgid(0)
    workers = _ready(server)["entity_pool"]["pids"]
    assert all(os.getpgid(p) == pgid for p in workers)  # the workers get the signal too
    # Eight searches in flight (one per client thread) when the whole group is signalled: each is answered.
    long = ["\n\n".join([t] * 4) for t in texts[:CONCURRENCY]]  # long enough to be in flight when signalled
    statuses = _load(server, long, rounds=1, during=lambda: os.killpg(pgid, sig))
    assert statuses == [200] * CONCURRENCY, statuses
    code, log = server.stop(timeout=60)
    assert code == 0, log[-3000:]
    assert "Traceback" not in log and "every accepted request was answered" in log, log[-3000:]
    _wait_for(lambda: not any(_alive(p) for p in workers), 10, "the workers gone after the server")


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:  # a zombie waiting for its reaper is gone too
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(") ", 1)[1][0] != "Z"
    except OSError:
        return False


@pytest.fixture
def damaged_copy(workdir, tmp_path):
    copy = tmp_path / "W"
    shutil.copytree(workdir, copy, ignore=shutil.ignore_patterns("train", "pretrain"))
    return copy


@pytest.mark.slow
def test_damage_on_disk_turns_readyz_503_and_a_reload_to_it_is_refused(damaged_copy, texts):
    server = Server(damaged_copy, "--config.serve.verify_mb_per_s=20", "--config.serve.verify_interval_s=1")
    try:
        _wait_for(lambda: _ready(server)["verification"]["passes"] >= 1, 60, "a first verification pass")
        before = server.search(texts[0]).json()
        assert _ready(server)["ready"]
        # Damage a store the served index never reads at query time (the index's entity store): what is served
        # stays right, but the workdir is no longer what was built.
        target = max((p for p in (damaged_copy / "entities").rglob("*") if p.is_file() and
                      p.name not in ("manifest.json", "checksums.json")), key=lambda p: p.stat().st_size)
        with open(target, "r+b") as f:
            f.seek(target.stat().st_size // 2)
            data = f.read(8)
            f.seek(target.stat().st_size // 2)
            f.write(bytes(b ^ 0xFF for b in data))
        answer = _wait_for(lambda: (r := server.client.get("/readyz")).status_code == 503 and r, 30,
                           "/readyz 503 after the damage")
        reason = answer.json()["reason"]
        assert str(target) in reason and "block 0" in reason and "\n" not in reason
        assert server.metric("cfir_stores_damaged") >= 1
        # A reload to the damaged workdir is refused, naming the file; the old index keeps answering.
        server.proc.send_signal(signal.SIGHUP)
        last = _wait_for(lambda: _ready(server)["last_reload"], 60, "the reload's outcome")
        assert last["ok"] is False and str(target) in last["error"]
        again = server.search(texts[0])
        assert again.status_code == 200 and again.json()["hits"] == before["hits"]
    finally:
        log = _stop_clean(server)
    assert "store damaged, /readyz now 503" in log and "reload refused" in log
