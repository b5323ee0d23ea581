"""The micro-batcher: requests that arrive together run as one batch through the library's `Index`
(`search_documents`: one batched `retrieve_many` per method, each request's documents with their own top_k, language
and filters), in one worker thread that alone drives the engines (JAX and spaCy are not meant to be driven from many
threads at once).

A batch takes every request that queued while the previous one ran, up to `max_batch` documents. When the previous
batch had company (more than one document: requests are arriving together), the first request also waits up to
`max_wait_ms` for others to join it; a lone request (concurrency 1) runs at once, so batching costs it nothing. A
batch runs as one batch through the Retriever (batched encoding, batched SR), its documents' entities parsed by the
index's `EntityWorkers` (every core), when it has one (`LoadedIndex.use_pool`): a request that queues behind a
running batch has them parsed at once (`Index.parse_entities_ahead`), so that the workers parse the next batch while
this one is encoded, ranked and answered. The queue is
bounded in documents: a request that would overflow it is refused at once (the service answers 503 with Retry-After)
rather than waiting without bound. A request past its deadline, or whose client went away, is dropped before its
batch runs.

A request fails alone. Before it joins its batch, the index version the batch runs on says every refusal its query
can meet (`Index.admit`: top_k, language, its filter's size, fields and values' types), answered to that request
only; a batch that raises while it runs is run again one request at a time, so that only the request that fails gets
the error (damage on disk and a shard down are every request's, answered to all). The Ray engine's fronts run this
batcher (`cfir_jax.cluster.front`). Each answer is the JSON `retrieve.py --format json` prints, rendered in the
worker thread (captions are read from the corpus there).
"""

from __future__ import annotations

import asyncio
import collections
import dataclasses
import logging
import threading
import time
import weakref
from collections.abc import Callable
from typing import TYPE_CHECKING

from cfir_jax.core.errors import first_line
from cfir_jax.retrieve import report
from cfir_jax.retrieve.pipeline import DocumentInput
from cfir_jax.serve.errors import Unavailable, answerable
from cfir_jax.stores.integrity import CorruptStore

if TYPE_CHECKING:
    from cfir_jax.api.index import Index

log = logging.getLogger("cfir_jax.serve")


class QueueFull(Exception):
    """The queue holds `queue_size` documents already."""


class Dropped(Exception):
    """The request's deadline passed or its client went away before its batch ran."""


@dataclasses.dataclass(eq=False)
class Job:
    """One request: its documents, the method and hits wanted, when it expires, and the future its handler awaits
    (set to one `--format json` string per document, or an exception)."""

    docs: list[DocumentInput]
    method: str
    top_k: int
    deadline: float  # time.monotonic()
    future: asyncio.Future
    loop: asyncio.AbstractEventLoop
    html: bool = False  # the gallery page instead of JSON (GET /'s page)
    cancelled: bool = False  # set by `MicroBatcher.withdraw` when the client disconnects or the deadline passes
    version: int | None = None  # the index version that answered it (set before the future is)
    ahead: Index | None = None  # the Index whose entity pool parses its documents ahead (`MicroBatcher._parse_ahead`)
    enqueued: float = dataclasses.field(default_factory=time.monotonic)

    def settle(self, value=None, error: BaseException | None = None) -> None:
        def set_it():
            if not self.future.done():
                if error is not None:
                    self.future.set_exception(error)
                    if self.cancelled:  # its handler answered already (504, 499): nobody reads this one
                        self.future.exception()
                else:
                    self.future.set_result(value)

        try:
            self.loop.call_soon_threadsafe(set_it)
        except RuntimeError:  # its event loop closed (its server stopped): nobody is left to read the answer
            pass


class MicroBatcher:
    """submit(job) from the event loop; a worker thread runs the batches. `stop()` drains the queue, then joins."""

    def __init__(self, current_index: Callable, max_batch: int, max_wait_ms: float, queue_size: int, metrics):
        self._current = current_index  # () -> LoadedIndex, read once per batch (a reload swaps it between batches)
        self.max_batch, self.max_wait = max(1, int(max_batch)), max(0.0, float(max_wait_ms)) / 1e3
        self.queue_size = int(queue_size)
        self.metrics = metrics
        self._queue: collections.deque[Job] = collections.deque()
        self._waiting_docs = 0
        self._cv = threading.Condition()
        self._stopping = False
        self._damage: tuple[Callable[[], object], str] | None = None  # (its index generation, its line): `damage_of`
        self._last_size = 0  # documents in the previous batch: > 1 means requests arrive together, worth waiting for
        self._busy = False  # a batch runs or gathers: a request that queues meanwhile has its entities parsed ahead
        self._thread = threading.Thread(target=self._run, name="cfir-retrieval", daemon=True)
        self._thread.start()

    def damage_of(self, loaded) -> str:
        """The line of the last impossible value (a damaged store or model) a batch met on the index generation
        `loaded`, '' if none: /readyz is 503 while that generation serves, and a reload's fresh one is not blamed for
        a batch that ran on its predecessor."""
        damage = self._damage
        return damage[1] if damage is not None and damage[0]() is loaded else ""

    @property
    def alive(self) -> bool:
        """Whether the worker thread that runs the batches is running (a cluster's front reports itself unhealthy
        when it is not)."""
        return self._thread.is_alive()

    @property
    def depth(self) -> int:
        """Documents waiting (not yet taken into a batch)."""
        return self._waiting_docs

    def submit(self, job: Job) -> None:
        with self._cv:
            if self._stopping:
                raise QueueFull("shutting down")
            if self._waiting_docs + len(job.docs) > self.queue_size:
                raise QueueFull(f"{self._waiting_docs} documents are waiting (serve.queue_size={self.queue_size})")
            if self._busy:  # before it queues: a batch that takes it at once finds it parsing, not parses it again
                self._parse_ahead(job)
            self._queue.append(job)
            self._waiting_docs += len(job.docs)
            self.metrics.queue_depth.set(self._waiting_docs)
            self._cv.notify()

    def _parse_ahead(self, job: Job) -> None:
        """The entity pool starts on a job that queues behind a running batch (`Index.parse_entities_ahead`): its
        workers parse it while that batch is encoded, ranked and answered, where they would idle."""
        index = self._current().index
        try:
            if index.reads_entities(job.method):
                job.ahead = index
                index.parse_entities_ahead(job.docs)
        except Exception:  # noqa: BLE001 - a head start only: the job's batch meets the same failure, answered to it
            log.debug("entities not parsed ahead for a queued request", exc_info=True)

    @staticmethod
    def _give_up_ahead(job: Job) -> None:
        """A job parsed ahead that will never run (withdrawn, past its deadline, refused), or has run: what its
        pool has not parsed yet and no other job holds is never parsed, and its place under the pool's bound goes to
        the requests behind it (an overloaded service's timed-out requests would otherwise take the workers' time
        from the live ones)."""
        if job.ahead is not None:
            try:
                job.ahead.give_up_entities_ahead(job.docs)
            except Exception:  # noqa: BLE001 - parsed for nothing at worst
                log.debug("entities parsed ahead not given up", exc_info=True)
            job.ahead = None

    def withdraw(self, job: Job) -> bool:
        """Gives `job` up (its client went away, or its deadline passed; its handler answers and counts the drop):
        taken out of the queue if it still waits, so that an abandoned request holds no place another could take;
        True when it did. A job already taken into a batch is skipped there if the batch has not run it yet."""
        with self._cv:
            job.cancelled = True
            try:
                self._queue.remove(job)
            except ValueError:
                return False
            self._waiting_docs -= len(job.docs)
            self.metrics.queue_depth.set(self._waiting_docs)
        self._give_up_ahead(job)
        return True

    def stop(self, timeout: float | None = None) -> None:
        with self._cv:
            self._stopping = True
            self._cv.notify()
        self._thread.join(timeout)

    def _take_batch(self) -> list[Job] | None:
        """Blocks for the first job, then gathers more until max_batch documents or max_wait; None when stopped."""
        with self._cv:
            while not self._queue:
                if self._stopping:
                    return None
                self._busy = False
                self._cv.wait()
            self._busy = True
            batch = [self._queue.popleft()]
            size = len(batch[0].docs)
            close_at = time.monotonic() + (self.max_wait if self._last_size > 1 else 0.0)
            while size < self.max_batch:
                if self._queue:
                    if size + len(self._queue[0].docs) > self.max_batch:
                        break
                    batch.append(self._queue.popleft())
                    size += len(batch[-1].docs)
                    continue
                left = close_at - time.monotonic()
                if left <= 0 or self._stopping:
                    break
                self._cv.wait(left)
            self._waiting_docs -= size
            self._last_size = size
            self.metrics.queue_depth.set(self._waiting_docs)
            return batch

    def _run(self) -> None:
        while (batch := self._take_batch()) is not None:
            now = time.monotonic()
            live = []
            for job in batch:
                if job.cancelled:  # given up by its handler once in this batch: answered and counted there
                    self._give_up_ahead(job)
                    job.settle(error=Dropped("withdrawn"))
                elif now > job.deadline:
                    self._give_up_ahead(job)
                    job.settle(error=Dropped("deadline passed"))
                    self.metrics.dropped.labels("deadline").inc()
                else:
                    live.append(job)
                    self.metrics.queue_wait.observe(now - job.enqueued)
            if not live:
                continue
            index = self._current()  # a reload between batches: this batch runs wholly on one index
            try:
                admitted = [job for job in live if self._admitted(index, job)]
                for method in dict.fromkeys(j.method for j in admitted):
                    self._run_method(index, method, [j for j in admitted if j.method == method])
            finally:  # answered without reading its entities (a filter no image passes): none left parsed ahead
                for job in live:
                    self._give_up_ahead(job)

    @staticmethod
    def _admitted(loaded, job: Job) -> bool:
        """Whether the job may join the batch: every refusal its query can meet (top_k, language, its filter's size,
        fields and values' types) asked of the index version the batch runs on (`Index.admit`); a refused job is
        answered its one line alone, and its neighbours run without it."""
        try:
            loaded.index.admit(job.docs, job.top_k, job.method)
        except BaseException as e:  # noqa: BLE001 - a refusal (one line), or a failure: this request's alone
            MicroBatcher._give_up_ahead(job)
            job.version = loaded.version
            job.settle(error=answerable(e))
            return False
        return True

    def _run_method(self, loaded, method: str, jobs: list[Job]) -> None:
        """One method's jobs of a batch, answered together (`_answer`). When the batch raises, each job runs again
        alone, so that only the request that fails gets its error; damage on disk and a shard down fail every
        request alike, and are answered to all at once."""
        for job in jobs:
            job.version = loaded.version
        try:
            self._answer(loaded, method, jobs)
        except BaseException as e:  # noqa: BLE001 - every request of the batch is answered (500 with an id), none
            # hangs, and the worker lives on whatever the engine raised (SystemExit would end its thread)
            if self._shared(e, loaded) or len(jobs) == 1:
                for job in jobs:
                    job.settle(error=answerable(e))
                return
            for job in jobs:
                try:
                    self._answer(loaded, method, [job])
                except BaseException as alone:  # noqa: BLE001 - this request's own failure, answered to it alone
                    self._shared(alone, loaded)
                    job.settle(error=answerable(alone))

    def record_damage(self, e: BaseException, loaded) -> None:
        """Damage the index cannot serve around (CorruptStore) that a search met on the generation `loaded` (a
        batch's, or an image search's): /readyz says so while that generation serves (`damage_of`). Damage met on a
        generation a reload has replaced is not recorded: an image search finishing late on it would overwrite the
        serving one's."""
        if isinstance(e, CorruptStore) and loaded is self._current():
            self._damage = (_reference(loaded), first_line(e))

    def _shared(self, e: BaseException, loaded) -> bool:
        """Whether a failure is every request's (damage on disk, recorded for /readyz; a shard down), not one's."""
        self.record_damage(e, loaded)
        return isinstance(e, (CorruptStore, Unavailable))

    def _answer(self, loaded, method: str, jobs: list[Job]) -> None:
        """The jobs' documents answered by the index as one batch, each job's with its top_k
        (`Index.search_documents`; the index's entity pool parses them while it encodes them); every answer is made
        before any is settled."""
        index = loaded.index
        docs = [d for j in jobs for d in j.docs]
        self.metrics.batch_docs.observe(len(docs))
        results = index.search_documents(docs, [j.top_k for j in jobs for _ in j.docs], method)
        answers, at = [], 0
        for job in jobs:
            mine = results[at : at + len(job.docs)]
            at += len(job.docs)
            for result in mine:
                self.metrics.observe_stages(result.times_ms)
            if job.html:  # the HTML report's gallery (`retrieve.py --html`), the images inline from the corpus
                answers.append(report.html_page(mine[0], index.image_bytes, job.top_k))
            else:
                answers.append([report.as_json(result, job.top_k) for result in mine])
        for job, answer in zip(jobs, answers):
            job.settle(answer)


def _reference(loaded) -> Callable[[], object]:
    """A reference to an index generation that lets it go with the reload that replaces it (held, for an object that
    takes no weak references: a test's stand-in)."""
    try:
        return weakref.ref(loaded)
    except TypeError:
        return lambda: loaded
