"""The service a process serves, without HTTP: the resident index, the micro-batcher, the image queue, the metrics,
the background verification and the reloads (`Service`), and the interface the HTTP app calls (`SearchService`), which
a Ray gateway implements too (`cfir_jax.cluster.gateway.GatewayService`).

It speaks the project's errors (`cfir_jax.serve.errors`: busy, deadline passed, client gone, unavailable, refused;
the query rule's `QueryRefused`); the app answers each over HTTP through that module's one table, and a Ray front
through the same table. A query's text and top_k are held to the one rule every door applies
(`cfir_jax.core.query_rule`).
"""

from __future__ import annotations

import asyncio
import math
import os
import time
from collections.abc import Awaitable, Callable
from typing import Protocol

from cfir_jax.core.errors import CfirError
from cfir_jax.core.query_rule import QueryRefused, check_top_k
from cfir_jax.core.query_rule import check_text as rule_text
from cfir_jax.retrieve.pipeline import DocumentInput
from cfir_jax.serve.batcher import Dropped, Job, MicroBatcher, QueueFull
from cfir_jax.serve.errors import Busy, ClientGone, DeadlinePassed, Refused
from cfir_jax.serve.image_search import ImageQueue, Shown, body_limit
from cfir_jax.serve.metrics import Metrics
from cfir_jax.serve.resident import IndexHolder
from cfir_jax.serve.verifier import BackgroundVerifier
from cfir_jax.stores.integrity import CorruptStore

VERSION_HEADER = "X-Index-Version"  # on every answer: the version of the index that answered it (index.json)


def check_text(settings, text: object, what: str) -> str:
    """A query's text held to the one rule (`core.query_rule`); a refusal is answered 413 (too long), else 422."""
    return rule_text(text, what, int(settings.max_text_bytes))


def max_body(settings) -> int:
    """The largest request body a service reads: a batch of documents (JSON escapes) or an image (base64)."""
    return max(8 * settings.max_text_bytes * max(1, settings.max_batch_docs), body_limit(settings.max_image_bytes))


def check_options(methods: list[str], max_top_k: int, top_k: object, method: str | None) -> str:
    """The method a request asks for (the first served one by default), refused (422) when unknown or when top_k
    breaks the rule (`cfir_jax.core.query_rule.check_top_k`)."""
    method = method or methods[0]
    if method not in methods:
        raise QueryRefused(f"unknown method {method!r}: this service answers {', '.join(methods)}")
    check_top_k(top_k, max_top_k)
    return method


class SearchService(Protocol):
    """What the HTTP app calls: the Service (over the resident index) and, on Ray, the gateway's view of
    the fronts (`cfir_jax.cluster.gateway.GatewayService`). Each refusal is an error of `cfir_jax.serve.errors`."""

    settings: object  # the config's serve section
    metrics: Metrics
    admin_token: str
    max_body: int  # the largest request body it reads

    def check_text(self, text: object, what: str) -> str: ...

    def check_options(self, top_k: object, method: str | None) -> str: ...

    async def answer(self, docs: list[DocumentInput], method: str, top_k: int, html: bool = False,
                     gone_when: Callable[[], Awaitable] | None = None) -> tuple[object, dict]: ...

    async def search_image(self, image: bytes | None, image_id: str | None, top_k: object, qid: str,
                           where: tuple = (), fold: bool = True, facets: tuple = (), html: bool = False
                           ) -> tuple[str, dict]: ...

    def readiness(self) -> tuple[bool, dict]: ...

    def refresh_metrics(self) -> None: ...

    async def reload(self) -> dict: ...

    async def shutdown(self) -> None: ...


class Service:
    """What the handlers share (injected with Depends): the index holder, the batcher, the metrics, the settings."""

    def __init__(self, holder: IndexHolder, settings):
        self.holder, self.settings = holder, settings
        self.metrics = Metrics()
        self.metrics.set_index(holder.current)
        self.batcher = MicroBatcher(lambda: self.holder.current, settings.max_batch, settings.max_wait_ms,
                                    settings.queue_size, self.metrics)
        self.admin_token = os.environ.get("CFIR_ADMIN_TOKEN") or settings.admin_token
        self.stopping = False
        self.watch_pool(holder.current)
        self.verifier = BackgroundVerifier(lambda: self.holder.current.workdir, float(settings.verify_mb_per_s),
                                           float(settings.verify_interval_s))
        self.max_body = max_body(settings)
        self.images = ImageQueue(settings, self.metrics)

    def watch_pool(self, index) -> None:
        """Counts the entity pool's worker restarts in /metrics (each is also logged in one line by the pool)."""
        if index.entity_pool is not None:
            index.entity_pool.on_restart = lambda reason: self.metrics.entity_restarts.labels(reason).inc()

    def readiness(self) -> tuple[bool, dict]:
        """Whether requests would succeed now, and everything that says so: the index, the entity pool's state,
        the background verification, damage met by a query; `reason` is the one line of a 503."""
        current = self.holder.current
        pool = current.entity_pool.describe() if current.entity_pool is not None else {"state": "off"}
        verification = self.verifier.describe()
        problems = []
        if self.stopping:
            problems.append("stopping: SIGTERM received, answering the requests already accepted")
        if verification.get("problems"):
            problems.append(f"store damaged: {verification['problems'][0]}")
        if not self.batcher.alive and not self.stopping:
            problems.append("the worker thread that runs the batches is gone: restart the service")
        if damage := self.batcher.damage_of(current):
            problems.append(damage)
        body = {"ready": not problems, **({"reason": problems[0]} if problems else {}), **current.describe(),
                "entity_pool": pool, "verification": verification, "queue_depth": self.batcher.depth,
                "reloading": self.holder.reloading, "last_reload": self.holder.last_reload}
        return not problems, body

    def check_text(self, text: object, what: str) -> str:
        return check_text(self.settings, text, what)

    def check_options(self, top_k: int, method: str | None) -> str:
        return check_options(list(self.holder.current.methods), self.holder.current.max_top_k, top_k, method)

    async def answer(self, docs: list[DocumentInput], method: str, top_k: int, html: bool = False,
                     gone_when: Callable[[], Awaitable] | None = None) -> tuple[object, dict]:
        """Queues the documents, then waits for their answer, the deadline or the client's going away (gone_when,
        when given, makes what is awaited as that). Returns the answer and its headers (X-Index-Version: the version
        of the index that answered it); raises Busy, DeadlinePassed, ClientGone, or what the batch met (a query the
        index refuses, damage on disk, a shard down: `cfir_jax.serve.errors.STATUSES`)."""
        loop = asyncio.get_running_loop()
        deadline = time.monotonic() + self.settings.deadline_ms / 1e3
        job = Job(docs, method, top_k, deadline, loop.create_future(), loop, html=html)
        try:
            self.batcher.submit(job)
        except QueueFull as e:
            self.metrics.rejected.inc()
            raise Busy(str(e), max(1, math.ceil(self.settings.max_wait_ms / 1e3 + 0.05 * self.batcher.depth))) \
                from None
        gone = asyncio.ensure_future(gone_when() if gone_when is not None else asyncio.Event().wait())
        try:
            done, _ = await asyncio.wait({job.future, gone}, timeout=max(0.0, deadline - time.monotonic()),
                                         return_when=asyncio.FIRST_COMPLETED)
        except asyncio.CancelledError:  # its handler cancelled (Ray Serve's, when the client goes): nobody waits
            self.batcher.withdraw(job)
            self.metrics.dropped.labels("disconnected").inc()  # as a client gone is counted, taken into a batch or not
            if job.future.done() and not job.future.cancelled():
                job.future.exception()  # its batch's error, answered to nobody: read, so that asyncio logs nothing
            raise
        finally:
            gone.cancel()
        if job.future in done:
            try:
                return job.future.result(), {VERSION_HEADER: str(job.version)}
            except Dropped as e:
                raise DeadlinePassed(f"not answered: {e}") from None
        withdrawn = self.batcher.withdraw(job)  # its place in the queue free for the next request
        if gone in done:
            self.metrics.dropped.labels("disconnected").inc()
            raise ClientGone()
        if withdrawn:  # dropped unrun (one the batch had taken runs, late: not a drop)
            self.metrics.dropped.labels("deadline").inc()
        raise DeadlinePassed(f"deadline of {self.settings.deadline_ms:g} ms passed (serve.deadline_ms)")

    async def search_image(self, image: bytes | None, image_id: str | None, top_k: object, qid: str,
                           where: tuple = (), fold: bool = True, facets: tuple = (), html: bool = False):
        """A checked image request's answer (JSON, or the HTML gallery when `html`) and headers
        (`cfir_jax.serve.image_search`), from the resident index, through the bounded image queue; only images
        passing `where` answer, folded unless not `fold`, with the `facets` asked."""
        searched = self.holder.current
        try:
            answer, version = await self.images.answer(self.holder, image, image_id, top_k, qid, where,
                                                       Shown(fold, facets, html))
        except CorruptStore as e:  # damage met by an image search makes /readyz 503 as a text search's does
            self.batcher.record_damage(e, searched)
            raise
        return answer, {VERSION_HEADER: str(version)}

    def refresh_metrics(self) -> None:
        """The gauges /metrics reads at scrape time."""
        pool = self.holder.current.entity_pool
        self.metrics.entity_degraded.set(1 if pool is not None and pool.degraded else 0)
        self.metrics.stores_damaged.set(len(self.verifier.problems))

    async def reload(self) -> dict:
        """Reloads in a thread of its own (the batcher keeps serving the old index meanwhile): what now serves, or
        Refused (409) with the reason the old index keeps serving."""
        try:
            fresh = await asyncio.to_thread(self.holder.reload)
        except CfirError as e:
            self.metrics.reloads.labels("refused").inc()
            raise Refused(f"reload refused, the old index keeps serving: {e}", 409) from None
        self.swapped(fresh)
        return {"reloaded": True, **fresh.describe()}

    def swapped(self, fresh) -> None:
        """What follows a reload that swapped `fresh` in: its metrics, its entity pool watched, its verification anew
        (damage a batch met is its generation's: `MicroBatcher.damage_of`)."""
        self.metrics.reloads.labels("ok").inc()
        self.metrics.set_index(fresh)
        self.watch_pool(fresh)
        self.verifier.reset()

    async def shutdown(self) -> None:
        """Stops accepting, answers what was accepted, then stops the workers."""
        self.stopping = True
        self.verifier.stop()
        await asyncio.to_thread(self.batcher.stop)
        await asyncio.to_thread(self.images.stop)
        await asyncio.to_thread(self.holder.close)
