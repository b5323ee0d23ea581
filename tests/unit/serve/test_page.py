"""The page at `GET /` as a picture desk uses it (docs/filters.md): it asks the counts of the fields seen on hits,
turns a click on a value into a filter, a click on an image into a search by that image, whose gallery
(POST /v1/search/image/html, over the stand-in service: tests/helpers/standin_service.py) shows every hit's pixels,
its own fields and the facets, every value escaped, in each form the image door takes. Chromium runs the page in
tests/e2e/test_filters.py, the Ray engine's door tests/e2e/test_serve_cluster.py."""

import base64
import html
import json
import re
from types import SimpleNamespace

import httpx
import pytest
from sample_images import small_png
from standin_service import IDS, StandInRetriever, StandInTower, serving

from cfir_jax.serve.page import PAGE

HOSTILE = '<script>alert("x")</script>&\'"'  # in a caption, a url, a field's name and value, a facet's value
PIXELS = {"img-a": small_png(colour=(10, 200, 30)), "img-b": small_png(colour=(250, 5, 90))}  # img-c: a url only
URLS = {"img-a": "", "img-b": "", "img-c": "https://images.example/c.jpg?w=1&h=2", "img-d": HOSTILE}


class RetrieverWithImages(StandInRetriever):
    """The stand-in engine with a corpus as the gallery reads it: img-a and img-b with their bytes, img-c with an
    http(s) url only, img-d with neither (and a hostile url); hostile captions and fields; facets counted as given."""

    def __init__(self):
        super().__init__(StandInTower(), 50)
        self.corpus = SimpleNamespace(image_ids=IDS, image=lambda n: SimpleNamespace(image=PIXELS.get(IDS[n], b"")))
        self.filters = SimpleNamespace(facets=lambda: SimpleNamespace(check=lambda names: None,
                                                                      count_retrievals=self._count))

    @staticmethod
    def _count(names, retrievals, groups):
        for asked, r in zip(names, retrievals):
            if asked:
                r.facets = ({f: {HOSTILE: 3, "reuters": 1} for f in asked}, 4)

    def describe_image(self, image_id):
        return f"{image_id} {HOSTILE}", URLS[image_id]

    def shown(self, image_id):
        return f"{image_id} {HOSTILE}", URLS[image_id], {"source": "reuters", HOSTILE: [HOSTILE, "sport"]}


@pytest.fixture(scope="module")
def served_images():
    """The stand-in service over RetrieverWithImages: its url."""
    with serving(retriever=RetrieverWithImages()) as (url, _, _):
        yield url


def _script() -> str:
    return PAGE.split("<script>", 1)[1].split("</script>", 1)[0]


def test_the_page_asks_the_counts_of_the_fields_seen_on_hits_but_a_numbers():
    script = _script()
    assert 'querySelectorAll("span.own[data-facet=\'1\']")' in script  # the gallery marks a number's field "0"
    assert "facets: counted" in script and "counted.length ?" in script  # none asked before a field is seen
    assert 'fetch(url, {method: "POST"' in script and '"/v1/search/html"' in script


def test_a_click_on_a_value_adds_its_filter_and_a_click_on_an_image_searches_by_it():
    script = _script()
    assert 'querySelectorAll("a.facet")' in script and "addFilter(a.dataset.field, a.dataset.value)" in script
    # a picked value is a triple sent as it is, never a line in the box (whose ';' and outer spaces and quotes are
    # syntax): the gallery's ' x ' or 'a; b' is filtered on as the gallery counted it (tests/e2e/test_filters.py)
    assert 'picked.push([field, "=", value])' in script and "where: filters().concat(picked)" in script
    assert "whereBox.value =" not in script.split("function addFilter")[1].split("gallery.addEventListener")[0]
    assert 'querySelectorAll("img[data-image-id]")' in script and "byImage(img.dataset.imageId)" in script
    by_image = script[script.index("async function byImage"):script.index("function addFilter")]
    assert 'ask("/v1/search/image/html", {image_id: id, id: `images like ${id}`, ...options()})' in by_image
    assert "gallery.srcdoc = await r.text()" in by_image  # the service's gallery, as a text search's


def test_the_page_draws_no_value_of_an_answer_itself():
    """Both galleries are the service's (each value escaped there: below); the page writes none into HTML."""
    script = _script()
    assert re.findall(r"srcdoc = ([^;]+);", script) == ["await r.text()", "await r.text()"]
    assert "innerHTML" not in script and "outerHTML" not in script and "insertAdjacentHTML" not in script
    assert "r.json()" not in script.replace("await r.json().catch", "")  # only an error's line, shown as text
    assert "status.textContent = `${r.status}: ${e.error}`" in script


def _figures(page: str) -> dict[str, str]:
    """Each hit's <figure> of a gallery, by its image's id (data-image-id, else the noimg box's hit)."""
    figures = page.split("<figure>")[1:]
    out = {}
    for f in figures:
        named = re.search(r'data-image-id="([^"]+)"', f) or re.search(r"</b> (?:<a [^>]*>)?([^ <]+)", f)
        out[html.unescape(named.group(1))] = f
    return out


def test_a_search_by_image_answers_the_gallery_with_every_hits_pixels(served_images):
    """POST /v1/search/image/html: the JSON door's hits in its order, each image's bytes inline (a data URI of
    its type), else its http(s) url, else a box; each image clickable (data-image-id); the version header."""
    body = {"image_id": "img-a", "top_k": 4, "id": "images like img-a"}
    page = httpx.post(f"{served_images}/v1/search/image/html", json=body, timeout=30)
    assert page.status_code == 200 and page.headers["content-type"].startswith("text/html"), page.text[:300]
    assert page.headers["x-index-version"] == "3" and "<h1>images like img-a</h1>" in page.text
    answer = httpx.post(f"{served_images}/v1/search/image", json=body, timeout=30).json()
    figures = _figures(page.text)
    assert list(figures) == [h["image_id"] for h in answer["hits"]] == IDS
    for image_id, data in PIXELS.items():
        src = f'src="data:image/png;base64,{base64.b64encode(data).decode()}"'
        assert f'<img {src} alt="{image_id}" data-image-id="{image_id}">' in figures[image_id]
    assert f'<img src="{html.escape(URLS["img-c"])}" alt="img-c" data-image-id="img-c"' in figures["img-c"]
    assert '<div class="noimg">no image</div>' in figures["img-d"] and "data-image-id" not in figures["img-d"]
    metrics = httpx.get(f"{served_images}/metrics", timeout=30).text  # counted under its own endpoint
    assert 'cfir_requests_total{endpoint="/v1/search/image/html",status="200"}' in metrics


@pytest.mark.parametrize("form", ["upload", "raw", "form"])
def test_the_gallery_answers_each_form_the_image_door_takes(served_images, form):
    """A multipart upload, a raw image/* body, a urlencoded form with an id: the same gallery, with the filters'
    and facets' fields of each form; a refusal is the JSON door's one line."""
    url, image = f"{served_images}/v1/search/image/html", small_png()
    if form == "upload":
        page = httpx.post(url, files={"image": ("p.png", image)}, data={"top_k": "2", "facets": "source"})
    elif form == "raw":
        page = httpx.post(f"{url}?top_k=2&facets=source", content=image, headers={"content-type": "image/png"})
    else:
        page = httpx.post(url, data={"image_id": "img-b", "top_k": "2", "facets": "source"})
    assert page.status_code == 200 and page.headers["content-type"].startswith("text/html"), page.text[:300]
    assert list(_figures(page.text)) == IDS[:2] and 'class="facet" data-field="source" data-value="reuters"' in \
        page.text and "data:image/png;base64," in page.text
    unknown = httpx.post(url, json={"image_id": "img-z"}, timeout=30)
    assert unknown.status_code == 404 and unknown.headers["content-type"] == "application/json"
    assert list(json.loads(unknown.content)) == ["error"] and "img-z" in unknown.json()["error"]


def test_every_value_of_the_image_gallery_is_escaped(served_images):
    """A caption, a url, a field's name and value and a facet's value holding markup are drawn as text."""
    page = httpx.post(f"{served_images}/v1/search/image/html", json={"image_id": "img-a", "top_k": 4, "id": HOSTILE,
                                                                     "facets": ["source"]}, timeout=30).text
    assert "<script>" not in page and html.escape(HOSTILE) in page
    assert page.count(html.escape(HOSTILE)) >= 4 * 3 + 2  # each hit's caption, field name and value; title, facet
    assert f'class="facet" data-field="source" data-value="{html.escape(HOSTILE)}"' in page
