"""POST /v1/search/image's reading of a request (cfir_jax/serve/picture.py), on real Starlette requests: a picture
as base64 JSON or as the raw body (Content-Type image/*), each bad form refused with its one-line status before any
index is touched, and a body read no further than its limit. The route over a served index is
tests/e2e/test_image_search.py."""

import asyncio
import base64
import json

import pytest
from fastapi.exceptions import RequestValidationError
from starlette.exceptions import HTTPException
from starlette.requests import Request

from cfir_jax.serve.picture import _body, _parse

PNG = b"\x89PNG\r\n\x1a\nnot really"


def _request(content_type: str, query: str = "", chunks=()) -> Request:
    messages = [{"type": "http.request", "body": c, "more_body": True} for c in chunks]
    messages.append({"type": "http.request", "body": b"", "more_body": False})

    async def receive():
        return messages.pop(0)

    scope = {"type": "http", "method": "POST", "path": "/v1/search/image", "query_string": query.encode(),
             "headers": [(b"content-type", content_type.encode())]}
    return Request(scope, receive)


def test_a_raw_picture_body_takes_top_k_and_id_from_the_query_string():
    picture, fields = _parse(_request("image/png", "top_k=3&id=mine"), PNG, max_bytes=1000)
    assert picture == PNG and (fields.top_k, fields.id, fields.image_id) == (3, "mine", None)
    picture, fields = _parse(_request("image/jpeg; charset=binary"), PNG, max_bytes=1000)
    assert picture == PNG and (fields.top_k, fields.id) == (None, "picture")  # the route's default


def test_a_json_picture_is_base64_or_an_id():
    body = json.dumps({"image": base64.b64encode(PNG).decode(), "top_k": 4}).encode()
    picture, fields = _parse(_request("application/json"), body, max_bytes=1000)
    assert picture == PNG and fields.top_k == 4
    picture, fields = _parse(_request("application/json"), b'{"image_id": "img7"}', max_bytes=1000)
    assert picture is None and fields.image_id == "img7"


@pytest.mark.parametrize("content_type, query, body, status, message", [
    ("image/png", "", b"x" * 11, 413, "the picture is 11 bytes, over serve.max_image_bytes=10"),
    ("image/png", "", b"", 422, "the picture is empty"),
    ("image/png", "top_k=many", PNG[:8], 422, "top_k='many': an integer"),
    ("application/json", "", json.dumps({"image": base64.b64encode(b"x" * 11).decode()}).encode(), 413,
     "over serve.max_image_bytes=10"),
    ("application/json", "", b'{"image": "not base64!"}', 422, "image is not base64"),
    ("application/json", "", b'{"top_k": 3}', 422, "give the picture (image: base64) or an indexed picture's id"),
    ("application/json", "", b'{"image": "eA==", "image_id": "a"}', 422, "one"),
])
def test_each_bad_request_is_one_line_with_its_status(content_type, query, body, status, message):
    with pytest.raises(HTTPException) as e:
        _parse(_request(content_type, query), body, max_bytes=10)
    assert e.value.status_code == status and message in e.value.detail and "\n" not in e.value.detail


def test_malformed_json_and_unknown_fields_go_to_the_apps_validation_answer():
    for body in (b"{not json", b'{"image_id": "a", "colour": "red"}', b'{"image_id": 7}'):
        with pytest.raises(RequestValidationError):
            _parse(_request("application/json"), body, max_bytes=10)


def test_a_body_is_read_no_further_than_its_limit():
    assert asyncio.run(_body(_request("image/png", chunks=[b"ab", b"cd"]), limit=4)) == b"abcd"
    with pytest.raises(HTTPException) as e:
        asyncio.run(_body(_request("image/png", chunks=[b"ab", b"cd", b"e"]), limit=4))
    assert e.value.status_code == 413
