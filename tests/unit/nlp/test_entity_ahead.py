"""The entity pool's head start (`EntityWorkers.ahead`, cfir_jax/nlp/entity_workers.py): a service's request queued
behind the running batch is parsed at once, from the event loop's thread, and the batch that asks for it later takes
what the workers found: the same entities as a call of its own, nothing parsed twice, nothing kept past the setting,
whatever the order of heads start, calls and give-ups, and from two threads at once."""

import collections
import os
import random
import signal
import threading
import time

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule

from cfir_jax.core.errors import CfirError
from cfir_jax.nlp import entity_workers
from cfir_jax.nlp.entities import EntityExtractor, load_spacy
from cfir_jax.nlp.entity_workers import EntityWorkers, Settings

TEXTS = [f"Ada Lovelace wrote to Charles Babbage from London, letter {i}." for i in range(8)] + \
    ["Nothing named here.", "Marie Curie worked in Paris and Warsaw.", "Angela Merkel met Barack Obama in Berlin."]
HELD = 6  # texts a pool of these tests holds ahead at most


@pytest.fixture(scope="module")
def expected():
    return dict(zip(TEXTS, EntityExtractor(load_spacy(None), "all").extract(TEXTS)))


@pytest.fixture(scope="module")
def pool():
    p = EntityWorkers("", "all", Settings(workers=2, deadline_s=2.0, ahead_texts=HELD))
    yield p
    p.close()


def _settled(pool: EntityWorkers, chunks: int, within: float = 30.0) -> None:
    """Waits until `chunks` answers wait in the pool's inbox, unread (the workers parsed them; nobody pumped)."""
    end = time.monotonic() + within
    while pool._inbox.qsize() < chunks and time.monotonic() < end:
        time.sleep(0.05)
    assert pool._inbox.qsize() >= chunks, "the workers did not parse what was handed them ahead"


def test_what_is_parsed_ahead_is_answered_when_the_workers_can_no_longer_parse(expected):
    """ahead() hands the texts to the workers at once; stopped afterwards, the workers could parse nothing more, yet
    the call that asks for those texts is answered from what they found, past no deadline, and keeps nothing."""
    pool = EntityWorkers("", "all", Settings(workers=2, deadline_s=2.0, ahead_texts=HELD))
    texts = TEXTS[:4]
    try:
        pool.ahead(texts, 1)  # four chunks: two with each worker
        _settled(pool, 4)
        pids = pool.describe()["pids"]
        for pid in pids:
            os.kill(pid, signal.SIGSTOP)
        assert pool.parsed_ahead(texts)
        t0 = time.monotonic()
        assert list(pool.stream(texts, 2)) == [expected[t] for t in texts]
        assert time.monotonic() - t0 < 1.0 and sum(pool.restarts.values()) == 0
        assert pool._texts == {} and pool._ahead == {} and pool._done == {} and not pool._pending
        assert not pool.parsed_ahead(texts[:1])  # taken: a later call parses it again
    finally:
        for pid in pool.describe()["pids"]:
            os.kill(pid, signal.SIGCONT)
        pool.close()


def test_a_call_asking_for_some_texts_ahead_and_some_not_gets_each_in_order(pool, expected):
    pool.ahead(TEXTS[2:7], 2)  # chunks (2, 3), (4, 5), (6,)
    asked = [TEXTS[0], TEXTS[3], TEXTS[3], TEXTS[9], TEXTS[2], TEXTS[4]]
    assert pool.entities(asked) == [expected[t] for t in asked]
    assert not pool.parsed_ahead([TEXTS[5]])  # in a chunk the call took (with TEXTS[4])
    assert pool.parsed_ahead([TEXTS[6]]) and len(pool._texts) == 1  # not asked for: still held
    assert pool.entities(TEXTS[5:7]) == [expected[t] for t in TEXTS[5:7]]
    assert pool._texts == {} and pool._ahead == {} and pool._done == {}


def test_the_pool_holds_at_most_its_setting_ahead_giving_up_the_oldest(pool, expected):
    pool.ahead(TEXTS[:HELD + 3], 1)
    assert len(pool._ahead) == HELD and len(pool._texts) == HELD
    assert pool.parsed_ahead(TEXTS[3 : HELD + 3]) and not pool.parsed_ahead(TEXTS[:1])
    assert list(pool.stream(TEXTS[: HELD + 3], 2)) == [expected[t] for t in TEXTS[: HELD + 3]]
    assert pool._texts == {} and pool._ahead == {}
    plain = EntityWorkers("", "all", Settings(workers=1), wait=False)  # the default: nothing parsed ahead
    try:
        plain.ahead(TEXTS, 1)
        assert not plain.parsed_ahead(TEXTS[:1]) and plain._texts == {}
    finally:
        plain.close()


def test_ahead_from_another_thread_while_calls_stream_answers_every_text_as_alone(pool, expected):
    """The service's event loop hands queued requests ahead while its retrieval thread reads a batch's entities."""
    stop, failures = threading.Event(), []
    rng = random.Random(0)

    def hand_ahead():
        try:
            while not stop.is_set():
                pool.ahead(rng.sample(TEXTS, 3), rng.choice([1, 2]))
                time.sleep(0.002)
        except Exception as e:  # noqa: BLE001 - reported below, in the test's thread
            failures.append(e)

    other = threading.Thread(target=hand_ahead)
    other.start()
    try:
        for n in range(25):
            asked = [rng.choice(TEXTS) for _ in range(rng.randint(1, 6))]
            got = pool.stream(asked, rng.choice([1, 2, 3]))
            if n % 5 == 4:  # given up part way, as a batch that raises
                next(got)
                got.close()
                continue
            assert list(got) == [expected[t] for t in asked]
    finally:
        stop.set()
        other.join()
    assert not failures, failures
    assert len(pool._ahead) <= HELD and set(pool._texts) == {task for task, _ in pool._ahead.values()}
    assert sum(pool.restarts.values()) == 0


class AheadAndCalls(RuleBasedStateMachine):
    """Random interleavings of heads start, calls read to their end, calls given up before or part way through their
    reading, and the pool's answers; after each step the pool holds only what ahead() keeps, within its setting."""

    pool: EntityWorkers
    expected: dict

    def __init__(self):
        super().__init__()
        while self.pool._ahead:  # the shared pool, as the example before left it: each of its holders gives up
            self.pool.give_up(list(self.pool._ahead))
        self.holders: collections.Counter = collections.Counter()  # the ahead() calls not given up, per text

    @rule(texts=st.lists(st.sampled_from(TEXTS), max_size=5), chunk=st.integers(1, 3))
    def ahead(self, texts, chunk):
        self.holders.update(dict.fromkeys(texts, 1))
        self.pool.ahead(texts, chunk)

    @rule(texts=st.lists(st.sampled_from(TEXTS), min_size=1, max_size=5), chunk=st.integers(1, 3))
    def call(self, texts, chunk):
        assert list(self.pool.stream(texts, chunk)) == [self.expected[t] for t in texts]

    @rule(texts=st.lists(st.sampled_from(TEXTS), min_size=1, max_size=5), read=st.integers(0, 4))
    def call_given_up(self, texts, read):
        got = self.pool.stream(texts, 2)
        for _ in range(min(read, len(texts))):
            next(got)
        got.close()

    @rule(texts=st.lists(st.sampled_from(TEXTS), max_size=5))
    def give_up(self, texts):
        """As one request's give-up: a chunk goes when no text of it is held by an ahead() call not given up."""
        held = {t: task for t, (task, _) in self.pool._ahead.items()}
        holders = collections.Counter({t: n for t, n in self.holders.items() if t in held})
        holders.subtract(t for t in dict.fromkeys(texts) if t in held)
        self.pool.give_up(texts)
        for text, task in held.items():
            kept = any(holders[t] > 0 for t, other in held.items() if other == task)
            assert (text in self.pool._ahead) == kept
        self.holders = holders

    @invariant()
    def holds_only_what_ahead_keeps(self):
        self.holders = collections.Counter({t: n for t, n in self.holders.items() if t in self.pool._ahead})
        ahead_chunks = {task for task, _ in self.pool._ahead.values()}
        assert len(self.pool._ahead) <= HELD
        assert set(self.pool._texts) == ahead_chunks and set(self.pool._done) <= ahead_chunks
        assert set(self.pool._pending) <= ahead_chunks


def test_random_interleavings_of_ahead_calls_and_give_ups(pool, expected):
    AheadAndCalls.pool, AheadAndCalls.expected = pool, expected
    runner = AheadAndCalls.TestCase
    runner.settings = settings(max_examples=12, stateful_step_count=8, deadline=None,
                               suppress_health_check=list(HealthCheck))
    runner().runTest()
    assert sum(pool.restarts.values()) == 0


def test_a_chunk_parsed_ahead_that_kills_its_worker_is_given_up_not_retried_by_the_calls_behind(monkeypatch, expected):
    """A text handed ahead for a request that then never runs (withdrawn, refused) and that takes its worker down (a
    crash, or past the deadline): no call owns its chunk, so none may retry it. It costs one restart and is given
    up; the calls behind are answered and the pool stays healthy (retried, it killed worker after worker until the
    pool degraded: found by review)."""
    poison = "Ada Lovelace wrote a text that takes its worker down."
    real_send = entity_workers._Worker.send

    def send(w, task, texts):  # whichever worker is handed the text dies before it answers
        if poison in texts:
            os.kill(w.proc.pid, signal.SIGKILL)
        real_send(w, task, texts)

    monkeypatch.setattr(entity_workers._Worker, "send", send)
    pool = EntityWorkers("", "all", Settings(workers=2, deadline_s=10.0, max_restarts=2, ahead_texts=HELD))
    try:
        pool.ahead([poison], 1)
        for n in range(5):  # later batches; each waits for the replacement to load, so that it is handed work
            end = time.monotonic() + 60
            while pool.state != "healthy" and time.monotonic() < end:
                time.sleep(0.05)
            texts = TEXTS[n : n + 3]
            assert pool.entities(texts) == [expected[t] for t in texts]
        assert dict(pool.restarts) == {"died": 1} and not pool.degraded
        assert not pool.parsed_ahead([poison]) and pool._texts == {} and not pool._pending
    finally:
        pool.close()


def test_a_chunk_ahead_that_failed_for_another_request_s_text_is_parsed_again_for_the_call_that_asks(monkeypatch,
                                                                                                    expected):
    """Two queued requests share a text, parsed ahead once in the first one's chunk beside a text spaCy raises on;
    the first is withdrawn (its chunk kept: the second holds a text of it). The second's call took the failed chunk
    and was answered the other request's error (found by review); it now parses its text again alone, and the text
    that raises still fails its own call."""
    poison = "Ada Lovelace wrote a text spaCy raises on."
    shared = TEXTS[9]
    pool = EntityWorkers("", "all", Settings(workers=2, deadline_s=10.0, ahead_texts=HELD))
    real = entity_workers._parsed

    def parsed(line):  # the workers' answer to a chunk holding the poison: spaCy's error, as a worker sends it
        message = real(line)
        if isinstance(message, list) and len(message) == 2 and poison in pool._texts.get(message[0], ()):
            return [message[0], {"error": "ValueError: spaCy raised on a text"}]
        return message

    monkeypatch.setattr(entity_workers, "_parsed", parsed)
    try:
        pool.ahead([poison, shared], 2)  # the first request: one chunk of both
        pool.ahead([shared], 1)  # the second: its text is in that chunk
        pool.give_up([poison, shared])  # the first withdrawn
        assert pool.parsed_ahead([shared])
        assert pool.entities([shared]) == [expected[shared]]
        with pytest.raises(CfirError, match="spaCy raised on a text"):
            pool.entities([poison])
        assert pool._texts == {} and pool._ahead == {} and sum(pool.restarts.values()) == 0
    finally:
        pool.close()


def test_a_degraded_pool_parses_a_shared_text_again_when_the_chunk_fails_in_the_calling_thread():
    """The same two requests in a pool that parses in the calling thread (degraded): the chunk's error was raised
    there, past the re-parse, so the second request was answered the first one's error (review)."""
    poison, shared = "a text spaCy raises on", "Marie Curie worked in Paris and Warsaw."

    class Local:  # the calling thread's spaCy
        def extract(self, texts):
            if poison in texts:
                raise ValueError("spaCy raised on a text")
            return [[t.split()[0]] for t in texts]

    pool = EntityWorkers("", "all", Settings(workers=1, deadline_s=10.0, ahead_texts=HELD), wait=False)
    with pool._lock:  # a crash loop's end (`_replace`): no workers, the calling thread parses
        pool.degraded_reason = "6 worker restarts within 60 s: parsing in the calling thread"
        for w in pool._workers:
            w.kill()
        pool._workers.clear()
    pool._local = Local()
    try:
        pool.ahead([poison, shared], 2)
        pool.ahead([shared], 1)
        pool.give_up([poison, shared])
        assert pool.entities([shared]) == [["Marie"]]
        with pytest.raises(ValueError, match="spaCy raised on a text"):
            pool.entities([poison])
        assert pool._texts == {} and pool._done == {} and pool._ahead == {}
    finally:
        pool.close()


def test_chunks_given_up_before_a_worker_takes_them_are_never_parsed(expected):
    """A request parsed ahead that will never run gives its chunks up (`give_up`): those still waiting for a worker
    never reach one, those with a worker are dropped when they come back, and a later call parses the texts anew."""
    pool = EntityWorkers("", "all", Settings(workers=2, deadline_s=30.0, ahead_texts=HELD))
    texts = TEXTS[:6]
    try:
        pool.entities(TEXTS[6:8])  # the workers loaded and ready
        pids = pool.describe()["pids"]
        for pid in pids:
            os.kill(pid, signal.SIGSTOP)
        pool.ahead(texts, 1)  # six chunks: two with each stopped worker, two waiting
        assert len(pool._pending) == 2 and pool.parsed_ahead(texts)
        pool.ahead(texts[:1], 1)  # a second request with the first text: its chunk is held twice
        pool.give_up(texts[:5] + ["a text never handed ahead"])  # the last chunk's text stays
        assert pool.parsed_ahead(texts[:1]) and not any(pool.parsed_ahead([t]) for t in texts[1:5])
        pool.give_up(texts[:1])  # the second request's: nobody holds the first chunk now
        assert pool.parsed_ahead(texts[5:]) and not any(pool.parsed_ahead([t]) for t in texts[:5])
        assert set(pool._texts) == {pool._ahead[texts[5]][0]} and list(pool._pending) == [pool._ahead[texts[5]][0]]
        for pid in pids:
            os.kill(pid, signal.SIGCONT)
        assert pool.entities(texts) == [expected[t] for t in texts]
        assert pool._texts == {} and pool._ahead == {} and sum(pool.restarts.values()) == 0
    finally:
        for pid in pool.describe()["pids"]:
            os.kill(pid, signal.SIGCONT)
        pool.close()
