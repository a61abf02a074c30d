"""Runs that end early, with real processes on tiny synthetic data: a diverging run stops every rank with
one line and exit 1, keeping the last finite checkpoint; --target-accuracy stops after the first epoch that
reaches it, and --resume respects it. Both also with --graph-step on (on the CPU: the graph step, eagerly)."""

import math
from pathlib import Path

import pytest
import torch

from conftest import metrics, progress, run_cli, tiny
from datafiles import ONE_THREAD
from mnist_ddp.common.config import RESUME_MUST_MATCH
from mnist_ddp.outputs import checkpoint
from procfs import MARK, marked_env, needs_proc, reaped

HANG = 300  # seconds: a hang detector only; these runs take seconds

# AdamW at a constant lr 1e4, global batch 200 (6 steps per epoch): epoch 1 ends finite, and by the end of
# epoch 2 BatchNorm's running variance overflows. fp32, so that every CPU sees the same numbers.
DIVERGING = [*tiny(1200, 200, epochs=3), "--scheduler", "none", "--lr", "1e4", "--amp", "off"]
GRAPH = ["--graph-step", "on"]
WORLDS = {"one process": ["--batch-size", "200"], "-g 2": ["-g", "2"], "-g 2, graph step": ["-g", "2", *GRAPH]}


def _finite(value: object) -> bool:
    """Whether every tensor in a (nested) checkpoint entry is finite."""
    if isinstance(value, torch.Tensor):
        return not value.is_floating_point() or bool(torch.isfinite(value).all())
    if isinstance(value, dict):
        return all(_finite(v) for v in value.values())
    if isinstance(value, list | tuple):
        return all(_finite(v) for v in value)
    return not isinstance(value, float) or math.isfinite(value)


def _final_line(out: str) -> str:
    """The run's last word, the `final:` line (the `time:` line follows it)."""
    *said, timed = out.strip().splitlines()
    assert timed.startswith("time: "), out
    return said[-1]


def _graph_step_ran(out: str) -> bool:
    return "step: the graph step, eagerly" in out


@needs_proc
@pytest.mark.parametrize("world", WORLDS.values(), ids=WORLDS.keys())
def test_divergence_stops_every_rank_and_keeps_the_last_finite_checkpoint(tmp_path: Path, world: list[str]) -> None:
    """A finite epoch 1 is saved first (the run stops there at a low target); resumed without the target,
    epoch 2 diverges: exit 1, one line naming epoch, step and lr, no process left, and the checkpoints are
    byte for byte the ones from before, every tensor finite."""
    out = tmp_path / "run"
    args = ["train", *DIVERGING, *world, "--out", str(out), "--resume"]
    _, mark = marked_env()
    with reaped(mark):
        first = run_cli(*args, "--target-accuracy", "0.01", env={MARK: mark, **ONE_THREAD}, timeout=HANG)
        assert first.returncode == 0, first.stderr
        assert "reached the target 1.00% after epoch 1 of 3" in _final_line(first.stdout)
        assert _graph_step_ran(first.stdout) == ("--graph-step" in world), first.stdout
        before = {name: (out / name).read_bytes() for name in ("checkpoint.pt", "best.pt")}
        assert all(_finite(checkpoint.load(out / name)) for name in before)

        run = run_cli(*args, env={MARK: mark, **ONE_THREAD}, timeout=HANG)
    assert run.returncode == 1, run.stderr
    lines = run.stderr.strip().splitlines()
    assert len(lines) == 1, run.stderr
    assert lines[0].startswith("mnist-ddp: error: training diverged in epoch 2 by step "), lines
    assert "at lr 1e+04:" in lines[0]
    assert "smaller --lr (e.g. 1000)" in lines[0]
    assert {name: (out / name).read_bytes() for name in before} == before
    assert len(metrics(out)) == 1 and progress(out)["epoch"] == 1


TARGETS = {"one process": ([], 0.7), "-g 2": (["-g", "2"], 0.55), "-g 2, graph step": (["-g", "2", *GRAPH], 0.55)}


@pytest.mark.parametrize(("world", "target"), TARGETS.values(), ids=TARGETS.keys())
def test_target_accuracy_stops_after_the_first_epoch_that_reaches_it(tmp_path: Path, world: list[str],
                                                                      target: float) -> None:
    out = tmp_path / "run"
    run = run_cli("train", *tiny(epochs=4), "--amp", "off", *world, "--out", str(out),
                  "--target-accuracy", str(target), env=ONE_THREAD, timeout=HANG)
    assert run.returncode == 0, run.stderr
    assert _graph_step_ran(run.stdout) == ("--graph-step" in world), run.stdout
    rows = metrics(out)
    accuracies = [row["test_accuracy"] for row in rows]
    assert 2 <= len(rows) < 4, accuracies  # an epoch fell short first, and the run stopped before the end
    assert all(a < target for a in accuracies[:-1]) and accuracies[-1] >= target, accuracies
    assert f"final: reached the target {target:.2%} after epoch {len(rows)} of 4: " in _final_line(run.stdout)
    saved = checkpoint.load(out / "checkpoint.pt")
    assert saved["progress"]["epoch"] == len(rows) and saved["config"]["target_accuracy"] == target
    assert (out / "best.pt").exists()


def test_resume_after_the_target_trains_on_only_for_a_higher_one(tmp_path: Path) -> None:
    out = tmp_path / "run"

    def train_(*flags: str):
        return run_cli("train", *tiny(epochs=3), "--amp", "off", "--out", str(out), *flags, env=ONE_THREAD,
                       timeout=HANG)

    assert "target_accuracy" not in RESUME_MUST_MATCH
    assert train_("--target-accuracy", "0.5").returncode == 0  # the first epoch reaches 60% here
    assert len(metrics(out)) == 1
    stopped = (out / "checkpoint.pt").read_bytes()
    for same_or_lower in ("0.5", "0.3"):
        again = train_("--resume", "--target-accuracy", same_or_lower)
        assert again.returncode == 0, again.stderr
        assert _final_line(again.stdout).startswith("final: already done: an earlier epoch reached the target")
        assert "epoch 2/3" not in again.stdout and (out / "checkpoint.pt").read_bytes() == stopped
    higher = train_("--resume", "--target-accuracy", "1")
    assert higher.returncode == 0, higher.stderr
    assert _final_line(higher.stdout).startswith("final: did not reach the target 100.00% in 3 epochs: ")
    assert [row["epoch"] for row in metrics(out)] == [1, 2, 3]
