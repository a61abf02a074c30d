"""`--out`, the run folder: a run writes there only if it overwrites nothing, and only one run at a time, as the
writing process holds a `flock` on `<out>/.lock` while it lives (docs/design/outdir.md)."""

import fcntl
import os
import socket
import sys
import tempfile
from pathlib import Path
from types import TracebackType

from .errors import UserError

LOCK = ".lock"  # hidden, and not an output: "holds a run" looks at checkpoint.pt and metrics.jsonl only


class Claim:
    """This process's hold on an --out folder, let go at the end of a `with` (or by `release`)."""

    def __init__(self, path: Path, fd: int | None) -> None:
        self.path, self._fd = path, fd

    def release(self) -> None:
        """Remove the lock file while still holding its lock, then unlock: a run that opened the old file
        meanwhile sees it gone and locks a new one (`_lock`), so two runs never both believe they hold it."""
        if self._fd is not None:
            self.path.unlink(missing_ok=True)
            os.close(self._fd)
            self._fd = None

    def __enter__(self) -> None:  # None: nothing to use, and `Dist.from_main` can send it to every rank
        return None

    def __exit__(self, kind: type[BaseException] | None, e: BaseException | None, tb: TracebackType | None) -> None:
        self.release()


def claim(out: Path, resume: bool) -> Claim:
    """Hold `out` for this run; refuse a folder that another run holds, that we cannot write, or that holds
    a run we would overwrite (without `resume`)."""
    try:
        out.mkdir(parents=True, exist_ok=True)
        held = Claim(out / LOCK, _lock(out / LOCK))
    except OSError as e:
        raise UserError(f"--out {out} is not a writable folder ({e.strerror}).") from e
    try:
        if not resume and ((out / "checkpoint.pt").exists() or (out / "metrics.jsonl").exists()):
            raise UserError(f"{out} already holds a run; pass --resume to continue it, or choose another --out.")
        try:
            with tempfile.TemporaryFile(dir=out):
                pass
        except OSError as e:
            raise UserError(f"--out {out} is not a writable folder ({e.strerror}).") from e
    except UserError:
        held.release()
        raise
    return held


def _lock(path: Path) -> int | None:
    """An open file descriptor holding an exclusive flock on `path`; None, after a warning, on a file system
    without flock (some NFS mounts), where the run goes on unguarded."""
    while True:
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)  # not inherited by child processes (PEP 446)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.pread(fd, 200, 0).decode(errors="replace").strip()
            os.close(fd)
            raise UserError(f"--out {path.parent} is in use by another run{f' ({holder})' if holder else ''}; "
                            f"wait for it to end, or choose another --out.") from None
        except OSError as e:
            os.close(fd)
            path.unlink(missing_ok=True)
            print(f"mnist-ddp: warning: cannot lock --out {path.parent} ({e.strerror}); nothing stops another run "
                  f"from writing there at the same time.", file=sys.stderr)
            return None
        if _same_file(fd, path):
            os.ftruncate(fd, 0)
            os.write(fd, f"pid {os.getpid()} on {socket.gethostname()}".encode())
            return fd
        os.close(fd)  # its holder removed it between our open and our lock: lock the one there now


def _same_file(fd: int, path: Path) -> bool:
    try:
        here, there = os.fstat(fd), os.stat(path)
    except FileNotFoundError:
        return False
    return (here.st_dev, here.st_ino) == (there.st_dev, there.st_ino)
