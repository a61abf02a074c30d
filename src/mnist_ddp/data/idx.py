"""Read and write the IDX files MNIST ships in, refusing anything malformed.

A truncated download or a file of the wrong kind must fail loudly here, naming the
file, rather than turn into a silently wrong tensor further down.
"""

import ctypes
import math
import struct
from pathlib import Path

import torch

from ..common import inputfile
from ..common.errors import UserError

IMAGES_MAGIC = 2051  # 0x00000803: unsigned bytes, 3 dimensions (count, rows, cols)
LABELS_MAGIC = 2049  # 0x00000801: unsigned bytes, 1 dimension (count)
_NDIM = {IMAGES_MAGIC: 3, LABELS_MAGIC: 1}
_KIND = {IMAGES_MAGIC: "images", LABELS_MAGIC: "labels"}
GZIP_MAGIC = b"\x1f\x8b"
SIDE = 28  # MNIST's images are 28x28, and this ConvNet takes nothing else
MOST = 250_000  # images (or labels) read from one file: 4x MNIST's 60,000, ~200 MB; more is not a dataset of ours


def expected_size(start: bytes, magic: int, name: str) -> int:
    """The bytes a whole IDX file must have, from its first `header_size(magic)` bytes: refused unless it is one
    of `magic`'s kind that this model can use (28x28 images, at most `MOST` of them)."""
    if len(start) < 4:
        raise UserError(f"{name}: {len(start)} bytes is too short to be an IDX file.")
    (found,) = struct.unpack(">I", start[:4])
    if found != magic:
        raise UserError(f"{name}: not an IDX {_KIND[magic]} file (magic number {found}, expected {magic}).")
    header = header_size(magic)
    if len(start) < header:
        raise UserError(f"{name}: the IDX header is truncated ({len(start)} bytes).")
    dims = struct.unpack(f">{_NDIM[magic]}I", start[4:header])
    if dims[1:] and dims[1:] != (SIDE, SIDE):
        raise UserError(f"{name}: images are {dims[1:]}, expected {SIDE}x{SIDE}.")
    if dims[0] > MOST:
        raise UserError(f"{name}: its header says {dims[0]:,} {_KIND[magic]}, more than the {MOST:,} mnist-ddp reads "
                        f"from one file (MNIST's has 60,000).")
    return header + math.prod(dims)


def header_size(magic: int) -> int:
    return 4 + 4 * _NDIM[magic]


def parse(raw: bytes, magic: int, name: str) -> torch.Tensor:
    """Decode IDX bytes whose magic number must be `magic` into a uint8 tensor."""
    size = expected_size(raw[:header_size(magic)], magic, name)
    header = header_size(magic)
    dims = struct.unpack(f">{_NDIM[magic]}I", raw[4:header])
    if len(raw) != size:
        raise UserError(
            f"{name}: header says {'x'.join(map(str, dims))} = {size - header} bytes of data "
            f"but the file holds {len(raw) - header}; it is truncated or corrupt."
        )
    if not math.prod(dims):  # frombuffer refuses an empty buffer
        return torch.empty(dims, dtype=torch.uint8)
    return torch.frombuffer(bytearray(memoryview(raw)[header:]), dtype=torch.uint8).reshape(dims)  # one copy, not two


def read(path: Path, magic: int) -> torch.Tensor:
    """Read an IDX file whose magic number must be `magic`, gunzipping it if it is gzip data, never past the size
    its header promises (`inputfile`).

    Compression is recognised from the content, not the name: mirrors and unpackers do not
    always keep the `.gz` suffix honest.
    """
    name = inputfile.shown(path)
    most = header_size(magic) + MOST * (SIDE * SIDE if magic == IMAGES_MAGIC else 1)
    raw = inputfile.read(path, most, f"file of IDX {_KIND[magic]}")
    if raw[:2] == GZIP_MAGIC:
        raw = inputfile.inflate(raw, header_size(magic), lambda start: expected_size(start, magic, name), name)
    return parse(raw, magic, name)


def encode(data: torch.Tensor) -> bytes:
    """IDX bytes for a uint8 tensor of 1 (labels) or 3 (images) dimensions."""
    magic = {1: LABELS_MAGIC, 3: IMAGES_MAGIC}[data.dim()]
    header = struct.pack(f">I{data.dim()}I", magic, *data.shape)
    data = data.to(torch.uint8).contiguous()
    return header + ctypes.string_at(data.data_ptr(), data.numel())  # no numpy needed
