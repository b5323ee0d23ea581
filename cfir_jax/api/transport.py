"""The client's transport (`cfir_jax.api.client`): one HTTP exchange, over TLS where the URL says https, held to the
call's one deadline.

- The deadline bounds the whole exchange: the connection (its TLS handshake included), every send and every read
  each wait at most what is left of it, so a server that trickles its answer a byte at a time cannot hold a call past
  it (a timeout per socket operation restarts with each byte). Resolving the host's name is the system's and is not
  bounded by it.
- A body is sent in chunks, and before each one an answer that has really arrived (a 413 sent as soon as the headers
  were read) is looked for without blocking; when there is one, the body is not sent on. Over TLS the raw socket's
  readability says nothing: a TLS 1.3 server sends session tickets after the handshake, which make the socket
  readable with no answer in them. So the TLS layer is asked: bytes it holds decrypted, then a non-blocking read of
  one byte, kept for the answer; a read that finds records without data (the tickets) is no answer.
- TLS checks the server's certificate and name against the environment's trust store (OpenSSL's default paths, and
  SSL_CERT_FILE / SSL_CERT_DIR where set) and the CA file a client is given (`Client(url, ca=...)`), or against the
  `ssl.SSLContext` it is given, as it stands.
"""

from __future__ import annotations

import http.client
import io
import os
import re
import select
import socket
import ssl
import time
import urllib.parse

from cfir_jax.core.errors import CfirError

SEND_CHUNK = 1 << 16  # a body is sent in chunks, and an answer that arrives before its end is read at once
NOT_IN_A_TARGET = re.compile(r"[\x00-\x20\x7f]")  # what http.client refuses in a request's target (spaces included)


class Unanswered(CfirError):
    """A request that the service never answered: its connection failed, or a proxy answered a 5xx for it."""


def tls_context(ca: str | os.PathLike | ssl.SSLContext | None) -> ssl.SSLContext:
    """The TLS settings of a client: `ca` as it stands when an SSLContext; else the environment's trust store and the
    peer's name checked, with the certificates of the CA file `ca` trusted beside them (a self-signed service's)."""
    if isinstance(ca, ssl.SSLContext):
        return ca
    context = ssl.create_default_context()
    if ca is not None:
        try:
            context.load_verify_locations(cafile=os.fspath(ca))
        except (OSError, ssl.SSLError, TypeError, ValueError) as e:
            raise CfirError(f"ca={str(ca)[:200]}: cannot read CA certificates from it ({reason(e)}); give a PEM file "
                            "or an ssl.SSLContext") from None
    return context


def bad_target(url: str) -> str | None:
    """Why a URL cannot be asked (a space or a control character in it, a port that is no number), or None."""
    try:
        parts = urllib.parse.urlsplit(url)
        parts.port  # noqa: B018 - read for its ValueError
    except ValueError as e:
        return str(e)
    if NOT_IN_A_TARGET.search(url):
        return "a space or a control character in it"
    return None


def exchange(method: str, url: str, headers: dict[str, str], data: bytes | None, deadline: float, *,
             tls: ssl.SSLContext | None, service: str, reached: bool
             ) -> tuple[int, str, http.client.HTTPMessage, bytes]:
    """One HTTP exchange with `url` before `deadline` (time.monotonic): (status, reason, headers, body). `service`
    names the service in a refusal to connect; `reached`: whether it answered this client before (a refused
    connection is then a restart: `Unanswered`). An answer that arrives while the body is being sent is read at once,
    and so is one the service sent before a send failed (the body is not sent on)."""
    why = bad_target(url)
    if why is not None:
        raise CfirError(f"{url[:200]!r}: not a URL the client can ask ({why})")
    parts = urllib.parse.urlsplit(url)
    try:
        timed = _connect(parts, deadline, tls, service, reached)
    except TimeoutError:
        raise CfirError(f"{service}: cannot reach the service (no connection within the deadline)") from None
    kind = http.client.HTTPSConnection if parts.scheme == "https" else http.client.HTTPConnection
    conn = kind(parts.hostname, parts.port)
    conn.sock = timed  # connected here, within the deadline; http.client writes the request and reads the answer
    try:
        failed = _send(conn, timed, method, urllib.parse.urlunsplit(("", "", parts.path or "/", parts.query, "")),
                       headers, data)
        try:
            response = conn.getresponse()
            raw = response.read()
        except (ConnectionError, http.client.IncompleteRead, http.client.RemoteDisconnected) as e:
            if failed is not None:  # the send failed and nothing was answered
                raise Unanswered(f"the connection failed ({reason(failed)})") from None
            raise Unanswered(f"the connection was closed before the answer ({type(e).__name__})") from None
        except http.client.HTTPException as e:
            raise CfirError(f"{url}: not an HTTP answer ({type(e).__name__})") from None
        except TimeoutError:
            raise
        except OSError as e:  # a TLS alert, a failed read
            raise Unanswered(f"the connection failed ({reason(e)})") from None
        return response.status, response.reason, response.headers, raw
    except TimeoutError:
        raise CfirError(f"{url}: no answer within the deadline") from None
    finally:
        timed.sock.close()


def _connect(parts: urllib.parse.SplitResult, deadline: float, tls: ssl.SSLContext | None, service: str,
             reached: bool) -> _Timed:
    """A socket connected to the URL's host (TLS for https, its handshake done) within the deadline."""
    https = parts.scheme == "https"
    left = deadline - time.monotonic()
    if left <= 0:
        raise TimeoutError("the deadline passed")
    try:
        raw = socket.create_connection((parts.hostname, parts.port or (443 if https else 80)), timeout=left)
    except ConnectionError as e:
        if reached or not isinstance(e, ConnectionRefusedError):
            raise Unanswered(f"the connection failed ({reason(e)})") from None
        raise CfirError(f"{service}: cannot reach the service ({reason(e)})") from None
    except TimeoutError:
        raise
    except OSError as e:  # a name that does not resolve, no route
        raise CfirError(f"{service}: cannot reach the service ({reason(e)})") from None
    if not https:
        return _Timed(raw, deadline)
    try:
        raw.settimeout(max(deadline - time.monotonic(), 1e-3))  # the handshake's whole wait, not each read's
        return _Timed((tls or tls_context(None)).wrap_socket(raw, server_hostname=parts.hostname), deadline)
    except TimeoutError:
        raw.close()
        raise
    except (ssl.SSLError, ssl.CertificateError, OSError) as e:  # a certificate refused, a protocol not spoken
        raw.close()
        if isinstance(e, ConnectionError) and reached:
            raise Unanswered(f"the connection failed ({reason(e)})") from None
        raise CfirError(f"{service}: cannot reach the service over TLS ({reason(e)})") from None


class _Timed:
    """A connected socket (TLS or not) whose every send and read waits at most what is left of `deadline`; what is
    read early, while the body is sent, is kept for the answer's reader. http.client drives it as its `sock`."""

    def __init__(self, sock: socket.socket, deadline: float):
        self.sock, self.deadline, self._early = sock, deadline, b""

    def _wait(self) -> None:
        left = self.deadline - time.monotonic()
        if left <= 0:
            raise TimeoutError("the deadline passed")
        self.sock.settimeout(left)

    def sendall(self, data) -> None:
        view = memoryview(data).cast("B")
        while view:
            self._wait()
            view = view[self.sock.send(view):]

    def recv_into(self, buffer) -> int:
        if self._early:
            n = min(len(buffer), len(self._early))
            buffer[:n], self._early = self._early[:n], self._early[n:]
            return n
        self._wait()
        return self.sock.recv_into(buffer)

    def makefile(self, mode: str = "rb", *args, **kwargs) -> io.BufferedReader:
        return io.BufferedReader(_Reader(self))

    def close(self) -> None:
        """Nothing: `exchange` closes the socket once the answer is read (http.client closes it before then)."""

    def answered(self) -> bool:
        """Whether the server has sent something (an answer, or the connection's end) yet, without waiting."""
        sock = self.sock
        if self._early or (isinstance(sock, ssl.SSLSocket) and sock.pending()):
            return True
        if not select.select([sock], [], [], 0)[0]:
            return False
        if not isinstance(sock, ssl.SSLSocket):
            return True
        sock.setblocking(False)
        try:
            self._early = sock.recv(1)  # b"": the server closed (what it sent before is read then)
        except (ssl.SSLWantReadError, ssl.SSLWantWriteError):
            return False  # records without data: TLS 1.3's session tickets
        except OSError:
            return True  # a failed connection: the answer's read says how
        return True


class _Reader(io.RawIOBase):
    """The answer's bytes as a file, for http.client's response."""

    def __init__(self, timed: _Timed):
        super().__init__()
        self.timed = timed

    def readable(self) -> bool:
        return True

    def readinto(self, buffer) -> int:
        return self.timed.recv_into(buffer)


def _send(conn: http.client.HTTPConnection, timed: _Timed, method: str, target: str, headers: dict,
          data: bytes | None) -> OSError | None:
    """Sends the request; stops sending its body when the service answers before its end. Returns the error that
    ended a failed send (a reset, a closed pipe: the service may still have answered first), else None."""
    try:
        conn.putrequest(method, target, skip_accept_encoding=True)
        for key, value in {**headers, **({"content-type": "application/json"} if data is not None else {})}.items():
            conn.putheader(key, value)
        if data is not None:
            conn.putheader("content-length", str(len(data)))
        conn.endheaders()
        body = memoryview(data or b"")
        for at in range(0, len(body), SEND_CHUNK):
            if timed.answered():  # an answer (a refusal) before the body's end: read it
                break
            timed.sendall(body[at : at + SEND_CHUNK])
    except TimeoutError:
        raise
    except OSError as e:
        return e
    return None


def reason(error) -> str:
    """An error's words: its strerror, else its text, else its kind."""
    return getattr(error, "strerror", None) or str(error) or type(error).__name__
