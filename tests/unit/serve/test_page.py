"""The page at `GET /` as a picture desk uses it (docs/filters.md): it asks the counts of the fields seen on hits,
turns a click on a value into a filter, a click on a picture into a search by that picture, and escapes every value
it draws from an answer. Chromium runs it in tests/e2e/test_filters.py."""

import re

from cfir_jax.serve.page import PAGE


def _script() -> str:
    return PAGE.split("<script>", 1)[1].split("</script>", 1)[0]


def test_the_page_asks_the_counts_of_the_fields_seen_on_hits_but_a_numbers():
    script = _script()
    assert 'querySelectorAll("span.own[data-facet=\'1\']")' in script  # the gallery marks a number's field "0"
    assert "facets: counted" in script and "counted.length ?" in script  # none asked before a field is seen
    assert 'fetch(url, {method: "POST"' in script and '"/v1/search/html"' in script


def test_a_click_on_a_value_adds_its_filter_and_a_click_on_a_picture_searches_by_it():
    script = _script()
    assert 'querySelectorAll("a.facet")' in script and "addFilter(a.dataset.field, a.dataset.value)" in script
    assert "`${field}=${value}`" in script and 'join("; ")' in script  # the filter box's own separator
    assert 'querySelectorAll("img[data-image-id]")' in script and "byPicture(img.dataset.imageId)" in script
    assert 'ask("/v1/search/image", {image_id: id, ...options()})' in script  # its id, with the filters and facets


def test_every_value_drawn_from_an_answer_is_escaped():
    script = _script()
    drawn = script[script.index("function ownFields"):script.index("async function byPicture")]
    interpolated = [x.strip() for x in re.findall(r"\$\{([^{}]+?)\}", drawn)]
    raw = [x for x in interpolated if not x.startswith(("esc(", "typeof ", "n", "h.rank", "h.score.toFixed",
                                                        "a.ranked", "facets", "hits", "ownFields("))]
    assert not raw, raw  # counts, ranks and scores are numbers; every text goes through esc
    assert "innerHTML" not in script
