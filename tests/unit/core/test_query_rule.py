"""The one rule of a query (cfir_jax/core/query_rule.py), which every door applies: a text is refused in one line for
its type, its size (413), a lone surrogate, a control character or nothing but whitespace, and otherwise searched as
its NFC form, stripped; top_k is an int in range; an id is valid Unicode. Properties over any text (hypothesis): the
rule never raises anything but its refusal, its answer is a fixed point, and the size is counted in UTF-8 bytes."""

import re
import unicodedata

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from cfir_jax.core.errors import CfirError
from cfir_jax.core.query_rule import QueryRefused, check_id, check_text, check_top_k

QUICK = settings(max_examples=150, deadline=None, database=None)


@pytest.mark.parametrize("text, status, refusal", [
    (5, 422, "text is int, expected text (str)"),
    (b"bytes", 422, "text is bytes, expected text (str)"),
    ("   \n\t\f\v ", 422, "text is empty"),
    ("", 422, "text is empty"),
    ("a\x00b", 422, "text is binary (control character U+0000 at character 1), expected plain text"),
    ("ok\x1b[31m", 422, "text is binary (control character U+001B at character 2), expected plain text"),
    ("del\x7f", 422, "text is binary (control character U+007F at character 3), expected plain text"),
    ("a\ud83db", 422, "text is not valid Unicode (a lone surrogate, U+D83D, at character 1)"),
    ("x" * 11, 413, "text is 11 bytes, over serve.max_text_bytes=10"),
    ("\u00e9" * 6, 413, "text is 12 bytes, over serve.max_text_bytes=10"),  # bytes of UTF-8, not characters
])
def test_a_text_the_rule_refuses_is_one_line_with_its_status(text, status, refusal):
    with pytest.raises(QueryRefused) as refused:
        check_text(text, "text", 10)
    assert str(refused.value) == refusal and refused.value.status == status
    assert isinstance(refused.value, CfirError)


def test_a_text_is_searched_as_its_nfc_form_stripped():
    assert check_text("  Cafe\u0301 in Zu\u0308rich\r\n\f", "text", 100) == "Caf\u00e9 in Z\u00fcrich"
    assert check_text("tab\tand\nlines\vand\fform feeds", "text", 100) == "tab\tand\nlines\vand\fform feeds"
    assert check_text("x" * 10, "text", 10) == "x" * 10  # the limit itself passes
    assert check_text("x" * 5000, "text") == "x" * 5000  # no limit: the client's check


@pytest.mark.parametrize("top_k, most, refusal", [
    (0, 20, "top_k=0 out of range: 1 .. 20"),
    (21, 20, "top_k=21 out of range: 1 .. 20"),
    (True, 20, "top_k=True: an integer"),
    ("3", 20, "top_k='3': an integer"),
    (2.0, 20, "top_k=2.0: an integer"),
    (None, 20, "top_k=None: an integer"),
    (10**300, 20, "top_k=a number of about 301 digits out of range: 1 .. 20"),
    ("x" * 100, None, "top_k='xxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxx...: an integer"),
])
def test_top_k_is_an_integer_in_range(top_k, most, refusal):
    with pytest.raises(QueryRefused, match=f"^{re.escape(refusal)}$"):
        check_top_k(top_k, most)
    assert check_top_k(20, 20) == 20 and check_top_k(10**6) == 10**6  # no bound: the client's check of its type


def test_a_number_too_long_to_print_is_named_not_printed():
    with pytest.raises(QueryRefused, match=r"^top_k=a number of about 5,001 digits out of range: 1 \.\. 20$"):
        check_top_k(10**5000, 20)  # str() of it raises ValueError (4,300 digits at most)


def test_an_id_is_text_of_valid_unicode():
    assert check_id("doc-\u00e9") == "doc-\u00e9"
    for doc_id, refusal in ((7, "id is int, expected text (str)"),
                            ("a\udc80", "id is not valid Unicode (a lone surrogate, U+DC80, at character 1)")):
        with pytest.raises(QueryRefused, match=re.escape(refusal)):
            check_id(doc_id)


@QUICK
@given(st.text(alphabet=st.characters(codec=None), max_size=200), st.integers(0, 600))
def test_any_text_is_answered_or_refused_in_one_line_and_an_answer_is_a_fixed_point(text, limit):
    try:
        searched = check_text(text, "text", limit)
    except QueryRefused as refused:
        assert "\n" not in str(refused) and refused.status in (413, 422)
        assert (refused.status == 413) == (len(text.encode("utf-8", "surrogatepass")) > limit)
        return
    assert searched and searched == unicodedata.normalize("NFC", searched).strip()
    assert check_text(searched, "text") == searched
    assert len(text.encode("utf-8")) <= limit
