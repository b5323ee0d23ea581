"""The service's refusals (`cfir_jax/serve/errors.py`): each error a request can meet has one HTTP answer in the one
table (status, one line, headers), and a refusal that crosses Ray as that answer and is raised again at the gateway
(`Refused`) is answered exactly as the front answered it."""

import pytest

from cfir_jax.core.errors import CfirError, StoreError, first_line
from cfir_jax.core.query_rule import QueryRefused
from cfir_jax.retrieve.filters import FilterError
from cfir_jax.retrieve.image_query import Expired, QueryImageTooLarge, UnknownImage, UnusableImage
from cfir_jax.serve.errors import Busy, ClientGone, DeadlinePassed, Refused, Unavailable, http_answer
from cfir_jax.stores.integrity import CorruptStore

ANSWERS = [
    (Busy("3 documents are waiting (serve.queue_size=3)", 2), 503,
     "busy: 3 documents are waiting (serve.queue_size=3); retry after 2 s", {"Retry-After": "2"}),
    (DeadlinePassed("deadline of 50 ms passed (serve.deadline_ms)"), 504, "deadline of 50 ms passed "
     "(serve.deadline_ms)", {}),
    (ClientGone(), 499, "client closed the request", {}),
    (Unavailable("shard 1 unavailable: no answer in 2 s\n(Ray's traceback)"), 503, "shard 1 unavailable: no answer "
     "in 2 s", {}),
    (Refused("documents is empty", 422), 422, "documents is empty", {}),
    (QueryRefused("text is 9 bytes, over serve.max_text_bytes=8", 413), 413, "text is 9 bytes, over "
     "serve.max_text_bytes=8", {}),
    (FilterError("filter 'x=1': unknown field 'x' (the images' fields: date)"), 422,
     "filter 'x=1': unknown field 'x' (the images' fields: date)", {}),
    (CorruptStore("W/image_cache/embeddings.npy: checksum mismatch\nmore"), 503,
     "W/image_cache/embeddings.npy: checksum mismatch", {}),
    (StoreError("W/fields: missing"), 503, "W/fields: missing", {}),
    (QueryImageTooLarge("the image has 90,000,000 pixels"), 413, "the image has 90,000,000 pixels", {}),
    (UnknownImage("no live image has the id 'x'"), 404, "no live image has the id 'x'", {}),
    (Expired("the deadline passed before the search's next stage"), 504,
     "the deadline passed before the search's next stage", {}),
    (UnusableImage("the image does not decode"), 422, "the image does not decode", {}),
    (CfirError("anything else the request gave"), 422, "anything else the request gave", {}),
]


@pytest.mark.parametrize("error, status, line, headers", ANSWERS, ids=[type(a[0]).__name__ for a in ANSWERS])
def test_each_refusal_has_one_answer_in_the_table(error, status, line, headers):
    assert http_answer(error) == (status, line, headers)


@pytest.mark.parametrize("error", [a[0] for a in ANSWERS], ids=[type(a[0]).__name__ for a in ANSWERS])
def test_a_fronts_refusal_raised_again_at_the_gateway_is_answered_alike(error):
    status, line, headers = http_answer(error)  # what crosses Ray (cfir_jax.cluster.deployments)
    assert http_answer(Refused(line, status, headers)) == (status, line, headers)  # cfir_jax.cluster.gateway's


def test_an_internal_error_is_not_in_the_table():
    assert http_answer(RuntimeError("bug")) is None and http_answer(KeyError("x")) is None


def test_the_services_errors_are_not_the_users():
    """Code that catches a user's error (a derived store rebuilt when unusable) must not catch a busy queue."""
    for error in (Busy("x"), DeadlinePassed("x"), ClientGone(), Unavailable("x"), Refused("x", 409)):
        assert not isinstance(error, CfirError)


def test_first_line_is_an_errors_one_line():
    assert first_line(ValueError("one\ntwo")) == "one" and first_line(ValueError("")) == "ValueError"
    assert first_line(ValueError("  padded  \nx")) == "padded" and first_line(ValueError("abcdef"), 3) == "abc"
    remote = RuntimeError("ray::Front.answer() (pid=1)\n  traceback ...")
    remote.cause = CfirError("the real reason")  # Ray's errors carry the remote one in `cause`
    assert first_line(remote) == "the real reason"
