"""Rendering results: the HTML gallery embeds the corpus' own pixels, and a real browser shows them."""

import io
import shutil
import subprocess

import numpy as np
from repo import ROOT

from cfir_jax.data.synthetic import IMAGE_SIZE, SyntheticConfig, build_world
from cfir_jax.retrieve.report import html_page, image_mime
from cfir_jax.retrieve.results import Hit, Result

WORLD = build_world(SyntheticConfig.tiny())
IMAGES = {i.image_id: i for i in WORLD.images}


def _gallery(n: int = 6) -> str:
    hits = tuple(Hit(k + 1, i.image_id, 1.0 - k / 10, i.caption, i.url, tuple(i.entities[:1]))
                 for k, i in enumerate(WORLD.images[:n]))
    result = Result("doc0", hits, ("x",), (), "a summary")
    return html_page(result, lambda i: IMAGES[i].image, n)


def test_image_mime_from_magic_bytes():
    assert image_mime(WORLD.images[0].image) == "image/png"
    assert image_mime(b"\xff\xd8\xff\xe0rest") == "image/jpeg"
    assert image_mime(b"RIFF....WEBPVP8 ") == "image/webp"


def test_html_embeds_the_corpus_pixels_as_data_uris():
    page = _gallery()
    assert page.count('<img src="data:image/png;base64,') == 6
    assert "http" not in page and "no image" not in page


def test_html_without_bytes_or_url_says_no_image():
    result = Result("d", (Hit(1, "x", 0.5, "cap", ""),))
    page = html_page(result, lambda i: b"", 1)
    assert "<img" not in page and "no image" in page


def test_a_documents_gallery_says_its_entities_and_summary_and_an_images_says_neither():
    assert "<b>Entities:</b> x" in _gallery(1) and "<b>Summary:</b> a summary" in _gallery(1)
    by_image = html_page(Result("images like img1", (Hit(1, "x", 0.5, "cap", ""),)), lambda i: b"", 1)
    assert "Entities:" not in by_image and "Summary:" not in by_image


def test_gallery_screenshot_in_headless_chromium_shows_the_images(tmp_path):
    """The page as Chromium paints it: each image's colours appear on screen, not a broken-image icon."""
    from PIL import Image as PILImage

    assert shutil.which("chromium"), "chromium is part of the test set: bash scripts/setup.sh test installs it " \
        "(Debian: apt-get install -y chromium)"
    page = tmp_path / "g.html"
    page.write_text(_gallery())
    shot = tmp_path / "g.png"
    subprocess.run(["bash", str(ROOT / "scripts" / "screenshot.sh"), str(page), str(shot), "1200,800"], check=True,
                   timeout=120, capture_output=True)
    screen = {tuple(c) for c in np.asarray(PILImage.open(shot).convert("RGB")).reshape(-1, 3)}
    for image in WORLD.images[:6]:
        pixels = np.asarray(PILImage.open(io.BytesIO(image.image)).convert("RGB"))
        colours, counts = np.unique(pixels.reshape(-1, 3), axis=0, return_counts=True)
        background, shape = (tuple(c) for c in colours[np.argsort(-counts)[:2]])
        # the page shows images at their own size (96 px <= 220 px max), so flat colours survive unscaled
        assert pixels.shape[:2] == (IMAGE_SIZE, IMAGE_SIZE)
        assert background in screen and shape in screen, image.image_id


def test_the_gallery_shows_each_hits_own_fields_and_the_facets_as_links_escaped():
    """A hit's fields under its caption (a number's marked not countable), the facets asked above the hits, each
    value a link that names its field and value for the page; every value escaped."""
    fields = {"date": "2020-06-12", "source": "<b>reuters</b>", "tags": ["news", "sport"], "featured": True,
              "width": 640}
    hits = (Hit(1, "img1", 0.5, "cap", "", (), (), fields), Hit(2, "img2", 0.25, "cap", ""))
    result = Result("d", hits, facets={"source": {"<b>reuters</b>": 3, "ap": 1}, "date": {"2020-06": 4}}, ranked=4)
    page = html_page(result, lambda i: WORLD.images[0].image if i == "img1" else b"", 2)
    assert "<b>reuters</b>" not in page and "&lt;b&gt;reuters&lt;/b&gt;" in page
    assert '<span class="own" data-field="tags" data-facet="1">tags: news, sport</span>' in page
    assert 'data-field="featured" data-facet="1">featured: true<' in page
    assert 'data-field="width" data-facet="0">width: 640<' in page
    assert 'class="facet" data-field="date" data-value="2020-06">2020-06</a>&nbsp;(4)' in page
    assert 'data-value="&lt;b&gt;reuters&lt;/b&gt;"' in page and "Counts over the 4 images ranked" in page
    assert 'data-image-id="img1"' in page and page.count('class="fields"') == 1  # img2 has none: nothing drawn
    plain = html_page(Result("d", hits[1:]), lambda i: b"", 1)
    assert 'class="facets"' not in plain and 'class="fields"' not in plain
