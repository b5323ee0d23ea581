"""The HTTP API (FastAPI): versioned search endpoints, health, readiness, metrics, reload, and the page at `/`.

Every error is a one-line JSON `{"error": ...}` with a 4xx status naming the problem (malformed JSON 400, unknown or
missing fields and bad values 422, text over serve.max_text_bytes or a body too large 413, a body that stopped
arriving 408, a full queue 503 with Retry-After, a passed deadline 504); a query's text and top_k are held to the one
rule every door applies (`cfir_jax.core.query_rule`). An internal error is logged with its traceback, answered 500 with
an id to find it there. Every request passes `cfir_jax.serve.middleware.RequestGuard` first.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import json
import logging
import math
import os
import signal
import time
import uuid
from typing import Annotated, Any, Protocol

from fastapi import Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import HTMLResponse, JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictStr
from starlette.exceptions import HTTPException
from starlette.requests import ClientDisconnect

from cfir_jax.core.errors import CfirError
from cfir_jax.core.query_rule import FilterLimits, QueryRefused, check_id, check_lang, check_top_k
from cfir_jax.core.query_rule import check_text as rule_text
from cfir_jax.retrieve.pipeline import DocumentInput
from cfir_jax.serve.batcher import Dropped, Job, MicroBatcher, QueueFull, Unavailable
from cfir_jax.serve.metrics import Metrics
from cfir_jax.serve.middleware import RequestGuard
from cfir_jax.serve.page import PAGE
from cfir_jax.serve.picture import PictureQueue, body_limit, picture_routes
from cfir_jax.serve.resident import IndexHolder
from cfir_jax.serve.verifier import BackgroundVerifier
from cfir_jax.stores.integrity import CorruptStore

log = logging.getLogger("cfir_jax.serve")
SHOWN = 20  # hits a request gets by default, as retrieve.py shows on stdout
VERSION_HEADER = "X-Index-Version"  # on every answer: the version of the index that answered it (index.json)
# A text and top_k are checked by the one rule (its words at every door), not by their models' types.
TEXT = Field(description="the document (plain UTF-8 text)", json_schema_extra={"type": "string"})
TOP_K = Field(SHOWN, description="hits to return, 1 .. retrieval.top_k", json_schema_extra={"type": "integer"})
LANG = Field(None, description="its language (ISO 639-1); default: found", json_schema_extra={"type": "string"})
WHERE = Field(None, description="the pictures' filters, AND: lines ('source=ap') or [field, op, value(s)] triples")


class SearchRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    text: Any = TEXT
    top_k: Any = TOP_K
    method: StrictStr | None = Field(None, description="cfir | dense_document | dense_summary | entity_only | bm25 "
                                     "| cfir_bm25 | cfir_bm25_fused (those the service loaded; default: the first)")
    id: StrictStr = Field("query", description="the document's id, echoed in the answer")
    lang: Any = LANG
    where: list[StrictStr | list] | None = WHERE
    fold: StrictBool = Field(True, description="near-duplicates folded under each one shown (docs/duplicates.md)")


class BatchDocument(BaseModel):
    model_config = ConfigDict(extra="forbid")
    id: StrictStr
    text: Any = TEXT
    lang: Any = LANG


class BatchRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    documents: list[BatchDocument] = Field(description="the documents, ids unique")
    top_k: Any = TOP_K
    method: StrictStr | None = None
    where: list[StrictStr | list] | None = WHERE
    fold: StrictBool = True  # near-duplicates folded under each one shown (docs/duplicates.md)


def check_text(settings, text: object, what: str) -> str:
    """A query's text held to the one rule (`core.query_rule`); a refusal is answered 413 (too long), else 422."""
    return rule_text(text, what, int(settings.max_text_bytes))


def max_body(settings) -> int:
    """The largest request body a service reads: a batch of documents (JSON escapes) or a picture (base64)."""
    return max(8 * settings.max_text_bytes * max(1, settings.max_batch_docs), body_limit(settings.max_image_bytes))


def check_options(methods: list[str], max_top_k: int, top_k: object, method: str | None) -> str:
    """The method a request asks for (the first served one by default), refused (422) when unknown or when top_k
    breaks the rule (`cfir_jax.core.query_rule.check_top_k`)."""
    method = method or methods[0]
    if method not in methods:
        raise HTTPException(422, f"unknown method {method!r}: this service answers {', '.join(methods)}")
    check_top_k(top_k, max_top_k)
    return method


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
        self.pictures = PictureQueue(int(settings.picture_queue_size), self.metrics)

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
        if self.batcher.damage:
            problems.append(self.batcher.damage)
        body = {"ready": not problems, **({"reason": problems[0]} if problems else {}), **current.describe(),
                "entity_pool": pool, "verification": verification, "queue_depth": self.batcher.depth,
                "reloading": self.holder.reloading, "last_reload": self.holder.last_reload}
        return not problems, body

    def check_text(self, text: object, what: str) -> str:
        return check_text(self.settings, text, what)

    def check_options(self, top_k: int, method: str | None) -> str:
        return check_options(list(self.holder.current.methods), self.holder.current.max_top_k, top_k, method)

    async def run(self, request: Request, docs: list[DocumentInput], method: str, top_k: int, html: bool = False):
        """Queues the documents, then waits for their answer, the deadline or the client's going away. Returns the
        answer and its headers (X-Index-Version: the version of the index that answered it)."""
        return await self.answer(docs, method, top_k, html, _disconnected(request))

    async def answer(self, docs: list[DocumentInput], method: str, top_k: int, html: bool = False, gone_when=None):
        """`run` without the HTTP request: gone_when, when given, is awaited as the client's going away."""
        loop = asyncio.get_running_loop()
        deadline = time.monotonic() + self.settings.deadline_ms / 1e3
        job = Job(docs, method, top_k, deadline, loop.create_future(), loop, html=html)
        try:
            self.batcher.submit(job)
        except QueueFull as e:
            self.metrics.rejected.inc()
            retry = max(1, math.ceil(self.settings.max_wait_ms / 1e3 + 0.05 * self.batcher.depth))
            raise HTTPException(503, f"busy: {e}; retry after {retry} s", headers={"Retry-After": str(retry)}) \
                from None
        gone = asyncio.ensure_future(gone_when if gone_when is not None else asyncio.Event().wait())
        try:
            done, _ = await asyncio.wait({job.future, gone}, timeout=max(0.0, deadline - time.monotonic()),
                                         return_when=asyncio.FIRST_COMPLETED)
        finally:
            gone.cancel()
        if job.future in done:
            try:
                return job.future.result(), {VERSION_HEADER: str(job.version)}
            except Dropped as e:
                raise HTTPException(504, f"not answered: {e}") from None
            except (CorruptStore, Unavailable) as e:  # damage on disk, a shard down: one line (also in /readyz)
                raise HTTPException(503, str(e).splitlines()[0]) from None
        job.cancelled = True
        if gone in done:
            self.metrics.dropped.labels("disconnected").inc()
            raise HTTPException(499, "client closed the request")
        raise HTTPException(504, f"deadline of {self.settings.deadline_ms:g} ms passed (serve.deadline_ms)")

    async def search_picture(self, picture: bytes | None, image_id: str | None, top_k: object, qid: str,
                             where: tuple = (), fold: bool = True):
        """A checked picture request's answer and headers (`cfir_jax.serve.picture`), from the resident index,
        through the bounded picture queue; only pictures passing `where` answer, folded unless not `fold`."""
        return await self.pictures.answer(self.holder, self.settings, picture, image_id, top_k, qid, VERSION_HEADER,
                                          where, fold)

    def refresh_metrics(self) -> None:
        """The gauges /metrics reads at scrape time."""
        pool = self.holder.current.entity_pool
        self.metrics.entity_degraded.set(1 if pool is not None and pool.degraded else 0)
        self.metrics.stores_damaged.set(len(self.verifier.problems))

    async def reload(self) -> JSONResponse:
        """Reloads in a thread of its own (the batcher keeps serving the old index meanwhile)."""
        try:
            fresh = await asyncio.to_thread(self.holder.reload)
        except CfirError as e:
            self.metrics.reloads.labels("refused").inc()
            return _error(409, f"reload refused, the old index keeps serving: {e}")
        self.swapped(fresh)
        return JSONResponse({"reloaded": True, **fresh.describe()})

    def swapped(self, fresh) -> None:
        """What follows a reload that swapped `fresh` in: its metrics, its entity pool watched, damage forgotten."""
        self.metrics.reloads.labels("ok").inc()
        self.metrics.set_index(fresh)
        self.watch_pool(fresh)
        self.batcher.damage = ""  # the new index was verified before it was swapped in
        self.verifier.reset()

    async def shutdown(self) -> None:
        """Stops accepting, answers what was accepted, then stops the workers."""
        self.stopping = True
        self.verifier.stop()
        await asyncio.to_thread(self.batcher.stop)
        await asyncio.to_thread(self.pictures.stop)
        await asyncio.to_thread(self.holder.close)


class SearchService(Protocol):
    """What the HTTP app calls: the Service (over the resident index's engines) and, on Ray, the gateway's view of
    the fronts (`cfir_jax.cluster.gateway.GatewayService`)."""

    settings: object  # the config's serve section
    metrics: Metrics
    admin_token: str
    max_body: int  # the largest request body it reads

    def check_text(self, text: object, what: str) -> str: ...

    def check_options(self, top_k: object, method: str | None) -> str: ...

    async def run(self, request: Request, docs: list[DocumentInput], method: str, top_k: int,
                  html: bool = False) -> tuple[object, dict]: ...

    async def search_picture(self, picture: bytes | None, image_id: str | None, top_k: object,
                             qid: str, where: tuple = (), fold: bool = True) -> tuple[str, dict]: ...

    def readiness(self) -> tuple[bool, dict]: ...

    def refresh_metrics(self) -> None: ...

    async def reload(self) -> JSONResponse: ...

    async def shutdown(self) -> None: ...


async def _disconnected(request: Request) -> None:
    """Returns when the client closes the connection (the body was read: the next message is the disconnect)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


def service(request: Request) -> SearchService:
    return request.app.state.service


ServiceDep = Annotated[SearchService, Depends(service)]


def _error(status: int, message: str, headers: dict | None = None) -> Response:
    """The one-line JSON refusal; ASCII, so that any character a request sent (a lone surrogate) can be named."""
    return Response(json.dumps({"error": message}), status_code=status, headers=headers, media_type="application/json")


def _validation_message(exc: RequestValidationError) -> tuple[int, str]:
    err = exc.errors()[0]
    where = ".".join(str(p) for p in err.get("loc", ()) if p != "body")
    kind = err.get("type", "")
    if kind == "json_invalid":
        return 400, f"malformed JSON: {err.get('ctx', {}).get('error', err.get('msg'))}"
    if kind == "extra_forbidden":
        return 422, f"unknown field {where!r}"
    if kind == "missing":
        return 422, f"missing field {where!r}" if where else "missing body: send a JSON object"
    if kind in ("model_attributes_type", "dict_type") and not where:
        return 400, "the body must be a JSON object"
    return 422, f"{where or 'body'}: {err.get('msg', 'invalid')}"


def create_app(svc: SearchService) -> FastAPI:
    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI):
        loop = asyncio.get_running_loop()
        with contextlib.suppress(NotImplementedError, RuntimeError, ValueError):  # not the main thread (tests)
            loop.add_signal_handler(signal.SIGHUP, lambda: loop.create_task(svc.reload()))
        yield
        await svc.shutdown()

    app = FastAPI(title="cfir-jax", version="1", lifespan=lifespan,
                  description="CFIR retrieval over a resident index: POST /v1/search with a document's text.")
    app.state.service = svc
    app.add_middleware(RequestGuard, service=svc)  # bounds, drains and counts every request (its docstring)

    _error_handlers(app)
    _search_routes(app)
    picture_routes(app)  # POST /v1/search/image: search by picture

    @app.get("/healthz", summary="alive")
    async def healthz() -> dict:
        return {"status": "alive"}

    @app.get("/readyz", summary="whether requests would succeed: index, models, entity pool, store verification")
    async def readyz(svc: ServiceDep) -> JSONResponse:
        ready, body = svc.readiness()
        return JSONResponse(body, status_code=200 if ready else 503)

    @app.get("/metrics", summary="Prometheus metrics")
    async def metrics(svc: ServiceDep) -> Response:
        svc.refresh_metrics()
        return Response(generate_latest(svc.metrics.registry), media_type=CONTENT_TYPE_LATEST)

    @app.post("/v1/admin/reload", summary="reload the workdir (needs serve.admin_token / CFIR_ADMIN_TOKEN)")
    async def admin_reload(request: Request, svc: ServiceDep) -> JSONResponse:
        if not svc.admin_token:
            raise HTTPException(404, "not found: the admin endpoint is off (set serve.admin_token or CFIR_ADMIN_TOKEN)")
        given = request.headers.get("authorization", "")
        if not hmac.compare_digest(given.encode(), f"Bearer {svc.admin_token}".encode()):
            raise HTTPException(401, "missing or wrong token (Authorization: Bearer TOKEN)")
        return await svc.reload()

    @app.get("/", response_class=HTMLResponse, include_in_schema=False)
    async def page() -> HTMLResponse:
        return HTMLResponse(PAGE)

    return app


def _error_handlers(app: FastAPI) -> None:
    @app.exception_handler(RequestValidationError)
    async def _invalid(request: Request, exc: RequestValidationError):
        return _error(*_validation_message(exc))

    @app.exception_handler(HTTPException)
    async def _http(request: Request, exc: HTTPException):
        detail = str(exc.detail)
        if exc.status_code == 400 and detail == "There was an error parsing the body":  # FastAPI's, undecodable
            cause = str(exc.__cause__ or "").splitlines()[0][:200] if str(exc.__cause__ or "") else ""
            detail = f"malformed JSON: {cause}" if cause else "malformed JSON: the body is not UTF-8 JSON"
        return _error(exc.status_code, detail, exc.headers)

    @app.exception_handler(QueryRefused)
    async def _refused(request: Request, exc: QueryRefused):  # the one rule of a query: its line and its status
        return _error(exc.status, str(exc))

    @app.exception_handler(ClientDisconnect)
    async def _gone(request: Request, exc: ClientDisconnect):  # mid-body: nobody reads the answer; no traceback
        return _error(499, "client closed the request")

    @app.exception_handler(Exception)
    async def _internal(request: Request, exc: Exception):
        error_id = uuid.uuid4().hex[:12]
        log.error("internal error %s on %s %s", error_id, request.method, request.url.path, exc_info=exc)
        return _error(500, f"internal error (id {error_id}; the service's log has its traceback)")


def _search_routes(app: FastAPI) -> None:
    @app.post("/v1/search", summary="the images of one document (the JSON of retrieve.py --format json)")
    async def search(body: SearchRequest, request: Request, svc: ServiceDep) -> Response:
        text = svc.check_text(body.text, "text")
        method = svc.check_options(body.top_k, body.method)
        doc = DocumentInput(text, check_id(body.id, "id"), lang=check_lang(body.lang),
                            where=FilterLimits.of(svc.settings).read(body.where), fold=body.fold)
        answer, headers = await svc.run(request, [doc], method, body.top_k)
        return Response(answer[0], media_type="application/json", headers=headers)

    @app.post("/v1/search/batch", summary="the images of several documents, answered in their order")
    async def search_batch(body: BatchRequest, request: Request, svc: ServiceDep) -> Response:
        if not body.documents:
            raise HTTPException(422, "documents is empty")
        if len(body.documents) > svc.settings.max_batch_docs:
            raise HTTPException(413, f"{len(body.documents)} documents, over serve.max_batch_docs="
                                     f"{svc.settings.max_batch_docs}")
        ids = [check_id(d.id, f"documents.{n}.id") for n, d in enumerate(body.documents)]
        if len(set(ids)) != len(ids):
            raise HTTPException(422, f"duplicate document id {next(i for i in ids if ids.count(i) > 1)!r}")
        texts = [svc.check_text(d.text, f"documents.{n}.text") for n, d in enumerate(body.documents)]
        langs = [check_lang(d.lang, f"documents.{n}") for n, d in enumerate(body.documents)]
        method = svc.check_options(body.top_k, body.method)
        where = FilterLimits.of(svc.settings).read(body.where)
        docs = [DocumentInput(t, d.id, lang=x, where=where, fold=body.fold)
                for t, d, x in zip(texts, body.documents, langs)]
        answer, headers = await svc.run(request, docs, method, body.top_k)
        return Response('{"results": [' + ", ".join(answer) + "]}", media_type="application/json", headers=headers)

    @app.post("/v1/search/html", response_class=HTMLResponse, summary="the HTML gallery of one document's images")
    async def search_html(body: SearchRequest, request: Request, svc: ServiceDep) -> HTMLResponse:
        text = svc.check_text(body.text, "text")
        method = svc.check_options(body.top_k, body.method)
        doc = DocumentInput(text, check_id(body.id, "id"), lang=check_lang(body.lang),
                            where=FilterLimits.of(svc.settings).read(body.where), fold=body.fold)
        page, headers = await svc.run(request, [doc], method, body.top_k, html=True)
        return HTMLResponse(page, headers=headers)

