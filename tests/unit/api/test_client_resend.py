"""The client sends a search again when the service never answered it, against a stand-in on 127.0.0.1 that fails
the first N requests as a cluster does when a replica dies: the connection closed or reset mid-request, Ray's HTTP
proxy's plain-text 500 (the ingress replica holding the request was killed), a 502/504 of a proxy, and a refused
connection while the service restarts. The service's own JSON errors are never sent again; past the deadline the
call is one line naming the last failure. Each answer carries the index version from `X-Index-Version`."""

import json
import socket
import struct
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from cfir_jax.api.client import Client, ServiceError
from cfir_jax.core.errors import CfirError
from cfir_jax.retrieve.results import Hit, Result

VERSION = 7


def _answer(doc_id: str) -> dict:
    return Result(doc_id, (Hit(1, f"img-{doc_id}", 0.5, "a caption", "", ()),)).to_json()


class _Flaky(BaseHTTPRequestHandler):
    """Fails the first `fail` searches with `failure`, then answers as the service does."""

    fail, failure, seen = 0, "close", 0

    def log_message(self, *args):  # quiet
        pass

    def _send(self, status: int, data: bytes, content_type: str, headers: dict | None = None) -> None:
        self.send_response(status)
        self.send_header("content-type", content_type)
        self.send_header("content-length", str(len(data)))
        for key, value in (headers or {}).items():
            self.send_header(key, value)
        self.end_headers()
        self.wfile.write(data)

    def _fail(self) -> None:
        failure = type(self).failure
        if failure == "close":  # the connection closed without an answer
            self.close_connection = True
        elif failure == "reset":  # a reset (RST) without an answer
            self.connection.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
            self.close_connection = True
        elif failure == "json500":  # the service's own internal error
            self._send(500, json.dumps({"error": "internal error (id 0123456789ab; the service's log has its "
                                                 "traceback)"}).encode(), "application/json")
        else:  # a proxy's plain-text 5xx: "500", "502", "504"
            self._send(int(failure), b"Internal Server Error", "text/plain; charset=utf-8")

    def do_POST(self):  # noqa: N802 - http.server's name
        body = json.loads(self.rfile.read(int(self.headers["content-length"])))
        type(self).seen += 1
        if type(self).fail:
            type(self).fail -= 1
            return self._fail()
        answer = _answer(body["id"]) if self.path == "/v1/search" else \
            {"results": [_answer(d["id"]) for d in body["documents"]]}
        self._send(200, json.dumps(answer).encode(), "application/json", {"X-Index-Version": str(VERSION)})


def _serve(port: int = 0) -> ThreadingHTTPServer:
    server = ThreadingHTTPServer(("127.0.0.1", port), _Flaky)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server


@pytest.fixture
def flaky():
    _Flaky.fail, _Flaky.failure, _Flaky.seen = 0, "close", 0
    server = _serve()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()
    server.server_close()


@pytest.mark.parametrize("failure", ["close", "reset", "500", "502", "504"])
def test_a_search_the_service_never_answered_is_sent_again(flaky, failure):
    _Flaky.fail, _Flaky.failure = 3, failure
    result = Client(flaky).search("eiffel", id="doc-1", deadline_s=10)
    assert result == Result.from_json(_answer("doc-1")) and result.version == VERSION
    assert _Flaky.seen == 4


def test_a_batch_is_sent_again_and_carries_the_version(flaky):
    _Flaky.fail, _Flaky.failure = 1, "500"
    results = Client(flaky).search_many(["a", "b", "c"], batch=2, deadline_s=10)
    assert [r.id for r in results] == ["0", "1", "2"] and {r.version for r in results} == {VERSION}
    assert _Flaky.seen == 3  # the first batch twice, the second once


def test_the_services_own_json_error_is_raised_at_once(flaky):
    _Flaky.fail, _Flaky.failure = 1, "json500"
    with pytest.raises(ServiceError, match=r"^internal error \(id 0123456789ab; .*\)$") as refused:
        Client(flaky).search("eiffel", deadline_s=10)
    assert refused.value.status == 500 and _Flaky.seen == 1


def test_past_the_deadline_the_call_names_the_last_failure(flaky):
    _Flaky.fail, _Flaky.failure = 1000, "500"
    t0 = time.monotonic()
    with pytest.raises(CfirError, match=r"^http://127\.0\.0\.1:\d+/v1/search: no answer within the 1\.5 s deadline "
                                        r"\(\d+ tries; the last: HTTP 500 Internal Server Error, not the service's "
                                        r"own answer\)$") as gone:
        Client(flaky).search("eiffel", deadline_s=1.5)
    assert time.monotonic() - t0 < 1.5 and 3 <= _Flaky.seen <= 8  # 50 ms, 100, 200, 400, 800: no wait past it
    assert "\n" not in str(gone.value) and not isinstance(gone.value, ServiceError)


def test_a_refused_connection_while_the_service_restarts_is_sent_again():
    _Flaky.fail, _Flaky.seen = 0, 0
    server = _serve()
    port = server.server_address[1]
    client = Client(f"http://127.0.0.1:{port}", deadline_s=10)
    assert client.search("before").version == VERSION  # reached once
    server.shutdown()
    server.server_close()  # refused from now on, until the restart
    restarted = []
    timer = threading.Timer(0.5, lambda: restarted.append(_serve(port)))
    timer.start()
    try:
        assert client.search("after", id="doc-2").id == "doc-2"
        assert restarted
    finally:
        timer.join()
        for s in restarted:
            s.shutdown()
            s.server_close()


def test_a_service_never_reached_is_said_at_once():
    t0 = time.monotonic()
    with pytest.raises(CfirError, match=r"^http://127\.0\.0\.1:9: cannot reach the service \(.+\)$"):
        Client("http://127.0.0.1:9").search("x", deadline_s=10)  # discard: nothing listens
    assert time.monotonic() - t0 < 1.0  # a wrong URL does not wait out the deadline
