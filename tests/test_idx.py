"""IDX files: what we write reads back bit for bit, and every kind of damage is refused by name."""

import gzip
import re
import struct
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from conftest import run_cli
from datafiles import ONE_THREAD, make_splits, write_files, write_idx
from mnist_ddp.common.config import DataConfig
from mnist_ddp.common.errors import UserError
from mnist_ddp.data import datasets, idx


@pytest.mark.parametrize("name", ["data-idx3-ubyte", "data-idx3-ubyte.gz"])
@pytest.mark.parametrize("shape", [(5, 28, 28), (0, 28, 28), (9,), (0,)])
def test_round_trip(tmp_path: Path, name: str, shape: tuple[int, ...]) -> None:
    data = torch.randint(0, 256, shape, dtype=torch.uint8)
    path = tmp_path / name
    write_idx(path, data)
    magic = idx.IMAGES_MAGIC if len(shape) == 3 else idx.LABELS_MAGIC
    back = idx.read(path, magic)
    assert back.dtype == torch.uint8 and back.shape == data.shape
    assert torch.equal(back, data)


def test_gzip_is_recognised_by_content_not_name(tmp_path: Path) -> None:
    data = torch.randint(0, 10, (20,), dtype=torch.uint8)
    gz, plain = tmp_path / "labels.gz", tmp_path / "labels"
    write_idx(gz, data)
    gz.rename(plain)  # gzip bytes without the suffix
    assert torch.equal(idx.read(plain, idx.LABELS_MAGIC), data)
    plain.write_bytes(idx.encode(data))
    plain.rename(gz)  # plain bytes behind a .gz name
    assert torch.equal(idx.read(gz, idx.LABELS_MAGIC), data)


def test_header_is_big_endian_idx() -> None:
    raw = idx.encode(torch.zeros(2, 3, 4, dtype=torch.uint8))
    assert struct.unpack(">IIII", raw[:16]) == (2051, 2, 3, 4) and len(raw) == 16 + 24


def _gz(raw: bytes) -> bytes:
    return gzip.compress(raw, mtime=0)


IMAGES = idx.encode(torch.randint(0, 256, (4, 28, 28), dtype=torch.uint8))
# Each case turns a good images file into a bad one; the reader must name the file in one sentence.
CORRUPTIONS: dict[str, Callable[[], bytes]] = {
    "empty": lambda: b"",
    "shorter than a magic number": lambda: IMAGES[:3],
    "wrong magic (a labels file)": lambda: struct.pack(">II", 2049, 4) + bytes(4),
    "wrong magic (garbage)": lambda: b"<html>404 not found</html>" + bytes(100),
    "truncated header": lambda: IMAGES[:10],
    "truncated data": lambda: IMAGES[:-1],
    "half the data": lambda: IMAGES[: 16 + len(IMAGES[16:]) // 2],
    "extra bytes": lambda: IMAGES + b"\x00",
    "truncated gzip": lambda: _gz(IMAGES)[:-20],
    "gzip with a damaged stream": lambda: _gz(IMAGES)[:12] + bytes(40) + _gz(IMAGES)[52:],
    "gzip with a wrong CRC": lambda: _gz(IMAGES)[:-8] + bytes(8),
    "gzip of a truncated file": lambda: _gz(IMAGES[:-100]),
    "gzip magic, then nothing": lambda: b"\x1f\x8b",
}


@pytest.mark.parametrize("case", CORRUPTIONS)
@pytest.mark.parametrize("name", ["t10k-images-idx3-ubyte", "t10k-images-idx3-ubyte.gz"])
def test_corrupt_file_is_a_user_error_naming_it(tmp_path: Path, case: str, name: str) -> None:
    path = tmp_path / name
    path.write_bytes(CORRUPTIONS[case]())
    with pytest.raises(UserError) as e:
        idx.read(path, idx.IMAGES_MAGIC)
    message = str(e.value)
    assert str(path) in message and "\n" not in message


def _load(folder: Path) -> datasets.Dataset:
    return datasets.load(DataConfig("mnist", data_dir=folder, download=False))


@pytest.fixture
def mnist_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """Four good files in tmp/mnist, with the working directory (./data) and system dirs out of reach."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(datasets, "SYSTEM_DIRS", ())
    write_files(tmp_path / "mnist", make_splits())
    return tmp_path / "mnist"


def test_good_files_load(mnist_dir: Path) -> None:
    data = _load(mnist_dir)
    expected = make_splits()
    for split in ("train", "test"):
        got = getattr(data, split)
        assert torch.equal(got.images, expected[split][0])
        assert torch.equal(got.labels, expected[split][1].long()) and got.labels.dtype == torch.int64


def test_label_count_must_match_image_count(mnist_dir: Path) -> None:
    write_idx(mnist_dir / "t10k-labels-idx1-ubyte.gz", torch.zeros(23, dtype=torch.uint8))  # 24 images
    with pytest.raises(UserError, match=re.escape("t10k-labels-idx1-ubyte.gz: 23 labels for 24 images")):
        _load(mnist_dir)


def test_labels_must_be_digits(mnist_dir: Path) -> None:
    labels = torch.zeros(48, dtype=torch.uint8)
    labels[7] = 10
    write_idx(mnist_dir / "train-labels-idx1-ubyte.gz", labels)
    with pytest.raises(UserError, match=re.escape("train-labels-idx1-ubyte.gz: label 10 is outside 0-9")):
        _load(mnist_dir)


def test_images_must_be_28x28(mnist_dir: Path) -> None:
    write_idx(mnist_dir / "t10k-images-idx3-ubyte.gz", torch.zeros(24, 32, 32, dtype=torch.uint8))
    with pytest.raises(UserError, match=r"t10k-images-idx3-ubyte.gz: images are \(32, 32\), expected 28x28"):
        _load(mnist_dir)


def test_swapped_files_are_refused(mnist_dir: Path) -> None:
    images = mnist_dir / "train-images-idx3-ubyte.gz"
    labels = mnist_dir / "train-labels-idx1-ubyte.gz"
    images.write_bytes(labels.read_bytes())
    with pytest.raises(UserError, match="not an IDX images file"):
        _load(mnist_dir)


def test_cli_names_the_corrupt_file_exit_2_no_traceback(mnist_dir: Path, tmp_path: Path) -> None:
    bad = mnist_dir / "train-images-idx3-ubyte.gz"
    bad.write_bytes(bad.read_bytes()[:-30])  # a download cut short
    r = run_cli("train", "--dataset", "mnist", "--data-dir", str(mnist_dir), "--no-download", "--no-progress",
                "--no-plots", "--out", str(tmp_path / "run"), cwd=tmp_path, env=ONE_THREAD, timeout=120)
    assert r.returncode == 2, r.stderr
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and str(bad) in lines[0] and lines[0].startswith("mnist-ddp: error:"), r.stderr
    assert "Traceback" not in r.stderr + r.stdout


def test_empty_split_is_refused(mnist_dir: Path) -> None:
    write_idx(mnist_dir / "t10k-images-idx3-ubyte.gz", torch.zeros(0, 28, 28, dtype=torch.uint8))
    write_idx(mnist_dir / "t10k-labels-idx1-ubyte.gz", torch.zeros(0, dtype=torch.uint8))
    with pytest.raises(UserError, match=re.escape("t10k-images-idx3-ubyte.gz: holds no images")):
        _load(mnist_dir)
