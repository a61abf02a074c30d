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

    `keep`: the old `path`, if any, is renamed to `keep` first, once the new bytes are on disk. Between the
    two renames there is no `path` for a moment, never a partial one; readers fall back to `keep` then."""
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    for stale in path.parent.glob(f".{path.name}.tmp-*"):
        stale.unlink(missing_ok=True)
    try:
        try:
            with open(tmp, "wb") as f:
                fill(f)
                f.flush()
                os.fsync(f.fileno())
            if keep is not None and path.exists():
                os.replace(path, keep)
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


def _os_error(e: BaseException | None) -> OSError | None:
    """The OSError behind `e`, if any: torch wraps the one a file write raised."""
    while e is not None and not isinstance(e, OSError):
        e = e.__cause__ or e.__context__
    return e
