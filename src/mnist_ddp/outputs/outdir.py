"""`--out`, the run folder: a run writes there only if it overwrites nothing, and only one run at a time, as the
writing process holds a `flock` on `<out>/.lock` while it lives (docs/design/outdir.md). The lock is taken only once
the folder was found free, and never through a link: a `.lock` planted as a link to another file is refused."""

import errno
import fcntl
import os
import socket
import stat
import sys
import tempfile
from pathlib import Path
from types import TracebackType

from ..common.errors import UserError
from ..common.inputfile import shown

LOCK = ".lock"  # hidden, and not an output
# Every name a run writes in its folder: a folder holding any of them holds a run, which only --resume continues.
OUTPUTS = ("checkpoint.pt", "checkpoint.prev.pt", "checkpoint.pt.rejected", "best.pt", "model.safetensors",
           "metrics.jsonl", "steps.jsonl", "timing.jsonl", "curves.png", "confusion.png", "mlflow-run.json",
           "profile", "tb")
RESUMABLE = ("checkpoint.pt", "checkpoint.prev.pt")  # what --resume continues from
SAVED_AFTER = ("best.pt", "model.safetensors")  # written only after checkpoint.pt: without it, another run's


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
    a run we would overwrite (without `resume`; with it, outputs of a run but no checkpoint to continue)."""
    where = shown(out)
    try:
        out.mkdir(parents=True, exist_ok=True)
        _check_free(out, resume)
    except OSError as e:
        raise UserError(f"--out {where} is not a writable folder ({(e.strerror or str(e)).lower()}).") from None
    try:
        with tempfile.TemporaryFile(dir=out):
            pass
        held = Claim(out / LOCK, _lock(out / LOCK))
    except OSError as e:
        raise UserError(f"--out {where} is not a writable folder ({(e.strerror or str(e)).lower()}).") from None
    try:  # again under the lock: a run that held it may have written its outputs meanwhile
        _check_free(out, resume)
    except UserError:
        held.release()
        raise
    return held


def _check_free(out: Path, resume: bool) -> None:
    """Refuse `out` where this run would overwrite the outputs it holds."""
    found = [name for name in OUTPUTS if os.path.lexists(out / name)]
    if found and not resume:
        raise UserError(f"{shown(out)} already holds a run; pass --resume to continue it, or choose another --out "
                        f"(it holds {', '.join(found[:3])}).")
    kept = [name for name in found if name in SAVED_AFTER]
    if kept and not any(name in found for name in RESUMABLE):
        raise UserError(f"{shown(out)} holds a trained model ({', '.join(kept)}) but no checkpoint.pt to continue "
                        f"from, and --resume would overwrite it; choose another --out.")


def _lock(path: Path) -> int | None:
    """An open file descriptor holding an exclusive flock on `path`; None, after a warning, on a file system
    without flock (some NFS mounts), where the run goes on unguarded."""
    while True:
        try:  # never through a link; not inherited by child processes (PEP 446)
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_NONBLOCK, 0o644)
        except OSError as e:
            if e.errno != errno.ELOOP:
                raise
            raise UserError(f"--out {shown(path.parent)}: its {LOCK} is a symbolic link; a run's lock never is, so "
                            f"nothing was written; remove it, or choose another --out.") from None
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode) or info.st_nlink != 1:
            os.close(fd)
            raise UserError(f"--out {shown(path.parent)}: its {LOCK} is not a file of its own (a link, a pipe or a "
                            f"device); a run's lock never is, so nothing was written; remove it, or choose another "
                            f"--out.")
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.pread(fd, 200, 0).decode(errors="replace").strip()
            os.close(fd)
            raise UserError(f"--out {shown(path.parent)} is in use by another run{f' ({holder})' if holder else ''}; "
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
