"""The micro-batcher (cfir_jax/serve/batcher.py) over a stand-in Retriever: requests that queue while a batch runs go
through `retrieve_many` together and each gets its own answers in order; the queue is bounded in documents; a request
past its deadline is dropped unrun; a failing batch answers every request with the error; a request whose event loop
closed is dropped alone and the worker lives; the resident service's `--config.*` arguments are the ones a reload
applies again."""

import asyncio
import contextlib
import threading
import time
from types import SimpleNamespace

import pytest
from standin_service import NoImages, standin_index

from cfir_jax.core.query_rule import Condition
from cfir_jax.retrieve.pipeline import DocumentInput
from cfir_jax.retrieve.results import Result
from cfir_jax.serve import batcher as batcher_lib
from cfir_jax.serve.metrics import Metrics
from cfir_jax.serve.resident import config_overrides


class StandIn:
    """A Retriever's batched path: each document's 'result' is its text upper-cased; batches are recorded."""

    entities = None
    image_search = NoImages

    def __init__(self, gate: threading.Event | None = None, fail: bool = False):
        self.batches, self.gate, self.fail = [], gate, fail

    def retrieve_many(self, docs, progress=False):
        self.batches.append([d.doc_id for d in docs])
        if self.gate is not None:
            self.gate.wait(5)
        if self.fail:
            raise RuntimeError("the device fell over")
        return [SimpleNamespace(text=d.text.upper(), times_ms={}) for d in docs]

    def describe_image(self, image_id):
        return "", ""


CC0 = Condition("license", "=", ("cc0",))


@pytest.fixture
def answers_as_text(monkeypatch):
    made = lambda doc_id, result, describe, top, *rest: SimpleNamespace(id=doc_id, text=result.text,  # noqa: E731
                                                                         times_ms=result.times_ms)
    monkeypatch.setattr(Result, "of", made)  # the stand-in's answers are no pipeline Retrievals
    monkeypatch.setattr(batcher_lib.report, "as_json", lambda result, top: f"{result.id}={result.text}")


def _job(loop, ids, deadline_s=5.0, method="cfir"):
    docs = [DocumentInput(f"text {i}", i) for i in ids]
    return batcher_lib.Job(docs, method, 10, time.monotonic() + deadline_s, loop.create_future(), loop)


def _batcher(retriever, max_batch=8, queue_size=64):
    index = SimpleNamespace(index=standin_index(retriever), version=3, entity_pool=None)
    return batcher_lib.MicroBatcher(lambda: index, max_batch, 0.0, queue_size, Metrics())


def test_requests_queued_behind_a_batch_run_together_and_keep_their_answers(answers_as_text):
    async def run():
        loop, gate = asyncio.get_running_loop(), threading.Event()
        retriever = StandIn(gate)
        mb = _batcher(retriever)
        first = _job(loop, ["a"])
        mb.submit(first)
        while not retriever.batches:  # the worker holds the first batch
            await asyncio.sleep(0.01)
        later = [_job(loop, ["b", "c"]), _job(loop, ["d"])]
        for job in later:
            mb.submit(job)
        gate.set()
        results = [await job.future for job in (first, *later)]
        mb.stop(5)
        return retriever.batches, results, [j.version for j in (first, *later)]

    batches, results, versions = asyncio.run(run())
    assert batches == [["a"], ["b", "c", "d"]]
    assert results == [["a=TEXT A"], ["b=TEXT B", "c=TEXT C"], ["d=TEXT D"]] and versions == [3, 3, 3]


def test_the_queue_is_bounded_in_documents(answers_as_text):
    async def run():
        loop, gate = asyncio.get_running_loop(), threading.Event()
        retriever = StandIn(gate)
        mb = _batcher(retriever, queue_size=3)
        mb.submit(_job(loop, ["running"]))
        while not retriever.batches:
            await asyncio.sleep(0.01)
        mb.submit(_job(loop, ["a", "b"]))
        with pytest.raises(batcher_lib.QueueFull, match=r"2 documents are waiting \(serve.queue_size=3\)"):
            mb.submit(_job(loop, ["c", "d"]))
        mb.submit(_job(loop, ["e"]))  # 3 documents fit
        gate.set()
        mb.stop(5)

    asyncio.run(run())


def test_a_withdrawn_request_frees_its_place_at_once_and_never_runs(answers_as_text):
    """Two requests fill the queue behind a running batch and their clients go (the handler withdraws them): the next
    request is queued, not refused busy, and only it runs after the first; the batcher counts no drop of its own (the
    handler counts each once)."""
    async def run():
        loop, gate = asyncio.get_running_loop(), threading.Event()
        retriever = StandIn(gate)
        mb = _batcher(retriever, queue_size=2)
        mb.submit(_job(loop, ["running"]))
        while not retriever.batches:
            await asyncio.sleep(0.01)
        gone = [_job(loop, ["gone1"]), _job(loop, ["gone2"])]
        for job in gone:
            mb.submit(job)
        with pytest.raises(batcher_lib.QueueFull):
            mb.submit(_job(loop, ["refused"]))
        assert [mb.withdraw(job) for job in gone] == [True, True] and mb.depth == 0
        assert not mb.withdraw(gone[0])  # once: it is no longer queued
        nxt = _job(loop, ["next"])
        mb.submit(nxt)
        gate.set()
        answer = await nxt.future
        mb.stop(5)
        dropped = mb.metrics.registry.get_sample_value("cfir_dropped_requests_total", {"reason": "disconnected"})
        return retriever.batches, answer, dropped, [j.future.done() for j in gone]

    batches, answer, dropped, settled = asyncio.run(run())
    assert batches == [["running"], ["next"]] and answer == ["next=TEXT NEXT"]
    assert dropped is None and settled == [False, False]  # never run, never answered by the batcher


def test_a_request_past_its_deadline_is_dropped_unrun(answers_as_text):
    async def run():
        loop = asyncio.get_running_loop()
        retriever = StandIn()
        mb = _batcher(retriever)
        late = _job(loop, ["late"], deadline_s=-1.0)
        mb.submit(late)
        with pytest.raises(batcher_lib.Dropped, match="deadline passed"):
            await late.future
        mb.stop(5)
        return retriever.batches

    assert asyncio.run(run()) == []


def test_a_failing_batch_answers_every_request_with_its_error(answers_as_text):
    async def run():
        loop, gate = asyncio.get_running_loop(), threading.Event()
        retriever = StandIn(gate, fail=True)
        mb = _batcher(retriever)
        jobs = [_job(loop, ["a"])]
        mb.submit(jobs[0])
        while not retriever.batches:
            await asyncio.sleep(0.01)
        jobs += [_job(loop, ["b"]), _job(loop, ["c"])]
        for job in jobs[1:]:
            mb.submit(job)
        gate.set()
        errors = []
        for job in jobs:
            with pytest.raises(RuntimeError, match="the device fell over"):
                await job.future
            errors.append(job)
        mb.stop(5)
        return len(errors)

    assert asyncio.run(run()) == 3


def test_a_batch_stops_at_max_batch_documents(answers_as_text):
    async def run():
        loop, gate = asyncio.get_running_loop(), threading.Event()
        retriever = StandIn(gate)
        mb = _batcher(retriever, max_batch=3)
        mb.submit(_job(loop, ["a"]))
        while not retriever.batches:
            await asyncio.sleep(0.01)
        jobs = [_job(loop, ["b", "c"]), _job(loop, ["d", "e"]), _job(loop, ["f"])]
        for job in jobs:
            mb.submit(job)
        gate.set()
        for job in jobs:
            await job.future
        mb.stop(5)
        return retriever.batches

    assert asyncio.run(run()) == [["a"], ["b", "c"], ["d", "e", "f"]]


def test_config_overrides_are_the_config_arguments_of_a_command_line():
    argv = ["--index", "W", "--serve", "--config.serve.max_batch=4", "--config.retrieval.top_k", "50", "--port", "0"]
    assert config_overrides(argv) == ["--config.serve.max_batch=4", "--config.retrieval.top_k=50"]


class Hits:
    """A Retriever's batched path answering five ranked images per document (the real records, no monkeypatching)."""

    entities = None
    image_search = NoImages

    def __init__(self, gate: threading.Event):
        self.batches, self.gate = [], gate

    filters = SimpleNamespace(check=lambda where: None)  # every field known

    def retrieve_many(self, docs, progress=False):
        from cfir_jax.retrieve.pipeline import RankedImage, Retrieval

        self.batches.append([(d.doc_id, d.where) for d in docs])
        self.gate.wait(5)
        return [Retrieval([RankedImage(n + 1, f"img-{n}", 1.0, n) for n in range(5)], [], [], "") for _ in docs]

    def describe_image(self, image_id):
        return f"caption of {image_id}", ""


def test_jobs_of_one_batch_get_their_own_top_k_and_filters_through_the_index():
    """The batcher answers through `Index.search_documents`: one retrieval for the batch, each request's top_k."""
    import json

    async def run():
        loop, gate = asyncio.get_running_loop(), threading.Event()
        retriever = Hits(gate)
        mb = _batcher(retriever)
        mb.submit(_job(loop, ["running"]))
        while not retriever.batches:  # the worker holds the first batch: the next two queue behind it
            await asyncio.sleep(0.01)
        few = batcher_lib.Job([DocumentInput("t", "a", where=(CC0,))], "cfir", 1,
                              time.monotonic() + 5, loop.create_future(), loop)
        many = batcher_lib.Job([DocumentInput("t", "b"), DocumentInput("t", "c")], "cfir", 4, time.monotonic() + 5,
                               loop.create_future(), loop)
        mb.submit(few)
        mb.submit(many)
        gate.set()
        answers = [await few.future, await many.future]
        mb.stop(5)
        return retriever.batches[1:], answers

    batches, answers = asyncio.run(run())
    assert batches == [[("a", (CC0,)), ("b", ()), ("c", ())]]
    shown = [[(json.loads(a)["id"], len(json.loads(a)["hits"])) for a in job] for job in answers]
    assert shown == [[("a", 1)], [("b", 4), ("c", 4)]]
    assert json.loads(answers[0][0])["hits"][0]["caption"] == "caption of img-0"


class WithEntities(StandIn):
    """A stand-in whose method reads entities: the documents handed to its pool ahead are recorded (one list per
    call), and the head start fails for a document whose id is "broken"."""

    def __init__(self, gate: threading.Event | None = None):
        super().__init__(gate)
        self.ahead: list[list[str]] = []
        self.given_up: list[list[str]] = []
        self.entities = SimpleNamespace(parse_ahead=self.parse_ahead,
                                        give_up_ahead=lambda docs: self.given_up.append([d.doc_id for d in docs]))
        self.languages = SimpleNamespace(language=lambda doc: "en")

    def parse_ahead(self, docs, language):
        if any(d.doc_id == "broken" for d in docs):
            raise RuntimeError("the pool fell over")
        self.ahead.append([d.doc_id for d in docs if language(d) == "en"])


async def _running_a_batch(retriever: StandIn) -> tuple[batcher_lib.MicroBatcher, batcher_lib.Job]:
    """A batcher over `retriever` and its first request, whose batch runs (held at the retriever's gate)."""
    mb = _batcher(retriever)
    first = _job(asyncio.get_running_loop(), ["a"])
    mb.submit(first)
    while not retriever.batches:
        await asyncio.sleep(0.01)
    return mb, first


def test_requests_queued_behind_a_running_batch_are_handed_to_the_entity_pool_at_once(answers_as_text):
    """A request that arrives while a batch runs has its documents' entities parsed ahead (so the pool works while
    the batch is ranked and answered); one that finds the batcher idle is taken at once and parses in its own batch;
    a head start that fails leaves the request to its batch, answered as the others."""

    async def run():
        loop, gate = asyncio.get_running_loop(), threading.Event()
        retriever = WithEntities(gate)
        mb, first = await _running_a_batch(retriever)
        later = [_job(loop, ["b", "c"]), _job(loop, ["broken"]), _job(loop, ["d"])]
        for job in later:
            mb.submit(job)
        handed = [list(ids) for ids in retriever.ahead]  # before the running batch ends
        gate.set()
        results = [await job.future for job in (first, *later)]
        mb.stop(5)
        return retriever.batches, handed, results

    batches, handed, results = asyncio.run(run())
    assert handed == [["b", "c"], ["d"]]
    assert batches == [["a"], ["b", "c", "broken", "d"]]
    assert results == [["a=TEXT A"], ["b=TEXT B", "c=TEXT C"], ["broken=TEXT BROKEN"], ["d=TEXT D"]]


def test_a_request_parsed_ahead_that_will_never_run_gives_its_head_start_up(answers_as_text):
    """A request parsed ahead and then withdrawn (its client went away), past its deadline when its batch starts,
    or refused by the index gives up what the pool had not parsed yet (an overloaded service's timed-out requests
    would take the workers' time from the live ones); one that ran gives up what its batch left (a filter that no
    image passes answers it without its entities), and one never parsed ahead gives nothing up."""

    async def run():
        loop, gate = asyncio.get_running_loop(), threading.Event()
        retriever = WithEntities(gate)
        mb, first = await _running_a_batch(retriever)
        gone, late, live = _job(loop, ["gone"]), _job(loop, ["late"], deadline_s=0.2), _job(loop, ["live"])
        refused = _job(loop, ["refused"])
        refused.top_k = 0
        for job in (gone, late, refused, live):
            mb.submit(job)
        assert mb.withdraw(gone)
        given_up_while_running = [list(ids) for ids in retriever.given_up]
        await asyncio.sleep(0.3)  # the late one's deadline passes while the first batch runs
        gate.set()
        for job in (first, late, live, refused):
            with contextlib.suppress(Exception):
                await job.future
        mb.stop(5)
        return retriever, given_up_while_running, refused.future.exception()

    retriever, while_running, refusal = asyncio.run(run())
    assert retriever.ahead == [["gone"], ["late"], ["refused"], ["live"]] and refusal is not None
    assert while_running == [["gone"]]
    assert retriever.given_up == [["gone"], ["late"], ["refused"], ["live"]]  # the one that ran: what it left
    assert retriever.batches == [["a"], ["live"]]


def test_a_request_whose_event_loop_closed_fails_alone_and_the_worker_lives(answers_as_text):
    """A request's handler loop closed before its batch answered (its server stopped, its thread gone): settling it
    raised in the worker thread, which died, and every later request waited forever. Its answer is dropped; its
    neighbours in the batch and the requests after are answered."""
    gone = asyncio.new_event_loop()
    orphan = _job(gone, ["orphan"])
    gone.close()

    async def run():
        loop, gate = asyncio.get_running_loop(), threading.Event()
        retriever = StandIn(gate)
        mb, first = await _running_a_batch(retriever)
        beside = _job(loop, ["b"])
        for job in (orphan, beside):
            mb.submit(job)
        gate.set()
        answered = [await asyncio.wait_for(job.future, 5) for job in (first, beside)]
        after = _job(loop, ["c"])
        mb.submit(after)
        answered.append(await asyncio.wait_for(after.future, 5))
        alive = mb.alive
        mb.stop(5)
        return retriever.batches, answered, alive

    batches, answered, alive = asyncio.run(run())
    assert batches == [["a"], ["orphan", "b"], ["c"]]
    assert answered == [["a=TEXT A"], ["b=TEXT B"], ["c=TEXT C"]] and alive


@pytest.mark.parametrize("raised", [SystemExit(3), KeyboardInterrupt()], ids=["SystemExit", "KeyboardInterrupt"])
def test_an_engine_raising_what_is_not_an_exception_fails_its_request_alone_and_the_worker_lives(answers_as_text,
                                                                                               raised):
    """SystemExit or KeyboardInterrupt out of one request's engine call (a library's exit) ended the worker thread:
    its neighbour and every later request waited for their deadlines. Now the request is answered a RuntimeError that
    names what was raised (a 500 with an id), in its batch and alone; the others are answered."""
    class Raises(StandIn):
        def retrieve_many(self, docs, progress=False):
            out = super().retrieve_many(docs, progress)
            if any(d.doc_id == "bad" for d in docs):
                raise raised
            return out

    async def run():
        loop, gate = asyncio.get_running_loop(), threading.Event()
        retriever = Raises(gate)
        mb, first = await _running_a_batch(retriever)
        bad, beside = _job(loop, ["bad"]), _job(loop, ["b"])
        for job in (bad, beside):
            mb.submit(job)
        gate.set()
        answered = [await asyncio.wait_for(job.future, 5) for job in (first, beside)]
        alone = _job(loop, ["bad"])
        mb.submit(alone)
        refused = [await asyncio.wait_for(asyncio.gather(job.future, return_exceptions=True), 5)
                   for job in (bad, alone)]
        last = _job(loop, ["c"])
        mb.submit(last)
        answered.append(await asyncio.wait_for(last.future, 5))
        alive = mb.alive
        mb.stop(5)
        return retriever.batches, answered, [r[0] for r in refused], alive

    batches, answered, refused, alive = asyncio.run(run())
    assert batches == [["a"], ["bad", "b"], ["bad"], ["b"], ["bad"], ["c"]] and alive
    assert answered == [["a=TEXT A"], ["b=TEXT B"], ["c=TEXT C"]]
    for error in refused:
        assert isinstance(error, RuntimeError) and str(error).startswith(f"the engine raised {type(raised).__name__}")
        assert error.__cause__ is raised
