"""Read and write the IDX files MNIST ships in, refusing anything malformed.

A truncated download or a file of the wrong kind must fail loudly here, naming the
file, rather than turn into a silently wrong tensor further down.
"""

import ctypes
import gzip
import math
import struct
import zlib
from pathlib import Path

import torch

from .errors import UserError

IMAGES_MAGIC = 2051  # 0x00000803: unsigned bytes, 3 dimensions (count, rows, cols)
LABELS_MAGIC = 2049  # 0x00000801: unsigned bytes, 1 dimension (count)
_NDIM = {IMAGES_MAGIC: 3, LABELS_MAGIC: 1}
_KIND = {IMAGES_MAGIC: "images", LABELS_MAGIC: "labels"}
GZIP_MAGIC = b"\x1f\x8b"


def parse(raw: bytes, magic: int, name: str) -> torch.Tensor:
    """Decode IDX bytes whose magic number must be `magic` into a uint8 tensor."""
    if len(raw) < 4:
        raise UserError(f"{name}: {len(raw)} bytes is too short to be an IDX file.")
    (found,) = struct.unpack(">I", raw[:4])
    if found != magic:
        raise UserError(f"{name}: not an IDX {_KIND[magic]} file (magic number {found}, expected {magic}).")
    header = 4 + 4 * _NDIM[magic]
    if len(raw) < header:
        raise UserError(f"{name}: the IDX header is truncated ({len(raw)} bytes).")
    dims = struct.unpack(f">{_NDIM[magic]}I", raw[4:header])
    if len(raw) - header != math.prod(dims):
        raise UserError(
            f"{name}: header says {'x'.join(map(str, dims))} = {math.prod(dims)} bytes of data "
            f"but the file holds {len(raw) - header}; it is truncated or corrupt."
        )
    if not math.prod(dims):  # frombuffer refuses an empty buffer
        return torch.empty(dims, dtype=torch.uint8)
    return torch.frombuffer(bytearray(memoryview(raw)[header:]), dtype=torch.uint8).reshape(dims)  # one copy, not two


def read(path: Path, magic: int) -> torch.Tensor:
    """Read an IDX file whose magic number must be `magic`, gunzipping it if it is gzip data.

    Compression is recognised from the content, not the name: mirrors and unpackers do not
    always keep the `.gz` suffix honest.
    """
    try:
        raw = path.read_bytes()
        if raw[:2] == GZIP_MAGIC:
            raw = gzip.decompress(raw)
    except (OSError, EOFError, zlib.error) as e:  # gzip.BadGzipFile is an OSError
        raise UserError(f"{path}: cannot be read ({e}); the file is truncated or corrupt.") from e
    return parse(raw, magic, str(path))


def encode(data: torch.Tensor) -> bytes:
    """IDX bytes for a uint8 tensor of 1 (labels) or 3 (images) dimensions."""
    magic = {1: LABELS_MAGIC, 3: IMAGES_MAGIC}[data.dim()]
    header = struct.pack(f">I{data.dim()}I", magic, *data.shape)
    data = data.to(torch.uint8).contiguous()
    return header + ctypes.string_at(data.data_ptr(), data.numel())  # no numpy needed
