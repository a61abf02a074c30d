"""One run per --out, and a full disk that never costs a run.

A second run into a busy --out is refused before it writes anything, while the first goes on unharmed;
a SIGKILLed run leaves no lock behind. A disk that fills up mid-run (a real tmpfs, filled by the test
while the run trains) ends the run with one line and exit 1, and leaves the previous checkpoint
loadable, metrics.jsonl without a half line and no temp file. Real processes throughout, watched from
outside as in test_faults.
"""

import errno
import fcntl
import math
import os
import re
import signal
import socket
import subprocess
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
import torch
from PIL import Image

from conftest import metrics, progress, tiny
from datafiles import one_thread
from mnist_ddp import cli
from mnist_ddp.common import config
from mnist_ddp.common.config import TrainConfig
from mnist_ddp.common.errors import UserError, WriteFailed
from mnist_ddp.outputs import checkpoint, outdir
from mnist_ddp.outputs.report import Reporter
from procfs import finish, free_port, marked_env, needs_proc, reaped, start, wait_for
from test_faults import HANG, _temp_files, _train

pytestmark = needs_proc

NO_SPACE = r"no space left on device writing .*; the previous checkpoint is intact"


def _error_lines(log: str) -> list[str]:
    return [line for line in log.splitlines() if line.startswith("mnist-ddp: error: ")]


# --- one run per --out ------------------------------------------------------------------------------------

def test_claim_refuses_a_second_holder_and_leaves_no_trace(tmp_path: Path) -> None:
    out = tmp_path / "o"
    first = outdir.claim(out, resume=False)
    with pytest.raises(UserError, match=rf"is in use by another run \(pid {os.getpid()} on "):
        outdir.claim(out, resume=True)  # a second open file: flock refuses it even in the same process
    assert [p.name for p in out.iterdir()] == [outdir.LOCK]
    first.release()
    assert list(out.iterdir()) == []  # a run that ends on its own takes its lock file with it
    (out / outdir.LOCK).write_text("pid 1 on a node that crashed")  # what a SIGKILLed holder leaves
    # A lock file nobody holds is no run, and no obstacle; its new holder names itself.
    with outdir.claim(out, resume=False), pytest.raises(UserError, match=rf"another run \(pid {os.getpid()} on "):
        outdir.claim(out, resume=True)
    assert list(out.iterdir()) == []


def test_second_run_into_a_busy_out_is_refused_and_the_first_finishes(tmp_path: Path) -> None:
    """A spawn job (-g 2: its parent holds the lock) is frozen while two more runs start into its --out, the
    same command line a double submission would give: one process, and a torchrun-style pair (rank 0 checks
    after joining). All are refused with one line, exit 2, without touching the folder; the first then
    finishes whole."""
    env, mark = marked_env()
    out = tmp_path / "out"
    args = ["--resume", "--epochs", "2", "--checkpoint-every", "2"]
    with reaped(mark):
        first = start(_train(out, "-n", "1", "-g", "2", *args, samples=2000), env, tmp_path, tmp_path / "first.log")
        wait_for("the first run's checkpoint", lambda: progress(out), HANG, running=first)
        os.killpg(first.pid, signal.SIGSTOP)  # frozen, it still holds the lock: the kernel keeps it
        try:
            before = {p.name: p.read_bytes() for p in out.iterdir()}
            pair = env | {"WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port())}
            seconds = {"single": start(_train(out, *args), env, tmp_path, tmp_path / "single.log")}
            for r in range(2):
                seconds[f"rank{r}"] = start(_train(out, *args), pair | {"RANK": str(r)}, tmp_path,
                                            tmp_path / f"rank{r}.log")
            for name, proc in seconds.items():
                rc, log = finish(proc, tmp_path / f"{name}.log", HANG)
                assert rc == 2, f"{name}: {log}"
                assert _error_lines(log) == [f"mnist-ddp: error: --out {out} is in use by another run (pid "
                                             f"{first.pid} on {socket.gethostname()}); wait for it to end, or "
                                             f"choose another --out."], f"{name}: {log}"
                assert "Traceback" not in log, f"{name}: {log}"
            assert {p.name: p.read_bytes() for p in out.iterdir()} == before  # refused before writing anything
        finally:
            os.killpg(first.pid, signal.SIGCONT)
        rc, log = finish(first, tmp_path / "first.log", HANG)
    assert rc == 0, log
    assert [m["epoch"] for m in metrics(out)] == [1, 2]
    assert checkpoint.load(out / "checkpoint.pt")["progress"]["epoch"] == 2
    assert sorted(p.name for p in out.iterdir()) == ["best.pt", "checkpoint.prev.pt", "checkpoint.pt", "metrics.jsonl",
                                                     "model.safetensors", "steps.jsonl", "timing.jsonl"]


def test_sigkilled_run_leaves_no_stale_lock(tmp_path: Path) -> None:
    """The lock dies with its holder: after a SIGKILL (its lock file still there) --resume takes over."""
    env, mark = marked_env()
    out = tmp_path / "out"
    args = ["--resume", "--epochs", "2", "--checkpoint-every", "2"]
    with reaped(mark):
        victim = start(_train(out, *args, samples=2000), env, tmp_path, tmp_path / "victim.log")
        wait_for("a checkpoint", lambda: progress(out), HANG, running=victim)
        os.kill(victim.pid, signal.SIGKILL)
        victim.wait()
        assert (out / outdir.LOCK).exists()
        rc, log = finish(start(_train(out, *args, samples=2000), env, tmp_path, tmp_path / "again.log"),
                         tmp_path / "again.log", HANG)
    assert rc == 0, log
    assert f"resume: from {out / 'checkpoint.pt'}" in log, log
    assert [m["epoch"] for m in metrics(out)] == [1, 2]
    assert not (out / outdir.LOCK).exists()


class _NoFlock:
    """fcntl as outdir sees it on a file system without flock: an NFS mount with no lock daemon says ENOLCK."""

    LOCK_EX, LOCK_NB = fcntl.LOCK_EX, fcntl.LOCK_NB

    @staticmethod
    def flock(fd: int, operation: int) -> None:
        raise OSError(errno.ENOLCK, os.strerror(errno.ENOLCK))


def test_without_flock_a_run_warns_once_and_goes_on_unguarded(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                              capfd: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setattr(outdir, "fcntl", _NoFlock)
    monkeypatch.chdir(tmp_path)
    out = tmp_path / "out"
    with one_thread():
        code = cli.main(["train", *tiny(200, 50), "--out", str(out)])
    _, err = capfd.readouterr()
    assert code == 0, err
    assert err.strip().splitlines() == [f"mnist-ddp: warning: cannot lock --out {out} (No locks available); nothing "
                                        f"stops another run from writing there at the same time."], err
    assert [m["epoch"] for m in metrics(out)] == [1] and progress(out) is not None
    assert not (out / outdir.LOCK).exists()  # no lock file pretending to guard anything
    with outdir.claim(out, resume=True), outdir.claim(out, resume=True):  # unguarded: a second run is not refused
        pass


# --- a full disk -------------------------------------------------------------------------------------------

@contextmanager
def _tmpfs(where: Path, size: str) -> Iterator[Path]:
    """A small tmpfs mounted at `where` for the block; the test is skipped where that is not allowed."""
    if os.geteuid() != 0:
        pytest.skip("mounting a tmpfs needs root")
    where.mkdir()
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(where)], capture_output=True,
                       text=True)
    if r.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {r.stderr.strip()}")
    try:
        yield where
    finally:
        # Lazy: after a failed test its processes, just SIGKILLed, may still hold files there for a moment.
        subprocess.run(["umount", "--lazy", str(where)], check=True)


def _fill(folder: Path) -> None:
    """Write a filler file until the file system has not one byte left."""
    fd = os.open(folder / "filler", os.O_WRONLY | os.O_CREAT | os.O_APPEND)
    try:
        while True:
            os.write(fd, b"\0" * 4096)
    except OSError:
        pass
    finally:
        os.close(fd)


def _epoch(n: int) -> dict:
    return {"epoch": n, "epochs": 9, "train_loss": 1.0, "test_loss": 1.0, "test_accuracy": 0.5,
            "images_per_second": 1.0, "epoch_seconds": 1.0}


def test_writers_on_a_full_disk_keep_what_was_there(tmp_path: Path) -> None:
    with _tmpfs(tmp_path / "fs", "1m") as fs:
        report = Reporter(fs, enabled=True, progress=False, plots=False)
        report.epoch(_epoch(1), torch.zeros(10, 10), (), step=1)
        checkpoint.save(fs / "checkpoint.pt", {"model": {"w": torch.ones(1000)}})
        _fill(fs)
        with pytest.raises(WriteFailed, match=NO_SPACE) as failed:
            report.epoch(_epoch(2), torch.zeros(10, 10), (), step=2)
        assert "metrics.jsonl" in str(failed.value) and failed.value.exit_code == 1
        with pytest.raises(WriteFailed, match=NO_SPACE):
            checkpoint.save(fs / "checkpoint.pt", {"model": {"w": torch.zeros(1000)}})
        with pytest.raises(WriteFailed, match=NO_SPACE):
            report.keep_epochs_before(1)  # rewrites the one line: no room for it
        assert metrics(fs) == [_epoch(1)]
        assert (fs / "metrics.jsonl").read_text().endswith("}\n")
        assert torch.equal(checkpoint.load(fs / "checkpoint.pt")["model"]["w"], torch.ones(1000))
        assert _temp_files(fs) == []


@pytest.mark.parametrize("raised", [None, KeyboardInterrupt], ids=["finished", "interrupted"])
def test_plots_on_a_full_disk_keep_the_last_ones_whole(tmp_path: Path, raised: type[BaseException] | None) -> None:
    """Room left for epoch 2's metrics line (two pages), not for its curves.png, which is drawn while the next epoch
    trains: the run's end says the write failed in one line (an interrupted run's end keeps its own reason), and
    curves.png and confusion.png are epoch 1's, byte for byte, whole PNGs; no temp file is left."""
    with _tmpfs(tmp_path / "fs", "2m") as fs:
        report = Reporter(fs, enabled=True, progress=False, plots=True, plots_every_s=0)  # every epoch's drawn
        report.epoch(_epoch(1), torch.eye(10, dtype=torch.long), tuple("0123456789"), step=1)
        report.wait_for_plots()
        plots = {name: (fs / name).read_bytes() for name in ("curves.png", "confusion.png")}
        _fill(fs)
        os.truncate(fs / "filler", (fs / "filler").stat().st_size - 2 * 4096)
        report.epoch(_epoch(2), torch.eye(10, dtype=torch.long), tuple("0123456789"), step=2)
        if raised is None:
            with pytest.raises(WriteFailed, match=NO_SPACE) as failed:
                report.close()
            assert f"writing {fs / 'curves.png'};" in str(failed.value)
        else:
            report.close(raised)
        assert metrics(fs) == [_epoch(1), _epoch(2)]  # the line fitted
        assert {name: (fs / name).read_bytes() for name in plots} == plots
        for name in plots:
            with Image.open(fs / name) as image:
                image.verify()  # a whole PNG: every chunk's CRC checks
        assert _temp_files(fs) == []


def test_an_epochs_plots_wait_until_due_and_the_last_are_drawn(tmp_path: Path) -> None:
    """With `plots_every_s` not yet passed, an epoch's plots are not drawn, and the next epoch's replace them; the
    run's last epoch is drawn at once, and the last epoch of a run that ended early (--target-accuracy) at close."""
    figures = ("curves.png", "confusion.png")
    for n, last in ((1, 9), (9, 9)):
        out = tmp_path / f"to epoch {n}"
        out.mkdir()
        report = Reporter(out, enabled=True, progress=False, plots=True, plots_every_s=math.inf)
        for epoch in range(1, n + 1):
            report.epoch(_epoch(epoch), torch.eye(10, dtype=torch.long), tuple("0123456789"), step=epoch)
        report.wait_for_plots()
        assert [(out / name).exists() for name in figures] == [n == last] * 2
        report.close()
        for name in figures:
            with Image.open(out / name) as image:
                image.verify()


def test_disk_full_mid_run_ends_it_with_one_line_and_exit_1(tmp_path: Path) -> None:
    """One process and a spawn job (-g 2), each into its own small tmpfs that the test fills once the first
    epoch is saved. The job ends (the other rank does not wait for --timeout), says why in one line,
    and leaves a checkpoint that loads, whole metrics lines and no temp file."""
    env, mark = marked_env()
    runs = {"one process": [], "-g 2": ["-n", "1", "-g", "2"]}
    with _tmpfs(tmp_path / "fs0", "4m") as fs0, _tmpfs(tmp_path / "fs1", "4m") as fs1, reaped(mark):
        folders = dict(zip(runs, (fs0, fs1)))
        procs = {name: start(_train(folders[name] / "out", *extra, "--epochs", "50", "--checkpoint-every", "2",
                                    "--timeout", "120", samples=2000), env, tmp_path, tmp_path / f"{n}.log")
                 for n, (name, extra) in enumerate(runs.items())}
        for name, proc in procs.items():
            wait_for(f"{name}: the first epoch's checkpoint and metrics",
                     lambda out=folders[name] / "out": (progress(out) or {"epoch": 0})["epoch"] >= 1, HANG, 0.01,
                     running=proc)
            _fill(folders[name])
        for n, (name, proc) in enumerate(procs.items()):
            rc, log = finish(proc, tmp_path / f"{n}.log", HANG)
            out = folders[name] / "out"
            assert rc == 1, f"{name}: {log}"
            errors = _error_lines(log)
            assert len(errors) == 1 and "Traceback" not in log, f"{name}: {log}"
            assert re.search(NO_SPACE, errors[0]), f"{name}: {errors}"
            assert checkpoint.load(out / "checkpoint.pt")["progress"]["epoch"] >= 1
            assert metrics(out)[0]["epoch"] == 1  # and every line parses
            assert _temp_files(out) == [], name
            assert not (out / outdir.LOCK).exists(), name


def test_the_default_out_is_a_fresh_folder_even_within_one_second(tmp_path: Path,
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    """Two runs started in the same second (a notebook's Run All) get two folders, runs/<date-time>[-N]."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(config.time, "strftime", lambda fmt: fmt.replace("%Y%m%d-%H%M%S", "20261205-101500"))
    names = []
    for _ in range(3):
        names.append(TrainConfig().out)
        Path(names[-1]).mkdir(parents=True)
    assert names == ["runs/20261205-101500", "runs/20261205-101500-2", "runs/20261205-101500-3"]
