"""POST /v1/search/image's reading of a request (cfir_jax/serve/image_search.py), on real Starlette requests: an image
as a multipart upload (as httpx, and so curl -F, encodes it), as base64 JSON or as the raw body (Content-Type
image/*), each bad form refused with its one-line status before any index is touched, and a body read no further
than its limit. The route over a served index is tests/e2e/test_image_search.py."""

import asyncio
import base64
import json

import httpx
import pytest
from fastapi.exceptions import RequestValidationError
from starlette.requests import Request

from cfir_jax.core.query_rule import FilterError, FilterLimits
from cfir_jax.serve.errors import Refused
from cfir_jax.serve.image_search import _body, _parse, read_request

PNG = b"\x89PNG\r\n\x1a\nnot really"


def _request(content_type: str, query: str = "", chunks=()) -> Request:
    messages = [{"type": "http.request", "body": c, "more_body": True} for c in chunks]
    messages.append({"type": "http.request", "body": b"", "more_body": False})

    async def receive():
        return messages.pop(0)

    scope = {"type": "http", "method": "POST", "path": "/v1/search/image", "query_string": query.encode(),
             "headers": [(b"content-type", content_type.encode())]}
    return Request(scope, receive)


def test_a_raw_image_body_takes_top_k_and_id_from_the_query_string():
    image, fields = _parse(_request("image/png", "top_k=3&id=mine"), PNG, max_bytes=1000)
    assert image == PNG and (fields.top_k, fields.id, fields.image_id) == (3, "mine", None)
    image, fields = _parse(_request("image/jpeg; charset=binary"), PNG, max_bytes=1000)
    assert image == PNG and (fields.top_k, fields.id) == (None, "image")  # the route's default


def test_a_json_image_is_base64_or_an_id():
    body = json.dumps({"image": base64.b64encode(PNG).decode(), "top_k": 4}).encode()
    image, fields = _parse(_request("application/json"), body, max_bytes=1000)
    assert image == PNG and fields.top_k == 4
    image, fields = _parse(_request("application/json"), b'{"image_id": "img7"}', max_bytes=1000)
    assert image is None and fields.image_id == "img7"


@pytest.mark.parametrize("content_type, query, body, status, message", [
    ("image/png", "", b"x" * 11, 413, "the image is 11 bytes, over serve.max_image_bytes=10"),
    ("image/png", "", b"", 422, "the image is empty"),
    ("application/json", "", json.dumps({"image": base64.b64encode(b"x" * 11).decode()}).encode(), 413,
     "over serve.max_image_bytes=10"),
    ("application/json", "", b'{"image": "not base64!"}', 422, "image is not base64"),
    ("application/json", "", b'{"top_k": 3}', 422, "give the image (image: base64) or an indexed image's id"),
    ("application/json", "", b'{"image": "eA==", "image_id": "a"}', 422, "one"),
])
def test_each_bad_request_is_one_line_with_its_status(content_type, query, body, status, message):
    with pytest.raises(Refused) as e:
        _parse(_request(content_type, query), body, max_bytes=10)
    assert e.value.status == status and message in str(e.value) and "\n" not in str(e.value)


def test_malformed_json_and_unknown_fields_go_to_the_apps_validation_answer():
    for body in (b"{not json", b'{"image_id": "a", "colour": "red"}', b'{"image_id": 7}'):
        with pytest.raises(RequestValidationError):
            _parse(_request("application/json"), body, max_bytes=10)


def test_a_body_is_read_no_further_than_its_limit():
    assert asyncio.run(_body(_request("image/png", chunks=[b"ab", b"cd"]), limit=4)) == b"abcd"
    with pytest.raises(Refused) as e:
        asyncio.run(_body(_request("image/png", chunks=[b"ab", b"cd", b"e"]), limit=4))
    assert e.value.status == 413


def _upload(files=None, data=None, split=7) -> Request:
    """A multipart/form-data request as httpx encodes it (its boundary, its parts), sent in chunks of `split` bytes."""
    encoded = httpx.Request("POST", "http://x/v1/search/image", files=files, data=data)
    body = encoded.read()
    return _request(encoded.headers["content-type"], chunks=[body[i : i + split] for i in range(0, len(body), split)])


def _read(request: Request, max_bytes: int = 1000, max_conditions: int = 32):
    return asyncio.run(read_request(request, max_bytes, max_conditions))


def test_an_upload_takes_the_file_image_and_the_fields_top_k_and_id():
    image = PNG + bytes(range(256)) + b"\r\n--not-the-boundary\r\n"  # binary, line breaks, a boundary look-alike
    got, fields = _read(_upload(files={"image": ("photo.png", image, "image/png")}, data={"top_k": "3", "id": "me"}))
    assert got == image and (fields.top_k, fields.id, fields.image_id) == (3, "me", None)
    got, fields = _read(_upload(files={"image": ("p.png", PNG)}))
    assert got == PNG and (fields.top_k, fields.id) == (None, "image")
    got, fields = _read(_upload(data={"image_id": "img7"}))
    assert got is None and fields.image_id == "img7"


@pytest.mark.parametrize("files, data, status, message", [
    ({"image": ("p.png", b"x" * 11)}, None, 413, "the image is 11 bytes, over serve.max_image_bytes=10"),
    ({"image": ("p.png", b"")}, None, 422, "the image is empty"),
    (None, {"image": "not a file"}, 422, "image is a file field (curl -F image=@photo.jpg)"),
    ({"top_k": ("k.txt", b"3")}, {"image_id": "a"}, 422, "are plain fields, not top_k"),
    (None, {"top_k": "3"}, 422, "give the image (the file field image) or an indexed image's id (image_id), one"),
    ({"image": ("p.png", PNG[:5])}, {"image_id": "a"}, 422, "or an indexed image's id (image_id), one"),
    ({"image": ("p.png", PNG[:5])}, {"colour": "red"}, 422, "unknown form field 'colour'"),
    ({"image": ("p.png", PNG[:5]), "other": ("q.png", PNG[:5])}, None, 422, "malformed multipart upload: Too many"),
])
def test_each_bad_upload_is_one_line_with_its_status(files, data, status, message):
    with pytest.raises(Refused) as e:
        _read(_upload(files=files, data=data), max_bytes=10)
    assert e.value.status == status and message in str(e.value) and "\n" not in str(e.value)


@pytest.mark.parametrize("content_type, body", [
    ("multipart/form-data", b"--x\r\n"),  # no boundary given
    ("multipart/form-data; boundary=x", b"--x\r\nContent-Disposition: form-data\r\n\r\nno name\r\n--x--\r\n"),
])
def test_a_malformed_upload_is_one_422(content_type, body):
    with pytest.raises(Refused) as e:
        _read(_request(content_type, chunks=[body]))
    assert e.value.status == 422 and str(e.value).startswith("malformed multipart upload: ")


def test_an_upload_is_read_no_further_than_its_limit():
    big = _upload(files={"image": ("p.png", b"x" * 200_000)}, split=65536)
    with pytest.raises(Refused) as e:
        _read(big, max_bytes=1000)  # read to the base64 of 1,000 bytes and 64 KiB around it, then refused
    assert e.value.status == 413 and "body over the" in str(e.value)


WHERE = ["date<=2020-06-30", "source=reuters", "license in cc-by,cc0", "width>100"]


def _forms(where: list[str]) -> dict:
    """One image request in each form, with `where` repeated (a form's fields, the query string) or a JSON list."""
    query = "&".join(f"where={w}" for w in where).replace(" ", "+").replace(",", "%2C")
    return {
        "multipart": _upload(files={"image": ("p.png", PNG)}, data={"where": where, "top_k": "2", "id": "me",
                                                                  "fold": "1"}),
        "urlencoded": _request("application/x-www-form-urlencoded", chunks=[httpx.Request(
            "POST", "http://x", data={"image_id": "img-a", "where": where}).read()]),
        "json": _request("application/json", chunks=[json.dumps({"image_id": "img-a", "where": where}).encode()]),
        "raw": _request("image/png", query=query, chunks=[PNG]),
    }


@pytest.mark.parametrize("form", ["multipart", "urlencoded", "json", "raw"])
def test_where_repeats_up_to_the_configs_limit_in_every_form(form):
    _, fields = _read(_forms(WHERE)[form], max_conditions=4)
    assert fields.where == WHERE  # four filters in a multipart upload: no "Too many fields"
    many = [f"n{i}>{i}" for i in range(32)]
    assert _read(_forms(many)[form], max_conditions=32)[1].where == many
    over = _read(_forms(WHERE + ["height<9"])[form], max_conditions=4)[1].where  # read whole: the limit's own line
    with pytest.raises(FilterError) as e:
        FilterLimits(4, 1024, 16384).read(over)
    assert e.value.status == 413 and str(e.value) == "where: 5 conditions, over serve.max_filter_conditions=4"


@pytest.mark.parametrize("form", ["multipart", "urlencoded", "json", "raw"])
def test_where_far_past_the_limit_is_the_limit_s_413_in_every_form(form):
    """40 filters where 4 may be (and 2,000 in a urlencoded form, past the form parser's own 1,000 fields): the
    limit's 413 in every form, as in the JSON and the query string (before, a multipart upload past its fields was
    "malformed multipart upload: Too many fields", 422, and so was a urlencoded form past 1,000)."""
    for count in (40, 2_000):
        where = [f"n{i}>{i}" for i in range(count)]
        with pytest.raises(FilterError) as e:
            FilterLimits(4, 1024, 1 << 20).read(_read(_forms(where)[form], 100_000, 4)[1].where)
        assert e.value.status == 413 and "over serve.max_filter_conditions=4" in str(e.value), str(e.value)


def test_a_where_sent_as_a_file_beside_a_plain_one_is_refused_not_read_as_a_filter():
    """`where` is a plain field wherever it repeats: a file part among them is the upload's one-line 422 (before, a
    file part before a plain `where` was written out as `UploadFile(filename=...)` and parsed as a filter)."""
    with pytest.raises(Refused) as e:
        _read(_upload(files=[("where", ("w.txt", b"tags=a")), ("where", (None, "n>1")),
                             ("image_id", (None, "img-a"))]))
    assert e.value.status == 422 and str(e.value).endswith("are plain fields, not where")
