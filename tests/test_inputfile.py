"""inputfile.py, the rules every file read from a user or from elsewhere is read under: a regular file of at most
its kind's size, opened without blocking, inflated no further than its header promises; each refusal one sentence
naming the file, printably. (The whole command under generated input: test_fuzz.py.)"""

import gzip
import os
import struct
import zlib
from pathlib import Path

import pytest

from fuzzing import make_fifo, make_socket
from mnist_ddp.common import inputfile
from mnist_ddp.common.errors import UserError


def test_a_regular_file_is_read_whole_up_to_its_bound(tmp_path: Path) -> None:
    f = tmp_path / "f"
    f.write_bytes(b"x" * 100)
    assert inputfile.read(f, 100, "thing") == b"x" * 100
    assert inputfile.read(f, 1000, "thing") == b"x" * 100
    (tmp_path / "empty").write_bytes(b"")
    assert inputfile.read(tmp_path / "empty", 0, "thing") == b""
    with pytest.raises(UserError, match=r"^.*/f: 100 bytes, more than a thing can hold \(99 at most\)\.$"):
        inputfile.read(f, 99, "thing")


def test_a_link_to_a_regular_file_is_followed(tmp_path: Path) -> None:
    (tmp_path / "f").write_bytes(b"data")
    (tmp_path / "link").symlink_to("f")
    assert inputfile.read(tmp_path / "link", 10, "thing") == b"data"


@pytest.mark.parametrize(("make", "said"), [
    (make_fifo, "a named pipe, not a file"),
    (lambda p: p.mkdir(), "a folder, not a file"),
    (lambda p: p.symlink_to("/dev/zero"), "a character device, not a file"),
    (make_socket, "cannot be read as a thing"),  # a socket cannot even be opened
    (lambda p: p.symlink_to(p.name), "cannot be read as a thing (too many levels of symbolic links)"),
    (lambda p: p.symlink_to("nowhere"), "no such file (a thing was expected)"),
], ids=["fifo", "folder", "device", "socket", "link loop", "dangling link"])
def test_what_is_not_a_regular_file_is_refused_before_any_read(tmp_path: Path, make: object, said: str) -> None:
    """A FIFO with no writer would block an open or a read for ever: it is opened without blocking and refused."""
    path = tmp_path / "x"
    make(path)  # type: ignore[operator]
    with pytest.raises(UserError) as refused:
        inputfile.read(path, 1 << 20, "thing")
    assert str(refused.value).startswith(f"{path}: ") and said in str(refused.value), refused.value


def test_names_are_shown_printably(tmp_path: Path) -> None:
    path = tmp_path / "a\x1b[2Jb\nc"
    with pytest.raises(UserError) as refused:
        inputfile.read(path, 10, "thing")
    assert "\\x1b[2Jb\\nc" in str(refused.value) and "\x1b" not in str(refused.value)
    assert inputfile.shown("x" * 500).endswith("…") and len(inputfile.shown("x" * 500)) == 201


def _header(start: bytes) -> int:
    """As a reader of a 4-byte header would: the header says how many bytes follow it; at most 1,000."""
    (n,) = struct.unpack(">I", start)
    if n > 1000:
        raise UserError(f"says {n}")
    return 4 + n


@pytest.mark.parametrize("body", [b"", b"abc", bytes(1000)])
def test_inflate_gives_exactly_what_the_header_promises(body: bytes) -> None:
    data = struct.pack(">I", len(body)) + body
    assert inputfile.inflate(gzip.compress(data), 4, _header, "f") == data


@pytest.mark.parametrize(("data", "said"), [
    (gzip.compress(struct.pack(">I", 3) + b"abcd"), "inflates past the 7 bytes its header promises"),
    (gzip.compress(struct.pack(">I", 5) + b"abc"), "ends before the 9 bytes its header promises"),
    (gzip.compress(struct.pack(">I", 5) + b"abcde")[:-12], "ends before the 9 bytes its header promises"),
    (gzip.compress(b"ab"), "ends after 2 bytes, inside the header"),
    (gzip.compress(struct.pack(">I", 10**6)), "says 1000000"),
    (b"\x1f\x8b" + bytes(30), "damaged gzip data"),
], ids=["longer", "shorter", "cut", "no header", "header refused", "not gzip"])
def test_inflate_refuses_what_the_header_does_not_promise(data: bytes, said: str) -> None:
    with pytest.raises(UserError, match=said):
        inputfile.inflate(data, 4, _header, "f")


def test_a_bomb_is_inflated_no_further_than_its_header_allows(monkeypatch: pytest.MonkeyPatch) -> None:
    """100 MB of zeros behind a header that promises 1,000 bytes: refused having inflated only 1,001 of them."""
    c = zlib.compressobj(9, zlib.DEFLATED, 16 + zlib.MAX_WBITS)
    bomb = c.compress(struct.pack(">I", 1000)) + b"".join(c.compress(bytes(1 << 20)) for _ in range(100)) + c.flush()
    inflated = []
    real = zlib.decompressobj

    class Counting:
        def __init__(self, **kwargs: int) -> None:
            self.d = real(**kwargs)

        def decompress(self, data: bytes, most: int = 0) -> bytes:
            out = self.d.decompress(data, most)
            inflated.append(len(out))
            return out

        def __getattr__(self, name: str) -> object:
            return getattr(self.d, name)

    monkeypatch.setattr(zlib, "decompressobj", Counting)  # a spy: it counts what the real one inflates
    with pytest.raises(UserError, match="inflates past the 1,004 bytes"):
        inputfile.inflate(bomb, 4, _header, "bomb")
    assert sum(inflated) == 1005


def test_a_file_whose_size_says_nothing_is_read_no_further_than_its_bound(monkeypatch: pytest.MonkeyPatch) -> None:
    """/proc's files say 0 bytes and hold more: the read stops at the bound and one byte past it, and refuses."""
    read = []
    real = os.read
    monkeypatch.setattr(os, "read", lambda fd, n: read.append(real(fd, n)) or read[-1])  # a spy: reads as os.read
    with pytest.raises(UserError, match=r"^/proc/self/status: grew past 100 bytes while it was read; a thing does "
                                        r"not\.$"):
        inputfile.read("/proc/self/status", 100, "thing")
    assert sum(map(len, read)) == 101


def test_a_file_read_in_several_pieces_is_read_whole(tmp_path: Path) -> None:
    f = tmp_path / "big"
    data = os.urandom(1 << 10) * (17 << 10)  # 17 MiB: more than one read's 16
    f.write_bytes(data)
    assert inputfile.read(f, len(data), "thing") == data


def test_a_read_that_fails_is_one_sentence_naming_the_file() -> None:
    """/proc/self/mem opens as a regular file, and reading its first page fails (nothing is mapped there)."""
    with pytest.raises(UserError, match=r"^/proc/self/mem: cannot be read \(input/output error\)\.$"):
        inputfile.read("/proc/self/mem", 100, "thing")


def test_inflate_takes_gzip_only() -> None:
    data = struct.pack(">I", 3) + b"abc"
    with pytest.raises(UserError, match=r"^f: damaged gzip data \(Error -3 while decompressing data: incorrect header "
                                        r"check\)\.$"):
        inputfile.inflate(zlib.compress(data), 4, _header, "f")


@pytest.mark.parametrize(("data", "said"), [
    (gzip.compress(struct.pack(">I", 3) + b"abcd"), "f: its gzip data inflates past the 7 bytes its header promises."),
    (gzip.compress(struct.pack(">I", 5) + b"abc"), "f: its gzip data ends before the 9 bytes its header promises (a "
                                                   "truncated file)."),
    (gzip.compress(b"ab"), "f: its gzip data ends after 2 bytes, inside the header."),
    (b"\x1f\x8b" + bytes(30), "f: damaged gzip data (Error -3 while decompressing data: unknown compression method)."),
], ids=["longer", "shorter", "no header", "not gzip"])
def test_inflates_refusals_name_the_file(data: bytes, said: str) -> None:
    with pytest.raises(UserError) as refused:
        inputfile.inflate(data, 4, _header, "f")
    assert str(refused.value) == said
