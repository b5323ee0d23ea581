"""Image decoding and the BEiT-3 retrieval evaluation preprocessing.

The reference evaluation transform is torchvision's
`Compose([Resize((S, S), interpolation=BICUBIC), ToTensor(), Normalize(0.5, 0.5)])` applied to a PIL image after
`.convert("RGB")`. torchvision resizes a PIL image by calling PIL's own `Image.resize(size, Image.BICUBIC)` (its
`antialias` flag only matters for tensors), so calling PIL here gives the same pixels, not an approximation of them.
The decoding and the resize (and what counts as a corrupt image) are `cfir_jax.data.image_decode`'s, shared with the
training input pipeline.
"""

from __future__ import annotations

import numpy as np

from cfir_jax.data.image_decode import (
    ImageDecodeError,
    ImageTooLarge,
    UnsupportedImageFormat,
    decode_rgb,
    resize_pixels,
)

__all__ = ["ImageDecodeError", "ImageTooLarge", "UnsupportedImageFormat", "decode_image"]


def decode_image(data: bytes, size: int, max_pixels: int | None = None) -> np.ndarray:
    """Encoded image bytes (JPEG, PNG, WebP, GIF, BMP, TIFF) -> pixels [size, size, 3] float32 in [-1, 1].

    Exactly the reference evaluation preprocessing: RGB conversion (alpha dropped, palettes expanded), a bicubic
    resize to (size, size) without crop or aspect preservation, /255, then (x - 0.5) / 0.5. Raises ImageDecodeError
    with a short reason for empty or undecodable bytes, UnsupportedImageFormat for another format (unread),
    ImageTooLarge past `max_pixels` (read from the header, before decoding) or PIL's decompression-bomb limit.
    """
    if size <= 0:
        raise ValueError(f"image size must be positive, got {size}")
    pixels = resize_pixels(decode_rgb(data, max_pixels), size).astype(np.float32) / 255.0
    return (pixels - 0.5) / 0.5
