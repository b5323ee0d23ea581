"""The front's client of the shards on Ray (cfir_jax/cluster/ray_shards.py), over stand-ins for Ray's deployment
handles: every call is routed by the version it asks for; a call that is slow is sent again beside the first and the
loser cancelled; a replica that found the version gone is told to the front (which asks for a reload) and the call
goes on to another replica; a shard that never answers is `Unavailable` after the budget; an answer of another
version is refused."""

import asyncio
import threading
import time
from types import SimpleNamespace

import pytest

from cfir_jax.cluster.ray_shards import RayShards
from cfir_jax.cluster.reload import VersionGone
from cfir_jax.cluster.shard import Answer, ShardClient
from cfir_jax.core.errors import CfirError
from cfir_jax.serve.errors import Unavailable


class FakeHandle:
    """A shard's deployment handle whose replicas answer in turn: (delay, what) each, what an Answer's version or an
    exception to raise; records the routing ids and the cancellations."""

    def __init__(self, replies):
        self.replies, self.sent, self.cancelled, self.routed = list(replies), 0, [], []
        self.model_id = ""

    def options(self, multiplexed_model_id=""):
        routed = FakeHandle.__new__(FakeHandle)
        routed.__dict__ = self.__dict__  # one replica set, routed by the id asked for
        self.routed.append(multiplexed_model_id)
        return routed

    def __getattr__(self, op):
        handle = self

        class Method:
            def remote(self, *args):
                if op == "ping":
                    return FakeResponse(handle, 0.0, None, args)
                delay, what = handle.replies[min(handle.sent, len(handle.replies) - 1)]
                handle.sent += 1
                return FakeResponse(handle, delay, what, (op, *args))

        return Method()


class FakeResponse:
    def __init__(self, handle, delay, what, args):
        self.handle, self.delay, self.what, self.args = handle, delay, what, args

    async def _answer(self):
        await asyncio.sleep(self.delay)
        if isinstance(self.what, BaseException):
            raise self.what
        return Answer(self.what, self.args)

    def __await__(self):
        return self._answer().__await__()

    def result(self, timeout_s=None):
        return 0

    def cancel(self):
        self.handle.cancelled.append(self.args)


@pytest.fixture
def loop():
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    yield loop
    loop.call_soon_threadsafe(loop.stop)
    thread.join(5)


def _client(handles, loop, gone=None, timeout_s=0.2, deadline_ms=20000):
    settings = SimpleNamespace(shard_timeout_s=timeout_s, deadline_ms=deadline_ms)
    return RayShards(handles, settings, loop, gone or (lambda vid, why: None))


def test_a_slow_call_is_hedged_and_the_loser_cancelled(loop):
    slow, quick = FakeHandle([(5.0, "7:v"), (0.01, "7:v")]), FakeHandle([(0.01, "7:v")])
    client = _client([slow, quick], loop)
    assert isinstance(client, ShardClient) and client.shards == 2
    try:
        t0 = time.monotonic()
        answers = client.score("7:v", False, "queries", {0: ["a"], 1: ["b"]})
        assert answers == {0: ("score", False, "queries", ["a"]), 1: ("score", False, "queries", ["b"])}
        assert 0.2 <= time.monotonic() - t0 < 1.0  # the duplicate went out after shard_timeout_s, answered at once
        assert slow.sent == 2 and quick.sent == 1 and set(slow.routed) == {"7:v"}  # routed by the version
        deadline = time.monotonic() + 5
        while not slow.cancelled:
            assert time.monotonic() < deadline
            time.sleep(0.01)
        assert slow.cancelled == [("score", False, "queries", ["a"])]  # the hedged loser was cancelled
    finally:
        client.close()


def test_a_version_gone_is_told_to_the_front_and_another_replica_answers(loop):
    told = []
    shard = FakeHandle([(0.0, VersionGone("7:v", "8:w", "shard 0: ")), (0.0, "7:v")])
    client = _client([shard], loop, gone=lambda vid, why: told.append((vid, why)))
    try:
        assert client.search("7:v", "q", 5, (1.0, 0.0)) == [("search", "q", 5, (1.0, 0.0))]
        assert told == [("7:v", "shard 0: version 7 (7:v) is no longer in the workdir, which holds "
                                "version 8 (8:w)")]
    finally:
        client.close()


def test_a_shard_with_no_answer_is_unavailable_within_the_budget_and_another_version_is_refused(loop):
    client = _client([FakeHandle([(0.0, RuntimeError("replica died"))])], loop, deadline_ms=600)
    try:
        t0 = time.monotonic()
        with pytest.raises(Unavailable, match="shard 0 unavailable: RuntimeError: replica died"):
            client.search("7:v", "q", 5, (1.0, 0.0))
        assert time.monotonic() - t0 < 1.5
    finally:
        client.close()
    client = _client([FakeHandle([(0.0, "6:old")])], loop, deadline_ms=300)
    try:
        with pytest.raises(Unavailable, match="answered at version 6:old, not 7:v"):
            client.search("7:v", "q", 5, (1.0, 0.0))
    finally:
        client.close()
    assert issubclass(Unavailable, Exception) and not issubclass(Unavailable, CfirError)
