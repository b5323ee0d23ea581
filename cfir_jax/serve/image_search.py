"""Search by image over HTTP: POST /v1/search/image, on both engines (`cfir_jax.retrieve.image_query` answers).

The image comes in one of three forms, each within serve.max_image_bytes:
- a multipart upload (`curl -F image=@photo.jpg -F top_k=5`): the file field `image`, the optional form fields
  `top_k` and `id` (or a field `image_id` instead of the file, also as a urlencoded form), parsed by Starlette's
  form parsers (python-multipart, FastAPI's own);
- JSON `{"image": BASE64, "top_k": 20, "id": "..."}`, or `{"image_id": ID}` for an indexed image;
- the request body itself with a `Content-Type: image/...` header (`?top_k=&id=` in the query string).
Each form may add filters on the images' own fields (`where`: a JSON list, or repeated form / query-string fields;
docs/filters.md), up to serve.max_filter_conditions of them in every form (413 past it): only images that pass answer.

The body is read no further than its limit (413 past it, whatever Content-Length said); an image over
serve.max_image_bytes, or whose header announces more than serve.max_image_pixels, is 413 (refused before it is
decoded), one in a format outside JPEG, PNG, WebP, GIF, BMP and TIFF 415 (refused unread), an undecodable one or a
malformed upload 422, an unknown or removed id 404, each one line; the answer is
the JSON of `retrieve.py --query-image ... --format json`, made by the library's `Index` (`search(image=...)`, the
one query core) of the resident index. Searches go through a bounded queue (`ImageQueue`: past
serve.image_queue_size, 503 with Retry-After, as a text search's queue answers) to threads of their own, and a
search stops at its next stage once serve.deadline_ms has passed (504). The single process searches its resident
index; on Ray (`--engine ray`) the gateway hands the checked image to a front, whose queue this is, which embeds it
and asks every shard for its nearest live rows (its Retriever's scoring, `cfir_jax.cluster.scoring.ShardedSR`).
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import concurrent.futures
import dataclasses
import threading
import time
from typing import Any

import pydantic
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import HTMLResponse, Response
from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictStr
from starlette.datastructures import UploadFile

from cfir_jax.core.query_rule import Condition, FilterError, FilterLimits, Query, check_facets, check_id, check_top_k
from cfir_jax.retrieve import report
from cfir_jax.retrieve.image_query import Expired
from cfir_jax.serve.errors import Busy, DeadlinePassed, Refused, answerable

SHOWN = 20  # hits a request gets by default (at most retrieval.top_k)
FORM_FIELDS = ("image", "image_id", "top_k", "id", "where", "fold", "facets")  # what a multipart upload may hold
FORMS = ("multipart/form-data", "application/x-www-form-urlencoded")  # read as a form (an upload, or an id's)


class ImageSearchRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    image: StrictStr | None = Field(None, description="the image's bytes (JPEG, PNG, WebP, ...), base64")
    image_id: StrictStr | None = Field(None, description="or an indexed image's id (its cached embedding)")
    top_k: Any = Field(None, description="hits to return, 1 .. retrieval.top_k (default: 20, or retrieval.top_k "
                       "when smaller)", json_schema_extra={"type": "integer"})  # the rule checks it
    id: StrictStr = Field("image", description="the query's id, echoed in the answer")
    where: list[StrictStr | list] | None = Field(None, description="filters on the images' own fields, joined by "
                                                 "AND: lines, or [field, op, value] triples (docs/filters.md); a "
                                                 "form or a query string repeats `where` (lines)")
    fold: StrictBool = Field(True, description="near-duplicates folded under each one shown (docs/duplicates.md); "
                             "a form or a query string says fold=0 to list them")
    facets: list[StrictStr] | None = Field(None, description="fields whose values are counted over the images "
                                           "ranked (docs/filters.md); a form or a query string says facets=F1,F2")


def body_limit(max_image_bytes: int) -> int:
    """The most bytes an image request's body is read to: the base64 of the largest image and what surrounds it
    (the JSON around it, a multipart upload's headers and fields)."""
    return 4 * -(-int(max_image_bytes) // 3) + 65536


async def _body(request: Request, limit: int) -> bytes:
    """The request body, read no further than `limit` bytes (413 past it, whatever Content-Length said)."""
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise Refused(f"body over the {limit:,} bytes an image of serve.max_image_bytes takes", 413)
        chunks.append(chunk)
    return b"".join(chunks)


def _kind(request: Request) -> str:
    return request.headers.get("content-type", "").split(";")[0].strip().lower()


def _top_k(given: str | None) -> int | str | None:
    """A form's or a query string's top_k: its integer, or the string itself for the rule to refuse in its words."""
    try:
        return None if given is None else int(given)
    except ValueError:
        return given


def _fold(given: str | None) -> bool:
    """A form's or a query string's fold: 1/true (the default) or 0/false; anything else is one 422."""
    if given is None or given.lower() in ("1", "true"):
        return True
    if given.lower() in ("0", "false"):
        return False
    raise Refused(f"fold: expected 1 or 0 (true or false), got {given[:40]!r}", 422)


def _checked(image: bytes | None, fields: ImageSearchRequest, max_bytes: int):
    if image is not None and len(image) > max_bytes:
        raise Refused(f"the image is {len(image):,} bytes, over serve.max_image_bytes={max_bytes:,}", 413)
    if image is not None and not image:
        raise Refused("the image is empty", 422)
    return image, fields


def _parse(request: Request, body: bytes, max_bytes: int) -> tuple[bytes | None, ImageSearchRequest]:
    """(image bytes or None, the request's fields) from a JSON body or a raw image/* body."""
    if _kind(request).startswith("image/"):
        fields = ImageSearchRequest(top_k=_top_k(request.query_params.get("top_k")),
                                    id=request.query_params.get("id", "image"),
                                    where=request.query_params.getlist("where") or None,
                                    fold=_fold(request.query_params.get("fold")),
                                    facets=list(check_facets(request.query_params.get("facets"))) or None)
        return _checked(body, fields, max_bytes)
    try:
        fields = ImageSearchRequest.model_validate_json(body)
    except pydantic.ValidationError as e:
        raise RequestValidationError(e.errors()) from None  # the app's one-line 400 / 422
    if (fields.image is None) == (fields.image_id is None):
        raise Refused("give the image (image: base64) or an indexed image's id (image_id), one", 422)
    try:
        image = base64.b64decode(fields.image, validate=True) if fields.image is not None else None
    except (binascii.Error, ValueError):
        raise Refused("image is not base64", 422) from None
    return _checked(image, fields, max_bytes)


async def _form(request: Request, body: bytes, max_bytes: int, max_conditions: int
                ) -> tuple[bytes | None, ImageSearchRequest]:
    """(image bytes or None, the fields) of a multipart/form-data upload already read (`body`): the file field
    `image` (or a field `image_id`), the fields `top_k` and `id`, `where` repeated; a malformed upload is one 422. A
    urlencoded form (no file) may name an indexed image."""
    # why: Starlette's form parsers import python-multipart, needed only when a form arrives
    from starlette.formparsers import FormParser, MultiPartException, MultiPartParser

    async def stream():
        yield body

    # The plain fields once each, `where` up to max_conditions times and one more: a request over the limit gets
    # the limit's own line (read_request), and one far over it, past the fields a form may hold, the limit's 413 too,
    # never the parser's "Too many fields" (a 422 that says nothing of the limit).
    fields = len(FORM_FIELDS) - 2 + max_conditions + 1
    try:
        if _kind(request) == "multipart/form-data":
            form = await MultiPartParser(request.headers, stream(), max_files=1, max_fields=fields,
                                         max_part_size=65536).parse()
        else:  # a form without a file (curl -d image_id=ID)
            form = await FormParser(request.headers, stream(), max_fields=fields).parse()
    except MultiPartException as e:
        if e.message.startswith("Too many fields"):
            raise FilterError(f"where: an upload of over {fields:,} fields, over serve.max_filter_conditions="
                              f"{max_conditions:,} conditions beside image, image_id, top_k, id, fold", 413) from None
        raise Refused(f"malformed multipart upload: {e.message}", 422) from None
    unknown = [name for name in form if name not in FORM_FIELDS]
    if unknown:
        raise Refused(f"unknown form field {unknown[0]!r}: an upload holds the file image (or image_id), top_k and "
                      "id", 422)
    upload, image_id = form.get("image"), form.get("image_id")
    plain = [name for name in FORM_FIELDS[1:] if any(isinstance(v, UploadFile) for v in form.getlist(name))]
    if plain or (upload is not None and not isinstance(upload, UploadFile)):
        raise Refused("image is a file field (curl -F image=@photo.jpg); image_id, top_k and id are plain fields"
                      f"{f', not {plain[0]}' if plain else ''}", 422)
    if (upload is None) == (image_id is None):
        raise Refused("give the image (the file field image) or an indexed image's id (image_id), one", 422)
    fields = ImageSearchRequest(image_id=image_id, top_k=_top_k(form.get("top_k")), id=form.get("id", "image"),
                                where=[str(w) for w in form.getlist("where")] or None, fold=_fold(form.get("fold")),
                                facets=list(check_facets(form.get("facets"))) or None)
    image = await upload.read() if upload is not None else None
    await form.close()
    return _checked(image, fields, max_bytes)


async def read_request(request: Request, max_bytes: int, max_conditions: int
                       ) -> tuple[bytes | None, ImageSearchRequest]:
    """The image (or None for an id) and the fields of a POST /v1/search/image, checked, in any of its forms; at
    `where` repeated up to `max_conditions` times and one more (serve.max_filter_conditions) in every form, so a
    request over the limit meets the limit's own refusal (`FilterLimits.read`, 413), not the form parser's."""
    body = await _body(request, body_limit(max_bytes))
    if _kind(request) in FORMS:
        image, fields = await _form(request, body, max_bytes, max_conditions)
    else:
        image, fields = _parse(request, body, max_bytes)
    return image, fields


@dataclasses.dataclass(frozen=True)
class Shown:
    """How an image search's answer shows its hits: near-duplicates folded under each (`fold`), the values of
    `facets` counted, and as JSON or, when `html`, as the gallery (POST /v1/search/image/html)."""

    fold: bool = True
    facets: tuple[str, ...] = ()
    html: bool = False


class ImageQueue:
    """Image searches in WORKERS threads of their own (one decodes while another embeds; the tower runs one image
    at a time), never the event loop's default pool, at most `size` searching or waiting: past it 503 with
    Retry-After at once. A search not answered by serve.deadline_ms is answered 504 and stops at its next stage (a
    queued one never starts). `stop` waits for the searches accepted."""

    WORKERS = 2

    def __init__(self, settings, metrics):
        self.settings, self.size, self.metrics = settings, int(settings.image_queue_size), metrics
        self._pool = concurrent.futures.ThreadPoolExecutor(self.WORKERS, thread_name_prefix="cfir-image")
        self._lock = threading.Lock()
        self.pending = 0
        self._stopping = False

    def stop(self) -> None:
        with self._lock:
            self._stopping = True
        self._pool.shutdown(wait=True)

    def _release(self, _future=None) -> None:
        with self._lock:
            self.pending -= 1

    async def answer(self, holder, image: bytes | None, image_id: str | None, top_k: object, qid: str,
                     where: tuple[Condition, ...] = (), shown: Shown = Shown()) -> tuple[str, int]:
        """The answer of a checked image request, as `shown` says (JSON, or the HTML gallery), searched by the
        index `holder` serves (a Ray front's search runs on its shards), with the version of the index that answered
        it; the queue's own serve settings (its deadline, the filter's limits)."""
        settings = self.settings
        current = holder.current
        top_k = check_top_k(min(SHOWN, current.max_top_k) if top_k is None else top_k, current.max_top_k)
        check_id(qid, "id")
        where = FilterLimits.of(settings).read(where)  # read at the door: a filter past its limits 413 before the queue
        with self._lock:
            if self._stopping or self.pending >= self.size:
                self.metrics.rejected.inc()
                why = "stopping" if self._stopping else f"{self.pending} images are being searched or waiting " \
                    f"(serve.image_queue_size={self.size})"
                raise Busy(why, 1)
            self.pending += 1
        deadline = time.monotonic() + float(settings.deadline_ms) / 1e3
        future = self._pool.submit(_search, current.index, image, image_id, top_k, qid, deadline, where, shown)
        future.add_done_callback(self._release)
        try:
            answer = await asyncio.wait_for(asyncio.wrap_future(future), timeout=max(0.0, deadline - time.monotonic()))
        except (TimeoutError, Expired):  # a queued search is cancelled; a running one stops at its next stage
            self.metrics.dropped.labels("deadline").inc()
            raise DeadlinePassed(f"deadline of {settings.deadline_ms:g} ms passed (serve.deadline_ms)") from None
        # any other refusal (damage on disk, a shard down, an image too large or unknown, an unknown filter field)
        # is answered by `cfir_jax.serve.errors`' table, as a text search's
        return answer, current.version


def _search(index, image: bytes | None, image_id: str | None, top_k: int, qid: str, deadline: float,
            where: tuple[Condition, ...] = (), shown: Shown = Shown()) -> str:
    """One image search of the index's default method (its first served) and its JSON answer, or when
    `shown.html` the gallery `retrieve.py --query-image --html` draws (each hit's pixels from the corpus, else its
    http(s) url), in a queue's thread; its pixels held to the index config's serve.max_image_pixels."""
    query = Query(image=image, image_id=image_id, top_k=top_k, id=qid, where=where, fold=shown.fold,
                  facets=shown.facets)
    try:
        index.check(query)
        result = index.search_image(query, deadline)
        return report.html_page(result, index.image_bytes, top_k) if shown.html else report.as_json(result, top_k)
    except Exception:
        raise
    except BaseException as e:  # noqa: BLE001 - SystemExit from an engine: this request's 500, not the server's end
        raise answerable(e) from e


async def _answered(request: Request, html: bool) -> tuple[str, dict]:
    """An image request read and checked here, searched by the app's service (`search_image`: the resident
    index, or on Ray a front): its answer (JSON, or the HTML gallery) and headers."""
    svc = request.app.state.service
    image, fields = await read_request(request, int(svc.settings.max_image_bytes),
                                       int(svc.settings.max_filter_conditions))
    where = FilterLimits.of(svc.settings).read(fields.where)  # parsed once, here; carried as conditions
    return await svc.search_image(image, fields.image_id, fields.top_k, fields.id, where, fields.fold,
                                  check_facets(fields.facets), html)


def image_routes(app: FastAPI) -> None:
    """Adds POST /v1/search/image (JSON) and POST /v1/search/image/html (the gallery) to the app."""

    @app.post("/v1/search/image", summary="the nearest images of an image (a multipart upload with the file field "
              "image, JSON {image: base64} or {image_id}, or the image as the body with Content-Type image/*)")
    async def search_by_image(request: Request) -> Response:
        answer, headers = await _answered(request, html=False)
        return Response(answer, media_type="application/json", headers=headers)

    @app.post("/v1/search/image/html", response_class=HTMLResponse, summary="the HTML gallery of an image's nearest "
              "images (the request of /v1/search/image), each hit's pixels inline as /v1/search/html has them")
    async def search_by_image_html(request: Request) -> HTMLResponse:
        answer, headers = await _answered(request, html=True)
        return HTMLResponse(answer, headers=headers)
