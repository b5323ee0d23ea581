"""One deadline for a client call (issue 59): `deadline_s` bounds the whole call, so a server that trickles its answer
(a byte every half second, each read answered well within any per-read timeout) cannot hold it past the deadline;
past it, the call is one CfirError line. A redirect to a malformed URL is one line too, never http.client's own
exception."""

import socket
import threading
import time

import pytest

from cfir_jax.api.client import Client
from cfir_jax.core.errors import CfirError

TRICKLE_S = 0.5  # a byte every half second


def _trickling(head: bytes, body: bytes) -> tuple[str, socket.socket]:
    """A server that reads a request whole, then sends `head` at once and `body` a byte every TRICKLE_S; stops when
    the client goes away."""
    listener = socket.create_server(("127.0.0.1", 0))

    def answer(conn: socket.socket) -> None:
        with conn:
            data = b""
            while b"\r\n\r\n" not in data:
                data += conn.recv(65536)
            headers, _, got = data.partition(b"\r\n\r\n")
            length = next((int(line.split(b":")[1]) for line in headers.split(b"\r\n")
                           if line.lower().startswith(b"content-length:")), 0)
            while len(got) < length:
                got += conn.recv(65536)
            try:
                conn.sendall(head)
                for byte in body:
                    time.sleep(TRICKLE_S)
                    conn.sendall(bytes([byte]))
            except OSError:
                return

    def serve() -> None:
        while True:
            try:
                conn, _ = listener.accept()
            except OSError:
                return
            threading.Thread(target=answer, args=(conn,), daemon=True).start()

    threading.Thread(target=serve, daemon=True).start()
    return f"http://127.0.0.1:{listener.getsockname()[1]}", listener


BODY = b'{"id": "query", "hits": []}' * 4
TRICKLED = {  # the answer's body trickled after its head, or its head itself
    "body": (b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: %d\r\n\r\n" % len(BODY), BODY),
    "head": (b"", b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: 2\r\n\r\n{}"),
}


@pytest.mark.parametrize("part", sorted(TRICKLED))
def test_a_trickling_server_holds_a_call_no_longer_than_its_deadline(part):
    url, listener = _trickling(*TRICKLED[part])
    try:
        for call in (lambda c: c.search("The Louvre."), lambda c: c.search_many(["The Louvre."])):
            t0 = time.monotonic()
            with pytest.raises(CfirError, match=r"no answer within the deadline") as e:
                call(Client(url, deadline_s=2))
            assert time.monotonic() - t0 < 2.5 and "\n" not in str(e.value)
        t0 = time.monotonic()
        with pytest.raises(CfirError, match=r"no answer within the deadline"):
            Client(url, deadline_s=60).search("The Louvre.", deadline_s=1)  # a call's own deadline holds too
        assert time.monotonic() - t0 < 1.5
    finally:
        listener.close()


@pytest.mark.parametrize("location", ["/v1/a b", "/v1/a\x7fb", "http://127.0.0.1:notaport/v1/search"])
def test_a_redirect_to_a_malformed_url_is_one_line(location):
    listener = socket.create_server(("127.0.0.1", 0))
    answer = b"HTTP/1.1 307 Temporary Redirect\r\nlocation: %s\r\ncontent-length: 0\r\n\r\n" % location.encode()
    threading.Thread(target=lambda: _redirecting(listener, answer), daemon=True).start()
    url = f"http://127.0.0.1:{listener.getsockname()[1]}"
    try:
        with pytest.raises(CfirError) as e:
            Client(url, deadline_s=5).search("The Louvre.")
        assert type(e.value) is CfirError and "\n" not in str(e.value)
        assert str(e.value).startswith(f"{url}/v1/search: the service redirected to ")
    finally:
        listener.close()


def _redirecting(listener: socket.socket, answer: bytes) -> None:
    while True:
        try:
            conn, _ = listener.accept()
        except OSError:
            return
        with conn:
            data = b""
            while b"\r\n\r\n" not in data:
                data += conn.recv(65536)
            conn.sendall(answer)
