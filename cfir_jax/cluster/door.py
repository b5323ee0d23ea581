"""The cluster's door: the command's own HTTP server on serve.host:serve.port, in front of Ray Serve's HTTP proxy,
which listens on 127.0.0.1 at a port of its own (`cfir_jax.cluster.command`).

Why: Ray's proxy answers a request that was in flight at an ingress replica when it died (a SIGKILL, the OOM killer,
a lost node) with a plain-text 500 of its own and never sends it again, although a search is idempotent; and it
answers a few requests itself in plain text (a route gone while the application stops). The door:

- sends a search (POST /v1/search, /batch, /html, /image; any GET) again when Ray's proxy lost it (a 5xx that is not
  the service's JSON, the connection cut, no proxy listening), after a short wait, to whichever ingress replica Ray
  routes it to, until serve.deadline_ms; past it, or while the command stops, it answers 503 with Retry-After, one
  JSON line. POST /v1/admin/reload is sent again only when it never reached the proxy;
- answers anything else of Ray's proxy's own (not the service's JSON) as one JSON line with its status;
- holds each body to the service's bounds before anything is sent on (`cfir_jax.serve.middleware.RequestGuard`:
  413, 408 for a body that stalls or drips), and answers bytes that are not HTTP with the service's JSON 400.

The service's own answers (JSON, the page, /metrics) pass unchanged, with their headers (X-Index-Version).
"""

from __future__ import annotations

import asyncio
import json
import logging
import socket
import threading
import time

import httpx
import uvicorn

from cfir_jax.serve.errors import http_answer
from cfir_jax.serve.metrics import Metrics
from cfir_jax.serve.middleware import KEEP_ALIVE_S, RequestGuard, http_protocol
from cfir_jax.serve.service import max_body

log = logging.getLogger("cfir_jax.serve")
SEARCHES = ("/v1/search", "/v1/search/batch", "/v1/search/html", "/v1/search/image")  # idempotent: sent again
RESEND_WAIT_S = (0.05, 1.0)  # the first wait before a lost request is sent again; the longest
RETRY_AFTER_S = 2  # what a 503 of the door asks a client to wait (an ingress replica is being replaced)
GRACE_S = 10.0  # beyond a request's deadline, how long the door waits for the service's own 504
RELOAD_S = 30.0  # beyond serve.ready_timeout_s, how long an admin reload may take
HOP = {b"connection", b"keep-alive", b"transfer-encoding", b"te", b"upgrade", b"host", b"content-length", b"expect",
       b"proxy-connection", b"trailer"}  # headers of one hop, never passed on


class _Settings:
    """What RequestGuard reads of a service: the bounds, the settings, the counts."""

    def __init__(self, settings):
        self.settings, self.max_body, self.metrics = settings, max_body(settings), Metrics()


class Door:
    """The ASGI app of the door (module docstring), forwarding to Ray's proxy at `upstream` (http://host:port)."""

    def __init__(self, settings, upstream: str):
        self.settings, self.upstream = settings, upstream.rstrip("/")
        self.stopping = False  # set by the command's stop: nothing is sent again, a lost request is a 503 at once
        self.app = RequestGuard(self._answer, _Settings(settings))
        self._client = None  # an httpx.AsyncClient, made on the server's loop

    async def _answer(self, scope, receive, send) -> None:
        try:
            body = await _body(receive)
        except Exception as e:  # noqa: BLE001 - the guard's refusals (413, 408) are answered as the app does
            refusal = http_answer(e)
            if refusal is None:
                raise
            await _send(send, refusal[0], _json(refusal[1]), {**refusal[2], "content-type": "application/json"})
            return
        status, headers, content = await self.forward(scope, body)
        await _send(send, status, content, headers)

    async def forward(self, scope, body: bytes) -> tuple[int, dict[str, str], bytes]:
        """Ray's proxy's answer to the request, sent again while it was lost (module docstring)."""
        if self._client is None:
            self._client = httpx.AsyncClient(timeout=None, limits=httpx.Limits(max_connections=512))
        method, path = scope["method"], scope["path"]
        url = self.upstream + scope.get("raw_path", path.encode()).decode("latin-1")
        if scope.get("query_string"):
            url += "?" + scope["query_string"].decode("latin-1")
        headers = [(k, v) for k, v in scope.get("headers", ()) if k.lower() not in HOP]
        again = method in ("GET", "HEAD") or (method == "POST" and path in SEARCHES)
        deadline = time.monotonic() + float(self.settings.deadline_ms) / 1e3
        patience = float(self.settings.ready_timeout_s) + RELOAD_S if path == "/v1/admin/reload" else GRACE_S
        wait, tries = RESEND_WAIT_S[0], 0
        while True:
            tries += 1
            try:
                r = await self._client.request(method, url, headers=headers, content=body,
                                               timeout=max(deadline - time.monotonic(), 0.0) + patience)
                if r.status_code < 500 or _theirs(r):
                    return r.status_code, _passed(r), r.content if _theirs(r) or r.status_code < 400 else \
                        _json(f"HTTP {r.status_code} from Ray's proxy: {_gist(r.text)}")
                lost = f"Ray's proxy answered HTTP {r.status_code} ({_gist(r.text)})"
            except httpx.TimeoutException:
                return 504, {"content-type": "application/json"}, _json(
                    f"deadline of {self.settings.deadline_ms:g} ms passed (serve.deadline_ms): no answer from the "
                    "cluster's ingress")
            except httpx.TransportError as e:
                lost = f"the cluster's ingress did not answer ({type(e).__name__})"
                again = again or isinstance(e, httpx.ConnectError)  # never reached the proxy: safe to send again
            if not again or self.stopping or time.monotonic() + wait > deadline:
                return 503, {"content-type": "application/json", "retry-after": str(RETRY_AFTER_S)}, _json(
                    f"unavailable: {lost}; an ingress replica is being replaced ({tries} tries): retry after "
                    f"{RETRY_AFTER_S} s")
            log.warning("door: %s %s: %s; sending it again in %.2f s", method, path, lost, wait)
            await asyncio.sleep(wait)
            wait = min(2 * wait, RESEND_WAIT_S[1])


class DoorServer:
    """The door on uvicorn in a thread of the command, over a socket bound at the start (a taken port is said before
    Ray starts)."""

    def __init__(self, door: Door, sock: socket.socket):
        self.door, self.sock = door, sock
        self.server = uvicorn.Server(uvicorn.Config(door.app, log_level="warning", access_log=False, lifespan="off",
                                                    timeout_keep_alive=KEEP_ALIVE_S,
                                                    http=http_protocol()))
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [sock]}, name="cfir-door",
                                       daemon=True)

    def start(self) -> None:
        self.thread.start()

    def stop(self, timeout_s: float = 30.0) -> None:
        """Answers what it accepted, then closes (uvicorn's graceful stop)."""
        self.door.stopping = True
        if self.thread.is_alive():
            self.server.should_exit = True
            self.thread.join(timeout_s)
        self.sock.close()



async def _body(receive) -> bytes:
    chunks = []
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            break
        chunks.append(message.get("body", b""))
        if not message.get("more_body", False):
            break
    return b"".join(chunks)


def _theirs(r) -> bool:
    """Whether an answer is the service's own: JSON with its "error" (a refusal), or any answer under 400."""
    if r.status_code < 400:
        return True
    try:
        body = json.loads(r.content)
    except ValueError:
        return False
    return isinstance(body, dict) and ("error" in body or "reason" in body)


def _passed(r) -> dict[str, str]:
    headers = {k: v for k, v in r.headers.items() if k.lower().encode() not in HOP}
    if not _theirs(r):
        headers = {"content-type": "application/json"}
    return headers


def _gist(text: str) -> str:
    return " ".join(text.split())[:160] or "no body"


def _json(line: str) -> bytes:
    return json.dumps({"error": line}).encode()


async def _send(send, status: int, content: bytes, headers: dict[str, str]) -> None:
    raw = [(k.encode("latin-1"), v.encode("latin-1")) for k, v in headers.items() if k.lower() != "content-length"]
    raw.append((b"content-length", str(len(content)).encode()))
    await send({"type": "http.response.start", "status": status, "headers": raw})
    await send({"type": "http.response.body", "body": content, "more_body": False})
