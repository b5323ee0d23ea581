"""Search by picture over HTTP: POST /v1/search/image (`cfir_jax.retrieve.image_query` in the single-process engine).

The picture comes as JSON `{"image": BASE64, "top_k": 20, "id": "..."}` (or `{"image_id": ID}` for an indexed
picture), or as the request body itself with a `Content-Type: image/...` header (`?top_k=&id=` in the query string).
Multipart uploads are not read: FastAPI needs python-multipart for them, which the project does not install.
A picture over serve.max_image_bytes is 413, an undecodable one 422, an unknown or removed id 404, each one line;
the answer is the JSON of `retrieve.py --query-image ... --format json`. The cluster engine answers 501.
"""

from __future__ import annotations

import asyncio
import base64
import binascii

import pydantic
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import Response
from pydantic import BaseModel, ConfigDict, Field, StrictInt, StrictStr
from starlette.exceptions import HTTPException

from cfir_jax.core.errors import CfirError
from cfir_jax.retrieve import report
from cfir_jax.retrieve.image_query import UnknownPicture, search_image
from cfir_jax.retrieve.pipeline import Retriever
from cfir_jax.stores.integrity import CorruptStore

SHOWN = 20  # hits a request gets by default (at most retrieval.top_k)


class ImageSearchRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    image: StrictStr | None = Field(None, description="the picture's bytes (JPEG, PNG, WebP, ...), base64")
    image_id: StrictStr | None = Field(None, description="or an indexed picture's id (its cached embedding)")
    top_k: StrictInt | None = Field(None, description="hits to return, 1 .. retrieval.top_k (default: 20, or "
                                    "retrieval.top_k when smaller)")
    id: StrictStr = Field("picture", description="the query's id, echoed in the answer")


async def _body(request: Request, limit: int) -> bytes:
    """The request body, read no further than `limit` bytes (413 past it, whatever Content-Length said)."""
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise HTTPException(413, f"body over the {limit:,} bytes a picture of serve.max_image_bytes takes")
        chunks.append(chunk)
    return b"".join(chunks)


def _parse(request: Request, body: bytes, max_bytes: int) -> tuple[bytes | None, ImageSearchRequest]:
    """(picture bytes or None, the request's fields) from a JSON body or a raw image/* body."""
    kind = request.headers.get("content-type", "").split(";")[0].strip().lower()
    if kind.startswith("image/"):
        try:
            top_k = request.query_params.get("top_k")
            fields = ImageSearchRequest(top_k=None if top_k is None else int(top_k),
                                        id=request.query_params.get("id", "picture"))
        except ValueError:
            raise HTTPException(422, f"top_k={request.query_params.get('top_k')!r}: an integer") from None
        picture = body
    else:
        try:
            fields = ImageSearchRequest.model_validate_json(body)
        except pydantic.ValidationError as e:
            raise RequestValidationError(e.errors()) from None  # the app's one-line 400 / 422
        if (fields.image is None) == (fields.image_id is None):
            raise HTTPException(422, "give the picture (image: base64) or an indexed picture's id (image_id), one")
        try:
            picture = base64.b64decode(fields.image, validate=True) if fields.image is not None else None
        except (binascii.Error, ValueError):
            raise HTTPException(422, "image is not base64") from None
    if picture is not None and len(picture) > max_bytes:
        raise HTTPException(413, f"the picture is {len(picture):,} bytes, over serve.max_image_bytes={max_bytes:,}")
    if picture is not None and not picture:
        raise HTTPException(422, "the picture is empty")
    return picture, fields


def picture_routes(app: FastAPI, version_header: str) -> None:
    """Adds POST /v1/search/image to the app; answers carry `version_header` (the index version), as every search's."""

    @app.post("/v1/search/image", summary="the nearest pictures of a picture (JSON {image: base64} or {image_id}, "
              "or the picture as the body with Content-Type image/*)")
    async def search_by_picture(request: Request) -> Response:
        svc = request.app.state.service
        max_bytes = int(svc.settings.max_image_bytes)
        body = await _body(request, 4 * -(-max_bytes // 3) + 65536)  # base64 and the JSON around it
        picture, fields = _parse(request, body, max_bytes)
        holder = getattr(svc, "holder", None)
        retrievers = holder.current.retrievers if holder is not None else {}
        retriever = next(iter(retrievers.values()), None)
        if not isinstance(retriever, Retriever):
            raise HTTPException(501, "search by picture is served by the single-process engine (serve.engine=local)")
        top_k = min(SHOWN, holder.current.max_top_k) if fields.top_k is None else fields.top_k
        if not 1 <= top_k <= holder.current.max_top_k:
            raise HTTPException(422, f"top_k={top_k} out of range: 1 .. {holder.current.max_top_k}")
        version = holder.current.version
        try:
            result = await asyncio.wait_for(asyncio.to_thread(
                search_image, retriever, image=picture, image_id=fields.image_id, top_k=top_k),
                timeout=svc.settings.deadline_ms / 1e3)
        except TimeoutError:
            raise HTTPException(504, f"deadline of {svc.settings.deadline_ms:g} ms passed (serve.deadline_ms)") \
                from None
        except CorruptStore as e:
            raise HTTPException(503, str(e).splitlines()[0]) from None
        except UnknownPicture as e:
            raise HTTPException(404, str(e).splitlines()[0]) from None
        except CfirError as e:
            raise HTTPException(422, str(e).splitlines()[0]) from None
        answer = await asyncio.to_thread(report.as_json, fields.id, result, retriever.describe_image, top_k)
        return Response(answer, media_type="application/json", headers={version_header: str(version)})
