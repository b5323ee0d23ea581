"""The cluster's reload protocol (cfir_jax/serve/reload.py) and the front's shard client (RayShards), in one process
with stand-ins for the indexes and Ray's handles: every replica of a shard is told a version (none loads it inside a
request); a reload the shards cannot follow is refused and what the fronts serve stays loaded; a replica drops a
version only once no front uses it; the board restores itself from the reports after a restart, and the fronts keep
following; a failed follow is tried again; a hedged duplicate shard call is cancelled once another answered."""

import asyncio
import threading
import time
from types import SimpleNamespace

import pytest

from cfir_jax.core.errors import CfirError
from cfir_jax.serve import reload as protocol
from cfir_jax.serve.reload import FrontReporter, ReloadBoard, ShardReplica, prepare_everywhere


class Workdir:
    """The workdir's committed version, as the replicas read it."""

    def __init__(self, version=1):
        self.version, self.opened = version, 0

    def open_index(self):
        self.opened += 1
        return SimpleNamespace(version=self.version)


class Boards:
    """A board that can be restarted (an actor restarts with an empty state): the parts call this one."""

    def __init__(self, **kw):
        self.kw = kw
        self.board = ReloadBoard(**kw)

    def restart(self):
        self.board = ReloadBoard(**self.kw)

    def __getattr__(self, name):
        return getattr(self.board, name)


def _wait(predicate, timeout=10.0, what="the condition"):
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, f"{what} did not hold in {timeout} s"
        time.sleep(0.02)


@pytest.fixture
def fast(monkeypatch):
    """Reports every 20 ms; the board drops nothing in its first 0.3 s."""
    monkeypatch.setattr(protocol, "REPLICA_REPORT_S", 0.02)
    monkeypatch.setattr(protocol, "SETTLE_S", 0.3)


def _replicas(board, workdir, shards=2, per_shard=2):
    out = [ShardReplica(board, s, workdir.open_index, lambda: workdir.version) for s in range(shards)
           for _ in range(per_shard)]
    for r in out:
        r.report()
    return out


def test_every_replica_of_every_shard_loads_a_prepared_version_before_a_request_asks(fast):
    board, w = Boards(), Workdir(1)
    replicas = _replicas(board, w)
    front = FrontReporter(board, lambda: 1, lambda: None, grace_s=0, start=False)
    front.report()
    w.version = 2
    prepare_everywhere(board, 2, shards=2, timeout_s=10)
    assert all(2 in r.held for r in replicas)  # every replica, told by the board: none waits for a request
    assert all(r.at(1).version == 1 for r in replicas)  # the served version is still there
    for r in replicas:
        r.close()


def test_a_replica_never_loads_inside_a_request(fast):
    board, w = Boards(), Workdir(1)
    [replica] = _replicas(board, w, shards=1, per_shard=1)
    w.version = 2
    opened = w.opened
    with pytest.raises(CfirError, match="holds versions \\[1\\], not 2"):
        replica.at(2)  # refused at once: another replica may hold it; nothing is loaded in the request's time
    assert w.opened == opened
    replica.close()


def test_refused_reloads_never_drop_what_the_fronts_serve(fast):
    """Two reloads the shards cannot follow (the workdir moved on meanwhile), then one they can: the version the
    front serves stays on every replica throughout; the old one goes only after the front moved past it."""
    board, w = Boards(), Workdir(1)
    replicas = _replicas(board, w, shards=1, per_shard=2)
    serving = [1]
    front = FrontReporter(board, lambda: serving[0], lambda: None, grace_s=0.5, start=False)
    front.report()
    for asked, workdir_at in ((2, 3), (3, 4)):
        w.version = workdir_at
        with pytest.raises(CfirError, match=f"the workdir is at version {workdir_at}, not {asked}"):
            prepare_everywhere(board, asked, shards=1, timeout_s=10)
        time.sleep(0.5)  # past the board's settling: drops are allowed now
        front.report()
        assert all(set(r.held) == {1} for r in replicas), [sorted(r.held) for r in replicas]
        assert all(r.at(1).version == 1 for r in replicas)
    prepare_everywhere(board, 4, shards=1, timeout_s=10)
    serving[0] = 4
    front.report()  # swapped: version 1 is still reported for grace_s (a batch may still run on it)
    time.sleep(0.1)
    assert all(set(r.held) == {1, 4} for r in replicas)
    time.sleep(0.5)
    front.report()
    _wait(lambda: all(set(r.held) == {4} for r in replicas), what="version 1 dropped")
    for r in replicas:
        r.close()


def test_a_version_is_kept_while_any_front_serves_it(fast):
    board, w = Boards(), Workdir(1)
    replicas = _replicas(board, w, shards=1, per_shard=1)
    behind = FrontReporter(board, lambda: 1, lambda: None, grace_s=0, start=False)
    ahead = FrontReporter(board, lambda: 2, lambda: None, grace_s=0, start=False)
    behind.report()
    w.version = 2
    prepare_everywhere(board, 2, shards=1, timeout_s=10)
    ahead.report()
    time.sleep(0.5)
    behind.report()
    ahead.report()
    time.sleep(0.1)
    assert set(replicas[0].held) == {1, 2}
    replicas[0].close()


def test_a_restarted_board_drops_nothing_and_the_fronts_follow_it(fast):
    """The board restarts with an empty state (generation 0 before): the fronts' reports restore its target, no
    replica drops a version meanwhile, and a front behind the target follows, its failed follow tried again."""
    board, w = Boards(), Workdir(1)
    replicas = _replicas(board, w, shards=1, per_shard=1)
    serving = {"a": 1, "b": 1}
    tries = []

    def follow_b():
        tries.append(1)
        if len(tries) == 1:
            raise CfirError("the first follow fails")
        serving["b"] = board.target

    a = FrontReporter(board, lambda: serving["a"], lambda: None, grace_s=0, start=False)
    b = FrontReporter(board, lambda: serving["b"], follow_b, grace_s=0, start=False)
    a.report()
    b.report()
    w.version = 2
    prepare_everywhere(board, 2, shards=1, timeout_s=10)
    board.restart()
    serving["a"] = 2  # a reloaded while the board was down
    assert a.report() == 2  # the board learns the version from the front that serves it
    replicas[0].report()
    replicas[0].step()
    assert set(replicas[0].held) == {1, 2}  # nothing dropped while the board settles
    _wait(lambda: b.report() == 2 and serving["b"] == 2, what="front b following version 2")
    assert len(tries) >= 2 and b.last_error == ""  # the failed follow was tried again
    replicas[0].close()


class FakeHandle:
    """A deployment handle of one shard whose replicas answer after `delays` (in turn); records cancellations."""

    def __init__(self, delays):
        self.delays, self.sent, self.cancelled = list(delays), 0, []

    def __getattr__(self, op):
        handle = self

        class Method:
            def remote(self, *args):
                if op != "score":  # the client's prober pings: not counted
                    return FakeResponse(handle, 0.0, (op, *args))
                delay = handle.delays[min(handle.sent, len(handle.delays) - 1)]
                handle.sent += 1
                return FakeResponse(handle, delay, (op, *args))

        return Method()


class FakeResponse:
    def __init__(self, handle, delay, answer):
        self.handle, self.delay, self.answer = handle, delay, answer

    def __await__(self):
        return asyncio.sleep(self.delay, self.answer).__await__()

    def cancel(self):
        self.handle.cancelled.append(self.answer)


def test_the_shard_client_waits_on_its_calls_and_cancels_the_hedged_duplicate():
    from cfir_jax.serve.deployments import RayShards

    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    slow, quick = FakeHandle([5.0, 0.01]), FakeHandle([0.01])
    settings = SimpleNamespace(shard_timeout_s=0.2, deadline_ms=20000)
    client = RayShards([slow, quick], settings, loop)
    try:
        t0 = time.monotonic()
        assert client.score(7, "cfir", ["doc"], 3) == [("score", 7, "cfir", ["doc"], 3)] * 2
        took = time.monotonic() - t0
        assert 0.2 <= took < 1.0, took  # the duplicate went out after shard_timeout_s and answered at once
        assert slow.sent == 2 and quick.sent == 1
        _wait(lambda: slow.cancelled, what="the first call's cancellation")
        assert slow.cancelled == [("score", 7, "cfir", ["doc"], 3)]  # the hedged loser was cancelled
    finally:
        client.close()
        loop.call_soon_threadsafe(loop.stop)
        thread.join(5)


def test_the_other_fronts_load_a_version_while_the_shards_do():
    """A reload that passed its front's checks is a version to load for every front (their own side loads beside the
    shards'); refused, it is not."""
    board, followed = ReloadBoard(), []
    front = FrontReporter(board, lambda: 1, lambda: followed.append(1), grace_s=0, start=False)
    assert front.report() == 1
    board.prepare(2, 1)
    assert front.report() == 2
    _wait(lambda: followed, what="the follow")
    board.abandon(2)
    assert front.report() == 1


def test_the_other_fronts_begin_a_reload_when_one_begins():
    board, followed = ReloadBoard(), []
    front = FrontReporter(board, lambda: 1, lambda: followed.append(1), grace_s=0, start=False)
    board.request(2)  # a front began a reload to version 2: its checks are still running
    assert front.report() == 2
    _wait(lambda: followed, what="the follow")
    assert board.replica("r", 0, [1], {}) == ([1], False)  # no shard loads it before a front's checks passed
    board.abandon(2)
    assert front.report() == 1
