"""The service's client against a stand-in service on 127.0.0.1 (the standard library's HTTP server, answering as
`cfir_jax.serve.app` does): a 503 with Retry-After is waited out within the caller's deadline and not past it, every
refusal is a CfirError carrying the service's one-line reason, the answers are the same records `Index.search`
returns, and a batch keeps its order across requests. The real services: one process, tests/e2e/test_api.py; Ray,
tests/e2e/test_serve_cluster.py."""

import json
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from cfir_jax.api.client import Client, ServiceError
from cfir_jax.core.errors import CfirError
from cfir_jax.retrieve.results import Hit, Result


def _answer(doc_id: str, text: str) -> dict:
    """What POST /v1/search answers (the JSON of `retrieve.py --format json`), its hit named after the text."""
    return Result(doc_id, (Hit(1, f"img-{text}", 0.5, "a caption", "http://x/1.png", ("paris",)),), ("paris",), (),
                  "a summary", "", 7, {"er": 1.0}).to_json()


class _Service(BaseHTTPRequestHandler):
    busy = 0  # how many of the next searches are answered 503 with Retry-After
    retry_after = "1"
    seen: list = []

    def log_message(self, *args):  # quiet
        pass

    def _send(self, status: int, body: dict, headers: dict | None = None) -> None:
        data = json.dumps(body).encode()
        self.send_response(status)
        self.send_header("content-type", "application/json")
        self.send_header("content-length", str(len(data)))
        for key, value in (headers or {}).items():
            self.send_header(key, value)
        self.end_headers()
        self.wfile.write(data)

    def do_GET(self):  # noqa: N802 - http.server's name
        if self.path == "/readyz":
            ready = type(self).busy == 0
            self._send(200 if ready else 503, {"ready": ready, **({} if ready else {"reason": "stopping"})})

    def do_POST(self):  # noqa: N802 - http.server's name
        body = json.loads(self.rfile.read(int(self.headers["content-length"])))
        type(self).seen.append((self.path, body, self.headers.get("authorization")))
        if type(self).busy:
            type(self).busy -= 1
            self._send(503, {"error": "busy: the queue is full; retry after 1 s"}, {"Retry-After": self.retry_after})
        elif self.path == "/v1/search" and not body["text"].strip():
            self._send(422, {"error": "text is empty"})
        elif self.path == "/v1/search":
            self._send(200, _answer(body["id"], body["text"]))
        elif self.path == "/v1/search/batch":
            self._send(200, {"results": [_answer(d["id"], d["text"]) for d in body["documents"]]})


@pytest.fixture
def service():
    _Service.busy, _Service.seen = 0, []
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Service)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()
    server.server_close()


def test_an_answer_is_the_record_index_search_returns(service):
    result = Client(service).search("eiffel", top_k=5, id="doc-1")
    assert result == Result.from_json(_answer("doc-1", "eiffel"))
    assert result.hits[0] == Hit(1, "img-eiffel", 0.5, "a caption", "http://x/1.png", ("paris",))
    assert result.times_ms == {"er": 1.0} and result.ids == ["img-eiffel"]
    assert _Service.seen[0][1] == {"text": "eiffel", "top_k": 5, "id": "doc-1"}


def test_a_busy_service_is_asked_again_after_retry_after(service):
    _Service.busy = 2
    t0 = time.monotonic()
    result = Client(service).search("louvre", deadline_s=10)
    assert result.hits[0].id == "img-louvre"
    assert time.monotonic() - t0 >= 2.0  # waited 1 s after each 503
    assert len(_Service.seen) == 3


def test_a_busy_service_past_the_deadline_is_its_one_line_reason(service):
    _Service.busy = 5
    t0 = time.monotonic()
    with pytest.raises(ServiceError, match=r"^busy: the queue is full; retry after 1 s$") as refused:
        Client(service).search("louvre", deadline_s=1.5)
    assert refused.value.status == 503 and refused.value.retry_after == 1.0
    assert time.monotonic() - t0 < 1.5  # a wait that would pass the deadline is not started
    assert len(_Service.seen) == 2


def test_a_refusal_is_a_cfir_error_with_the_service_reason(service):
    with pytest.raises(CfirError, match=r"^text is empty$") as refused:
        Client(service).search("  ")
    assert refused.value.status == 422


def test_a_batch_keeps_its_order_across_requests_and_sends_the_token(service):
    texts = [f"t{n}" for n in range(5)]
    results = Client(service, token="s3cret").search_many(texts, batch=2)
    assert [r.id for r in results] == ["0", "1", "2", "3", "4"]
    assert [r.hits[0].id for r in results] == [f"img-{t}" for t in texts]
    assert [len(body["documents"]) for _, body, _ in _Service.seen] == [2, 2, 1]
    assert {auth for _, _, auth in _Service.seen} == {"Bearer s3cret"}


def test_ready_follows_readyz_and_an_unreachable_service_is_one_line(service):
    assert Client(service).ready()
    _Service.busy = 1
    assert not Client(service).ready()
    gone = "http://127.0.0.1:9"  # discard: nothing listens
    assert not Client(gone).ready()
    with pytest.raises(CfirError, match=r"^http://127.0.0.1:9: cannot reach the service \(.+\)$"):
        Client(gone).search("x", deadline_s=5)


def test_a_url_without_a_scheme_is_refused():
    with pytest.raises(CfirError, match="starts with http://"):
        Client("localhost:8080")
