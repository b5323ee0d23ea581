"""The service on Ray Serve against hostile input, as issue 51 fuzzed the single process (tests/e2e/test_serve.py,
tests/unit/serve/test_doors.py): one cluster for the module (`retrieve.py --serve --engine ray`, 2 shards, 2 fronts
behind a gateway, so that every request crosses the command's door, Ray's proxy, a gateway and a front), then
malformed bodies at every search door, hypothesis searches (answered exactly when the one rule accepts them), any
JSON body at any path, multipart and raw picture uploads, and bytes that are not HTTP. Nothing answers 500 (nor
any 5xx), every answer but a search's is one JSON line, and the cluster stays ready. Bounded: each property's
examples are few (the module takes about a minute past the cluster's start)."""

import json
import socket

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from pictures import small_png
from test_serve import _malformed
from test_serve_cluster import Cluster

from cfir_jax.core.query_rule import QueryRefused, check_text, check_top_k

pytest.importorskip("ray.serve", reason="the cluster service needs Ray Serve: pip install -e '.[cluster]'")
pytestmark = pytest.mark.slow

FEW = settings(max_examples=40, deadline=None, database=None,
               suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
DOORS = ["/v1/search", "/v1/search/batch", "/v1/search/html", "/v1/search/image"]


@pytest.fixture(scope="module")
def cluster(workdir, tmp_path_factory):
    c = Cluster(workdir, tmp_path_factory.mktemp("home"), "--config.serve.shards=2", "--config.serve.front_replicas=2",
                "--config.serve.shard_num_cpus=0.1", "--config.serve.front_num_cpus=0.1",
                "--config.serve.gateway_num_cpus=0.1")
    yield c
    if c.proc.poll() is None:
        c.stop()


def _one_line(r: httpx.Response) -> str:
    """The refusal of an answer: exactly {"error": "one line"}, and never a 5xx but a 503 or 504."""
    assert r.status_code < 500 or r.status_code in (503, 504), (r.status_code, r.text[:300])
    assert r.headers["content-type"].startswith("application/json"), (r.status_code, r.text[:300])
    body = json.loads(r.content)
    assert list(body) == ["error"] and isinstance(body["error"], str) and "\n" not in body["error"], body
    return body["error"]


def test_malformed_bodies_at_every_door_are_one_json_line_4xx(cluster):
    for path, headers, body in _malformed(120):
        r = cluster.client.post(path, content=body, headers=headers)
        assert 400 <= r.status_code < 500, (path, headers, body[:80], r.status_code, r.text[:200])
        _one_line(r)


TEXTS = st.one_of(st.text(max_size=60), st.text(alphabet=st.characters(codec=None), max_size=30),
                  st.sampled_from(["Ada Lovelace in London", "a\x00b", "\ud800", " \f\v ", "x" * 70000, 12, None]))
TOP_KS = st.one_of(st.integers(-2, 105), st.sampled_from([True, "5", 2.5, None]))


@FEW
@given(text=TEXTS, top_k=TOP_KS)
def test_fuzz_a_search_is_answered_exactly_when_the_rule_accepts_it(cluster, text, top_k):
    r = cluster.client.post("/v1/search", content=json.dumps({"text": text, "top_k": top_k}),
                            headers={"content-type": "application/json"})
    try:
        check_text(text, "text", 65536)
        check_top_k(top_k, 100)
    except QueryRefused as refused:
        assert r.status_code == refused.status and _one_line(r) == str(refused), r.text[:300]
    else:
        assert r.status_code == 200 and 0 < len(r.json()["hits"]) <= top_k, r.text[:300]


JSON_VALUES = st.recursive(st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=20),
                           lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=8), inner,
                                                                                      max_size=3), max_leaves=8)
BODIES = st.one_of(st.binary(max_size=200), JSON_VALUES.map(lambda v: json.dumps(v).encode()),
                   st.fixed_dictionaries({}, optional={"text": TEXTS, "top_k": TOP_KS, "documents": JSON_VALUES,
                                                       "where": JSON_VALUES, "fold": JSON_VALUES,
                                                       "image_id": JSON_VALUES, "lang": JSON_VALUES,
                                                       "extra": JSON_VALUES}).map(lambda v: json.dumps(v).encode()))


@FEW
@given(body=BODIES, path=st.sampled_from([*DOORS, "/v1/admin/reload", "/nowhere"]),
       content_type=st.sampled_from(["application/json", "", "text/plain", "multipart/form-data",
                                     "multipart/form-data; boundary=x", "image/png",
                                     "application/x-www-form-urlencoded"]))
def test_fuzz_any_body_at_any_path_is_answered_or_refused_in_one_line(cluster, body, path, content_type):
    r = cluster.client.post(path, content=body, headers={"content-type": content_type} if content_type else {})
    assert r.status_code in (200, 400, 401, 404, 405, 413, 415, 422), (r.status_code, r.text[:300])
    if r.status_code >= 400:
        _one_line(r)


FORM_NAMES = st.sampled_from(["image", "image_id", "top_k", "id", "where", "fold", "other"])


@FEW
@given(files=st.dictionaries(FORM_NAMES, st.tuples(st.text(max_size=8), st.one_of(
           st.binary(max_size=80), st.binary(max_size=40).map(lambda b: small_png()[:40] + b))), max_size=2),
       data=st.dictionaries(FORM_NAMES, st.one_of(st.text(max_size=10), TOP_KS.map(str)), max_size=3),
       whole=st.booleans())
def test_fuzz_any_picture_upload_is_answered_or_refused_in_one_line(cluster, files, data, whole):
    """A multipart upload (the world's cache was imported: a picture's bytes are refused in one line, an id is
    searched) or a raw picture body."""
    if whole:
        r = cluster.client.post("/v1/search/image", content=small_png(), headers={"content-type": "image/png"},
                                params=data)
    else:
        r = cluster.client.post("/v1/search/image", files=files or None, data=data or None)
    assert r.status_code in (200, 400, 404, 413, 415, 422), (r.status_code, r.text[:300])
    if r.status_code != 200:
        _one_line(r)


RAW = [b"NOT HTTP AT ALL\r\n\r\n", b"POST /v1/search HTTP/9.9\r\nHost: x\r\n\r\n",
       b"POST /v1/search HTTP/1.1\r\nHost: x\r\nContent-Length: 5\r\nContent-Length: 7\r\n\r\n{}",
       b"POST /v1/search HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\nzz\r\n{}\r\n0\r\n\r\n",
       b"POST /v1/search HTTP/1.1\r\nHost: x\r\nContent-Length: -1\r\n\r\n",
       b"POST /v1/search HTTP/1.1\r\n" + b"X-Big: " + b"a" * 70000 + b"\r\n\r\n",
       b"GET /\x00\x01 HTTP/1.1\r\nHost: x\r\n\r\n"]


def test_bytes_that_are_not_http_are_one_json_line_and_the_cluster_stays_ready(cluster, documents):
    """Malformed HTTP meets the command's door (uvicorn with the service's protocol class), never Ray's proxy: each
    answer is a JSON 400 (or the connection closed at once), then the cluster answers and is ready."""
    host, port = cluster.url.removeprefix("http://").split(":")
    for raw in RAW:
        with socket.create_connection((host, int(port)), timeout=20) as conn:
            conn.sendall(raw)
            data = b""
            try:
                while chunk := conn.recv(65536):
                    data += chunk
            except (TimeoutError, ConnectionResetError):
                pass
        assert data == b"" or data.startswith(b"HTTP/1.1 4"), (raw[:60], data[:300])
        if data:
            head, body = data.split(b"\r\n\r\n", 1)
            assert b"content-type: application/json" in head.lower(), data[:300]
            assert list(json.loads(body)) == ["error"] and b"\n" not in body.strip(), data[:300]
    ready = cluster.client.get("/readyz")
    assert ready.status_code == 200 and ready.json()["ready"], ready.text
    assert cluster.search(documents[0][1]).status_code == 200
    counts = [line for line in cluster.client.get("/metrics").text.splitlines()
              if line.startswith("cfir_requests_total") and 'status="5' in line and 'status="503"' not in line]
    assert not counts, counts
