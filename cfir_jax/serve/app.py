"""The HTTP API (FastAPI): the request models, the app and its routes (versioned search endpoints, health,
readiness, metrics, reload, and the page at `/`), over a `cfir_jax.serve.service.SearchService`.

Every error is a one-line JSON `{"error": ...}` with a 4xx status naming the problem (malformed JSON 400, unknown or
missing fields and bad values 422, text over serve.max_text_bytes or a body too large 413, a body that stopped
arriving 408, a full queue 503 with Retry-After, a passed deadline 504). The service and the parts under it raise the
project's errors, and this module, the only one of `serve/` that names HTTP's exceptions, answers each once through
the one table of `cfir_jax.serve.errors`. An internal error is logged with its traceback, answered 500 with an id to
find it there, and its connection stays open for the client's next request (`_InternalErrors`). Every request passes
`cfir_jax.serve.middleware.RequestGuard` first.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import json
import logging
import signal
import uuid
from typing import Annotated, Any

from fastapi import Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import HTMLResponse, JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictStr
from starlette.exceptions import HTTPException
from starlette.requests import ClientDisconnect

from cfir_jax.core.errors import CfirError, first_line
from cfir_jax.core.query_rule import FilterLimits, check_facets, check_id, check_lang
from cfir_jax.retrieve.pipeline import DocumentInput
from cfir_jax.serve.errors import ClientGone, Refused, ServiceError, http_answer
from cfir_jax.serve.image_search import image_routes
from cfir_jax.serve.middleware import RequestGuard
from cfir_jax.serve.page import PAGE
from cfir_jax.serve.service import SearchService

log = logging.getLogger("cfir_jax.serve")
SHOWN = 20  # hits a request gets by default, as retrieve.py shows on stdout
# A text and top_k are checked by the one rule (its words at every door), not by their models' types.
TEXT = Field(description="the document (plain UTF-8 text)", json_schema_extra={"type": "string"})
TOP_K = Field(SHOWN, description="hits to return, 1 .. retrieval.top_k", json_schema_extra={"type": "integer"})
LANG = Field(None, description="its language (ISO 639-1); default: found", json_schema_extra={"type": "string"})
WHERE = Field(None, description="the images' filters, AND: lines ('source=ap') or [field, op, value(s)] triples")
FACETS = Field(None, description="fields whose values are counted over the images ranked ('source', 'tags')")


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
    facets: list[StrictStr] | None = FACETS


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
    facets: list[StrictStr] | None = FACETS


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


def _answer(exc: BaseException) -> Response | None:
    """The one-line refusal of an error `cfir_jax.serve.errors.STATUSES` knows (None for any other)."""
    answered = http_answer(exc)
    return _error(*answered) if answered is not None else None


async def _reload_quietly(svc: SearchService) -> None:
    """SIGHUP's reload: a refusal is logged by the reload itself (the old index keeps serving), not raised."""
    with contextlib.suppress(ServiceError):
        await svc.reload()


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
            loop.add_signal_handler(signal.SIGHUP, lambda: loop.create_task(_reload_quietly(svc)))
        yield
        await svc.shutdown()

    app = FastAPI(title="cfir-jax", version="1", lifespan=lifespan,
                  description="CFIR retrieval over a resident index: POST /v1/search with a document's text.")
    app.state.service = svc
    app.add_middleware(_InternalErrors)  # inside the guard, which counts its 500s
    app.add_middleware(RequestGuard, service=svc)  # bounds, drains and counts every request (its docstring)

    _error_handlers(app)
    _search_routes(app)
    image_routes(app)  # POST /v1/search/image: search by image

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
            raise Refused("not found: the admin endpoint is off (set serve.admin_token or CFIR_ADMIN_TOKEN)", 404)
        given = request.headers.get("authorization", "")
        if not hmac.compare_digest(given.encode(), f"Bearer {svc.admin_token}".encode()):
            raise Refused("missing or wrong token (Authorization: Bearer TOKEN)", 401)
        return JSONResponse(await svc.reload())

    @app.get("/", response_class=HTMLResponse, include_in_schema=False)
    async def page() -> HTMLResponse:
        return HTMLResponse(PAGE)

    return app


def _error_handlers(app: FastAPI) -> None:
    @app.exception_handler(Exception)
    async def _unexpected(request: Request, exc: Exception):  # raised by RequestGuard itself, outside _InternalErrors:
        return _internal(request.method, request.url.path, exc)  # the same 500 (Starlette then ends the connection)

    @app.exception_handler(RequestValidationError)
    async def _invalid(request: Request, exc: RequestValidationError):
        return _error(*_validation_message(exc))

    @app.exception_handler(HTTPException)
    async def _http(request: Request, exc: HTTPException):
        refusal = _answer(exc.__cause__) if exc.__cause__ is not None else None
        if refusal is not None:  # raised while FastAPI read the body (the guard's 413, 408), which FastAPI wraps
            return refusal
        detail = str(exc.detail)
        if exc.status_code == 400 and detail == "There was an error parsing the body":  # FastAPI's, undecodable
            cause = first_line(exc.__cause__, 200) if str(exc.__cause__ or "").strip() else ""
            detail = f"malformed JSON: {cause}" if cause else "malformed JSON: the body is not UTF-8 JSON"
        return _error(exc.status_code, detail, exc.headers)

    @app.exception_handler(ServiceError)
    @app.exception_handler(CfirError)
    async def _refused(request: Request, exc: Exception):  # the service's refusals, the query rule's: the one table
        return _answer(exc) or _internal(request.method, request.url.path, exc)

    @app.exception_handler(ClientDisconnect)
    async def _gone(request: Request, exc: ClientDisconnect):  # mid-body: nobody reads the answer; no traceback
        return _answer(ClientGone())


def _internal(method: str, path: str, exc: BaseException) -> Response:
    """An error no table knows: logged with its traceback and an id, answered 500 with that id."""
    error_id = uuid.uuid4().hex[:12]
    log.error("internal error %s on %s %s", error_id, method, path, exc_info=exc)
    return _error(500, f"internal error (id {error_id}; the service's log has its traceback)")


class _InternalErrors:
    """The ASGI middleware that answers an error no handler knows (`_internal`) and ends the request there. Starlette's
    own handler of Exception answers it, then raises it again to the server, which closes the connection: a client's
    next request on that kept-alive connection met a reset, and the log held a second traceback."""

    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        started = False

        async def sending(message) -> None:
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await send(message)

        try:
            await self.app(scope, receive, sending)
        except Exception as exc:
            if started:  # an answer half sent cannot become another: the server ends the connection
                raise
            await _internal(scope.get("method", ""), scope.get("path", ""), exc)(scope, receive, send)


def _search_routes(app: FastAPI) -> None:
    @app.post("/v1/search", summary="the images of one document (the JSON of retrieve.py --format json)")
    async def search(body: SearchRequest, request: Request, svc: ServiceDep) -> Response:
        text = svc.check_text(body.text, "text")
        method = svc.check_options(body.top_k, body.method)
        doc = DocumentInput(text, check_id(body.id, "id"), lang=check_lang(body.lang),
                            where=FilterLimits.of(svc.settings).read(body.where), fold=body.fold,
                            facets=check_facets(body.facets))
        answer, headers = await svc.answer([doc], method, body.top_k, gone_when=lambda: _disconnected(request))
        return Response(answer[0], media_type="application/json", headers=headers)

    @app.post("/v1/search/batch", summary="the images of several documents, answered in their order")
    async def search_batch(body: BatchRequest, request: Request, svc: ServiceDep) -> Response:
        if not body.documents:
            raise Refused("documents is empty", 422)
        if len(body.documents) > svc.settings.max_batch_docs:
            raise Refused(f"{len(body.documents)} documents, over serve.max_batch_docs={svc.settings.max_batch_docs}",
                          413)
        ids = [check_id(d.id, f"documents.{n}.id") for n, d in enumerate(body.documents)]
        if len(set(ids)) != len(ids):
            raise Refused(f"duplicate document id {next(i for i in ids if ids.count(i) > 1)!r}", 422)
        texts = [svc.check_text(d.text, f"documents.{n}.text") for n, d in enumerate(body.documents)]
        langs = [check_lang(d.lang, f"documents.{n}") for n, d in enumerate(body.documents)]
        method = svc.check_options(body.top_k, body.method)
        where = FilterLimits.of(svc.settings).read(body.where)
        facets = check_facets(body.facets)
        docs = [DocumentInput(t, d.id, lang=x, where=where, fold=body.fold, facets=facets)
                for t, d, x in zip(texts, body.documents, langs)]
        answer, headers = await svc.answer(docs, method, body.top_k, gone_when=lambda: _disconnected(request))
        return Response('{"results": [' + ", ".join(answer) + "]}", media_type="application/json", headers=headers)

    @app.post("/v1/search/html", response_class=HTMLResponse, summary="the HTML gallery of one document's images")
    async def search_html(body: SearchRequest, request: Request, svc: ServiceDep) -> HTMLResponse:
        text = svc.check_text(body.text, "text")
        method = svc.check_options(body.top_k, body.method)
        doc = DocumentInput(text, check_id(body.id, "id"), lang=check_lang(body.lang),
                            where=FilterLimits.of(svc.settings).read(body.where), fold=body.fold,
                            facets=check_facets(body.facets))  # the page's counts beside its hits
        page, headers = await svc.answer([doc], method, body.top_k, html=True, gone_when=lambda: _disconnected(request))
        return HTMLResponse(page, headers=headers)

