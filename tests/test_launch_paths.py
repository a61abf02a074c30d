"""Every way of starting a run trains one short epoch and leaves the same outputs, written by rank 0 alone."""

import importlib.util
import math
from pathlib import Path

from conftest import metrics, run_cli, tiny
from datafiles import ONE_THREAD
from mnist_ddp.outputs import checkpoint

REQUIRED = {"epoch", "train_loss", "test_loss", "test_accuracy", "images_per_second", "epoch_seconds", "lr",
            "world_size"}
TEST_SAMPLES = 150  # not a multiple of the world size: the eval shards are uneven, still counted once


def _args(out: Path) -> list[str]:
    return ["train", *tiny(test=TEST_SAMPLES), "--out", str(out)]


def _check_run(out: Path, stdout: str, world: int) -> None:
    rows = metrics(out)
    assert [r["epoch"] for r in rows] == [1], rows  # one line for the epoch, not one per rank
    row = rows[0]
    assert row.keys() >= REQUIRED
    assert row["world_size"] == world and row["test_count"] == TEST_SAMPLES
    assert 0 <= row["test_correct"] <= TEST_SAMPLES and row["test_accuracy"] == row["test_correct"] / TEST_SAMPLES
    assert all(math.isfinite(row[k]) and row[k] > 0 for k in ("train_loss", "test_loss", "images_per_second"))
    for line in ("data: synthetic", "epoch 1/1", "final: test accuracy"):  # rank 0 speaks, the others do not
        assert sum(s.startswith(line) for s in stdout.splitlines()) == 1, stdout
    assert f"world size {world}" in stdout
    ckpt = checkpoint.load(out / "checkpoint.pt")
    assert ckpt["progress"]["epoch"] == 1 and ckpt["config"]["world_size"] == world
    assert not any(k.startswith("module.") for k in ckpt["model"])  # saved unwrapped: loads into a plain ConvNet
    assert not list(out.glob(".*tmp*"))  # no temp files left from the atomic saves


def test_single_process(tmp_path: Path) -> None:
    out = tmp_path / "run"
    args = [a for a in _args(out) if a != "--no-plots"]
    r = run_cli(*args, cwd=tmp_path, env=ONE_THREAD)
    assert r.returncode == 0, r.stderr
    _check_run(out, r.stdout, world=1)
    if importlib.util.find_spec("matplotlib"):
        assert (out / "curves.png").stat().st_size > 0 and (out / "confusion.png").stat().st_size > 0


def test_spawn_two_local_processes(tmp_path: Path) -> None:
    """The tutorial's command line, `mnist-ddp -n 1 -g 2 -nr 0 …` (train implied), spawns 2 gloo ranks."""
    out = tmp_path / "run"
    r = run_cli("-n", "1", "-g", "2", "-nr", "0", *_args(out)[1:], "--device", "cpu", cwd=tmp_path, env=ONE_THREAD)
    assert r.returncode == 0, r.stderr
    _check_run(out, r.stdout, world=2)


def test_torchrun(tmp_path: Path) -> None:
    out = tmp_path / "run"
    r = run_cli("--standalone", "--nproc-per-node", "2", "-m", "mnist_ddp", *_args(out), "--device", "cpu",
                module="torch.distributed.run", cwd=tmp_path, env=ONE_THREAD)
    assert r.returncode == 0, r.stderr
    _check_run(out, r.stdout, world=2)


def test_bad_input_under_each_launcher_ends_as_the_readme_says(tmp_path: Path) -> None:
    """A bad flag: `mnist-ddp train` (one process, or -g's launcher) prints one sentence and exits 2, before any
    process starts. Under torchrun each worker checks for itself, prints that sentence and exits 2 (torchrun stops
    the others once the first has), and torchrun, which owns the exit code, adds its ChildFailedError report
    (exitcode 2) and exits 1."""
    bad = ["train", *tiny(), "--epochs", "0", "--out", str(tmp_path / "run")]
    said = "mnist-ddp: error: --epochs must be at least 1, not 0."
    for launch in ([], ["-g", "2"]):
        r = run_cli(*bad, *launch, cwd=tmp_path, env=ONE_THREAD)
        assert (r.returncode, r.stderr.strip(), r.stdout) == (2, said, ""), (launch, r.stderr)
    r = run_cli("--standalone", "--nproc-per-node", "2", "-m", "mnist_ddp", *bad, module="torch.distributed.run",
                cwd=tmp_path, env=ONE_THREAD)
    assert r.returncode == 1, r.stderr
    assert said in r.stderr and "ChildFailedError" in r.stderr and "exitcode  : 2" in r.stderr, r.stderr
    assert not (tmp_path / "run").exists()
