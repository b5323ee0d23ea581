"""The service's HTTP doors against hostile input (issue 51), on the real app over a stand-in index (no model:
tests/helpers/standin_service.py): images bounded before they are decoded and decoded outside the tower's lock, a
bounded image queue (503 with Retry-After) whose deadline stops the work, bodies that lie about their length or
stop, a client gone mid-body, a body far over the limit answered 413 and readable by a client that sends it whole;
then hypothesis fuzzing every door (texts, top_k, ids, JSON bodies of any shape, multipart uploads, raw image
bodies): never a 500, never a logged error, every refusal one JSON line with its status, a text or top_k answered
exactly when the one rule accepts it (the library's rule: cfir_jax/core/query_rule.py), and the service ready after.
The real service over a real index: tests/e2e/test_serve.py, tests/e2e/test_image_search.py."""

import base64
import concurrent.futures
import json
import socket
import time

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from sample_images import bomb_png, small_png
from standin_service import serving

from cfir_jax.core.query_rule import QueryRefused, check_id, check_text, check_top_k
from cfir_jax.retrieve import image_query

QUICK = settings(max_examples=40, deadline=None, database=None, suppress_health_check=[HealthCheck.too_slow,
                                                                                       HealthCheck.data_too_large])
LONG = settings(QUICK, max_examples=120)
MAX_TOP_K = 50


@pytest.fixture(scope="module")
def door():
    """One stand-in service for the fuzzing: (url, service, retriever)."""
    with serving(max_top_k=MAX_TOP_K, deadline_ms=3000, max_text_bytes=4096) as served:
        yield served


def _one_line(response: httpx.Response) -> str:
    """The refusal of a 4xx/5xx answer: exactly {"error": "one line"}."""
    assert response.headers["content-type"].startswith("application/json"), response.text[:200]
    body = json.loads(response.content)
    assert list(body) == ["error"] and isinstance(body["error"], str) and "\n" not in body["error"], body
    return body["error"]


def _still_ready(url: str, svc) -> None:
    assert httpx.get(f"{url}/readyz", timeout=10).status_code == 200
    errors = [r for r in svc.log_records if r.levelname in ("ERROR", "CRITICAL") or r.exc_info]
    assert not errors, [r.getMessage() for r in errors]


# ------------------------------------------------------------------------------------------------------ images


def test_a_decompression_bomb_is_refused_from_its_header_without_decoding(door):
    url, svc, _ = door
    bomb = bomb_png()  # 20 KB; 169 MP, under PIL's own limit: 507 MB once decoded to RGB
    t0 = time.monotonic()
    answer = httpx.post(f"{url}/v1/search/image", content=bomb, headers={"content-type": "image/png"}, timeout=30)
    assert answer.status_code == 413 and time.monotonic() - t0 < 5, answer.text  # decoded, it was a 200, later
    assert _one_line(answer) == (f"the image ({len(bomb):,} bytes) is too large: 13,000 x 13,000 = 169,000,000 "
                                 "pixels, over serve.max_image_pixels=50,000,000")
    _still_ready(url, svc)


def test_an_image_is_decoded_outside_the_lock_the_tower_holds(door):
    url, _, retriever = door
    engine = image_query.prepare(retriever)
    with engine.lock:  # the tower busy with another image: a bad image is refused all the same
        answer = httpx.post(f"{url}/v1/search/image", content=bomb_png(), headers={"content-type": "image/png"},
                            timeout=30)
    assert answer.status_code == 413, answer.text


def test_a_full_image_queue_answers_503_with_retry_after_at_once():
    with serving(tower_delay_s=3.0, image_queue_size=1, deadline_ms=10000) as (url, svc, retriever):
        with concurrent.futures.ThreadPoolExecutor(3) as pool:
            answers = list(pool.map(lambda _: httpx.post(f"{url}/v1/search/image", content=small_png(),
                                                         headers={"content-type": "image/png"}, timeout=30), range(3)))
        busy = [a for a in answers if a.status_code == 503]
        assert sorted(a.status_code for a in answers) == [200, 503, 503], [a.text for a in answers]
        assert all(a.headers["retry-after"] == "1" and _one_line(a).startswith("busy: 1 images") for a in busy)
        assert retriever.tower.calls == 1
        _still_ready(url, svc)


def test_an_image_past_its_deadline_is_answered_504_and_its_work_stops():
    with serving(tower_delay_s=1.0, image_queue_size=4, deadline_ms=400) as (url, svc, retriever):
        with concurrent.futures.ThreadPoolExecutor(3) as pool:
            answers = list(pool.map(lambda _: httpx.post(f"{url}/v1/search/image", content=small_png(),
                                                         headers={"content-type": "image/png"}, timeout=30), range(3)))
        assert [a.status_code for a in answers] == [504] * 3
        assert all(_one_line(a) == "deadline of 400 ms passed (serve.deadline_ms)" for a in answers)
        time.sleep(2.5)  # what the threads would still do
        assert retriever.tower.calls <= 1  # at most the first reached the tower; the others stopped before it
        assert svc.images.pending == 0
        _still_ready(url, svc)


# -------------------------------------------------------------------------------------------------------- bodies


def _raw(url: str, head: bytes, body: bytes = b"", close_after: bool = False, timeout: float = 10) -> bytes:
    """Sends a request as bytes on a socket of its own and returns what came back until the server closed or the
    timeout passed (close_after: the client's side is shut after sending)."""
    host, port = url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=timeout) as conn:
        conn.sendall(head + body)
        if close_after:
            conn.shutdown(socket.SHUT_WR)
        data = b""
        try:
            while b"\r\n\r\n" not in data or len(data) < data.index(b"\r\n\r\n") + 4 + _length(data):
                chunk = conn.recv(65536)
                if not chunk:
                    break
                data += chunk
        except (TimeoutError, ConnectionResetError):
            pass
    return data


def _length(data: bytes) -> int:
    for line in data.split(b"\r\n\r\n")[0].split(b"\r\n")[1:]:
        if line.lower().startswith(b"content-length:"):
            return int(line.split(b":")[1])
    return 0


def _head(path: str, length: int, content_type: str = "application/json") -> bytes:
    return (f"POST {path} HTTP/1.1\r\nHost: x\r\nContent-Type: {content_type}\r\nContent-Length: {length}\r\n\r\n"
            ).encode()


def test_a_body_that_stops_arriving_is_answered_408_in_one_line():
    with serving(deadline_ms=400) as (url, svc, _):
        for path in ("/v1/search", "/v1/search/image"):
            t0 = time.monotonic()
            answer = _raw(url, _head(path, 1000), b'{"text": "half a bo')  # 1,000 bytes promised, 20 sent
            assert answer.startswith(b"HTTP/1.1 408 ") and time.monotonic() - t0 < 3, answer[:300]
            error = json.loads(answer.split(b"\r\n\r\n", 1)[1])["error"]
            assert error == "the request body stopped arriving (19 bytes in, none for 0.4 s: serve.deadline_ms)"
        _still_ready(url, svc)


def test_a_body_longer_than_its_content_length_is_one_json_line_all_the_same(door):
    url, svc, _ = door
    answer = _raw(url, _head("/v1/search", 10), b'{"text": "The harbour of Ashford."}')
    # The first 10 bytes are the body (malformed JSON); the rest, read as the next request, is no HTTP. Whichever
    # answer leaves first, it is a 400 and one JSON line.
    assert answer.startswith(b"HTTP/1.1 400 "), answer[:300]
    error = json.loads(answer.split(b"\r\n\r\n", 1)[1][:_length(answer)])["error"]
    assert error.startswith(("malformed JSON", "malformed HTTP request: ")), error
    _still_ready(url, svc)


def test_a_client_gone_mid_body_ends_its_request_quietly(door):
    url, svc, _ = door
    for path in ("/v1/search", "/v1/search/image", "/v1/search/batch"):
        assert _raw(url, _head(path, 5000), b"x" * 100, close_after=True) in (b"",) or True
    time.sleep(0.3)
    _still_ready(url, svc)  # no handler error, no traceback logged
    counted = [line for line in httpx.get(f"{url}/metrics").text.splitlines()
               if line.startswith("cfir_requests_total") and 'status="499"' in line]
    assert counted, "a client gone mid-body is counted as 499"


def test_a_body_far_over_the_limit_is_413_and_readable_by_a_client_that_sends_it_whole(door):
    url, svc, _ = door
    t0 = time.monotonic()  # 48 MB, sent whole before anything is read (what urllib and many clients do)
    answer = _raw(url, _head("/v1/search/image", 48 << 20, "image/png"), b"\x00" * (48 << 20), timeout=15)
    assert answer.startswith(b"HTTP/1.1 413 ") and time.monotonic() - t0 < 15, answer[:300]
    assert json.loads(answer.split(b"\r\n\r\n", 1)[1])["error"].startswith("body of 50,331,648 bytes is over")
    _still_ready(url, svc)


# -------------------------------------------------------------------------------------------------------- fuzzing

TEXTS = st.one_of(st.text(max_size=60), st.text(alphabet=st.characters(codec=None), max_size=30),
                  st.sampled_from(["", "   ", "a\x00b", "caf\u0065\u0301", "x" * 5000, "\ud800", "ok \x1b[0m"]),
                  st.integers(), st.none(), st.lists(st.text(max_size=3), max_size=2))
HUGE = "<a number of 5,001 digits>"  # json.dumps cannot write it: _dumps writes its digits
TOP_KS = st.one_of(st.integers(-3, 60), st.sampled_from([True, None, "5", 2.5, 10**30, HUGE]), st.text(max_size=3))
JSON_VALUES = st.recursive(st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=20),
                           lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=8), inner,
                                                                                      max_size=3), max_leaves=10)


def _dumps(value) -> bytes:
    return json.dumps(value, default=str).replace(json.dumps(HUGE), "1" + "0" * 5000).encode()


def _accepted(text, top_k, doc_id="query") -> str | None:
    """The rule's refusal of a search (what the library says), or None when it answers."""
    try:
        check_text(text, "text", 4096)
        check_top_k(top_k, MAX_TOP_K)
        check_id(doc_id, "id")
    except QueryRefused as e:
        return str(e)
    return None


def _check_search(url: str, text, top_k) -> None:
    response = httpx.post(f"{url}/v1/search", content=_dumps({"text": text, "top_k": top_k}),
                          headers={"content-type": "application/json"}, timeout=30)
    if HUGE in (text, top_k):  # more digits than Python reads as a number: malformed JSON, before any rule
        assert response.status_code == 400 and _one_line(response).startswith("malformed JSON: Exceeds the limit")
        return
    refusal = _accepted(text, top_k)
    if refusal is None:
        assert response.status_code == 200 and response.json()["hits"], response.text
    else:  # the service refuses exactly what the rule refuses, in its words
        assert response.status_code in (413, 422) and _one_line(response) == refusal


SEARCHES = dict(text=TEXTS, top_k=TOP_KS)


def _search_door(door, text, top_k):
    _check_search(door[0], text, top_k)


BODIES = dict(
    body=st.one_of(JSON_VALUES.map(_dumps), st.binary(max_size=200),
                   st.fixed_dictionaries({}, optional={"text": TEXTS, "top_k": TOP_KS, "id": JSON_VALUES,
                                                       "method": JSON_VALUES, "documents": JSON_VALUES,
                                                       "image": JSON_VALUES, "image_id": JSON_VALUES,
                                                       "extra": JSON_VALUES}).map(_dumps)),
    path=st.sampled_from(["/v1/search", "/v1/search/batch", "/v1/search/html", "/v1/search/image",
                          "/v1/admin/reload", "/readyz", "/nowhere"]),
    content_type=st.sampled_from(["application/json", "", "text/plain", "application/json; charset=latin-1",
                                  "multipart/form-data", "multipart/form-data; boundary=x", "image/png",
                                  "application/x-www-form-urlencoded"]))


def _any_body(door, body, path, content_type):
    headers = {"content-type": content_type} if content_type else {}
    response = httpx.post(f"{door[0]}{path}", content=body, headers=headers, timeout=30)
    assert response.status_code in (200, 400, 404, 405, 413, 415, 422), response.text[:300]
    if response.status_code >= 400:
        _one_line(response)


FORM_NAMES = st.sampled_from(["image", "image_id", "top_k", "id", "other", ""])
IMAGES = {"bomb": bomb_png(8000), "small": small_png()}  # named, so that a failing example prints short
UPLOADS = dict(
    files=st.dictionaries(FORM_NAMES, st.tuples(st.text(max_size=8), st.one_of(
        st.binary(max_size=100), st.binary(max_size=60).map(lambda b: small_png()[:40] + b))), max_size=2),
    named=st.sampled_from([None, *sorted(IMAGES)]),
    data=st.dictionaries(FORM_NAMES, st.one_of(st.text(max_size=10), TOP_KS.map(str)), max_size=3))


def _any_upload(door, files, named, data):
    if named is not None:  # a whole image, or a bomb, as the file field image
        files = {**files, "image": ("p.png", IMAGES[named])}
    response = httpx.post(f"{door[0]}/v1/search/image", files=files or None, data=data or None, timeout=30)
    assert response.status_code in (200, 400, 404, 413, 415, 422), response.text[:300]  # 400: nothing sent, no form
    if response.status_code != 200:
        _one_line(response)


RAW_IMAGES = dict(image=st.one_of(st.binary(max_size=300), st.integers(1, 200), st.sampled_from(sorted(IMAGES))),
                  as_json=st.booleans(), top_k=st.one_of(st.none(), TOP_KS))


def _any_raw_image(door, image, as_json, top_k):
    """image: its bytes, a small image cut after n bytes, or a named one; as the body, or base64 in JSON."""
    url = door[0]
    image = small_png()[:image] if isinstance(image, int) else IMAGES.get(image, image)
    if as_json:
        body = {"image": base64.b64encode(image).decode(), **({"top_k": top_k} if top_k is not None else {})}
        response = httpx.post(f"{url}/v1/search/image", content=_dumps(body),
                              headers={"content-type": "application/json"}, timeout=30)
    else:
        query = {"top_k": str(top_k)} if top_k is not None else {}
        response = httpx.post(f"{url}/v1/search/image", params=query, content=image,
                              headers={"content-type": "image/png"}, timeout=30)
    huge = response.status_code == 400 and top_k == HUGE and as_json  # more digits than JSON's reader takes
    assert response.status_code in (200, 413, 415, 422) or huge, response.text[:300]  # 415: a format not read
    if response.status_code != 200:
        _one_line(response)


# Each property twice: a short profile in the quick tier, a long one in the slow tier.
test_fuzz_a_search_is_answered_exactly_when_the_rule_accepts_it = QUICK(given(**SEARCHES)(_search_door))
test_fuzz_any_body_at_any_door_is_answered_or_refused_in_one_line = QUICK(given(**BODIES)(_any_body))
test_fuzz_any_multipart_upload_is_answered_or_refused_in_one_line = QUICK(given(**UPLOADS)(_any_upload))
test_fuzz_any_raw_image_is_answered_or_refused_in_one_line = QUICK(given(**RAW_IMAGES)(_any_raw_image))
test_fuzz_long_searches = pytest.mark.slow(LONG(given(**SEARCHES)(_search_door)))
test_fuzz_long_bodies = pytest.mark.slow(LONG(given(**BODIES)(_any_body)))
test_fuzz_long_uploads = pytest.mark.slow(LONG(given(**UPLOADS)(_any_upload)))
test_fuzz_long_raw_images = pytest.mark.slow(LONG(given(**RAW_IMAGES)(_any_raw_image)))


def test_zz_after_the_fuzzing_the_service_is_ready_and_logged_no_error(door):
    """Defined last, so run last: whatever the fuzzing sent, the service is ready and logged no error."""
    _still_ready(door[0], door[1])
