"""What every HTTP request passes through first (a pure ASGI middleware): its body held to the service's bounds, its
answer made readable, and its count, status and latency in /metrics.

- A body whose Content-Length is over the service's `max_body` is answered 413 at once, without calling the app.
- A body that grows past `max_body` as it arrives (chunked, or a Content-Length that lied) is refused 413 where it
  passes the bound, and a body that stops arriving for serve.deadline_ms is refused 408: a client that sends half a
  body and waits holds no handler. A body must also arrive whole within serve.body_deadline_ms of its request's
  start, whatever its pace: a body dripped a byte at a time, each byte in time for the stall's bound, is refused 408
  there too, and its connection closed. A search takes a slot (the batcher's queue, the image queue) only once
  its body is read, so dripping connections hold none.
- An answer sent before the body was read whole (those two, a 404, a refused image) is followed by reading the
  rest of the body and dropping it, for up to `DRAIN_S`, before the answer ends. A server that closes a connection
  with unread data in it makes its TCP reset the connection, and a client still sending then loses the answer: it
  sees a reset, takes the request for unanswered, and sends it again (the issue 51 client sent a 32 MB image 8
  times in 4 s and never saw the 413). A client that asked `Expect: 100-continue` sends no body after an early
  answer, so nothing is read then.
- A client that goes away mid-body ends its request quietly (499 in the counts): no handler error, no traceback; a
  request the server cancels (Ray Serve does when its client goes) is counted 499 too.

Bytes that are not HTTP at all (a Content-Length shorter than the body sent leaves the rest to be read as the next
request) never reach the app: uvicorn answers them itself, before it closes the connection. `http_protocol` makes
that answer the service's one JSON line too.
"""

from __future__ import annotations

import asyncio
import importlib.util
import json
import socket
import time

from cfir_jax.core.errors import CfirError
from cfir_jax.serve.errors import Refused
from cfir_jax.serve.metrics import Metrics

DRAIN_S = 10.0  # how long an early answer's connection reads the rest of the body, so the client reads the answer
DRAIN_BYTES = 1 << 30  # and at most how many of its bytes
# An idle connection is kept this long (uvicorn's timeout_keep_alive): longer than the clients' own pools keep one
# (httpx 5 s), so that the client closes it first. Equal timeouts race: the server closing a connection as the client
# sends on it loses that request unanswered (a reset; the soaks met one in 6,185 and one in 921 at 5 s).
KEEP_ALIVE_S = 75
ENDPOINTS = ("/", "/v1/search", "/v1/search/batch", "/v1/search/html", "/healthz", "/readyz", "/metrics",
             "/v1/admin/reload", "/docs", "/openapi.json", "/v1/search/image",
             "/v1/search/image/html")


def http_protocol(kind: str = "auto"):
    """uvicorn's HTTP protocol class (httptools when installed, else h11, as uvicorn's "auto" picks) whose answer to
    bytes that are not an HTTP request is a one-line JSON 400, as the app's refusals are: `uvicorn.Config(http=...)`."""
    # why: uvicorn loads only when serving starts
    from uvicorn.config import HTTP_PROTOCOLS
    from uvicorn.importer import import_from_string

    if kind == "auto":
        kind = "httptools" if importlib.util.find_spec("httptools") is not None else "h11"
    base = import_from_string(HTTP_PROTOCOLS[kind])

    def send_400_response(self, msg: str) -> None:
        data = json.dumps({"error": f"malformed HTTP request: {msg}"}).encode()
        self.transport.write(b"HTTP/1.1 400 Bad Request\r\ncontent-type: application/json\r\ncontent-length: %d\r\n"
                             b"connection: close\r\n\r\n%s" % (len(data), data))
        self.transport.close()

    return type(f"JsonErrors{base.__name__}", (base,), {"send_400_response": send_400_response})


class RequestGuard:
    """The ASGI middleware above: `service` gives `max_body` (bytes), `settings.deadline_ms` (how long a body may
    stall), `settings.body_deadline_ms` (how long it may take, all of it) and `metrics`."""

    def __init__(self, app, service):
        self.app, self.service = app, service

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        svc, t0 = self.service, time.perf_counter()
        metrics: Metrics = svc.metrics
        route = scope["path"] if scope["path"] in ENDPOINTS else "other"
        searching = route.startswith("/v1/search")
        body = _Body(scope, receive, svc.max_body, float(svc.settings.deadline_ms) / 1e3,
                     float(svc.settings.body_deadline_ms) / 1e3)

        def count(status: int) -> None:  # an answer's status, or 0 where none began
            metrics.requests.labels(route, str(status or (499 if body.gone else 500))).inc()
            if status:
                metrics.latency.labels(route).observe(time.perf_counter() - t0)

        answer = _Answer(send, body, count)
        if searching:
            metrics.in_flight.inc()
        try:
            if body.declared is not None and body.declared > svc.max_body:
                await answer.refuse(413, f"body of {body.declared:,} bytes is over the {svc.max_body:,} this service "
                                         "reads")
            else:
                await self.app(scope, body.receive, answer.send)
        except asyncio.CancelledError:  # the server cancelled it (Ray Serve's, when its client goes): 499, not 500
            body.gone = True
            raise
        finally:
            if searching:
                metrics.in_flight.dec()
            if not answer.counted:  # no answer, or one cut short
                count(answer.status)


class _Body:
    """The request body as the app receives it: bounded, timed, and the rest of it drained after an early answer."""

    def __init__(self, scope, receive, limit: int, stall_s: float, whole_s: float):
        self._receive, self.limit, self.stall_s, self.whole_s = receive, limit, stall_s, whole_s
        self.ends = time.monotonic() + whole_s  # the whole body by then, whatever its pace
        headers = dict(scope.get("headers") or ())
        declared = headers.get(b"content-length", b"").strip()
        self.declared = int(declared) if declared.isdigit() else None
        self.expects_continue = headers.get(b"expect", b"").lower() == b"100-continue"
        self.done = scope.get("method") in ("GET", "HEAD") and not declared  # no body comes
        self.gone = False
        self.read = 0

    async def receive(self):
        """The next ASGI message: Refused 413 past the bound, 408 when the body stalls or is not whole by its deadline
        (the app answers each through `cfir_jax.serve.errors`); after the body, the messages as they come (the
        handler's wait for a disconnect)."""
        if self.done:
            return await self._receive()
        left = self.ends - time.monotonic()
        try:
            if left <= 0:
                raise TimeoutError
            message = await asyncio.wait_for(self._receive(), timeout=min(self.stall_s, left))
        except TimeoutError:
            self.done = True  # nothing is drained: a stalled client sends nothing, a dripping one is cut off
            if left < self.stall_s:
                raise Refused(f"the request body did not arrive whole within {self.whole_s:g} s ({self.read:,} bytes "
                              "in: serve.body_deadline_ms)", 408, {"connection": "close"}) from None
            raise Refused(f"the request body stopped arriving ({self.read:,} bytes in, none for {self.stall_s:g} s: "
                          "serve.deadline_ms)", 408) from None
        if message["type"] == "http.disconnect":
            self.done = self.gone = True
        elif message["type"] == "http.request":
            self.read += len(message.get("body", b""))
            if not message.get("more_body", False):
                self.done = True
            if self.read > self.limit:
                raise Refused(f"body over the {self.limit:,} bytes this service reads", 413)
        return message

    async def drain(self) -> None:
        """Reads what is left of the body and drops it, for up to DRAIN_S and DRAIN_BYTES."""
        if self.done or self.expects_continue:
            return
        deadline, start = time.monotonic() + DRAIN_S, self.read
        while not self.done and self.read - start < DRAIN_BYTES:
            left = deadline - time.monotonic()
            if left <= 0:
                return
            try:
                message = await asyncio.wait_for(self._receive(), timeout=left)
            except TimeoutError:
                return
            if message["type"] != "http.request":
                self.done = self.gone = True
                return
            self.read += len(message.get("body", b""))
            self.done = not message.get("more_body", False)


class _Answer:
    """The app's `send`: the status counted (with its latency) when the answer's last part leaves, which is what the
    client sees, and an answer that ends before the body was read followed by the body's drain, so that the client
    reads it."""

    def __init__(self, send, body: _Body, count):
        self._send, self.body, self._count = send, body, count
        self.status, self.counted = 0, False

    async def send(self, message) -> None:
        if message["type"] == "http.response.start":
            self.status = int(message["status"])
        elif message["type"] == "http.response.body" and not message.get("more_body", False) and not self.counted:
            self.counted = True
            self._count(self.status)
        if message["type"] == "http.response.body" and not message.get("more_body", False) and not self.body.done:
            await self._send({**message, "more_body": True})  # the whole answer, held open while the body drains
            await self.body.drain()
            message = {"type": "http.response.body", "body": b"", "more_body": False}
        await self._send(message)

    async def refuse(self, status: int, reason: str) -> None:
        """A one-line JSON refusal sent by the guard itself; the connection then closes (after the drain)."""
        data = json.dumps({"error": reason}).encode()
        await self.send({"type": "http.response.start", "status": status,
                         "headers": [(b"content-type", b"application/json"),
                                     (b"content-length", str(len(data)).encode()), (b"connection", b"close")]})
        await self.send({"type": "http.response.body", "body": data, "more_body": False})


def bind(host: str, port: int) -> socket.socket:
    """A listening socket on host:port (0: one the system picks; IPv6 when the host has a colon), or one line naming
    the taken port: both servers (the single process's and the Ray command's door) bind before they load."""
    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as e:
        sock.close()
        raise CfirError(f"cannot listen on {host}:{port}: {e.strerror}; pick another --port") from None
    sock.listen(2048)
    return sock
