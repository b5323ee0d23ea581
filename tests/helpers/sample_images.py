"""Images an attacker or a careless user sends: a decompression bomb (a small PNG whose header announces a huge
image) made without ever holding its pixels, and a small real image."""

import io
import struct
import zlib


def _chunk(kind: bytes, data: bytes) -> bytes:
    return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data) & 0xFFFFFFFF)


def bomb_png(side: int = 13_000) -> bytes:
    """A valid 1-bit greyscale PNG of side x side black pixels: ~20 KB for 13,000 x 13,000 (169 MP, under PIL's own
    bomb limit of 2 x 89 MP), which decodes to 169 MB and converts to 507 MB of RGB."""
    row = b"\x00" * (1 + (side + 7) // 8)  # filter byte 0, then the packed bits
    packer = zlib.compressobj(9)
    body = b"".join(packer.compress(row) for _ in range(side)) + packer.flush()
    header = struct.pack(">IIBBBBB", side, side, 1, 0, 0, 0, 0)
    return b"\x89PNG\r\n\x1a\n" + _chunk(b"IHDR", header) + _chunk(b"IDAT", body) + _chunk(b"IEND", b"")


def small_png(side: int = 16, colour=(200, 120, 40)) -> bytes:
    """A real side x side RGB PNG."""
    from PIL import Image

    out = io.BytesIO()
    Image.new("RGB", (side, side), colour).save(out, "PNG")
    return out.getvalue()
