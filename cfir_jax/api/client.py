"""The service's client: `Client(url).search(text)` answers with the same `Result` as `cfir_jax.open(W).search(text)`,
over HTTP to `retrieve.py --index W --serve` (one process or `--engine ray`: the same API).

    client = cfir_jax.Client("http://127.0.0.1:8080")
    result = client.search("The Eiffel Tower in Paris ...", top_k=5)
    alike = client.search(image="photo.jpg", top_k=5)       # search by image: its bytes or a file
    same = client.search(image_id="img0000013", top_k=5)     # or an indexed image's id (never read as a file)

A busy service answers 503 with `Retry-After`: the client waits that long (at least RETRY_AFTER_MIN_S) and asks
again, as long as the call's deadline (`deadline_s`) allows; any other refusal (and a 503 past the deadline) is a
`ServiceError`, a `CfirError` whose message is the service's one-line reason. An answer the service sent before the
client had sent the whole body (a 413 for an image over its limit) is read and raised at once: the body is not sent
on, and never sent again. A search that the service never answered is sent again: the connection failed
mid-request (reset, closed, refused while the service restarts), or a proxy answered a 5xx that is not the service's
own JSON (Ray's HTTP proxy answers a plain-text 500 when the ingress replica holding the request died). A search is
idempotent, so sending it again is safe; the waits between tries grow from 50 ms to 1 s, within the deadline, past
which the call is a one-line `CfirError` naming the last failure. A refused connection is tried again only once this
client has reached the service (a restart); a URL never reached is said at once.

The token goes to the service's own origin only: a redirect to another scheme, host or port (https to http
included) is refused in one line, never followed. A query is held to the rule every door applies
(`cfir_jax.core.query_rule`) before it is sent, as far as the client can hold it without the service's settings
(the size and top_k's range are the service's to check). The standard library's HTTP alone: no JAX, no extra
dependency; no proxy from the environment is used. The transport (`cfir_jax.api.transport`) holds a call to its one
deadline, connection, TLS handshake, sends and every read included, and speaks https (TLS 1.2 and 1.3) against the
environment's trust store and a CA the caller gives (`ca=`).
"""

from __future__ import annotations

import base64
import email.utils
import http.client
import json
import logging
import math
import os
import ssl
import time
import urllib.parse
from collections.abc import Sequence
from pathlib import Path

from cfir_jax.api.transport import Unanswered as _Unanswered
from cfir_jax.api.transport import bad_target, exchange, tls_context
from cfir_jax.api.transport import reason as _reason
from cfir_jax.core.errors import CfirError, first_line
from cfir_jax.core.query_rule import (
    QUERY_KINDS,
    Query,
    check_facets,
    check_id,
    check_lang,
    check_text,
    check_top_k,
    conditions,
)
from cfir_jax.retrieve.results import Result

__all__ = ["Client", "ServiceError"]

log = logging.getLogger("cfir_jax.client")
RESEND_WAIT_S = (0.05, 1.0)  # the first wait before a search the service never answered is sent again; the longest
RETRY_AFTER_MIN_S = 0.5  # the shortest wait a 503's Retry-After gets (0 would ask again in a tight loop)
PROXY_5XX = (500, 502, 503, 504)  # statuses a proxy answers for a request that its upstream lost
MAX_REDIRECTS = 5  # redirects followed within the service's own origin


class ServiceError(CfirError):
    """A refusal of the service: its one-line reason, with the HTTP status (and Retry-After, in s, when given)."""

    def __init__(self, reason: str, status: int, retry_after: float | None = None):
        super().__init__(reason)
        self.status, self.retry_after = status, retry_after


class Client:
    """A client of one service at `url` ("http://host:port", or "https://..."); token: sent as `Authorization:
    Bearer TOKEN` to that origin only (a proxy's, or the admin token); deadline_s: how long a call may take, all of
    it (connecting, sending, every read, the waits for a busy service and the tries again); ca: for https, a CA file
    (PEM) trusted beside the environment's trust store (a service with a self-signed certificate), or the
    `ssl.SSLContext` to use as it stands."""

    def __init__(self, url: str, token: str | None = None, *, deadline_s: float = 60.0,
                 ca: str | os.PathLike | ssl.SSLContext | None = None):
        if not isinstance(url, str) or not url.startswith(("http://", "https://")) or not _host(url):
            raise CfirError(f"{url!r}: the service's URL starts with http:// or https:// and names a host")
        self.url, self.token, self.deadline_s = url.rstrip("/"), token, float(deadline_s)
        self._tls = tls_context(ca) if url.startswith("https://") or ca is not None else None
        self._origin = _origin(self.url)
        self._reached = False  # whether the service ever answered this client (a refusal after it is a restart)

    def __repr__(self) -> str:
        return f"Client({self.url!r})"

    def search(self, text: str | os.PathLike | Query | None = None, *,
               image: bytes | str | os.PathLike | None = None, image_id: str | None = None, top_k: int = 20,
               id: str = "query", deadline_s: float | None = None, lang: str | None = None,
               where: Sequence | None = None) -> Result:  # noqa: A002
        """The images of one document (`POST /v1/search`; a path is read as a UTF-8 text file, its stem the id; `lang`
        its language, None: the service finds it; `where`: filters on the images' fields, docs/filters.md), or
        of one image (`POST /v1/search/image`): `image` is its bytes or an image file (its stem the id),
        `image_id` the id of an indexed image, as `Index.search` takes them; or of a `Query`
        (`cfir_jax.core.query_rule`), which also says the method and whether near-duplicates are folded (`fold`,
        on here: each hit shown with its near-duplicates under it, `Hit.duplicates`, docs/duplicates.md) and the
        fields whose values are counted over every image ranked (`facets`: `Result.facets`, docs/filters.md)."""
        method, fold, facets = None, True, ()
        if isinstance(text, Query):
            q = text
            text, image, image_id, top_k, lang, where = q.text, q.image, q.image_id, q.top_k, q.lang, q.where
            id, method, fold, facets = q.id or id, q.method, q.fold, q.facets  # noqa: A001
        if sum(x is not None for x in (text, image, image_id)) != 1:
            raise CfirError(QUERY_KINDS)
        counted = {"facets": list(check_facets(facets))} if facets else {}
        if text is None:
            body = {**_image(image, image_id), "top_k": check_top_k(top_k),
                    **({"where": _where(where)} if where else {}), **({} if fold else {"fold": False}), **counted}
            answer, version = self._post("/v1/search/image", body, deadline_s)
            return _result(answer, version, f"{self.url}/v1/search/image")
        text, id = _text(text, id)
        body = {"text": text, "top_k": check_top_k(top_k), "id": id, **({"method": method} if method else {}),
                **({"lang": check_lang(lang)} if lang is not None else {}),
                **({"where": _where(where)} if where else {}), **({} if fold else {"fold": False}), **counted}
        answer, version = self._post("/v1/search", body, deadline_s)
        return _result(answer, version, f"{self.url}/v1/search")

    def search_many(self, texts: Sequence[str | os.PathLike], *, top_k: int = 20, method: str | None = None,
                    ids: Sequence[str] | None = None, batch: int = 64, deadline_s: float | None = None,
                    where: Sequence | None = None, fold: bool = True) -> list[Result]:
        """The images of each document, in order (`POST /v1/search/batch`, `batch` documents a request: at most the
        service's serve.max_batch_docs); ids default to "0", "1", ... as `Index.search_many`'s; where, fold: as
        `search`'s (facets: a `Query` each through `search`, or `"facets"` in POST /v1/search/batch)."""
        if isinstance(texts, (str, os.PathLike)):
            raise CfirError("search_many takes a list of documents; search takes one")
        ids = [str(n) for n in range(len(texts))] if ids is None else list(ids)
        if len(ids) != len(texts):
            raise CfirError(f"{len(ids)} ids for {len(texts)} documents")
        docs = [dict(zip(("text", "id"), _text(t, i))) for t, i in zip(texts, ids)]
        check_top_k(top_k)
        out: list[Result] = []
        for at in range(0, len(docs), max(1, batch)):
            chunk = docs[at : at + batch]
            body = {"documents": chunk, "top_k": top_k, **({"method": method} if method else {}),
                    **({"where": _where(where)} if where else {}), **({} if fold else {"fold": False})}
            answer, version = self._post("/v1/search/batch", body, deadline_s)
            results = answer.get("results") if isinstance(answer, dict) else None
            if not isinstance(results, list) or len(results) != len(chunk):
                raise CfirError(f"{self.url}/v1/search/batch: the answer is not {len(chunk)} search results; is this "
                                "a cfir-jax service?")
            out += [_result(r, version, f"{self.url}/v1/search/batch") for r in results]
        return out

    def ready(self) -> bool:
        """Whether a search would succeed now (`GET /readyz` 200); False while the service starts, stops or is
        damaged, or cannot be reached."""
        try:
            self._call("GET", "/readyz", None, time.monotonic() + 10)
        except CfirError:
            return False
        return True

    def _headers(self, url: str) -> dict[str, str]:
        headers = {"accept": "application/json", "user-agent": "cfir-jax-client"}
        if self.token and _origin(url) == self._origin:  # never to another origin (a redirect's is refused anyway)
            headers["authorization"] = f"Bearer {self.token}"
        return headers

    def _post(self, path: str, body: dict, deadline_s: float | None) -> tuple[object, int | None]:
        """The service's JSON answer to a search, and the index version that answered (X-Index-Version): waits
        out a busy service (503 with Retry-After) and sends a search that it never answered again, both within
        the deadline."""
        data = json.dumps(body).encode()  # ASCII: a text's every character escaped as JSON allows
        budget = self.deadline_s if deadline_s is None else float(deadline_s)
        deadline, wait, tries = time.monotonic() + budget, RESEND_WAIT_S[0], 0
        while True:
            tries += 1
            try:
                answer, headers = self._call("POST", path, data, deadline)
                version = headers.get("x-index-version", "")
                return answer, int(version) if version.strip().isdigit() else None
            except ServiceError as e:  # busy: wait as told, within the deadline
                if e.status != 503 or e.retry_after is None or time.monotonic() + e.retry_after >= deadline:
                    raise
                time.sleep(e.retry_after)
            except _Unanswered as e:  # the service never answered it: a search is idempotent, so send it again
                if time.monotonic() + wait >= deadline:
                    raise CfirError(f"{self.url}{path}: no answer within the {budget:g} s deadline ({tries} "
                                    f"tries; the last: {e})") from None
                log.info("%s%s: %s; sending it again in %.2f s", self.url, path, e, wait)
                time.sleep(wait)
                wait = min(2 * wait, RESEND_WAIT_S[1])

    def _call(self, method: str, path: str, data: bytes | None, deadline: float
              ) -> tuple[object, http.client.HTTPMessage]:
        """One request, answered within what is left of the deadline, following redirects within the service's
        origin: its JSON and headers, or a one-line error (`_Unanswered` when the service never answered it)."""
        url = f"{self.url}{path}"
        for _ in range(MAX_REDIRECTS + 1):
            status, reason, headers, raw = self._exchange(method, url, data, deadline)
            if status in (301, 302, 303, 307, 308) and headers.get("location"):
                url = self._redirect(url, headers["location"], status, method)
                continue
            if status >= 400:
                raise _refusal(status, reason, headers, raw)
            if status >= 300:
                raise CfirError(f"{url}: the service answered HTTP {status} {reason}, not a search's answer")
            try:
                return json.loads(raw), headers
            except (json.JSONDecodeError, UnicodeDecodeError):
                raise CfirError(f"{url}: the answer is not JSON (is this a cfir-jax service?)") from None
        raise CfirError(f"{self.url}{path}: more than {MAX_REDIRECTS} redirects")

    def _redirect(self, url: str, location: str, status: int, method: str) -> str:
        """Where a redirect from `url` leads, refused in one line off the service's origin (scheme, host, port):
        the token is for it alone. A search (a POST) follows only a redirect that keeps it one (307, 308)."""
        target = urllib.parse.urljoin(url, location.strip())
        why = bad_target(target)
        if why is not None:
            raise CfirError(f"{url}: the service redirected to {target[:200]!r}, not a URL ({why}); not followed")
        if _origin(target) != self._origin:
            shown = urllib.parse.urlunsplit(urllib.parse.urlsplit(target)[:3] + ("", ""))[:200]
            raise CfirError(f"{url}: the service redirected to {shown}, another origin than {self.url}; not followed "
                            "(the client sends its token to the service's own origin only)")
        if method != "GET" and status not in (307, 308):
            raise CfirError(f"{url}: the service answered HTTP {status} (a redirect to {target[:200]}) to a search; a "
                            "search is not sent as a GET")
        return target

    def _exchange(self, method: str, url: str, data: bytes | None, deadline: float
                  ) -> tuple[int, str, http.client.HTTPMessage, bytes]:
        """One HTTP exchange within the deadline (`cfir_jax.api.transport`): (status, reason, headers, body)."""
        answer = exchange(method, url, self._headers(url), data, deadline, tls=self._tls, service=self.url,
                          reached=self._reached)
        self._reached = True
        return answer


def _refusal(status: int, reason: str, headers: http.client.HTTPMessage, raw: bytes) -> CfirError:
    """The service's one-line reason ({"error": ...}, or /readyz's "reason") of an HTTP error; `_Unanswered` for a
    proxy's 5xx (not the service's JSON, no Retry-After): the request never reached an answer of the service."""
    try:
        body = json.loads(raw or b"{}")
    except (json.JSONDecodeError, UnicodeDecodeError):
        body = None
    found = body.get("error") or body.get("reason") if isinstance(body, dict) else None
    retry_after = _retry_after(headers.get("Retry-After"))
    if found is None and retry_after is None and status in PROXY_5XX:
        return _Unanswered(f"HTTP {status} {reason}, not the service's own answer")
    line = first_line(str(found), 2000) if found is not None and str(found).strip() else f"HTTP {status} {reason}"
    return ServiceError(line, status, retry_after)


def _retry_after(value: str | None) -> float | None:
    """A Retry-After header in seconds (delta-seconds or an HTTP date), at least RETRY_AFTER_MIN_S; None when absent
    or unreadable."""
    if not value:
        return None
    try:
        seconds = float(value.strip())
    except ValueError:
        try:
            seconds = email.utils.parsedate_to_datetime(value).timestamp() - time.time()
        except (TypeError, ValueError, IndexError, OverflowError):
            return None
    return max(seconds, RETRY_AFTER_MIN_S) if math.isfinite(seconds) else None


def _result(answer: object, version: int | None, where: str) -> Result:
    """The record of one search's answer, or one line saying the answer is not one."""
    try:
        if not isinstance(answer, dict):
            raise TypeError(f"a JSON {type(answer).__name__}, not an object")
        return Result.from_json(answer, version)
    except (KeyError, TypeError, ValueError, AttributeError) as e:
        what = f"no {e.args[0]!r}" if isinstance(e, KeyError) else first_line(e, 120)
        raise CfirError(f"{where}: the answer is not a search result ({what}); is this a cfir-jax service?") from None


def _host(url: str) -> str | None:
    try:
        return urllib.parse.urlsplit(url).hostname
    except ValueError:
        return None


def _origin(url: str) -> tuple[str, str, int]:
    """(scheme, host, port) of a URL, the port its scheme's default when none is given."""
    parts = urllib.parse.urlsplit(url)
    try:
        port = parts.port
    except ValueError:
        port = -1
    return parts.scheme.lower(), (parts.hostname or "").lower(), port or (443 if parts.scheme == "https" else 80)


def _text(text: str | os.PathLike, doc_id: str) -> tuple[str, str]:
    """(text, id) of a document given as text or as a UTF-8 file (its stem the id, as `retrieve.py --query`), held
    to the rule of a query's text (its size is the service's to check)."""
    if isinstance(text, os.PathLike):
        path = Path(text)
        try:
            read = path.read_text(encoding="utf-8")
        except (OSError, ValueError) as e:  # missing, a name too long or with a NUL, not UTF-8
            raise CfirError(f"{str(path)[:200]}: cannot read the document ({_reason(e)})") from None
        check_text(read, f"{path}: query file")
        return read, path.stem or "query"
    check_text(text, "text")
    return text, check_id(doc_id, "id")


def _image(image: bytes | str | os.PathLike | None, image_id: str | None) -> dict:
    """The JSON fields of an image query, named as `Index.search` names its answer: bytes (base64, id "query"), an
    image file (its stem the id) or an indexed image's id (the id; never read as a file)."""
    if image_id is not None:
        if not isinstance(image_id, str):
            raise CfirError(f"image_id: expected an indexed image's id (str), got {type(image_id).__name__}")
        return {"image_id": image_id, "id": image_id}
    if isinstance(image, (bytes, bytearray, memoryview)):
        return {"image": base64.b64encode(bytes(image)).decode(), "id": "query"}
    if isinstance(image, (str, os.PathLike)):
        path = Path(image)
        try:
            return {"image": base64.b64encode(path.read_bytes()).decode(), "id": path.stem or "query"}
        except (OSError, ValueError) as e:  # missing, a folder, a name too long or with a NUL
            raise CfirError(f"{str(path)[:200]}: cannot read the image ({_reason(e)})") from None
    raise CfirError(f"image: expected an image's bytes or an image file, got {type(image).__name__}")


def _where(where: Sequence) -> list[list]:
    """Filters as they cross the wire: each condition a JSON triple (`cfir_jax.core.query_rule.Condition.to_json`), a
    line parsed here, once, a triple's values sent verbatim (the service never parses them again)."""
    return [c.to_json() for c in conditions(where)]
