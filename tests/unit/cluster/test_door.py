"""The cluster's door (cfir_jax/cluster/door.py) over a stand-in for Ray's HTTP proxy that answers as it does when an
ingress replica dies under a request (a plain-text 500, a connection cut) or when the application is gone (a
plain-text 404): a search is sent again and answered by the next replica, or answered 503 with Retry-After past
the deadline, never 500; every answer is one JSON line; the service's own answers pass unchanged."""

import http.server
import json
import threading

import httpx
import ml_collections
import pytest

from cfir_jax.cluster.door import Door, DoorServer
from cfir_jax.serve.middleware import bind


class Upstream:
    """Ray's proxy as the door meets it: `script` is what it answers to each request in turn (status, body, headers),
    "cut" to close the connection without an answer; past the script, the service's 200."""

    def __init__(self, script):
        self.script, self.seen = list(script), []
        outer = self

        class Handler(http.server.BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def do_POST(self):  # noqa: N802 - http.server's name
                body = self.rfile.read(int(self.headers.get("content-length", 0)))
                outer.seen.append((self.path, body, self.headers.get("authorization")))
                step = outer.script.pop(0) if outer.script else (200, json.dumps({"hits": []}),
                                                                  {"x-index-version": "3"})
                if step == "cut":
                    self.close_connection = True
                    self.connection.shutdown(2)
                    return
                status, text, headers = step
                data = text.encode()
                self.send_response(status)
                for k, v in {"content-type": "application/json" if text.startswith("{") else "text/plain",
                             **headers}.items():
                    self.send_header(k, v)
                self.send_header("content-length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            do_GET = do_POST  # noqa: N815

            def log_message(self, *args):
                pass

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()


SETTINGS = ml_collections.ConfigDict({"deadline_ms": 3000.0, "body_deadline_ms": 2000.0, "max_text_bytes": 4096,
                                      "max_batch_docs": 4, "max_image_bytes": 1 << 20, "ready_timeout_s": 5.0})


@pytest.fixture
def door():
    servers = []

    def start(script, upstream_url=None):
        upstream = Upstream(script)
        sock = bind("127.0.0.1", 0)
        server = DoorServer(Door(SETTINGS, upstream_url or upstream.url), sock)
        server.start()
        servers.append(server)
        return f"http://127.0.0.1:{sock.getsockname()[1]}", upstream

    yield start
    for s in servers:
        s.stop(5)


def _one_line(r: httpx.Response) -> str:
    assert r.headers["content-type"] == "application/json" and b"\n" not in r.content, r.content
    return r.json()["error"]


def test_a_search_lost_by_ray_s_proxy_is_sent_again_and_answered(door):
    url, upstream = door([(500, "Internal Server Error", {}), "cut", (503, "Service Unavailable", {})])
    r = httpx.post(f"{url}/v1/search", json={"text": "Ada"}, headers={"authorization": "Bearer t"}, timeout=30)
    assert r.status_code == 200 and r.json() == {"hits": []} and r.headers["x-index-version"] == "3"
    assert len(upstream.seen) == 4 and all(s == ("/v1/search", b'{"text":"Ada"}', "Bearer t") for s in upstream.seen)


def test_past_the_deadline_a_lost_search_is_503_with_retry_after_never_500(door):
    url, upstream = door([(500, "Internal Server Error", {})] * 1000)
    r = httpx.post(f"{url}/v1/search/batch", json={"documents": []}, timeout=30)
    assert r.status_code == 503 and r.headers["retry-after"] == "2", r.text
    assert _one_line(r).startswith("unavailable: Ray's proxy answered HTTP 500 (Internal Server Error); an ingress "
                                   "replica is being replaced")
    nobody = door([], upstream_url="http://127.0.0.1:9")[0]  # no proxy listening at all
    r = httpx.post(f"{nobody}/v1/search/image", content=b"x", timeout=30)
    assert r.status_code == 503 and "ConnectError" in _one_line(r)


def test_ray_s_own_answers_are_one_json_line_and_the_service_s_pass_unchanged(door):
    url, upstream = door([(404, "Path '/v1/search' not found. Ping http://.../-/routes for available routes.", {}),
                          (503, json.dumps({"error": "busy: queue full; retry after 1 s"}), {"retry-after": "1"}),
                          (500, "Internal Server Error", {})])
    gone = httpx.post(f"{url}/v1/search", json={"text": "x"}, timeout=30)
    assert gone.status_code == 404 and _one_line(gone).startswith("HTTP 404 from Ray's proxy: Path '/v1/search' not")
    busy = httpx.post(f"{url}/v1/search", json={"text": "x"}, timeout=30)
    assert busy.status_code == 503 and busy.headers["retry-after"] == "1"
    assert _one_line(busy) == "busy: queue full; retry after 1 s"
    reload = httpx.post(f"{url}/v1/admin/reload", timeout=30)  # not a search: answered at once, not sent again
    assert reload.status_code == 503 and reload.headers["retry-after"] == "2" and len(upstream.seen) == 3


def test_a_body_over_the_bound_or_not_http_is_refused_by_the_door_itself(door):
    url, upstream = door([])
    big = httpx.post(f"{url}/v1/search", content=b"x" * (4 << 20), timeout=30)
    assert big.status_code == 413 and "over the" in _one_line(big)
    import socket

    with socket.create_connection(("127.0.0.1", int(url.rsplit(":", 1)[1])), timeout=10) as conn:
        conn.sendall(b"NOT HTTP AT ALL\r\n\r\n")
        answer = conn.recv(4096)
    assert answer.startswith(b"HTTP/1.1 400 ") and b'{"error": "malformed HTTP request: ' in answer
    assert upstream.seen == []


def test_an_idle_connection_outlives_the_clients_own_keep_alive():
    """The client's pool closes an idle connection first (httpx: 5 s): with equal timeouts the door closed one as a
    client sent on it, and that request was lost unanswered (the soak's one lost request in 921)."""
    sock = bind("127.0.0.1", 0)
    server = DoorServer(Door(SETTINGS, "http://127.0.0.1:9"), sock)
    sock.close()
    assert server.server.config.timeout_keep_alive > httpx.Limits(max_connections=1).keepalive_expiry
