"""What one request cannot do to the service (`cfir_jax/serve/service.py`, `app.py`, `batcher.py`): its internal
error closes no kept-alive connection and logs one traceback, an engine's SystemExit in an image search is its own
500, a handler cancelled while it waits gives its place in the queue up, damage a lone request or an image search
meets makes /readyz 503 while that index serves and not after a reload swapped another in, and a worker thread that
is gone is /readyz's 503 too."""

import asyncio
import copy
import gc
import json
import logging
import threading
import weakref

import httpx
import pytest
from standin_service import Generation, StandInHolder, StandInRetriever, StandInTower, serving, settings, standin_index

from cfir_jax.api.index import Index
from cfir_jax.retrieve.pipeline import DocumentInput
from cfir_jax.serve.batcher import MicroBatcher
from cfir_jax.serve.metrics import Metrics
from cfir_jax.serve.middleware import RequestGuard
from cfir_jax.serve.service import Service
from cfir_jax.stores.integrity import CorruptStore

DAMAGE = "W/image_cache/embeddings.npy: checksum mismatch"


class Raises(StandInRetriever):
    """The stand-in engine; the text "boom" raises what `raised` is."""

    def __init__(self, raised: BaseException):
        super().__init__(StandInTower(), 50)
        self.raised = raised

    def retrieve_many(self, docs, progress=False):
        if any(d.text == "boom" for d in docs):
            raise self.raised
        return super().retrieve_many(docs, progress)


def _internal_error(response: httpx.Response) -> bool:
    error = response.json()["error"]
    return response.status_code == 500 and error.startswith("internal error (id ") and "\n" not in error


@pytest.mark.parametrize("raised", [RuntimeError("a bug"), SystemExit(0)], ids=["RuntimeError", "SystemExit"])
def test_an_internal_error_keeps_the_connection_and_logs_one_traceback(raised):
    """Starlette's handler of Exception answered the 500, then raised the error again to uvicorn, which closed the
    connection: the client's next request on it met a reset, and uvicorn logged a second traceback."""
    with serving(retriever=Raises(raised), deadline_ms=5000) as (url, svc, _):
        with httpx.Client(base_url=url, timeout=10) as client:
            first = client.post("/v1/search", json={"text": "boom"})
            second = client.post("/v1/search", json={"text": "a neighbour, on the same connection"})
            ready = client.get("/readyz")
        assert _internal_error(first) and second.status_code == 200 and ready.status_code == 200
        error_id = first.json()["error"].split()[3].rstrip(";")
        logged = [r.getMessage() for r in svc.log_records]
        assert logged == [f"internal error {error_id} on POST /v1/search"]


def test_an_error_raised_by_the_request_guard_itself_is_the_same_json_500():
    """The guard runs outside the app's own handling of internal errors; what it raises is still the one JSON line
    with an id (Starlette's fallback, which then ends the connection)."""
    class Broken:
        def inc(self):
            raise RuntimeError("a bug in the guard")

        def dec(self):
            pass

    with serving(deadline_ms=5000) as (url, svc, _):
        svc.metrics.in_flight = Broken()
        with httpx.Client(base_url=url, timeout=10) as client:
            answer = client.post("/v1/search", json={"text": "x"})
        assert _internal_error(answer) and answer.headers["content-type"] == "application/json"


def test_an_image_search_raising_systemexit_is_its_own_500(monkeypatch):
    real = Index.search_image

    def search_image(self, query, deadline=None):
        if query.image_id == "img-b":
            raise SystemExit(0)
        return real(self, query, deadline)

    monkeypatch.setattr(Index, "search_image", search_image)
    with serving(deadline_ms=5000) as (url, svc, _):
        with httpx.Client(base_url=url, timeout=10) as client:
            exits = client.post("/v1/search/image", json={"image_id": "img-b"})
            image = client.post("/v1/search/image", json={"image_id": "img-a"})
            text = client.post("/v1/search", json={"text": "a text after"})
        assert _internal_error(exits) and image.status_code == 200 and text.status_code == 200
        assert len(svc.log_records) == 1 and "raised SystemExit" in repr(svc.log_records[0].exc_info[1])


class Gated(StandInRetriever):
    """The stand-in engine, each batch held until `gate` is set (`started` once one runs); raises `raised` if set."""

    def __init__(self, raised: BaseException | None = None):
        super().__init__(StandInTower(), 50)
        self.gate, self.started, self.raised = threading.Event(), threading.Event(), raised

    def retrieve_many(self, docs, progress=False):
        self.started.set()
        self.gate.wait(10)
        if self.raised is not None:  # a fresh error each time, as a store raises (one kept would hold its frames)
            raise type(self.raised)(*self.raised.args)
        return super().retrieve_many(docs, progress)


def _stop(svc: Service) -> None:
    svc.batcher.stop(5)
    svc.images.stop()
    svc.verifier.stop()


def test_a_cancelled_handler_gives_its_place_in_the_queue_up():
    """Ray Serve cancels a handler's task when its client goes; the cancelled wait skipped the withdrawal, so the job
    held its place (a neighbour was refused busy) and later ran for nobody."""
    async def run():
        engine = Gated()
        serve = settings(queue_size=1, deadline_ms=20000)
        svc = Service(StandInHolder(engine, 50, serve), serve)
        running = asyncio.create_task(svc.answer([DocumentInput("running", "a")], "cfir", 5))
        await asyncio.to_thread(engine.started.wait, 5)
        abandoned = asyncio.create_task(svc.answer([DocumentInput("abandoned", "b")], "cfir", 5))
        while svc.batcher.depth == 0:
            await asyncio.sleep(0.01)
        abandoned.cancel()
        await asyncio.gather(abandoned, return_exceptions=True)
        depth = svc.batcher.depth
        neighbour = asyncio.create_task(svc.answer([DocumentInput("neighbour", "c")], "cfir", 5))  # fits queue_size 1
        engine.gate.set()
        answers = [json.loads((await task)[0][0])["id"] for task in (running, neighbour)]
        _stop(svc)
        dropped = svc.metrics.dropped.labels("disconnected")._value.get()
        return depth, answers, engine.texts, dropped

    depth, answers, texts, dropped = asyncio.run(run())
    assert depth == 0 and answers == ["a", "c"] and "abandoned" not in texts and dropped == 1


def test_a_handler_cancelled_once_its_batch_took_it_is_counted_and_its_error_read(caplog):
    """Cancelled after its batch took it (withdrawal too late), the request is counted gone as a client gone is; and
    cancelled as its batch's error lands, that error is read, so asyncio logs no 'exception was never retrieved'."""
    async def run():
        engine = Gated(RuntimeError("the engine failed"))
        serve = settings(deadline_ms=20000)
        svc = Service(StandInHolder(engine, 50, serve), serve)
        jobs = []
        submit = svc.batcher.submit
        svc.batcher.submit = lambda job: (jobs.append(job), submit(job))[1]
        task = asyncio.create_task(svc.answer([DocumentInput("x", "a")], "cfir", 5))
        await asyncio.to_thread(engine.started.wait, 5)  # taken into its batch
        engine.gate.set()
        while not jobs[0].future.done():
            await asyncio.sleep(0)
        task.cancel()  # the client goes as the answer arrives
        await asyncio.gather(task, return_exceptions=True)
        _stop(svc)
        jobs.clear()
        return task.cancelled(), svc.metrics.dropped.labels("disconnected")._value.get()

    with caplog.at_level(logging.ERROR, logger="asyncio"):
        cancelled, dropped = asyncio.run(run())
        gc.collect()
    assert cancelled and dropped == 1
    assert not [r.getMessage() for r in caplog.records if r.name == "asyncio"]


@pytest.mark.parametrize("requests", [1, 2])
def test_damage_a_batch_meets_is_its_index_s_until_a_reload_swaps_another_in(requests):
    """A lone request (concurrency 1) that met damage left /readyz 200 (the damage was recorded only when the batch
    had company); and a batch still running on the damaged index when a reload swapped an intact one in recorded its
    damage after the swap had cleared it, /readyz 503 for the new index until the next reload."""
    async def run():
        engine = Gated(CorruptStore(DAMAGE))
        serve = settings(max_wait_ms=200)
        holder = StandInHolder(engine, 50, serve)
        svc = Service(holder, serve)
        svc.batcher._last_size = requests  # with company, the batch waits max_wait_ms for the others to join it
        tasks = [asyncio.create_task(svc.answer([DocumentInput("x", f"d{n}")], "cfir", 5)) for n in range(requests)]
        await asyncio.to_thread(engine.started.wait, 5)
        engine.gate.set()
        answers = await asyncio.gather(*tasks, return_exceptions=True)
        damaged = svc.readiness()
        engine.gate.clear()
        engine.started.clear()
        svc.batcher._last_size = 2
        late = [asyncio.create_task(svc.answer([DocumentInput("x", f"late{n}")], "cfir", 5)) for n in range(2)]
        await asyncio.to_thread(engine.started.wait, 5)  # a batch of two runs on the damaged index ...
        fresh = copy.copy(holder.current)
        fresh.index = standin_index(StandInRetriever(StandInTower(), 50), 50, serve)
        old = weakref.ref(holder.current)
        holder.current = fresh
        svc.swapped(fresh)  # ... when a reload swaps an intact one in
        engine.gate.set()
        answers += await asyncio.gather(*late, return_exceptions=True)
        after = svc.readiness()
        await svc.answer([DocumentInput("y", "next")], "cfir", 5)  # the next batch runs on the new index
        kinds = [type(a) for a in answers]
        del answers, tasks, late  # the errors' tracebacks hold the frames that ran on the old index
        gc.collect()
        _stop(svc)
        return kinds, damaged, after, old() is None

    kinds, (ready, body), (ready_after, body_after), let_go = asyncio.run(run())
    assert kinds == [CorruptStore] * (requests + 2)
    assert not ready and body["reason"] == DAMAGE
    assert ready_after and "reason" not in body_after
    assert let_go, "the damage recorded against the old index kept it alive after the reload"


def test_damage_an_image_search_meets_makes_readyz_503(monkeypatch):
    def search_image(self, query, deadline=None):
        raise CorruptStore(DAMAGE)

    monkeypatch.setattr(Index, "search_image", search_image)
    with serving(deadline_ms=5000) as (url, svc, _):
        with httpx.Client(base_url=url, timeout=10) as client:
            answer = client.post("/v1/search/image", json={"image_id": "img-a"})
            ready = client.get("/readyz")
        assert answer.status_code == 503 and answer.json()["error"] == DAMAGE
        assert ready.status_code == 503 and ready.json()["reason"] == DAMAGE


def test_damage_met_late_on_a_replaced_generation_leaves_the_serving_one_s():
    """An image search still running on the old index (the image threads run beside the batches) ended after a
    reload and a batch had recorded the new index's damage: it overwrote that record, /readyz 200 (review)."""
    old, new = Generation(), Generation()
    serving_now = [old]
    batcher = MicroBatcher(lambda: serving_now[0], 8, 0.0, 64, Metrics())
    serving_now[0] = new  # a reload
    batcher.record_damage(CorruptStore("W/new: checksum mismatch"), new)
    batcher.record_damage(CorruptStore("W/old: checksum mismatch"), old)  # the late image search's
    batcher.stop(5)
    assert batcher.damage_of(new) == "W/new: checksum mismatch" and batcher.damage_of(old) == ""


def test_a_worker_thread_that_is_gone_is_readyz_s_503():
    serve = settings()
    svc = Service(StandInHolder(StandInRetriever(StandInTower(), 50), 50, serve), serve)
    assert svc.readiness()[0]
    svc.batcher.stop(5)  # as if it had died: the service itself is not stopping
    ready, body = svc.readiness()
    _stop(svc)
    assert not ready and body["reason"].startswith("the worker thread that runs the batches is gone")


def test_a_request_the_server_cancels_is_counted_499_not_500():
    """Ray Serve cancels a request's task when its client goes; the guard counted that as an internal error."""
    async def app(scope, receive, send):
        await asyncio.Event().wait()  # a search that waits, until the task is cancelled

    async def receive():
        return {"type": "http.request", "body": b"{}", "more_body": False}

    async def send(message):
        pass

    async def run(svc):
        scope = {"type": "http", "method": "POST", "path": "/v1/search", "headers": [(b"content-length", b"2")]}
        task = asyncio.create_task(RequestGuard(app, svc)(scope, receive, send))
        await asyncio.sleep(0.05)
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)

    serve = settings()
    svc = Service(StandInHolder(StandInRetriever(StandInTower(), 50), 50, serve), serve)
    asyncio.run(run(svc))
    _stop(svc)
    counted = {s.labels["status"]: s.value for m in svc.metrics.requests.collect() for s in m.samples
               if s.name.endswith("_total")}
    assert counted == {"499": 1.0}
