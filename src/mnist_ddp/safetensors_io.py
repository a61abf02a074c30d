"""The safetensors format, written and read in plain Python: an 8-byte little-endian header length, a JSON header
(each tensor's dtype, shape and byte range, and an optional "__metadata__" of strings), then the tensors' bytes.

Nothing in it is executed or unpickled, so a stranger's file can at worst be refused; every field of the header
is checked before it is used, and the byte ranges must tile the data exactly (docs/outputs.md). The `safetensors`
package reads what `encode` writes and writes what `decode` reads (tests/test_model_file.py).
"""

import ctypes
import json
import struct
from pathlib import Path
from typing import Any

import torch

from .errors import UserError

DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
          "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
          "BOOL": torch.bool}
NAMES = {dtype: name for name, dtype in DTYPES.items()}
MAX_HEADER = 100_000_000  # bytes: the reference implementation's limit
SUFFIX = ".safetensors"


def _bytes(t: torch.Tensor) -> bytes:
    """A CPU tensor's bytes, in its own (little-endian: every platform torch ships for) order."""
    t = t.detach().to("cpu").contiguous()
    return bytes((ctypes.c_char * (t.numel() * t.element_size())).from_address(t.data_ptr())) if t.numel() else b""


def encode(tensors: dict[str, torch.Tensor], metadata: dict[str, str]) -> bytes:
    """The file's bytes: `tensors` in name order, the header padded with spaces so the data starts 8-aligned."""
    header: dict[str, Any] = {"__metadata__": metadata} if metadata else {}
    chunks, at = [], 0
    for name in sorted(tensors):
        t = tensors[name]
        if t.dtype not in NAMES:
            raise ValueError(f"{name}: safetensors has no dtype {t.dtype}")
        chunks.append(_bytes(t))
        header[name] = {"dtype": NAMES[t.dtype], "shape": list(t.shape), "data_offsets": [at, at + len(chunks[-1])]}
        at += len(chunks[-1])
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    return struct.pack("<Q", len(text)) + text + b"".join(chunks)


def is_safetensors(path: Path) -> bool:
    """Whether `path` is meant as a safetensors file: named so, or starting like one (a header length, then `{`);
    PyTorch's checkpoints start otherwise (a zip's "PK", a pickle's 0x80)."""
    if path.suffix == SUFFIX:
        return True
    try:
        with open(path, "rb") as f:
            start = f.read(9)
    except OSError:
        return False
    return len(start) == 9 and start[8:] == b"{" and struct.unpack("<Q", start[:8])[0] <= path.stat().st_size


def read(path: Path) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """The tensors and metadata of a safetensors file; anything else, or a damaged one, is one sentence naming it."""
    try:
        data = path.read_bytes()
    except OSError as e:
        raise UserError(f"{path}: cannot be read ({e.strerror}).") from None
    return decode(data, path)


def decode(data: bytes, name: str | Path) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """`encode`'s inverse, for bytes from anywhere: every header field is checked before it is trusted."""
    def refuse(why: str) -> UserError:
        return UserError(f"{name}: not a safetensors file, or a damaged one: {why}.")

    if len(data) < 8:
        raise refuse(f"{len(data)} bytes, fewer than the 8 of a header length")
    size = struct.unpack("<Q", data[:8])[0]
    if size > min(MAX_HEADER, len(data) - 8):
        raise refuse(f"its header length {size:,} is more than the {len(data) - 8:,} bytes that follow it")
    try:
        header = json.loads(data[8:8 + size].decode(), object_pairs_hook=_no_repeats)
    except (UnicodeDecodeError, ValueError, RecursionError) as e:
        raise refuse(f"its header is not JSON ({str(e).split(':')[0]})") from None
    if not isinstance(header, dict):
        raise refuse("its header is not a JSON object")
    metadata = header.pop("__metadata__", {})
    if not (isinstance(metadata, dict) and all(isinstance(v, str) for v in metadata.values())):
        raise refuse("its __metadata__ is not an object of strings")
    body = data[8 + size:]
    ranges = sorted(((_entry(key, value, refuse), key) for key, value in header.items()),
                    key=lambda entry: (entry[0][:2], entry[1]))  # by byte range
    at = 0
    for (begin, end, _, _), key in ranges:
        if begin != at:
            raise refuse(f"tensor {key!r} starts at byte {begin} of the data, not {at}, where the one before it ends")
        at = end
    if at != len(body):
        raise refuse(f"its tensors take {at:,} bytes, but {len(body):,} follow the header (a truncated or padded file)")
    tensors = {}
    for (begin, end, dtype, shape), key in ranges:
        chunk = bytearray(body[begin:end])  # a copy: aligned, writable, and not a view of `data`
        tensors[key] = torch.frombuffer(chunk, dtype=dtype).reshape(shape) if chunk else torch.empty(shape, dtype=dtype)
    return tensors, metadata


def _no_repeats(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    """A JSON object whose keys are each said once: a repeated one would mean two tensors of one name."""
    out = dict(pairs)
    if len(out) != len(pairs):
        raise ValueError("a key repeated")
    return out


def _entry(key: str, value: Any, refuse: Any) -> tuple[int, int, torch.dtype, list[int]]:
    """One tensor's header entry, checked: (begin, end, dtype, shape), its byte count that of its shape."""
    if not (isinstance(value, dict) and set(value) == {"dtype", "shape", "data_offsets"}):
        raise refuse(f"tensor {key!r} is not described by exactly dtype, shape and data_offsets")
    dtype, shape, offsets = DTYPES.get(value["dtype"]), value["shape"], value["data_offsets"]
    if dtype is None:
        raise refuse(f"tensor {key!r} has the unknown dtype {str(value['dtype'])[:20]!r}")
    if not (isinstance(shape, list) and all(type(n) is int and n >= 0 for n in shape)):
        raise refuse(f"tensor {key!r} has a shape that is not a list of sizes")
    if not (isinstance(offsets, list) and len(offsets) == 2 and all(type(n) is int for n in offsets)
            and 0 <= offsets[0] <= offsets[1]):
        raise refuse(f"tensor {key!r} has data_offsets that are not a byte range")
    count = 1
    for n in shape:
        count *= n
    if offsets[1] - offsets[0] != count * dtype.itemsize:
        raise refuse(f"tensor {key!r} of shape {shape} needs {count * dtype.itemsize:,} bytes, not the "
                     f"{offsets[1] - offsets[0]:,} of its data_offsets")
    return offsets[0], offsets[1], dtype, shape
