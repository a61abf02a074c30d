"""Output files replaced whole: a reader sees the old content or the new, never a mix.

Every file a run rewrites while it runs (checkpoints, metrics.jsonl, plots) goes through `write`: the
bytes go to a temp file next to the target, are fsynced, and the temp file is renamed over the target.
A writer killed mid-write leaves the old file whole (the next write of that file removes its temp
file). A write that fails — on a cluster, most often a full disk or a quota — removes its temp file,
leaves the old file as it was, and ends the run with one line (`WriteFailed`, exit code 1).
"""

import errno
import os
from collections.abc import Callable
from pathlib import Path
from typing import BinaryIO

from .errors import WriteFailed


def write(path: Path, fill: Callable[[BinaryIO], object], keep: Path | None = None) -> None:
    """Replace `path` by what `fill` writes into the file it is given (one writer per file: rank 0).

    `keep`: the old `path`, if any, becomes `keep` once the new bytes are on disk. `path` is there throughout,
    old or new: a writer killed or interrupted (Ctrl-C) between the steps leaves it whole, and `keep` too."""
    tmp = _temp(path)
    for target in (path, keep) if keep else (path,):  # temp files (`_temp`) that dead writers left
        for stale in target.parent.glob(f".{target.name}.tmp-*"):
            stale.unlink(missing_ok=True)
    try:
        try:
            with open(tmp, "wb") as f:
                fill(f)
                f.flush()
                os.fsync(f.fileno())
            if keep is not None and path.exists():
                _keep(path, keep)
            os.replace(tmp, path)
        finally:
            tmp.unlink(missing_ok=True)
        dir_fd = os.open(path.parent, os.O_RDONLY)
        try:
            os.fsync(dir_fd)
        finally:
            os.close(dir_fd)
    except (OSError, RuntimeError) as e:  # torch.save reports a failed write as a RuntimeError
        cause = _os_error(e)
        if cause is None:
            raise
        fix = "free some space" if cause.errno in (errno.ENOSPC, errno.EDQUOT) else "fix that"
        raise WriteFailed(f"{(cause.strerror or str(cause)).lower()} writing {path}; the previous checkpoint is "
                          f"intact: {fix}, then run again with --resume to continue from it.") from e


def write_bytes(path: Path, data: bytes) -> None:
    """`write` of `data`."""
    write(path, lambda f: f.write(data))


def _temp(path: Path) -> Path:
    """This process's temp file beside `path` (hidden; the next write of `path` removes a dead writer's)."""
    return path.with_name(f".{path.name}.tmp-{os.getpid()}")


def _keep(path: Path, keep: Path) -> None:
    """Make `keep` a second name of `path`'s file (a hard link, renamed over the old `keep`), so that `path`
    itself is never missing: renaming `path` to `keep` left no `path` until the new one was renamed in, and
    a Ctrl-C between the two renames left none at all. Where the file system has no hard links, that rename."""
    linked = _temp(keep)
    try:
        try:
            os.link(path, linked)
        except OSError as e:
            if e.errno not in (errno.EPERM, errno.EOPNOTSUPP, errno.EMLINK, errno.ENOSYS):
                raise
            os.replace(path, keep)
            return
        os.replace(linked, keep)
    finally:
        linked.unlink(missing_ok=True)


def _os_error(e: BaseException | None) -> OSError | None:
    """The OSError behind `e`, if any: torch wraps the one a file write raised."""
    while e is not None and not isinstance(e, OSError):
        e = e.__cause__ or e.__context__
    return e
