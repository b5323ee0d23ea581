"""The client against hostile or broken services on 127.0.0.1 (issue 51): its token never follows a redirect off the
service's origin, an answer the service sent before the body's end (a 413) is raised once and the body never sent
again, a Retry-After of 0 is no tight loop, a malformed 200 is one line, an indexed image's id is never read as a
file, and a query the rule refuses is refused before anything is sent, in the library's words."""

import json
import socket
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from cfir_jax.api.client import RETRY_AFTER_MIN_S, Client, ServiceError
from cfir_jax.core.errors import CfirError
from cfir_jax.core.query_rule import check_text
from cfir_jax.retrieve.results import Hit, Result

ANSWER = Result("query", (Hit(1, "img-1", 0.5, "a caption", "", ()),)).to_json()


class _Handler(BaseHTTPRequestHandler):
    """Answers each request with `reply(handler)` -> (status, body bytes, headers); records what it was sent."""

    def log_message(self, *args):  # quiet
        pass

    def _any(self):
        length = int(self.headers.get("content-length") or 0)
        body = self.rfile.read(length) if length else b""
        self.server.seen.append((self.command, self.path, self.headers.get("authorization"), body))
        status, data, headers = self.server.reply(self)
        self.send_response(status)
        for key, value in {"content-type": "application/json", "content-length": str(len(data)), **headers}.items():
            self.send_header(key, value)
        self.end_headers()
        self.wfile.write(data)

    do_GET = do_POST = _any  # noqa: N815 - http.server's names


@pytest.fixture
def services():
    """Starts stand-in services: services(reply) -> (url, seen)."""
    started = []

    def start(reply):
        server = ThreadingHTTPServer(("127.0.0.1", 0), _Handler)
        server.reply, server.seen = reply, []
        threading.Thread(target=server.serve_forever, daemon=True).start()
        started.append(server)
        return f"http://127.0.0.1:{server.server_address[1]}", server.seen

    yield start
    for server in started:
        server.shutdown()
        server.server_close()


def _json(status: int, body, **headers):
    return lambda handler: (status, json.dumps(body).encode(), headers)


@pytest.mark.parametrize("status", [301, 302, 303, 307, 308])
def test_a_redirect_to_another_host_is_refused_in_one_line_and_that_host_never_sees_the_token(services, status):
    thief, stolen = services(_json(200, ANSWER))
    url, seen = services(lambda h: (status, b"{}", {"location": f"{thief}/v1/search"}))
    client = Client(url, token="s3cret")
    refusal = r"^http://127\.0\.0\.1:\d+/v1/search: the service redirected to http://127\.0\.0\.1:\d+/v1/search, " \
        r"another origin than .*; not followed"
    with pytest.raises(CfirError, match=refusal) as e:
        client.search("The Eiffel Tower in Paris.")
    assert "\n" not in str(e.value) and not isinstance(e.value, ServiceError)
    assert not client.ready()  # /readyz redirected the same way: not ready, and nothing sent there either
    assert stolen == [] and len(seen) == 2 and seen[0][2] == "Bearer s3cret"


def test_a_redirect_from_https_to_http_is_refused_even_on_the_same_host():
    client = Client("https://search.example:443", token="s3cret")
    for location in ("http://search.example/v1/search", "http://search.example:443/v1/search",
                     "https://search.example:8443/v1/search", "https://other.example/v1/search"):
        with pytest.raises(CfirError, match="another origin than https://search.example:443; not followed"):
            client._redirect("https://search.example/v1/search", location, 307, "POST")
    assert client._redirect("https://search.example/v1/search", "/v2/search", 308, "POST") == \
        "https://search.example/v2/search"  # the same origin: followed


def test_a_redirect_within_the_origin_keeps_the_search_and_its_token(services):
    def reply(handler):
        if handler.path == "/v1/search":
            return 307, b"{}", {"location": "/v2/search"}
        return 200, json.dumps(ANSWER).encode(), {"x-index-version": "4"}

    url, seen = services(reply)
    result = Client(url, token="s3cret").search("The Louvre.", top_k=3)
    assert result.ids == ["img-1"] and result.version == 4
    assert [(m, p, a) for m, p, a, _ in seen] == [("POST", "/v1/search", "Bearer s3cret")] + \
        [("POST", "/v2/search", "Bearer s3cret")]
    assert seen[0][3] == seen[1][3] and json.loads(seen[1][3])["top_k"] == 3  # the body, sent again as it was


def _early_413(connections: list) -> tuple[str, socket.socket]:
    """A service that answers 413 as soon as it has read a request's headers, as the issue's did, and stops
    reading (its connection then resets under a client that keeps sending)."""
    listener = socket.create_server(("127.0.0.1", 0))
    answer = json.dumps({"error": "body of 33,554,432 bytes is over the 1,000 this service reads"}).encode()

    def serve():
        while True:
            try:
                conn, _ = listener.accept()
            except OSError:
                return
            connections.append(conn)
            data = b""
            while b"\r\n\r\n" not in data:
                data += conn.recv(65536)
            conn.sendall(b"HTTP/1.1 413 Request Entity Too Large\r\ncontent-type: application/json\r\n"
                         b"content-length: %d\r\n\r\n%s" % (len(answer), answer))
            time.sleep(0.3)
            conn.close()  # unread data: a reset

    threading.Thread(target=serve, daemon=True).start()
    return f"http://127.0.0.1:{listener.getsockname()[1]}", listener


def test_an_answer_sent_before_the_body_ends_is_raised_once_and_the_body_never_sent_again():
    connections: list = []
    url, listener = _early_413(connections)
    try:
        t0 = time.monotonic()
        with pytest.raises(ServiceError, match=r"^body of 33,554,432 bytes is over the 1,000") as refused:
            Client(url, deadline_s=20).search(image=b"\x89PNG" + b"\x00" * (24 << 20))
        assert refused.value.status == 413 and time.monotonic() - t0 < 5
        time.sleep(0.2)
        assert len(connections) == 1  # sent once: never again
    finally:
        listener.close()


@pytest.mark.parametrize("retry_after", ["0", "0.0", "-5", "nan"])
def test_a_retry_after_of_nothing_is_waited_at_least_the_floor(services, retry_after):
    url, seen = services(_json(503, {"error": "busy: 64 documents are waiting"}, **{"Retry-After": retry_after}))
    t0 = time.monotonic()
    with pytest.raises(ServiceError, match="^busy: 64 documents are waiting$"):
        Client(url).search("A report on the mill.", deadline_s=1.2)
    if retry_after == "nan":  # unreadable: not a wait the service asked for; raised at once
        assert len(seen) == 1
    else:
        assert 2 <= len(seen) <= 1 + 1.2 / RETRY_AFTER_MIN_S and time.monotonic() - t0 < 1.5


def test_a_retry_after_as_an_http_date_is_waited_out(services):
    when = time.strftime("%a, %d %b %Y %H:%M:%S GMT", time.gmtime(time.time() + 1))
    replies = iter([_json(503, {"error": "busy"}, **{"Retry-After": when}), _json(200, ANSWER)])
    url, seen = services(lambda h: next(replies)(h))
    assert Client(url).search("The mill.", deadline_s=10).ids == ["img-1"] and len(seen) == 2


@pytest.mark.parametrize("body", [b"{}", b"[]", b"null", b'"hits"', b'{"id": "q", "hits": "many"}',
                                  b'{"id": "q", "hits": [{"rank": "first"}]}', b'{"id": "q", "hits": [7]}',
                                  b'{"hits": [], "times_ms": {"er": "slow"}}'])
def test_a_malformed_200_is_one_line(services, body):
    url, _ = services(lambda h: (200, body, {}))
    with pytest.raises(CfirError, match=r"^http://127\.0\.0\.1:\d+/v1/search: the answer is not a search result "
                                        r"\(.*\); is this a cfir-jax service\?$") as e:
        Client(url).search("The regatta at Kingsham.")
    assert "\n" not in str(e.value)


def test_a_malformed_batch_answer_is_one_line(services):
    url, _ = services(_json(200, {"results": [ANSWER]}))  # one answer for two documents
    with pytest.raises(CfirError, match=r"/v1/search/batch: the answer is not 2 search results; is this a cfir-jax"):
        Client(url).search_many(["one", "two"])


def test_an_indexed_images_id_is_never_read_as_a_file(services, tmp_path, monkeypatch):
    url, seen = services(_json(200, ANSWER))
    monkeypatch.chdir(tmp_path)
    (tmp_path / "img7").write_bytes(b"the bytes of a local file named like the id")
    client = Client(url)
    client.search(image_id="img7", top_k=3)
    assert json.loads(seen[-1][3]) == {"image_id": "img7", "id": "img7", "top_k": 3}
    client.search(image="img7", top_k=3)  # image= is an image: its bytes, or a file
    assert set(json.loads(seen[-1][3])) == {"image", "id", "top_k"}
    long_id = "x" * 300  # over the 255 bytes of a file name: an id, sent as it is
    client.search(image_id=long_id)
    assert json.loads(seen[-1][3])["image_id"] == long_id
    with pytest.raises(CfirError, match=r"^x{200}: cannot read the image \(File name too long\)$"):
        client.search(image=long_id)  # as a file: one line, no OSError
    with pytest.raises(CfirError, match="^give one of text= .*, image= .* or image_id= "):
        client.search(image=b"x", image_id="img7")


@pytest.mark.parametrize("text", ["", "  \n", "a\x00b", "bell\x07", "a\ud800b", 42])
def test_a_text_the_rule_refuses_is_refused_before_it_is_sent_in_the_rules_words(services, text):
    url, seen = services(_json(200, ANSWER))
    with pytest.raises(CfirError) as refused:
        Client(url).search(text)
    with pytest.raises(CfirError) as rule:
        check_text(text, "text")
    assert str(refused.value) == str(rule.value) and seen == []
    with pytest.raises(CfirError, match=r"^top_k='5': an integer$"):
        Client(url).search("The mill.", top_k="5")
    assert seen == []
