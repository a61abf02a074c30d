"""Every file mnist-ddp reads from a user or from elsewhere is read here, under the same rules: a regular file (a
link to one is followed; a FIFO, a device, a folder or a link loop is refused before any read, so none can hang or
stream for ever), its size from `fstat` before any read and at most what its kind can hold, and a compressed one
inflated only up to what its header promises. Whatever fails is one `UserError` naming the file, printably
(docs/design/bad-input.md).
"""

import os
import stat
import zlib
from collections.abc import Callable
from pathlib import Path

from .errors import UserError
from .untrusted import printable

_KINDS = ((stat.S_ISDIR, "a folder"), (stat.S_ISFIFO, "a named pipe"), (stat.S_ISCHR, "a character device"),
          (stat.S_ISBLK, "a block device"), (stat.S_ISSOCK, "a socket"))


def shown(path: str | Path) -> str:
    """A file name as it may be printed: control characters escaped, cut to a line's worth."""
    return printable(str(path), limit=200)


def read(path: str | Path, most: int, what: str) -> bytes:
    """The bytes of `path`, `what` it is meant to be (for the error): a regular file of at most `most` bytes."""
    fd = open_regular(path, what)
    try:
        size = os.fstat(fd).st_size
        if size > most:
            raise UserError(f"{shown(path)}: {size:,} bytes, more than a {what} can hold ({most:,} at most).")
        chunks, left = [], most + 1  # a file that grows while it is read is cut at `most` + 1, and refused
        while left and (chunk := os.read(fd, min(left, 1 << 24))):
            chunks.append(chunk)
            left -= len(chunk)
    except OSError as e:
        raise UserError(f"{shown(path)}: cannot be read ({(e.strerror or str(e)).lower()}).") from None
    finally:
        os.close(fd)
    data = b"".join(chunks)
    if len(data) > most:
        raise UserError(f"{shown(path)}: grew past {most:,} bytes while it was read; a {what} does not.")
    return data


def open_regular(path: str | Path, what: str) -> int:
    """A file descriptor of `path`, open for reading, refused unless it is a regular file. Opening does not
    block (a FIFO with no writer), and nothing is read before the kind is known."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    except FileNotFoundError:
        raise UserError(f"{shown(path)}: no such file (a {what} was expected).") from None
    except OSError as e:
        raise UserError(f"{shown(path)}: cannot be read as a {what} ({(e.strerror or str(e)).lower()}).") from None
    mode = os.fstat(fd).st_mode
    if not stat.S_ISREG(mode):
        os.close(fd)
        kind = next((name for test, name in _KINDS if test(mode)), "not a regular file")
        raise UserError(f"{shown(path)}: {kind}, not a file; a {what} must be a regular file.")
    os.set_blocking(fd, True)
    return fd


def inflate(data: bytes, head: int, expected: Callable[[bytes], int], name: str | Path) -> bytes:
    """The gzip `data` inflated, never past what its own first `head` bytes promise: `expected(head_bytes)` reads
    them (refusing what it must) and says how many bytes the whole must be; more or fewer is refused."""
    d = zlib.decompressobj(wbits=16 + zlib.MAX_WBITS)  # gzip only
    try:
        start = d.decompress(data, head)
        if len(start) < head:
            raise UserError(f"{shown(name)}: its gzip data ends after {len(start)} bytes, inside the header.")
        size = expected(start)
        rest = d.decompress(d.unconsumed_tail, size - head + 1)
    except zlib.error as e:
        raise UserError(f"{shown(name)}: damaged gzip data ({e}).") from None
    if len(rest) > size - head:
        raise UserError(f"{shown(name)}: its gzip data inflates past the {size:,} bytes its header promises.")
    if not d.eof or len(rest) < size - head:
        raise UserError(f"{shown(name)}: its gzip data ends before the {size:,} bytes its header promises "
                        f"(a truncated file).")
    return start + rest
