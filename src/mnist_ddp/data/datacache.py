"""Make a dataset's tensors once per node and share them with the other local processes as plain IDX files.

Generating the synthetic digits costs seconds of CPU; when every local process did it at once on the
same few cores, start-up took longer than an epoch. Now the first process to take the folder's lock
makes the tensors (with all the cores: the others only wait), writes each as a plain IDX file
(`atomic.write`: the real name never holds half a file) with its SHA-256 beside it, and the others read
them back, which takes a fraction of a second. A file that does not match its digest (a flipped bit still
parses as IDX) or fails the IDX checks is made again rather than trusted.
Where the folder cannot be written, each process makes its own, as before.
"""

import contextlib
import hashlib
import os
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import torch

from ..common import atomic, inputfile
from ..common.errors import UserError, WriteFailed
from . import idx
from .download import file_lock

Tensors = dict[str, torch.Tensor]  # file name -> uint8 tensor of 1 (labels) or 3 (images) dimensions


@contextlib.contextmanager
def all_cores() -> Iterator[None]:
    """Let this process use every core it may run on for the block, then restore its share.

    Local processes are pinned to a slice of the cores before data loading (compute.share_cores);
    the one making the data is alone while the others wait, so it takes them all. An explicit
    OMP_NUM_THREADS is left alone.
    """
    if os.environ.get("OMP_NUM_THREADS") or not hasattr(os, "sched_getaffinity"):
        yield
        return
    mine, threads = os.sched_getaffinity(0), torch.get_num_threads()
    try:
        os.sched_setaffinity(0, range(os.cpu_count() or 1))  # the kernel keeps only the cores we are allowed
        torch.set_num_threads(len(os.sched_getaffinity(0)))
    except OSError:
        pass  # keep the share we have
    try:
        yield
    finally:
        os.sched_setaffinity(0, mine)
        torch.set_num_threads(threads)


def _digest(path: Path) -> Path:
    """Where the SHA-256 of cached file `path` is kept."""
    return path.with_name(f"{path.name}.sha256")


def _read(folder: Path, names: tuple[str, ...]) -> Tensors | None:
    """The files of a complete earlier make, or None if any is missing, does not match its digest or fails the
    IDX checks."""
    found = {}
    try:
        for name in names:
            raw = inputfile.read(folder / name, idx.MOST * 28 * 28 + 16, "cached data file")
            said = inputfile.read(_digest(folder / name), 100, "digest").decode().strip()
            if hashlib.sha256(raw).hexdigest() != said:
                return None
            found[name] = idx.parse(raw, idx.IMAGES_MAGIC if "images" in name else idx.LABELS_MAGIC, name)
    except (OSError, UnicodeDecodeError, UserError):  # missing, truncated or corrupt: make it again
        return None
    return found


def shared(folder: Path, names: tuple[str, ...], make: Callable[[], Tensors]) -> tuple[Tensors, str]:
    """The tensors `make` returns (keyed by `names`, which hold "images" or "labels"), made once per folder.

    Also says how they were had, for the `data:` line: read from the cache, made here, or made in
    every process because `folder` cannot be written.
    """
    started, made = time.perf_counter(), None

    def took() -> str:
        return f"{time.perf_counter() - started:.1f} s"

    if found := _read(folder, names):  # no lock needed: files are only ever renamed in complete
        return found, f"{folder} (cached, read in {took()})"
    try:
        folder.mkdir(parents=True, exist_ok=True)
        with file_lock(folder / ".lock"):
            if found := _read(folder, names):  # made by another local process while this one waited
                return found, f"{folder} (made by another process, ready in {took()})"
            with all_cores():
                made = make()
            for name in names:  # each file whole or absent, even after a crash; a killed maker's temp files go
                raw = idx.encode(made[name])
                sha = hashlib.sha256(raw).hexdigest().encode()
                atomic.write_bytes(folder / name, raw)  # the digest last: a maker killed in between leaves a
                atomic.write_bytes(_digest(folder / name), sha)  # mismatch
            return made, f"{folder} (made and cached in {took()})"
    except (OSError, WriteFailed) as e:  # read-only or full: each process makes its own, on its share of the cores
        made = made if made is not None else make()  # made already if only the writing failed
        cause = e.__cause__ if isinstance(e, WriteFailed) else e
        why = getattr(cause, "strerror", None) or cause
        return made, f"made in {took()} by each process: {folder} cannot be written ({why})"
