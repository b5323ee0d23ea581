"""Image decoding and the BEiT-3 retrieval evaluation preprocessing.

The reference evaluation transform is torchvision's
`Compose([Resize((S, S), interpolation=BICUBIC), ToTensor(), Normalize(0.5, 0.5)])` applied to a PIL image after
`.convert("RGB")`. torchvision resizes a PIL image by calling PIL's own `Image.resize(size, Image.BICUBIC)` (its
`antialias` flag only matters for tensors), so calling PIL here gives the same pixels, not an approximation of them.
"""

from __future__ import annotations

import io
import struct
import warnings

import numpy as np
from PIL import Image as PILImage

from cfir_jax.errors import CfirError


class ImageDecodeError(CfirError):
    """The bytes of one image are empty, corrupt, or not an image PIL can read; the cache skips such images."""


def decode_image(data: bytes, size: int) -> np.ndarray:
    """Encoded image bytes (WebP, JPEG, PNG, ...) -> pixels [size, size, 3] float32 in [-1, 1].

    Exactly the reference evaluation preprocessing: RGB conversion (alpha dropped, palettes expanded), a bicubic
    resize to (size, size) without crop or aspect preservation, /255, then (x - 0.5) / 0.5. Raises ImageDecodeError
    with a short reason for empty or undecodable bytes (and for decompression bombs, which PIL refuses).
    """
    if size <= 0:
        raise ValueError(f"image size must be positive, got {size}")
    if not data:
        raise ImageDecodeError("empty image bytes")
    try:
        with warnings.catch_warnings():
            # A DecompressionBombWarning (between 1x and 2x PIL's pixel limit) is still decodable; only the error
            # above 2x is a failure.
            warnings.simplefilter("ignore", PILImage.DecompressionBombWarning)
            with PILImage.open(io.BytesIO(data)) as im:
                # `resize` decodes lazily; an image truncated mid-stream fails here, inside the try.
                rgb = im.convert("RGB").resize((size, size), PILImage.BICUBIC)
    except PILImage.DecompressionBombError:
        raise ImageDecodeError("image too large (PIL decompression bomb limit)") from None
    except PILImage.UnidentifiedImageError:
        raise ImageDecodeError("not a recognised image format") from None
    except (OSError, ValueError, SyntaxError, EOFError, struct.error, IndexError, KeyError, ZeroDivisionError) as e:
        # Past the header, PIL signals bad data with OSError("image file is truncated"), and its format plugins
        # let ValueError, SyntaxError, struct.error, IndexError, ... escape on malformed headers or EXIF/ICC
        # blocks; to the cache they all mean "these bytes are not a usable image".
        first = str(e).splitlines()[0] if str(e) else ""
        raise ImageDecodeError(f"cannot decode image ({e.__class__.__name__}: {first[:80]})") from None
    pixels = np.asarray(rgb, dtype=np.float32) / 255.0
    return (pixels - 0.5) / 0.5
