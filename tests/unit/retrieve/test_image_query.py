"""Search by image's refusals that need no index (cfir_jax/retrieve/image_query.py): an image file read safely,
and the arguments of `search_image` checked before anything loads, each in one line. What it finds, over a built
index, is tests/e2e/test_image_search.py."""

from types import SimpleNamespace

import pytest

from cfir_jax.core.errors import CfirError
from cfir_jax.retrieve.image_query import UnusableImage, read_image, search_image

UNOPENED = SimpleNamespace()  # no stores: the arguments are checked before any is touched


def test_an_image_file_is_read_whole(tmp_path):
    path = tmp_path / "photo.png"
    path.write_bytes(b"\x89PNG\r\n\x1a\n....")
    assert read_image(path, limit=100) == b"\x89PNG\r\n\x1a\n...."


@pytest.mark.parametrize("make, refusal", [
    (lambda p: None, "image not found"),
    (lambda p: p.mkdir(), "image is not a regular file"),
    (lambda p: p.write_bytes(b""), "image is empty"),
    (lambda p: p.write_bytes(b"x" * 101), "image is 101 bytes, over serve.max_image_bytes=100"),
])
def test_a_bad_image_file_is_one_line_naming_it(tmp_path, make, refusal):
    path = tmp_path / "photo.jpg"
    make(path)
    with pytest.raises(UnusableImage) as e:
        read_image(path, limit=100)
    assert str(e.value) == f"{path}: {refusal}"


@pytest.mark.parametrize("kwargs, refusal", [
    (dict(top_k=5), "give an image's bytes (image) or an indexed image's id (image_id), not both or neither"),
    (dict(image=b"x", image_id="a", top_k=5), "not both or neither"),
    (dict(image_id="a", top_k=0), "top_k=0 out of range: at least 1"),
    (dict(image_id="a", top_k=True), "top_k=True: an integer"),
    (dict(image_id="a", top_k="3"), "top_k='3': an integer"),
    (dict(image=b"", top_k=3), "the image is empty"),
    (dict(image="photo.png", top_k=3), "image must be the image's bytes, got str"),
])
def test_search_arguments_are_checked_before_the_index_is_touched(kwargs, refusal):
    with pytest.raises(CfirError) as e:
        search_image(UNOPENED, **kwargs)  # no stores: the check comes first
    assert refusal in str(e.value) and "\n" not in str(e.value)
