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
from procfs import free_port

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
    assert seen["epoch"] == 1 and seen["consumed"] == 0
    assert progress(out) == seen  # killed inside epoch 2, before its checkpoint
    assert [r["epoch"] for r in metrics(out)] == [1]

    r = run_cli(*_train(out, "--resume"), cwd=tmp_path, env=ONE_THREAD)
    assert r.returncode == 0, r.stderr
    assert "resume: from" in r.stdout and "epoch 2, 0 of its 800 samples done" in r.stdout
    _assert_trained_only_epoch_2(r.stdout)
    _assert_same_weights(reference, out)
    _assert_same_history(reference, out)


# `mnist-ddp` with checkpoint.save wrapped: the process SIGKILLs itself the moment the first mid-epoch
# checkpoint of the second epoch is on disk, which is exactly where a crash hurts most.
_KILL_AFTER_MID_EPOCH_SAVE = """
import os, signal, sys
from mnist_ddp import checkpoint, cli
save = checkpoint.save
def save_then_die(path, payload, **kw):
    save(path, payload, **kw)
    if path.name == "checkpoint.pt" and payload["progress"]["epoch"] == 1 and payload["progress"]["consumed"] > 0:
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
    assert progress(out)["consumed"] == 300  # type: ignore[index]  # 3 steps of 100

    r = run_cli(*_train(out, *every, "--resume"), cwd=tmp_path, env=ONE_THREAD)
    assert r.returncode == 0, r.stderr
    assert "epoch 2, 300 of its 800 samples done" in r.stdout
    _assert_trained_only_epoch_2(r.stdout)
    _assert_same_weights(reference, out)
    _assert_same_history(reference, out)


def test_existing_run_is_never_overwritten(reference: Path, capsys: pytest.CaptureFixture[str]) -> None:
    before = {p: (p.read_bytes(), p.stat().st_mtime_ns) for p in reference.iterdir()}
    assert cli.main(_train(reference)) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--resume" in err[0] and str(reference) in err[0], err
    assert {p: (p.read_bytes(), p.stat().st_mtime_ns) for p in reference.iterdir()} == before


# --- resuming at another world size ------------------------------------------------------------------------

ODD = ["train", *tiny(801, 200, epochs=2), "--checkpoint-every", "3"]  # 801: the sampler pads at world 2


def _killed_mid_epoch_2(out: Path, world: int) -> None:
    """Run at `world` (hand-made env launch for 2) until rank 0 SIGKILLs itself after its first mid-epoch save
    of epoch 2; any other rank then stops on its own (lost contact)."""
    env = cli_env(ONE_THREAD | ({"WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port())}
                               if world > 1 else {}))
    runs = [subprocess.Popen([sys.executable, "-c", _KILL_AFTER_MID_EPOCH_SAVE, *ODD, "--out", str(out)],
                             cwd=out.parent, env=env | ({"RANK": str(r)} if world > 1 else {}),
                             stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True) for r in range(world)]
    for r, run in enumerate(runs):
        _, err = run.communicate(timeout=180)
        assert run.returncode == (-signal.SIGKILL if r == 0 else 1), err


def _world(n: int) -> list[str]:
    return ["-n", "1", "-g", str(n)] if n > 1 else []


@pytest.fixture(scope="module")
def calm_accuracy(tmp_path_factory: pytest.TempPathFactory) -> dict[int, float]:
    """Final test accuracy of uninterrupted runs at world size 1 and 2. They differ (a run at world 2 takes
    half the steps, and this tiny run is far from converged), so a resumed run is judged against both."""
    where = tmp_path_factory.mktemp("calm")
    accuracy = {}
    for world in (1, 2):
        r = run_cli(*ODD, "--out", str(where / str(world)), *_world(world), cwd=where, env=ONE_THREAD)
        assert r.returncode == 0, r.stderr
        accuracy[world] = metrics(where / str(world))[-1]["test_accuracy"]
    return accuracy


@pytest.mark.parametrize(("before", "after"), [(2, 1), (1, 2)])
def test_resume_mid_epoch_at_another_world_size(before: int, after: int, calm_accuracy: dict[int, float],
                                                tmp_path: Path) -> None:
    """Killed mid-epoch 2 at one world size, resumed with --resume at another: it finishes, epoch 2 trains
    every sample once plus only the new world's padding, and it lands among the uninterrupted runs."""
    out = tmp_path / "out"
    _killed_mid_epoch_2(out, before)
    consumed = progress(out)["consumed"]  # type: ignore[index]
    assert consumed == 3 * 100 * before  # 3 steps of the global batch
    r = run_cli(*ODD, "--out", str(out), "--resume", *_world(after), cwd=tmp_path, env=ONE_THREAD)
    assert r.returncode == 0, r.stderr
    assert f"world size changed {before} → {after}, global batch {100 * before} → {100 * after}" in r.stdout
    assert f"epoch 2, {consumed} of its 801 samples done" in r.stdout
    history = metrics(out)
    assert [m["epoch"] for m in history] == [1, 2] and [m["world_size"] for m in history] == [before, after]
    remaining = 801 - consumed
    padding = -remaining % after  # DistributedSampler's: the remainder rounded up to a multiple of the world
    assert history[0]["train_samples"] == 801 + (-801 % before)
    assert history[1]["train_samples"] == 801 + padding
    low, high = sorted(calm_accuracy.values())
    assert low - 0.05 <= history[1]["test_accuracy"] <= high + 0.05, (history[1], calm_accuracy)
