"""The synthetic set is made once per node and shared through a cache of plain IDX files; so are a real
dataset's .gz files, decoded.

The local processes must all train on the bytes the generator makes, whether they made them, read
them from the cache, or (cache folder read-only) each made their own; a damaged cache file is made
again, never trusted; a changed .gz is decoded again.
"""

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from conftest import TINY, cli_env, run_cli
from datafiles import ONE_THREAD, make_splits, one_thread, write_files
from mnist_ddp.common.config import DataConfig
from mnist_ddp.data import datasets, idx, synthetic
from mnist_ddp.outputs import checkpoint

SEEDS = datasets.SYNTHETIC_SEEDS
FILES = {f"{split}-{n}-seed{SEEDS[split]}-{part}{digest}" for split, n in (("train", 800), ("test", 200))
         for part in ("images", "labels") for digest in ("", ".sha256")}  # TINY's sizes, each file and its SHA-256


def _data_line(stdout: str) -> str:
    said = [line for line in stdout.splitlines() if line.startswith("data: ")]
    assert len(said) == 1, stdout
    return said[0]


def _assert_same(a: datasets.Dataset, b: datasets.Dataset) -> None:
    for split in ("train", "test"):
        for part in ("images", "labels"):
            x, y = getattr(getattr(a, split), part), getattr(getattr(b, split), part)
            assert x.dtype == y.dtype and torch.equal(x, y), (split, part)


def _in_read_only_folder(folder: Path, args: list[str], env: dict[str, str]) -> subprocess.CompletedProcess:
    """`python -m mnist_ddp ARGS` with `folder`, its working directory, mounted read-only (root ignores modes)."""
    if os.geteuid() != 0 or shutil.which("unshare") is None:
        pytest.skip("a read-only mount needs root and unshare (util-linux)")
    folder.mkdir()
    mounted = 'mount --bind -o ro "$0" "$0" && cd "$0" && exec "$@"'
    r = subprocess.run(["unshare", "-m", "sh", "-c", mounted, str(folder), sys.executable, "-m", "mnist_ddp", *args],
                       cwd=folder, env=cli_env(env), text=True, capture_output=True, timeout=180)
    if "mount:" in r.stderr or "unshare:" in r.stderr:
        pytest.skip(f"cannot mount a folder read-only here: {r.stderr.strip()}")
    return r


def test_two_processes_share_one_cached_copy_and_train_as_without_it(tmp_path: Path) -> None:
    args = ["train", *TINY, "-g", "2"]
    cached = run_cli(*args, "--out", str(tmp_path / "cached"), cwd=tmp_path, env=ONE_THREAD)
    assert cached.returncode == 0, cached.stderr
    folder = tmp_path / "data" / "synthetic" / f"v{synthetic.VERSION}"
    assert {p.name for p in folder.iterdir()} == FILES | {".lock"}  # one set, no temp files left behind
    said = _data_line(cached.stdout)  # rank 0 either made it or waited for rank 1 to
    assert f"{folder.relative_to(tmp_path)} (made and cached in" in said or "(made by another process" in said, said

    # Each process makes its own when the cache cannot be written: the bytes the generator makes,
    # so the same weights prove that both ranks of the cached run trained on exactly those bytes.
    uncached = _in_read_only_folder(tmp_path / "read-only", [*args, "--out", str(tmp_path / "uncached")], ONE_THREAD)
    assert uncached.returncode == 0, uncached.stderr
    unwritable = f"data/synthetic/v{synthetic.VERSION} cannot be written (Read-only file system)"
    assert f"by each process: {unwritable}" in _data_line(uncached.stdout)
    assert not list((tmp_path / "read-only").iterdir())
    mine, theirs = (checkpoint.load(tmp_path / run / "checkpoint.pt")["model"] for run in ("cached", "uncached"))
    assert mine.keys() == theirs.keys() and all(torch.equal(mine[k], theirs[k]) for k in mine)


def test_the_cache_holds_the_generators_bytes_and_a_damaged_file_is_made_again(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    req = DataConfig("synthetic", data_dir=Path("given"), train_samples=50, test_samples=20)
    folder = Path("given", "synthetic", f"v{synthetic.VERSION}")
    with one_thread():
        first = datasets.load(req)
        assert first.where.startswith(f"{folder} (made and cached in")
        images, labels = synthetic.generate(50, SEEDS["train"])
        assert torch.equal(first.train.images, images) and torch.equal(first.train.labels, labels)
        files = {p: p.read_bytes() for p in folder.iterdir() if p.name != ".lock"}
        assert len(files) == 8  # four files, each with its digest

        cached = datasets.load(req)
        assert cached.where.startswith(f"{folder} (cached, read in")
        _assert_same(cached, first)
        train_images = folder / f"train-50-seed{SEEDS['train']}-images"
        train_images.write_bytes(files[train_images][:1000])  # truncated
        (folder / f".{train_images.name}.tmp-1").write_bytes(b"left by a maker killed mid-write")
        (folder / f"test-20-seed{SEEDS['test']}-labels").write_bytes(b"junk")
        again = datasets.load(req)
    assert again.where.startswith(f"{folder} (made and cached in")
    assert {p: p.read_bytes() for p in folder.iterdir() if p.name != ".lock"} == files
    _assert_same(again, first)


def test_a_cache_file_with_a_flipped_pixel_is_made_again(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Bit rot in a cached file that still parses as IDX (a pixel flipped: the magic number, sizes and labels all
    pass): the run must train on the generator's bytes, not on the flipped ones, so the file is made again."""
    monkeypatch.chdir(tmp_path)
    req = DataConfig("synthetic", data_dir=Path("given"), train_samples=50, test_samples=20)
    train_images = Path("given", "synthetic", f"v{synthetic.VERSION}", f"train-50-seed{SEEDS['train']}-images")
    with one_thread():
        first = datasets.load(req)
        raw = bytearray(train_images.read_bytes())
        raw[16 + 28 * 14 + 14] ^= 0xFF  # the middle pixel of the first image
        train_images.write_bytes(bytes(raw))
        again = datasets.load(req)
    assert "(made and cached in" in again.where, again.where
    _assert_same(again, first)


def _expect(splits: dict[str, tuple[torch.Tensor, torch.Tensor]], data: datasets.Dataset) -> None:
    for split in ("train", "test"):
        got = getattr(data, split)
        assert torch.equal(got.images, splits[split][0]) and torch.equal(got.labels, splits[split][1].long()), split


def test_gz_files_are_decoded_once_and_a_changed_file_again(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The first load decodes the .gz files into a folder of plain IDX files, the next reads those and never
    inflates a .gz; a file replaced by another (a new download) is decoded again, never answered from the
    old cache."""
    monkeypatch.chdir(tmp_path)
    splits = make_splits()
    files = write_files(tmp_path / "mnist", splits)
    req = DataConfig(dataset="mnist", data_dir=tmp_path / "mnist", download=False)
    first = datasets.load(req)
    _expect(splits, first)
    assert "(made and cached in" in first.cache, first.cache
    [folder] = (tmp_path / "mnist" / "decoded").iterdir()
    inflated = []
    real_read = idx.read
    monkeypatch.setattr(idx, "read", lambda *a, **k: inflated.append(a[0]) or real_read(*a, **k))
    again = datasets.load(req)
    _expect(splits, again)
    assert inflated == [] and f"{folder} (cached, read in" in again.cache, again.cache

    changed = make_splits(seed=1)
    write_files(tmp_path / "mnist", changed)
    os.utime(files["train-labels-idx1-ubyte.gz"], ns=(1, 1))  # a time no write had: the times are in the key
    renewed = datasets.load(req)
    _expect(changed, renewed)
    assert len(inflated) == 4 and "(made and cached in" in renewed.cache, renewed.cache


def test_plain_idx_files_are_read_as_they_are(tmp_path: Path) -> None:
    splits = make_splits()
    write_files(tmp_path / "mnist", splits, gz=False)
    data = datasets.load(DataConfig(dataset="mnist", data_dir=tmp_path / "mnist", download=False))
    _expect(splits, data)
    assert data.cache == "" and not (tmp_path / "mnist" / "decoded").exists()


def test_the_data_line_says_where_the_decoded_files_came_from(tmp_path: Path) -> None:
    write_files(tmp_path / "mnist", make_splits(n_train=40))
    args = ["train", "--dataset", "mnist", "--data-dir", str(tmp_path / "mnist"), "--epochs", "1", "--no-plots",
            "--no-progress"]
    lines = [_data_line(run_cli(*args, "--out", str(tmp_path / out), cwd=tmp_path, env=ONE_THREAD).stdout)
             for out in ("a", "b")]
    folder = next((tmp_path / "mnist" / "decoded").iterdir())
    assert lines[0].startswith(f"data: mnist, 40 train / 24 test images, from {tmp_path / 'mnist'}; .gz decoded "
                               f"once: {folder} (made and cached in "), lines[0]
    assert f"; .gz decoded once: {folder} (cached, read in " in lines[1], lines[1]
