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


def test_gallery_screenshot_in_headless_chromium_shows_the_pictures(tmp_path):
    """The page as Chromium paints it: each picture's colours appear on screen, not a broken-image icon."""
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
