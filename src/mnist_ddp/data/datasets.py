"""Where the four IDX files of a dataset come from (`--data-dir`, `./data`, system folders, then an MD5-checked
download; `synthetic` generated and cached; `auto`: MNIST, else synthetic), and the checks they must pass.
The order and its reasons: docs/design/data-sources.md."""

import hashlib
from dataclasses import dataclass
from pathlib import Path

import torch

from ..common.config import DataConfig, Known
from ..common.errors import UserError
from . import datacache, idx, synthetic
from .download import DownloadError, fetch, file_lock

SPLIT_FILES = {  # (split, part) -> the standard base file name
    ("train", "images"): "train-images-idx3-ubyte",
    ("train", "labels"): "train-labels-idx1-ubyte",
    ("test", "images"): "t10k-images-idx3-ubyte",
    ("test", "labels"): "t10k-labels-idx1-ubyte",
}
SYNTHETIC_SIZES = {"train": 60_000, "test": 10_000}
SYNTHETIC_SEEDS = {"train": 20_240_601, "test": 20_240_602}  # fixed: the data, not the run


class DataNotFound(UserError):
    """The dataset is nowhere to be found or fetched (as opposed to found but corrupt); `failed`, what failed in a
    few words, goes into the line `--dataset auto` prints when it falls back to the synthetic digits."""

    def __init__(self, source: "Source", dirs: list[Path], why: str, failed: str) -> None:
        super().__init__(
            f"{source.name} was not found in {', '.join(map(str, dirs))}, and {why}. "
            f"Put the four IDX files ({', '.join(SPLIT_FILES.values())}, plain or .gz) in a folder "
            f"and pass --data-dir FOLDER, or train on the built-in digits with --dataset synthetic."
        )
        self.failed = failed


@dataclass(frozen=True)
class Source:
    """A published IDX dataset: where to look for it and how to download it."""

    name: Known
    torchvision_dir: str  # torchvision keeps it in <root>/<this>/raw
    mirrors: tuple[str, ...]
    md5: dict[str, str]  # .gz file name -> MD5 of the published file
    classes: tuple[str, ...]


SOURCES = {
    "mnist": Source(
        name="mnist",
        torchvision_dir="MNIST",
        mirrors=("https://ossci-datasets.s3.amazonaws.com/mnist/", "http://yann.lecun.com/exdb/mnist/"),
        md5={
            "train-images-idx3-ubyte.gz": "f68b3c2dcbeaaa9fbdd348bbdeb94873",
            "train-labels-idx1-ubyte.gz": "d53e105ee54ea40749a09fcbcd1e9432",
            "t10k-images-idx3-ubyte.gz": "9fb629c4189551a2d022fa330f9573f3",
            "t10k-labels-idx1-ubyte.gz": "ec29112dd5afa0611ce80d1b7f02629c",
        },
        classes=tuple("0123456789"),
    ),
    "fashion-mnist": Source(
        name="fashion-mnist",
        torchvision_dir="FashionMNIST",
        mirrors=("http://fashion-mnist.s3-website.eu-central-1.amazonaws.com/",),
        md5={
            "train-images-idx3-ubyte.gz": "8d4fb7e6c68d591d4c3dfef9ec88bf0d",
            "train-labels-idx1-ubyte.gz": "25c81989df183df01b3e8a0aad5dffbe",
            "t10k-images-idx3-ubyte.gz": "bef4ecab320f06d8554ea6380940ec79",
            "t10k-labels-idx1-ubyte.gz": "bb300cfdad3c16e7a12a480ee83cd310",
        },
        classes=("T-shirt/top", "Trouser", "Pullover", "Dress", "Coat",
                 "Sandal", "Shirt", "Sneaker", "Bag", "Ankle boot"),
    ),
}
SYSTEM_DIRS = (Path("/usr/share/datasets"),)


@dataclass(frozen=True)
class Split:
    """One split in memory: uint8 images (N, 28, 28) and int64 labels (N,)."""

    images: torch.Tensor
    labels: torch.Tensor


EMPTY = Split(torch.empty(0, 28, 28, dtype=torch.uint8), torch.empty(0, dtype=torch.int64))


@dataclass(frozen=True)
class Dataset:
    name: Known
    where: str  # a folder, "… (downloaded)", or where the synthetic set was made or cached: said once at start
    classes: tuple[str, ...]
    train: Split
    test: Split
    cache: str = ""  # how .gz files were had decoded (`_decoded`), for the `data:` line; "" where none is read


def candidate_dirs(source: Source, data_dir: Path | None) -> list[Path]:
    """Folders searched, in order, for the four files."""
    dirs = [data_dir, data_dir / source.name, data_dir / source.torchvision_dir / "raw"] if data_dir else []
    root = Path("data")
    return dirs + [root / source.name, root / source.torchvision_dir / "raw"] + [d / source.name for d in SYSTEM_DIRS]


def _find_file(folder: Path, base: str) -> Path | None:
    for name in (base, base + ".gz", base.replace("-idx", ".idx")):  # last: some mirrors' spelling
        if (folder / name).is_file():
            return folder / name
    return None


def _find_files(folder: Path, splits: tuple[str, ...]) -> dict[tuple[str, str], Path] | None:
    """The files of `splits` in `folder`, each plain or .gz, or None if any is missing."""
    found = {key: _find_file(folder, base) for key, base in SPLIT_FILES.items() if key[0] in splits}
    return None if None in found.values() else found  # type: ignore[return-value]


def _download(source: Source, folder: Path, splits: tuple[str, ...], mirrors: tuple[str, ...],
              timeout: float) -> dict[tuple[str, str], Path]:
    """Download the missing .gz files of `splits` into `folder`; one process does it, the others
    wait on the lock and then find the files there (so each file is fetched once per folder)."""
    folder.mkdir(parents=True, exist_ok=True)
    with file_lock(folder / ".download.lock"):
        for (split, _), base in SPLIT_FILES.items():
            if split not in splits or _find_file(folder, base):  # kept from an earlier (partial) download
                continue
            name = base + ".gz"
            errors = []
            for mirror in mirrors or source.mirrors:
                try:
                    fetch(mirror.rstrip("/") + "/" + name, folder / name, source.md5[name], timeout)
                    break
                except DownloadError as e:
                    errors.append(str(e))
            else:
                raise DownloadError("; ".join(errors))
    files = _find_files(folder, splits)
    assert files is not None
    return files


def _split(tensors: dict[tuple[str, str], torch.Tensor], files: dict[tuple[str, str], Path], split: str,
           limit: int | None) -> Split:
    images, labels = tensors[split, "images"], tensors[split, "labels"]
    if len(labels) != len(images):
        raise UserError(f"{files[split, 'labels']}: {len(labels)} labels for {len(images)} images.")
    if not len(images):
        raise UserError(f"{files[split, 'images']}: holds no images.")
    if len(labels) and int(labels.max()) > 9:
        raise UserError(f"{files[split, 'labels']}: label {int(labels.max())} is outside 0-9.")
    return Split(images[:limit], labels[:limit].long())


def _read_all(files: dict[tuple[str, str], Path]) -> dict[tuple[str, str], torch.Tensor]:
    """Each (split, part) file read and checked as IDX."""
    return {key: idx.read(path, idx.IMAGES_MAGIC if key[1] == "images" else idx.LABELS_MAGIC)
            for key, path in files.items()}


def _decoded(files: dict[tuple[str, str], Path], source: Source, req: DataConfig) -> tuple[
        dict[tuple[str, str], torch.Tensor], str]:
    """The files' tensors. .gz files are inflated once per node and kept as plain IDX (datacache.py), in a folder
    named by the files' paths, sizes and modification times: a changed file is decoded again. Plain files are
    read as they are. Also how they were had, for the `data:` line ("" when read directly)."""
    if not any(path.suffix == ".gz" for path in files.values()):
        return _read_all(files), ""
    stamp = hashlib.sha256()
    for key, path in sorted(files.items()):
        info = path.stat()
        stamp.update(f"{key}\0{path.resolve()}\0{info.st_size}\0{info.st_mtime_ns}\0".encode())
    folder = (req.data_dir or Path("data")) / "decoded" / f"{source.name}-{stamp.hexdigest()[:16]}"
    names = {key: f"{key[0]}-{key[1]}" for key in files}

    tensors, how = datacache.shared(folder, tuple(names.values()),
                                    lambda: {names[key]: t for key, t in _read_all(files).items()})
    return {key: tensors[name] for key, name in names.items()}, f".gz decoded once: {how}"


def _load_source(source: Source, req: DataConfig) -> Dataset:
    dirs = candidate_dirs(source, req.data_dir)
    for folder in dirs:
        if files := _find_files(folder, req.splits):
            where = str(folder)
            break
    else:
        if not req.download:
            raise DataNotFound(source, dirs, "downloads are off (--no-download)", "downloads are off")
        target = req.data_dir or Path("data") / source.name
        try:
            files = _download(source, target, req.splits, req.mirrors, req.download_timeout)
        except (DownloadError, OSError) as e:
            raise DataNotFound(source, dirs, f"the download failed: {e}", "its download failed") from e
        where = f"{target} (downloaded)"
    tensors, cache = _decoded(files, source, req)
    train = _split(tensors, files, "train", req.train_samples) if "train" in req.splits else EMPTY
    test = _split(tensors, files, "test", req.test_samples)
    return Dataset(source.name, where, source.classes, train, test, cache)


def _synthetic(req: DataConfig) -> Dataset:
    """The built-in digits, generated by one process per node and read from its cache by the others."""
    sizes = {split: getattr(req, f"{split}_samples") or SYNTHETIC_SIZES[split] for split in req.splits}
    names = {(split, part): f"{split}-{n}-seed{SYNTHETIC_SEEDS[split]}-{part}"  # plain IDX files
             for split, n in sizes.items() for part in ("images", "labels")}

    def generate() -> datacache.Tensors:
        made = {split: synthetic.generate(n, SYNTHETIC_SEEDS[split]) for split, n in sizes.items()}
        return {name: made[split][0 if part == "images" else 1] for (split, part), name in names.items()}

    folder = (req.data_dir or Path("data")) / "synthetic" / f"v{synthetic.VERSION}"
    tensors, where = datacache.shared(folder, tuple(names.values()), generate)
    splits = {split: Split(tensors[names[split, "images"]], tensors[names[split, "labels"]].long())
              if split in sizes else EMPTY for split in SYNTHETIC_SIZES}
    return Dataset("synthetic", where, tuple("0123456789"), splits["train"], splits["test"])


def load(req: DataConfig) -> Dataset:
    """The dataset `req` names, fully in memory; UserError if it cannot be had."""
    if req.dataset == "synthetic":
        return _synthetic(req)
    if req.dataset == "auto":
        try:
            return _load_source(SOURCES["mnist"], req)
        except DataNotFound as e:  # a corrupt MNIST is still an error, never a silent fallback
            fallback = _synthetic(req)
            return Dataset(fallback.name, f"{fallback.where}: MNIST is not here and {e.failed}, so --dataset auto "
                           f"fell back to the built-in digits; to train on MNIST, put its four IDX files in a folder "
                           f"and pass --data-dir FOLDER", fallback.classes, fallback.train, fallback.test)
    return _load_source(SOURCES[req.dataset], req)
