"""Resume: a run killed and continued with --resume ends with the very weights of an uninterrupted run.

The reference run A trains 2 epochs straight through. Run B is SIGKILLed (no chance to clean
up) once its checkpoint says one epoch is done, then continued; run C is killed right after a
mid-epoch checkpoint (`--checkpoint-every`) and continued. Both must end where A ended.
"""

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from conftest import cli_env, metrics, progress, run_cli, tiny
from datafiles import ONE_THREAD
from mnist_ddp import checkpoint, cli

EPOCHS = ["--epochs", "2"]
ARGS = [*tiny(epochs=None), *EPOCHS]  # 800 images: 8 steps per epoch


def _train(out: Path, *extra: str) -> list[str]:
    return ["train", *ARGS, "--out", str(out), *extra]


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Run A: two epochs, uninterrupted."""
    out = tmp_path_factory.mktemp("resume") / "A"
    r = run_cli(*_train(out), cwd=out.parent, env=ONE_THREAD)
    assert r.returncode == 0, r.stderr
    return out


def _assert_same_weights(a: Path, b: Path) -> None:
    wa, wb = (checkpoint.load(p / "checkpoint.pt")["model"] for p in (a, b))
    assert wa.keys() == wb.keys()
    for name in wa:
        torch.testing.assert_close(wb[name], wa[name], rtol=0, atol=1e-6, msg=name)  # buffers too (BN stats)


def _assert_same_history(a: Path, b: Path) -> None:
    ra, rb = metrics(a), metrics(b)
    assert [r["epoch"] for r in rb] == [1, 2]  # the killed epoch is redone, not written twice
    for x, y in zip(ra, rb):
        assert (y["test_correct"], y["test_count"]) == (x["test_correct"], x["test_count"])
        assert y["test_loss"] == pytest.approx(x["test_loss"], abs=1e-6)


def _assert_trained_only_epoch_2(stdout: str) -> None:
    """A restart from scratch would reach A's weights too (training is deterministic): rule it out."""
    assert [line.split()[1] for line in stdout.splitlines() if line.startswith("epoch ")] == ["2/2"], stdout


def test_killed_after_an_epoch_resumes_to_the_same_weights(reference: Path, tmp_path: Path) -> None:
    out = tmp_path / "B"
    run = subprocess.Popen([sys.executable, "-m", "mnist_ddp", *_train(out)], cwd=tmp_path, env=cli_env(ONE_THREAD),
                           stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 120
        while (seen := progress(out)) is None or seen["epoch"] < 1:
            assert run.poll() is None, f"run B ended before its first checkpoint: {run.communicate()[1]}"
            assert time.monotonic() < deadline, "no checkpoint within 120 s"
            time.sleep(0.05)
        assert run.poll() is None, "run B finished before it could be killed"
        os.kill(run.pid, signal.SIGKILL)
    finally:
        run.kill()
        run.wait(30)
    assert run.returncode == -signal.SIGKILL
    assert seen["epoch"] == 1 and seen["step"] == 0
    assert progress(out) == seen  # killed inside epoch 2, before its checkpoint
    assert [r["epoch"] for r in metrics(out)] == [1]

    r = run_cli(*_train(out, "--resume"), cwd=tmp_path, env=ONE_THREAD)
    assert r.returncode == 0, r.stderr
    assert "resume: from" in r.stdout and "epoch 2 step 0" in r.stdout
    _assert_trained_only_epoch_2(r.stdout)
    _assert_same_weights(reference, out)
    _assert_same_history(reference, out)


# `mnist-ddp` with checkpoint.save wrapped: the process SIGKILLs itself the moment the first mid-epoch
# checkpoint of the second epoch is on disk, which is exactly where a crash hurts most.
_KILL_AFTER_MID_EPOCH_SAVE = """
import os, signal, sys
from mnist_ddp import checkpoint, cli
save = checkpoint.save
def save_then_die(path, payload):
    save(path, payload)
    if path.name == "checkpoint.pt" and payload["progress"]["epoch"] == 1 and payload["progress"]["step"] > 0:
        os.kill(os.getpid(), signal.SIGKILL)
checkpoint.save = save_then_die
sys.exit(cli.main(sys.argv[1:]))
"""


def test_killed_mid_epoch_resumes_to_the_same_weights(reference: Path, tmp_path: Path) -> None:
    out = tmp_path / "C"
    every = ["--checkpoint-every", "3"]
    r = subprocess.run([sys.executable, "-c", _KILL_AFTER_MID_EPOCH_SAVE, *_train(out, *every)], cwd=tmp_path,
                       env=cli_env(ONE_THREAD), capture_output=True, text=True, timeout=180)
    assert r.returncode == -signal.SIGKILL, r.stderr
    assert progress(out)["step"] == 3  # type: ignore[index]

    r = run_cli(*_train(out, *every, "--resume"), cwd=tmp_path, env=ONE_THREAD)
    assert r.returncode == 0, r.stderr
    assert "epoch 2 step 3" in r.stdout
    _assert_trained_only_epoch_2(r.stdout)
    _assert_same_weights(reference, out)
    _assert_same_history(reference, out)


def test_existing_run_is_never_overwritten(reference: Path, capsys: pytest.CaptureFixture[str]) -> None:
    before = {p: (p.read_bytes(), p.stat().st_mtime_ns) for p in reference.iterdir()}
    assert cli.main(_train(reference)) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--resume" in err[0] and str(reference) in err[0], err
    assert {p: (p.read_bytes(), p.stat().st_mtime_ns) for p in reference.iterdir()} == before
