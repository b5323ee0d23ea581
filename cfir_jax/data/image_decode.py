"""Encoded image bytes -> an RGB PIL image (and its eval resize): the one decoder the image cache's eval preprocessing
(`cfir_jax.model.preprocess`) and the training input pipeline (`cfir_jax.data.image_pipeline`) share.

It sits in the data floor because both stages stand on it: the pipeline crops the decoded image before resizing it,
the eval transform resizes it whole, and both must agree on what counts as an unusable image.

Images are decoded from FORMATS alone (JPEG, PNG, WebP, GIF, BMP, TIFF: what a folder of images holds,
`data.files.IMAGE_SUFFIXES`). Pillow reads some forty formats, some through code few look at (EPS, which it hands to
Ghostscript where that is installed); an image in another one is refused in one line (`UnsupportedImageFormat`),
before any of its bytes reach that format's reader.
"""

from __future__ import annotations

import io
import struct
import warnings

import numpy as np
from PIL import Image as PILImage

from cfir_jax.core.errors import CfirError, first_line


class ImageDecodeError(CfirError):
    """The bytes of one image are empty, corrupt, or not an image PIL can read; callers skip such images."""


class ImageTooLarge(ImageDecodeError):
    """An image whose header announces more pixels than the caller takes: refused before any pixel is decoded."""


class UnsupportedImageFormat(ImageDecodeError):
    """An image in a format Pillow knows but FORMATS does not hold (EPS, PSD, ...): refused unread."""


FORMATS = ("JPEG", "PNG", "WEBP", "GIF", "BMP", "TIFF")  # Pillow's names of the formats images are decoded from
SHOWN_FORMATS = "JPEG, PNG, WebP, GIF, BMP or TIFF"


def _refused_format(data: bytes) -> str | None:
    """The name of the format outside FORMATS whose signature `data` starts with, as Pillow's own plugins test it
    (on the first 16 bytes, as `Image.open` does), or None."""
    PILImage.init()  # every plugin registered, so that a format outside FORMATS is named, not called unknown
    prefix = data[:16]
    for name, (_factory, accept) in PILImage.OPEN.items():
        if name in FORMATS or accept is None:
            continue
        try:
            found = accept(prefix)
        except (struct.error, IndexError, ValueError, TypeError):  # a test that reads past a short prefix (DIB's)
            continue
        if found and not isinstance(found, str):  # a string is a plugin's warning, not a yes
            return name
    return None


def decode_rgb(data: bytes, max_pixels: int | None = None) -> PILImage.Image:
    """Encoded image bytes (JPEG, PNG, WebP, GIF, BMP, TIFF) -> a fully decoded RGB PIL image (alpha dropped, palettes
    expanded).

    Raises ImageDecodeError with a short reason for empty or undecodable bytes, UnsupportedImageFormat for a format
    outside FORMATS (unread), and ImageTooLarge, before decoding,
    when the header announces more than `max_pixels` pixels (a query's serve.max_image_pixels: a 20 KB PNG can
    announce 169 MP, half a GB decoded) or when PIL refuses it as a decompression bomb (`max_pixels` None: PIL's own
    limit alone, what the index builders keep). The pixels are decoded here, inside the error handling, so later
    crops and resizes cannot fail.
    """
    if not data:
        raise ImageDecodeError("empty image bytes")
    try:
        with warnings.catch_warnings():
            # A DecompressionBombWarning (between 1x and 2x PIL's pixel limit) is still decodable; only the error
            # above 2x is a failure.
            warnings.simplefilter("ignore", PILImage.DecompressionBombWarning)
            with PILImage.open(io.BytesIO(data), formats=FORMATS) as im:  # reads the header only
                width, height = im.size
                if max_pixels is not None and width * height > max_pixels:
                    raise ImageTooLarge(f"{width:,} x {height:,} = {width * height:,} pixels, over "
                                        f"serve.max_image_pixels={max_pixels:,}")
                # `convert` loads the pixels: an image truncated mid-stream fails here, inside the try.
                return im.convert("RGB")
    except PILImage.DecompressionBombError:
        raise ImageTooLarge("image too large (PIL decompression bomb limit)") from None
    except PILImage.UnidentifiedImageError:
        refused = _refused_format(data)
        if refused is not None:
            raise UnsupportedImageFormat(f"a {refused} image: images are read from {SHOWN_FORMATS} only") from None
        raise ImageDecodeError("not a recognised image format") from None
    except (OSError, ValueError, SyntaxError, EOFError, struct.error, IndexError, KeyError, ZeroDivisionError) as e:
        # Past the header, PIL signals bad data with OSError("image file is truncated"), and its format plugins
        # let ValueError, SyntaxError, struct.error, IndexError, ... escape on malformed headers or EXIF/ICC
        # blocks; to a caller they all mean "these bytes are not a usable image".
        said = first_line(e, 80) if str(e).strip() else ""
        raise ImageDecodeError(f"cannot decode image ({e.__class__.__name__}: {said})") from None


def resize_pixels(rgb: PILImage.Image, size: int) -> np.ndarray:
    """The eval transform's geometry: a bicubic resize to (size, size), no crop, no aspect kept -> uint8 [S, S, 3]."""
    return np.asarray(rgb.resize((size, size), PILImage.BICUBIC), dtype=np.uint8)
