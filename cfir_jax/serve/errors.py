"""The service's refusals as the project's own errors, and the one table that answers each over HTTP.

The Service and the parts under it (`cfir_jax.serve.service`, the image queue, the request guard) raise these, never
an HTTP exception; `STATUSES` says the status of each (and of the library's refusals a search can meet: the query
rule's, an image's, a store's), and `http_answer` makes an error the (status, one line, headers) every door answers
with. Two readers use it: the app's exception handlers (`cfir_jax.serve.app`), and a Ray front, whose refusal crosses
Ray as that triple and is raised again at the gateway as `Refused` (`cfir_jax.cluster.deployments`,
`cfir_jax.cluster.gateway`), so both engines answer a refusal alike.

These errors are not `CfirError`s: a busy queue or a shard down is not the user's input, and code that catches a
user's error (a derived store rebuilt when unusable) must not catch them.
"""

from __future__ import annotations

from cfir_jax.core.errors import CfirError, StoreError, first_line
from cfir_jax.core.query_rule import QueryRefused
from cfir_jax.retrieve.image_query import Expired, QueryImageTooLarge, UnknownImage, UnsupportedImage

__all__ = ["STATUSES", "Busy", "ClientGone", "DeadlinePassed", "Refused", "ServiceError", "Unavailable",
           "answerable", "http_answer"]


class ServiceError(Exception):
    """A request the service does not answer: one line; its status and headers are `STATUSES`'."""

    def headers(self) -> dict[str, str]:
        return {}


class Busy(ServiceError):
    """The queue is full, or the service is stopping: the client may try again after `retry_after` seconds."""

    def __init__(self, reason: str, retry_after: int = 1):
        super().__init__(f"busy: {reason}; retry after {retry_after} s")
        self.retry_after = int(retry_after)

    def headers(self) -> dict[str, str]:
        return {"Retry-After": str(self.retry_after)}


class DeadlinePassed(ServiceError):
    """serve.deadline_ms passed before the request was answered (or its batch dropped it)."""


class ClientGone(ServiceError):
    """The client closed the request before its answer: nobody reads it."""

    def __init__(self, line: str = "client closed the request"):
        super().__init__(line)


class Unavailable(ServiceError):
    """A part the request needs cannot answer now (a shard down, a front gone): the service answers 503 naming it."""


class Refused(ServiceError):
    """A refusal with its own status: the request's form (an empty batch, a body over its bound or stalled, an upload
    malformed, the admin endpoint's token), or a front's answer raised again at the gateway."""

    def __init__(self, line: str, status: int, headers: dict[str, str] | None = None):
        super().__init__(line)
        self.status, self._headers = int(status), dict(headers or {})

    def headers(self) -> dict[str, str]:
        return dict(self._headers)


# The one table: each error a request can meet and its HTTP status, the first that matches (a subclass before its
# base); None: the error's own `status`. Its one line is the error's first line.
STATUSES: tuple[tuple[type[BaseException], int | None], ...] = (
    (Refused, None),
    (QueryRefused, None),  # the one rule of a query (and a filter): 413 or 422
    (Busy, 503),  # with Retry-After
    (DeadlinePassed, 504),
    (Expired, 504),  # an image search stopped at its next stage past the deadline
    (ClientGone, 499),
    (Unavailable, 503),
    (StoreError, 503),  # damage on disk met by a query (CorruptStore), a store gone: /readyz says so too
    (QueryImageTooLarge, 413),
    (UnsupportedImage, 415),  # a format outside the allow-list (cfir_jax.data.image_decode.FORMATS), unread
    (UnknownImage, 404),
    (CfirError, 422),  # any other refusal of what the request gave (an image that does not decode)
)


def http_answer(e: BaseException) -> tuple[int, str, dict[str, str]] | None:
    """(status, its one line, headers) of an error the table knows; None for any other (an internal error: 500)."""
    for kind, status in STATUSES:
        if isinstance(e, kind):
            headers = e.headers() if isinstance(e, ServiceError) else {}
            return (int(e.status) if status is None else status), first_line(e), headers  # type: ignore[attr-defined]
    return None


def answerable(e: BaseException) -> Exception:
    """e as a request may be answered with it: an Exception as it is; SystemExit, KeyboardInterrupt or another
    BaseException that a worker thread met (and that the awaiting handler's task would raise out of the event loop)
    as a RuntimeError that names it, answered 500 with an id."""
    if isinstance(e, Exception):
        return e
    error = RuntimeError(f"the engine raised {type(e).__name__}" + (f": {first_line(e)}" if str(e) else ""))
    error.__cause__ = e
    return error
