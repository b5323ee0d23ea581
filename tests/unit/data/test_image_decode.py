"""Images are decoded from an allow-list of formats (issue 59, cfir_jax/data/image_decode.py): JPEG, PNG, WebP, GIF,
BMP and TIFF decode; an image in any other format Pillow reads (EPS, which it hands to Ghostscript, PSD, ICO, ...)
is refused in one line naming its format, before that format's reader ever sees its bytes."""

import io

import pytest
from PIL import EpsImagePlugin
from PIL import Image as PILImage

from cfir_jax.data.image_decode import FORMATS, ImageDecodeError, UnsupportedImageFormat, decode_rgb
from cfir_jax.model.preprocess import decode_image

IMAGE = PILImage.new("RGB", (8, 6), (200, 120, 40))


def _encoded(fmt: str) -> bytes:
    out = io.BytesIO()
    IMAGE.save(out, fmt)
    return out.getvalue()


@pytest.mark.parametrize("fmt", FORMATS)
def test_each_allowed_format_decodes(fmt):
    rgb = decode_rgb(_encoded(fmt))
    assert rgb.mode == "RGB" and rgb.size == (8, 6)
    assert decode_image(_encoded(fmt), 4).shape == (4, 4, 3)


REFUSED = ["EPS", "PPM", "ICO", "PCX", "SGI", "DDS", "QOI", "JPEG2000", "ICNS"]


@pytest.mark.parametrize("fmt", REFUSED)
def test_another_format_is_refused_in_one_line_naming_it(fmt):
    data = _encoded(fmt)
    with pytest.raises(UnsupportedImageFormat) as e:
        decode_rgb(data)
    message = str(e.value)
    assert "\n" not in message and message.endswith("images are read from JPEG, PNG, WebP, GIF, BMP or TIFF only")
    assert message.startswith("a ") and isinstance(e.value, ImageDecodeError)


def test_an_eps_image_never_reaches_the_eps_reader(monkeypatch):
    def never(self):
        raise AssertionError("the EPS reader was called on a query's bytes")

    monkeypatch.setattr(EpsImagePlugin.EpsImageFile, "_open", never)
    with pytest.raises(UnsupportedImageFormat, match=r"^a EPS image: "):
        decode_rgb(_encoded("EPS"))


@pytest.mark.parametrize("fmt", ["IM", "TGA"])
def test_a_format_pillow_knows_by_no_signature_is_not_read(fmt):
    with pytest.raises(ImageDecodeError):  # its reader is never tried (a TGA's first bytes look like a CUR's)
        decode_rgb(_encoded(fmt))


def test_bytes_of_no_format_are_still_undecodable_not_unsupported():
    with pytest.raises(ImageDecodeError, match="^not a recognised image format$") as e:
        decode_rgb(b"these are not the bytes of any image")
    assert not isinstance(e.value, UnsupportedImageFormat)
