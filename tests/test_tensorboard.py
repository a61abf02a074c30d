"""--tensorboard: real runs write event files that TensorBoard's own reader finds to hold what
metrics.jsonl holds, the train loss at every --log-every step, each step once after a resume, and
only rank 0's writer; without the package the flag is refused before any process starts."""

import json
import subprocess
from pathlib import Path

import pytest

from conftest import metrics, run_cli, tiny
from datafiles import ONE_THREAD
from mnist_ddp import cli
from mnist_ddp.outputs import checkpoint

pytest.importorskip("tensorboard")  # the `dev` extra installs it
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

SAMPLES = 800  # per epoch, tiny()'s: TensorBoard's x-axis counts training samples (the same at any world size)
STEPS = 8  # optimizer steps per epoch at batch 100, one process
PER_EPOCH = ("train_loss", "test_loss", "test_accuracy", "lr", "images_per_second")


def _train(out: Path, *extra: str) -> list[str]:
    return ["train", *tiny(epochs=2), "--tensorboard", "--out", str(out), *extra]


def _ok(r: subprocess.CompletedProcess) -> None:
    assert r.returncode == 0, r.stderr


def _events(out: Path) -> EventAccumulator:
    """Everything TensorBoard would show for `out` (all points kept, purges applied, as its UI does)."""
    return EventAccumulator(str(out / "tb"), size_guidance={"scalars": 0, "images": 0}).Reload()


def _points(acc: EventAccumulator, tag: str) -> dict[int, float]:
    """x (samples trained) → value; a point drawn twice fails here rather than silently keeping one."""
    steps = [e.step for e in acc.Scalars(tag)]
    assert steps == sorted(set(steps)), f"{tag}: steps {steps}"
    return {e.step: e.value for e in acc.Scalars(tag)}


def _assert_epochs_match_metrics(out: Path) -> None:
    """One point per epoch at its end, equal to metrics.jsonl (TensorBoard keeps float32)."""
    acc, rows = _events(out), metrics(out)
    ends = [row["epoch"] * SAMPLES for row in rows]
    for key in PER_EPOCH:
        points = _points(acc, f"epoch/{key}")
        assert list(points) == ends, key
        assert list(points.values()) == pytest.approx([row[key] for row in rows], rel=1e-6), key
    images = acc.Images("epoch/confusion")
    assert [i.step for i in images] == ends
    assert all(i.encoded_image_string.startswith(b"\x89PNG") and i.width > 100 for i in images)


def _assert_steps_file_matches_events(out: Path) -> None:
    """steps.jsonl (what curves.png draws) holds the same logged steps as TensorBoard, each once."""
    steps = [json.loads(line) for line in (out / "steps.jsonl").read_text().splitlines()]
    loss = _points(_events(out), "train/loss")
    assert [p["samples"] for p in steps] == list(loss)
    assert [p["train_loss"] for p in steps] == pytest.approx(list(loss.values()), rel=1e-6)
    assert [p["epoch"] for p in steps] == pytest.approx([p["samples"] / SAMPLES for p in steps])


def test_one_process_logs_every_n_steps_and_each_epoch(tmp_path: Path) -> None:
    out = tmp_path / "run"
    _ok(run_cli(*_train(out, "--log-every", "3"), cwd=tmp_path, env=ONE_THREAD))
    acc = _events(out)
    every_3rd_step = [300, 600, 900, 1200, 1500]  # the run's optimizer steps 3, 6, …, across epochs, in samples
    assert list(_points(acc, "train/loss")) == every_3rd_step
    assert list(_points(acc, "train/lr")) == every_3rd_step
    _assert_epochs_match_metrics(out)
    _assert_steps_file_matches_events(out)


def test_without_tensorboard_the_logged_steps_go_to_steps_jsonl_and_curves(tmp_path: Path) -> None:
    out = tmp_path / "run"
    with_plots = [arg for arg in tiny(epochs=2) if arg != "--no-plots"]
    _ok(run_cli("train", *with_plots, "--log-every", "3", "--out", str(out), cwd=tmp_path, env=ONE_THREAD))
    steps = [json.loads(line) for line in (out / "steps.jsonl").read_text().splitlines()]
    assert [p["samples"] for p in steps] == [300, 600, 900, 1200, 1500]
    assert all(0 < p["train_loss"] < 10 and p["lr"] > 0 for p in steps)
    assert (out / "curves.png").read_bytes()[:4] == b"\x89PNG" and not (out / "tb").exists()


def test_two_ranks_log_all_ranks_loss_through_rank_0_alone(tmp_path: Path) -> None:
    out = tmp_path / "run"
    _ok(run_cli(*_train(out, "-g", "2", "--log-every", "1"), cwd=tmp_path, env=ONE_THREAD))
    assert len(list((out / "tb").iterdir())) == 1  # one writer: rank 0's
    steps = STEPS // 2  # 400 images per rank
    _assert_epochs_match_metrics(out)
    # Every step's loss is the mean over both ranks' equal batches, so an epoch's points average to
    # metrics.jsonl's train loss (all ranks' images); rank 0's own losses would not.
    loss = list(_points(_events(out), "train/loss").values())
    assert len(loss) == 2 * steps
    epoch_means = [sum(loss[i:i + steps]) / steps for i in (0, steps)]
    assert epoch_means == pytest.approx([row["train_loss"] for row in metrics(out)], rel=1e-5)
    _assert_steps_file_matches_events(out)


def test_a_resumed_run_draws_each_step_once(tmp_path: Path) -> None:
    """A run killed in epoch 2 leaves events past its last checkpoint (they are flushed as written); the
    resumed run redoes epoch 2, and TensorBoard must show the redone steps once, with their new values."""
    out = tmp_path / "run"
    args = _train(out, "--log-every", "3", "--scheduler", "none")  # constant lr: the schedule can be rewound
    _ok(run_cli(*args, cwd=tmp_path, env=ONE_THREAD))
    before = _points(_events(out), "train/loss")
    # Rewind the checkpoint to the end of epoch 1: exactly what a kill during epoch 2 leaves on disk.
    ckpt = checkpoint.load(out / "checkpoint.pt")
    ckpt["progress"].update(epoch=1, consumed=0, loss_sum=0.0, seen=0)
    checkpoint.save(out / "checkpoint.pt", ckpt)

    _ok(run_cli(*args, "--resume", cwd=tmp_path, env=ONE_THREAD))
    after = _points(_events(out), "train/loss")
    assert list(after) == [300, 600, 900, 1200, 1500]
    assert [after[s] for s in (300, 600)] == [before[s] for s in (300, 600)]  # epoch 1: kept, not redone
    assert all(after[s] != before[s] for s in (900, 1200, 1500))  # epoch 2 trained twice: the second one's values
    _assert_epochs_match_metrics(out)
    _assert_steps_file_matches_events(out)


def test_log_every_must_be_a_positive_number_of_steps(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["train", "--tensorboard", "--log-every", "0"]) == 2
    assert capsys.readouterr().err.strip() == "mnist-ddp: error: --log-every must be at least 1 step, not 0."
