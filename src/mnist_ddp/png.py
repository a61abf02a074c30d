"""Just enough PNG to read a user's digit and write test images, without Pillow.

Reads 8-bit, non-interlaced PNGs of every colour type and returns grey levels;
writes 8-bit greyscale. Anything else is refused with a clear message.
"""

import struct
import zlib
from pathlib import Path

import torch

from .errors import UserError

SIGNATURE = b"\x89PNG\r\n\x1a\n"
_CHANNELS = {0: 1, 2: 3, 3: 1, 4: 2, 6: 4}  # colour type -> samples per pixel


def _paeth(a: int, b: int, c: int) -> int:
    p = a + b - c
    pa, pb, pc = abs(p - a), abs(p - b), abs(p - c)
    return a if pa <= pb and pa <= pc else b if pb <= pc else c


def _unfilter(data: bytes, height: int, stride: int, bpp: int) -> bytearray:
    """Undo the per-row filters (PNG spec, section 9)."""
    out = bytearray(height * stride)
    prev = bytearray(stride)
    pos = 0
    for row in range(height):
        kind, line = data[pos], bytearray(data[pos + 1 : pos + 1 + stride])
        pos += 1 + stride
        for i in range(stride):
            a = line[i - bpp] if i >= bpp else 0
            b, c = prev[i], prev[i - bpp] if i >= bpp else 0
            line[i] = (line[i] + (0, a, b, (a + b) // 2, _paeth(a, b, c))[kind]) & 0xFF
        out[row * stride : (row + 1) * stride] = line
        prev = line
    return out


def read_gray(path: Path) -> torch.Tensor:
    """A PNG as a (H, W) uint8 grey image (colour averaged, alpha composited onto black)."""
    raw = path.read_bytes()
    if not raw.startswith(SIGNATURE):
        raise UserError(f"{path}: not a PNG file.")
    pos, idat, palette, header = 8, b"", None, None
    try:
        while pos < len(raw):
            length, kind = struct.unpack(">I4s", raw[pos : pos + 8])
            body = raw[pos + 8 : pos + 8 + length]
            pos += 12 + length
            if kind == b"IHDR":
                header = struct.unpack(">IIBBBBB", body)
            elif kind == b"PLTE":
                palette = torch.tensor(list(body), dtype=torch.uint8).reshape(-1, 3)
            elif kind == b"IDAT":
                idat += body
            elif kind == b"IEND":
                break
        assert header is not None
        width, height, depth, colour, _, _, interlace = header
        if depth != 8 or interlace or colour not in _CHANNELS:
            raise UserError(f"{path}: only 8-bit, non-interlaced PNGs are supported.")
        channels = _CHANNELS[colour]
        pixels = _unfilter(zlib.decompress(idat), height, width * channels, channels)
    except (struct.error, zlib.error, AssertionError, IndexError) as e:
        raise UserError(f"{path}: a damaged PNG ({e or 'missing header'}).") from e
    img = torch.frombuffer(pixels, dtype=torch.uint8).reshape(height, width, channels).float()
    if colour == 3:
        if palette is None:
            raise UserError(f"{path}: a palette PNG without its palette.")
        img = palette[img[..., 0].long()].float()
    if channels in (2, 4):  # alpha: composite onto black, the MNIST background
        img = img[..., :-1] * img[..., -1:] / 255
    return img.mean(-1).round().to(torch.uint8)


def write_gray(path: Path, image: torch.Tensor) -> None:
    """Write a (H, W) uint8 tensor as an 8-bit greyscale PNG."""
    height, width = image.shape
    rows = b"".join(b"\x00" + bytes(image[r].tolist()) for r in range(height))

    def chunk(kind: bytes, body: bytes) -> bytes:
        return struct.pack(">I", len(body)) + kind + body + struct.pack(">I", zlib.crc32(kind + body))

    path.write_bytes(SIGNATURE + chunk(b"IHDR", struct.pack(">IIBBBBB", width, height, 8, 0, 0, 0, 0))
                     + chunk(b"IDAT", zlib.compress(rows)) + chunk(b"IEND", b""))
