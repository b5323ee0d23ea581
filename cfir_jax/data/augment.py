"""BEiT-3's retrieval fine-tuning augmentation, in numpy and PIL, driven by an explicit numpy Generator.

unilm's `beit3/datasets.py` `build_transform(is_train=True)` is
`RandomResizedCropAndInterpolation(S, scale=(0.5, 1.0), interpolation=bicubic)` (timm), `RandomHorizontalFlip()`,
then (with `--randaug`, as its retrieval fine-tuning runs) `RandomAugment(2, 7, isPIL=True, augs=RANDAUG_OPS)` of
`beit3/randaug.py`: two ops drawn with replacement, each applied with probability 0.5 at level 7 of 10. The
reference draws from Python's and numpy's global generators; here every draw comes from the `rng` argument, so a
caller that seeds it per sample (the input pipeline: seed, epoch, pair) gets the same pixels in any process, any
worker count, and after any resume.

Where the reference uses OpenCV, the op is rebuilt from its definition: the lookup-table ops (autocontrast,
equalize, brightness) are the reference's tables exactly; sharpness is its 3x3 smoothing blend (clipped, where the
reference's uint8 cast can wrap); the geometric ops (shear, translate, rotate, fill grey 128) are PIL affine
transforms with bilinear sampling, which may differ from OpenCV's warpAffine by rounding at a few pixels.
"""

from __future__ import annotations

import math

import numpy as np
from PIL import Image as PILImage

from cfir_jax.data.image_decode import resize_pixels

CROP_SCALE = (0.5, 1.0)
CROP_RATIO = (3 / 4, 4 / 3)
RANDAUG_OPS = ("Identity", "AutoContrast", "Equalize", "Brightness", "Sharpness",
               "ShearX", "ShearY", "TranslateX", "TranslateY", "Rotate")
RANDAUG_NUM_OPS = 2
RANDAUG_MAGNITUDE = 7  # beit3/datasets.py: RandomAugment(2, 7, ...)
_MAX_LEVEL = 10
_FILL = (128, 128, 128)
_TRANSLATE_CONST = 10  # pixels at the maximum level (randaug.py's translate_const)


def eval_transform(rgb: PILImage.Image, size: int) -> np.ndarray:
    """The evaluation transform's pixels: a bicubic resize to (size, size) -> uint8 [size, size, 3]."""
    return resize_pixels(rgb, size)


def train_transform(rgb: PILImage.Image, size: int, rng: np.random.Generator, randaug: bool = True) -> np.ndarray:
    """Random resized crop (scale 0.5-1, bicubic), horizontal flip, RandAugment(2, 7) -> uint8 [size, size, 3].

    randaug=False: crop and flip only (BEiT-3's transform without `--randaug`; `train.randaug`)."""
    top, left, height, width = crop_box(rgb.width, rgb.height, rng)
    img = rgb.crop((left, top, left + width, top + height)).resize((size, size), PILImage.BICUBIC)
    if rng.random() < 0.5:
        img = img.transpose(PILImage.Transpose.FLIP_LEFT_RIGHT)
    pixels = np.asarray(img, dtype=np.uint8)
    return rand_augment(pixels, rng) if randaug else pixels


def crop_box(width: int, height: int, rng: np.random.Generator) -> tuple[int, int, int, int]:
    """timm's RandomResizedCropAndInterpolation.get_params: (top, left, height, width) of the crop.

    Ten tries at an area fraction in CROP_SCALE and a log-uniform aspect ratio in CROP_RATIO; then the central crop
    at the nearest allowed ratio.
    """
    area = width * height
    log_ratio = (math.log(CROP_RATIO[0]), math.log(CROP_RATIO[1]))
    for _ in range(10):
        target_area = rng.uniform(*CROP_SCALE) * area
        aspect = math.exp(rng.uniform(*log_ratio))
        w = int(round(math.sqrt(target_area * aspect)))
        h = int(round(math.sqrt(target_area / aspect)))
        if w <= width and h <= height:
            return int(rng.integers(0, height - h + 1)), int(rng.integers(0, width - w + 1)), h, w
    in_ratio = width / height
    if in_ratio < min(CROP_RATIO):
        w, h = width, int(round(width / min(CROP_RATIO)))
    elif in_ratio > max(CROP_RATIO):
        w, h = int(round(height * max(CROP_RATIO))), height
    else:
        w, h = width, height
    return (height - h) // 2, (width - w) // 2, h, w


def rand_augment(pixels: np.ndarray, rng: np.random.Generator) -> np.ndarray:
    """BEiT-3's RandomAugment(2, 7) over RANDAUG_OPS on uint8 [H, W, 3]: two ops drawn with replacement, each
    applied with probability 0.5; the geometric ops draw their direction only when applied, as the reference does."""
    for name in rng.choice(RANDAUG_OPS, RANDAUG_NUM_OPS):
        if rng.random() > 0.5:
            continue
        pixels = _apply(str(name), pixels, RANDAUG_MAGNITUDE / _MAX_LEVEL, rng)
    return pixels


def _signed(value: float, rng: np.random.Generator) -> float:
    return -value if rng.random() > 0.5 else value


def _apply(name: str, pixels: np.ndarray, level: float, rng: np.random.Generator) -> np.ndarray:
    if name == "Identity":
        return pixels
    if name == "AutoContrast":
        return _per_channel(pixels, _autocontrast_table)
    if name == "Equalize":
        return _per_channel(pixels, _equalize_table)
    if name == "Brightness":
        table = (np.arange(256, dtype=np.float32) * (level * 1.8 + 0.1)).clip(0, 255).astype(np.uint8)
        return table[pixels]
    if name == "Sharpness":
        return _sharpness(pixels, level * 1.8 + 0.1)
    if name in ("ShearX", "ShearY"):
        s = _signed(level * 0.3, rng)
        return _affine(pixels, (1, -s, 0, 0, 1, 0) if name == "ShearX" else (1, 0, 0, -s, 1, 0))
    if name in ("TranslateX", "TranslateY"):
        t = _signed(level * _TRANSLATE_CONST, rng)
        return _affine(pixels, (1, 0, t, 0, 1, 0) if name == "TranslateX" else (1, 0, 0, 0, 1, t))
    if name == "Rotate":
        degrees = level * 30 * (-1 if rng.random() < 0.5 else 1)
        img = PILImage.fromarray(pixels).rotate(degrees, resample=PILImage.BILINEAR, fillcolor=_FILL)
        return np.asarray(img, dtype=np.uint8)
    raise ValueError(f"unknown RandAugment op {name!r}")


def _per_channel(pixels: np.ndarray, table_of) -> np.ndarray:
    return np.stack([table_of(pixels[..., c])[pixels[..., c]] for c in range(pixels.shape[-1])], axis=-1)


def _autocontrast_table(channel: np.ndarray) -> np.ndarray:
    """randaug.py's autocontrast_func at cutoff 0 (PIL's ImageOps.autocontrast): stretch [min, max] to [0, 255]."""
    low, high = int(channel.min()), int(channel.max())
    if high <= low:
        return np.arange(256, dtype=np.uint8)
    scale = 255 / (high - low)
    return (np.arange(256) * scale - low * scale).clip(0, 255).astype(np.uint8)


def _equalize_table(channel: np.ndarray) -> np.ndarray:
    """randaug.py's equalize_func (PIL's ImageOps.equalize, not OpenCV's)."""
    hist = np.bincount(channel.ravel(), minlength=256).astype(np.float64)
    nonzero = hist[hist != 0]
    step = np.sum(nonzero[:-1]) // 255
    if step == 0:
        return np.arange(256, dtype=np.uint8)
    shifted = np.empty_like(hist)
    shifted[0] = step // 2
    shifted[1:] = hist[:-1]
    return (np.cumsum(shifted) // step).clip(0, 255).astype(np.uint8)


def _sharpness(pixels: np.ndarray, factor: float) -> np.ndarray:
    """randaug.py's sharpness_func: blend with the [[1,1,1],[1,5,1],[1,1,1]]/13 smoothing on the interior pixels."""
    if pixels.shape[0] < 3 or pixels.shape[1] < 3:
        return pixels
    x = pixels.astype(np.float32)
    h, w = x.shape[:2]
    total = sum(x[dy:h - 2 + dy, dx:w - 2 + dx] for dy in range(3) for dx in range(3)) + 4 * x[1:-1, 1:-1]
    degenerate = np.rint(total / 13).clip(0, 255)
    out = x.copy()
    out[1:-1, 1:-1] = degenerate + factor * (x[1:-1, 1:-1] - degenerate)
    return out.clip(0, 255).astype(np.uint8)


def _affine(pixels: np.ndarray, data: tuple[float, ...]) -> np.ndarray:
    """PIL's affine transform (output (x, y) samples input (a x + b y + c, d x + e y + f)), bilinear, grey fill."""
    img = PILImage.fromarray(pixels)
    out = img.transform(img.size, PILImage.Transform.AFFINE, data, resample=PILImage.BILINEAR, fillcolor=_FILL)
    return np.asarray(out, dtype=np.uint8)
