"""Tiny IDX datasets for the data tests: four files written by `write_idx`.

The tensors are random but seeded, so each test knows exactly what a loader must
return; `md5s` gives the `.gz` checksums a test `Source` needs to accept them.
"""

import contextlib
import gzip
import hashlib
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path

import torch

from mnist_ddp.data import datasets, idx

# Children of the tests run one thread each: on a small shared box, two or more OpenMP threads per
# process spin against each other and run many times slower (and the timings are never asserted).
ONE_THREAD = {"OMP_NUM_THREADS": "1"}


def write_idx(path: Path, data: torch.Tensor) -> None:
    """Write `data` as an IDX file, gzip-compressed when the name ends in .gz (the package only reads them)."""
    raw = idx.encode(data)
    path.write_bytes(gzip.compress(raw, mtime=0) if path.suffix == ".gz" else raw)  # mtime=0: same bytes each time


@contextlib.contextmanager
def one_thread() -> Iterator[None]:
    """The same for work done inside the pytest process."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def make_splits(n_train: int = 48, n_test: int = 24, seed: int = 0) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """{"train": (images, labels), "test": (images, labels)}: uint8 28x28 images, labels 0-9."""
    g = torch.Generator().manual_seed(seed)
    return {split: (torch.randint(0, 256, (n, 28, 28), generator=g, dtype=torch.uint8),
                    torch.randint(0, 10, (n,), generator=g, dtype=torch.uint8))
            for split, n in (("train", n_train), ("test", n_test))}


def write_files(folder: Path, splits: dict[str, tuple[torch.Tensor, torch.Tensor]], gz: bool = True,
                only: tuple[str, ...] = ("train", "test")) -> dict[str, Path]:
    """Write the IDX files of `only` splits under their standard names; returns {file name: path}."""
    folder.mkdir(parents=True, exist_ok=True)
    written = {}
    for (split, part), base in datasets.SPLIT_FILES.items():
        if split in only:
            name = base + (".gz" if gz else "")
            write_idx(folder / name, splits[split][0 if part == "images" else 1])
            written[name] = folder / name
    return written


def md5s(files: dict[str, Path]) -> dict[str, str]:
    return {name: hashlib.md5(path.read_bytes()).hexdigest() for name, path in files.items()}


def source_for(md5: dict[str, str], mirrors: tuple[str, ...] = ()) -> datasets.Source:
    """The real MNIST entry, with the checksums (and mirrors) of our test files."""
    return replace(datasets.SOURCES["mnist"], md5=md5, mirrors=mirrors)

