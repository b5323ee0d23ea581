"""The synthetic world's images: each image drawn from the facts it depicts, so the vision tower has something to
learn (the topic's background colour, one shape per depicted entity with its colour and initials)."""

from __future__ import annotations

import colorsys
import io
from collections.abc import Sequence
from typing import Protocol

import numpy as np

IMAGE_SIZE = 96  # px, square: small enough for 5,000 PNGs in a few seconds, large enough to read the initials


class Depicted(Protocol):
    """What an image needs of an entity (`synthetic.Entity` is one): its name and kind."""

    name: str
    kind: str  # "person", "place" or "org"


def _hsv(hue: float, saturation: float, value: float) -> tuple[int, int, int]:
    return tuple(int(255 * c) for c in colorsys.hsv_to_rgb(hue % 1.0, saturation, value))


def _initials(name: str) -> str:
    words = [w for w in name.split() if w[0].isupper()]
    return "".join(w[0] for w in words[:2]) or name[:2]


def render_image(entities: Sequence[Depicted], members: list[int], topic: int, image_index: int, seed: int) -> bytes:
    """The image of one image: PNG bytes [IMAGE_SIZE, IMAGE_SIZE, 3], a pure function of its arguments.

    The background hue follows the topic; each depicted entity (`members`, indices into `entities`) is a shape
    by kind (circle person, triangle place, square organisation) filled with the entity's colour (hue by golden
    ratio over the entity index, so neighbours differ) and labelled with its initials. A small per-image jitter
    (its own generator, not the world's, so adding pixels changed no other draw) keeps images of one entity from
    being byte-identical.
    """
    # why: Pillow loads only when a world draws its images
    from PIL import Image as PILImage
    from PIL import ImageDraw

    jitter = np.random.default_rng([seed, image_index]).integers(-6, 7, (len(members), 2))
    canvas = PILImage.new("RGB", (IMAGE_SIZE, IMAGE_SIZE), _hsv(topic * 0.137, 0.25, 0.95))
    draw = ImageDraw.Draw(canvas)
    # Slots for 1, 2 or 3 shapes: (centre x, centre y, radius) as fractions of the side.
    slots = {1: [(0.5, 0.5, 0.36)], 2: [(0.3, 0.35, 0.26), (0.7, 0.65, 0.26)],
             3: [(0.28, 0.3, 0.22), (0.72, 0.3, 0.22), (0.5, 0.72, 0.22)]}[len(members)]
    for (cx, cy, r), e, (dx, dy) in zip(slots, members, jitter):
        x, y, rad = cx * IMAGE_SIZE + dx, cy * IMAGE_SIZE + dy, r * IMAGE_SIZE
        ent = entities[e]
        fill = _hsv(e * 0.618034, 0.75, 0.55 + 0.3 * ((e * 7) % 3) / 2)
        if ent.kind == "person":
            draw.ellipse((x - rad, y - rad, x + rad, y + rad), fill=fill, outline=(30, 30, 30))
        elif ent.kind == "place":
            draw.polygon([(x, y - rad), (x - rad, y + 0.8 * rad), (x + rad, y + 0.8 * rad)], fill=fill,
                         outline=(30, 30, 30))
        else:
            draw.rectangle((x - 0.85 * rad, y - 0.85 * rad, x + 0.85 * rad, y + 0.85 * rad), fill=fill,
                           outline=(30, 30, 30))
        draw.text((x, y + (0.2 * rad if ent.kind == "place" else 0)), _initials(ent.name), fill=(255, 255, 255),
                  anchor="mm", stroke_width=1, stroke_fill=(0, 0, 0))
    out = io.BytesIO()
    canvas.save(out, format="PNG", optimize=False, compress_level=6)
    return out.getvalue()
