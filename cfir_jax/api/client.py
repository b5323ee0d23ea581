"""The service's client: `Client(url).search(text)` answers with the same `Result` as `cfir_jax.open(W).search(text)`,
over HTTP to `retrieve.py --index W --serve` (one process or `--engine ray`: the same API).

    client = cfir_jax.Client("http://127.0.0.1:8080")
    result = client.search("The Eiffel Tower in Paris ...", top_k=5)
    alike = client.search(image="photo.jpg", top_k=5)   # search by picture: bytes, a file, or an indexed id

A busy service answers 503 with `Retry-After`: the client waits that long and asks again, as long as the call's
deadline (`deadline_s`) allows; any other refusal (and a 503 past the deadline) is a `ServiceError`, a `CfirError`
whose message is the service's one-line reason. A search that the service never answered is sent again: the
connection failed mid-request (reset, closed, refused while the service restarts), or a proxy answered a 5xx that is
not the service's own JSON (Ray's HTTP proxy answers a plain-text 500 when the ingress replica holding the request
died). A search is idempotent, so sending it again is safe; the waits between tries grow from 50 ms to 1 s, within
the deadline, past which the call is a one-line `CfirError` naming the last failure. A refused connection is tried
again only once this client has reached the service (a restart); a URL never reached is said at once. The standard
library's HTTP alone: no JAX, no extra dependency.
"""

from __future__ import annotations

import base64
import http.client
import json
import logging
import os
import time
import urllib.error
import urllib.request
from collections.abc import Sequence
from pathlib import Path

from cfir_jax.core.errors import CfirError
from cfir_jax.retrieve.results import Result

__all__ = ["Client", "ServiceError"]

log = logging.getLogger("cfir_jax.client")
RESEND_WAIT_S = (0.05, 1.0)  # the first wait before a search the service never answered is sent again; the longest
PROXY_5XX = (500, 502, 503, 504)  # statuses a proxy answers for a request that its upstream lost


class ServiceError(CfirError):
    """A refusal of the service: its one-line reason, with the HTTP status (and Retry-After, in s, when given)."""

    def __init__(self, reason: str, status: int, retry_after: float | None = None):
        super().__init__(reason)
        self.status, self.retry_after = status, retry_after


class Client:
    """A client of one service at `url` ("http://host:port"); token: sent as `Authorization: Bearer TOKEN` (a
    proxy's, or the admin token); deadline_s: how long a call may take, waits for a busy service included."""

    def __init__(self, url: str, token: str | None = None, *, deadline_s: float = 60.0):
        if not url.startswith(("http://", "https://")):
            raise CfirError(f"{url!r}: the service's URL starts with http:// or https://")
        self.url, self.token, self.deadline_s = url.rstrip("/"), token, float(deadline_s)
        self._reached = False  # whether the service ever answered this client (a refusal after it is a restart)

    def __repr__(self) -> str:
        return f"Client({self.url!r})"

    def search(self, text: str | os.PathLike | None = None, *, image: bytes | str | os.PathLike | None = None,
               top_k: int = 20, method: str | None = None, id: str = "query",  # noqa: A002
               deadline_s: float | None = None) -> Result:
        """The images of one document (`POST /v1/search`; a path is read as a UTF-8 text file, its stem the id), or
        of one picture (`POST /v1/search/image`): `image` is its bytes, a picture file (its stem the id) or the id of
        an indexed image, as `Index.search(image=...)` takes it."""
        if (text is None) == (image is None):
            raise CfirError("give one of text= (a document) or image= (a picture's bytes, file or indexed id)")
        if image is not None:
            answer, version = self._post("/v1/search/image", {**_picture(image), "top_k": top_k}, deadline_s)
            return Result.from_json(answer, version)
        text, id = _text(text, id)
        body = {"text": text, "top_k": top_k, "id": id, **({"method": method} if method else {})}
        answer, version = self._post("/v1/search", body, deadline_s)
        return Result.from_json(answer, version)

    def search_many(self, texts: Sequence[str | os.PathLike], *, top_k: int = 20, method: str | None = None,
                    ids: Sequence[str] | None = None, batch: int = 64, deadline_s: float | None = None
                    ) -> list[Result]:
        """The images of each document, in order (`POST /v1/search/batch`, `batch` documents a request: at most the
        service's serve.max_batch_docs); ids default to "0", "1", ... as `Index.search_many`'s."""
        if isinstance(texts, (str, os.PathLike)):
            raise CfirError("search_many takes a list of documents; search takes one")
        ids = [str(n) for n in range(len(texts))] if ids is None else list(ids)
        if len(ids) != len(texts):
            raise CfirError(f"{len(ids)} ids for {len(texts)} documents")
        docs = [dict(zip(("text", "id"), _text(t, i))) for t, i in zip(texts, ids)]
        out: list[Result] = []
        for at in range(0, len(docs), max(1, batch)):
            body = {"documents": docs[at : at + batch], "top_k": top_k, **({"method": method} if method else {})}
            answer, version = self._post("/v1/search/batch", body, deadline_s)
            out += [Result.from_json(r, version) for r in answer["results"]]
        return out

    def ready(self) -> bool:
        """Whether a search would succeed now (`GET /readyz` 200); False while the service starts, stops or is
        damaged, or cannot be reached."""
        try:
            self._call(urllib.request.Request(f"{self.url}/readyz", headers=self._headers()), time.monotonic() + 10)
        except CfirError:
            return False
        return True

    def _headers(self) -> dict[str, str]:
        headers = {"accept": "application/json"}
        if self.token:
            headers["authorization"] = f"Bearer {self.token}"
        return headers

    def _post(self, path: str, body: dict, deadline_s: float | None) -> tuple[dict, int | None]:
        """The service's JSON answer to a search, and the index version that answered (X-Index-Version): waits
        out a busy service (503 with Retry-After) and sends a search that it never answered again, both within
        the deadline."""
        data = json.dumps(body, ensure_ascii=False).encode()
        request = urllib.request.Request(f"{self.url}{path}", data=data, method="POST",
                                         headers={**self._headers(), "content-type": "application/json"})
        budget = self.deadline_s if deadline_s is None else float(deadline_s)
        deadline, wait, tries = time.monotonic() + budget, RESEND_WAIT_S[0], 0
        while True:
            tries += 1
            try:
                answer, headers = self._call(request, deadline)
                version = headers.get("x-index-version", "")
                return answer, int(version) if version.strip().isdigit() else None
            except ServiceError as e:  # busy: wait as told, within the deadline
                if e.status != 503 or e.retry_after is None or time.monotonic() + e.retry_after >= deadline:
                    raise
                time.sleep(e.retry_after)
            except _Unanswered as e:  # the service never answered it: a search is idempotent, so send it again
                if time.monotonic() + wait >= deadline:
                    raise CfirError(f"{request.full_url}: no answer within the {budget:g} s deadline ({tries} "
                                    f"tries; the last: {e})") from None
                log.info("%s: %s; sending it again in %.2f s", request.full_url, e, wait)
                time.sleep(wait)
                wait = min(2 * wait, RESEND_WAIT_S[1])

    def _call(self, request: urllib.request.Request, deadline: float) -> tuple[dict, http.client.HTTPMessage]:
        """One request, answered within what is left of the deadline: its JSON and headers, or a one-line error
        (`_Unanswered` when the service never answered it)."""
        left = deadline - time.monotonic()
        if left <= 0:
            raise CfirError(f"{request.full_url}: no answer within the deadline")
        try:
            with urllib.request.urlopen(request, timeout=left) as response:
                self._reached = True
                return json.loads(response.read()), response.headers
        except urllib.error.HTTPError as e:
            self._reached = True
            raise _refusal(e) from None
        except urllib.error.URLError as e:  # raised while connecting or sending
            if isinstance(e.reason, ConnectionError) and (self._reached or not isinstance(
                    e.reason, ConnectionRefusedError)):
                raise _Unanswered(f"the connection failed ({_reason(e.reason)})") from None
            raise CfirError(f"{self.url}: cannot reach the service ({_reason(e.reason)})") from None
        except TimeoutError:
            raise CfirError(f"{request.full_url}: no answer within the deadline") from None
        except (ConnectionError, http.client.IncompleteRead) as e:  # while the answer was awaited or read
            raise _Unanswered(f"the connection was closed before the answer ({type(e).__name__})") from None
        except http.client.HTTPException as e:
            raise CfirError(f"{request.full_url}: not an HTTP answer ({type(e).__name__})") from None
        except json.JSONDecodeError:
            raise CfirError(f"{request.full_url}: the answer is not JSON (is this a cfir-jax service?)") from None


class _Unanswered(CfirError):
    """A request that the service never answered: its connection failed, or a proxy answered a 5xx for it."""


def _refusal(e: urllib.error.HTTPError) -> CfirError:
    """The service's one-line reason ({"error": ...}, or /readyz's "reason") of an HTTP error; `_Unanswered` for a
    proxy's 5xx (not the service's JSON, no Retry-After): the request never reached an answer of the service."""
    try:
        body = json.loads(e.read() or b"{}")
    except (json.JSONDecodeError, OSError, http.client.HTTPException, UnicodeDecodeError):
        body = None
    reason = body.get("error") or body.get("reason") if isinstance(body, dict) else None
    retry = e.headers.get("Retry-After") if e.headers else None
    retry_after = float(retry) if retry and retry.strip().isdigit() else None
    if reason is None and retry_after is None and e.code in PROXY_5XX:
        return _Unanswered(f"HTTP {e.code} {e.reason}, not the service's own answer")
    return ServiceError(str(reason or f"HTTP {e.code} {e.reason}"), e.code, retry_after)


def _reason(reason) -> str:
    return getattr(reason, "strerror", None) or str(reason)


def _text(text: str | os.PathLike, doc_id: str) -> tuple[str, str]:
    """(text, id) of a document given as text or as a UTF-8 file (its stem the id, as `retrieve.py --query`)."""
    if isinstance(text, os.PathLike):
        path = Path(text)
        try:
            return path.read_text(encoding="utf-8").strip(), path.stem or "query"
        except (OSError, UnicodeDecodeError) as e:
            raise CfirError(f"{path}: cannot read the document ({e.__class__.__name__})") from None
    if not isinstance(text, str):
        raise CfirError(f"a document is text (str) or a path, got {type(text).__name__}")
    return text, doc_id


def _picture(image: bytes | str | os.PathLike) -> dict:
    """The JSON fields of a picture query, named as `Index.search(image=...)` names its answer: bytes (base64, id
    "query"), a picture file (its stem the id) or an indexed image's id (the id)."""
    if isinstance(image, (bytes, bytearray)):
        return {"image": base64.b64encode(bytes(image)).decode(), "id": "query"}
    if isinstance(image, os.PathLike) or (isinstance(image, str) and Path(image).is_file()):
        path = Path(image)
        try:
            return {"image": base64.b64encode(path.read_bytes()).decode(), "id": path.stem or "query"}
        except OSError as e:
            raise CfirError(f"{path}: cannot read the picture ({e.strerror or e.__class__.__name__})") from None
    if isinstance(image, str):
        return {"image_id": image, "id": image}
    raise CfirError(f"image: expected bytes, a picture file or an indexed image id, got {type(image).__name__}")
