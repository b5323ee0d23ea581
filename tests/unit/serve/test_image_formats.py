"""The image door refuses a format outside the allow-list (issue 59) in one line, 415, in each of its forms, and the
client raises it as the service's reason, and the library's `Index.search` in the same line; an image in an allowed
format is answered beside it. On the real app over
a stand-in index (tests/helpers/standin_service.py), whose image search decodes for real."""

import base64
import io

import httpx
import pytest
from PIL import Image as PILImage
from standin_service import StandInRetriever, StandInTower, serving, standin_index

from cfir_jax.api.client import Client, ServiceError
from cfir_jax.retrieve.image_query import UnsupportedImage

REASON = "cannot be used: a EPS image: images are read from JPEG, PNG, WebP, GIF, BMP or TIFF only"


def _encoded(fmt: str) -> bytes:
    out = io.BytesIO()
    PILImage.new("RGB", (8, 8), (10, 20, 30)).save(out, fmt)
    return out.getvalue()


@pytest.fixture(scope="module")
def door():
    with serving() as (url, svc, _):
        yield url, svc


def test_an_eps_image_is_415_in_one_line_in_every_form(door):
    url, svc = door
    eps = _encoded("EPS")
    asks = [dict(json={"image": base64.b64encode(eps).decode()}),
            dict(content=eps, headers={"content-type": "image/x-eps"}),
            dict(files={"image": ("p.eps", eps, "application/postscript")})]
    for ask in asks:
        answer = httpx.post(f"{url}/v1/search/image", timeout=10, **ask)
        assert answer.status_code == 415 and list(answer.json()) == ["error"], answer.text
        assert answer.json()["error"] == f"the image ({len(eps):,} bytes) {REASON}"
    with pytest.raises(ServiceError, match=REASON) as e:
        Client(url, deadline_s=10).search(image=eps)
    assert e.value.status == 415
    for fmt in ("JPEG", "WEBP", "GIF", "BMP", "TIFF"):
        assert Client(url, deadline_s=10).search(image=_encoded(fmt), top_k=2).ids == ["img-a", "img-b"]
    assert not [r for r in svc.log_records if r.levelname in ("ERROR", "CRITICAL") or r.exc_info]


def test_the_library_refuses_it_in_the_same_line():
    eps = _encoded("EPS")
    with pytest.raises(UnsupportedImage) as e:
        standin_index(StandInRetriever(StandInTower(), 50)).search(image=eps)
    assert str(e.value) == f"the image ({len(eps):,} bytes) {REASON}"
