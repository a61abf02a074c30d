"""The run's sentences: what is about to run, how a resume at another world shares it, and the last word."""

import platform
from typing import Any

import torch

from ..common.config import TrainConfig
from ..core.batches import Share
from ..core.distributed import Dist
from ..core.evaluation import EvalResult
from ..core.state import Progress
from ..data.datasets import Dataset


def data_line(data: Dataset) -> str:
    """Which data, how much of it, and where it came from."""
    return (f"data: {data.name}, {len(data.train.labels):,} train / {len(data.test.labels):,} test images, "
            f"from {data.where}{f'; {data.cache}' if data.cache else ''}")


def counted(n: int, noun: str, plural: str = "") -> str:
    """`n` and `noun`, plural (by default `noun` + "s") unless `n` is 1: "1 epoch", "2 epochs"."""
    return f"{n} {noun if n == 1 else plural or noun + 's'}"


def _global_batch(slots: int, batch: int, how: str = "") -> str:
    """The run's global batch in words, "200 (2 micro-batches of 100)", and `how` a world shares it."""
    return f"{slots * batch} ({counted(slots, 'micro-batch', 'micro-batches')} of {batch}{'; ' + how if how else ''})"


def run_line(cfg: TrainConfig, d: Dist, share: Share, amp: str, channels_last: bool) -> str:
    """The software, the world, and the run's global batch and how this world shares it."""
    r, bitwise = cfg.recipe, cfg.bitwise
    how = share.describe(r.batch_size)
    pinned = " (pinned by --bitwise: the kernels' sums depend on it)" if bitwise and d.device.type == "cpu" else ""
    reduced = ("gradients bitwise: every micro-batch's gradient summed in slot order" if bitwise
               else "gradients averaged by all-reduce" if d.world_size > 1 else "one process: no all-reduce")
    return (f"run: torch {torch.__version__}, python {platform.python_version()}, device {d.device.type}, "
            f"world size {d.world_size}, {torch.get_num_threads()} thread(s) per process{pinned}, "
            f"global batch {_global_batch(share.slots, r.batch_size, how)}, {reduced}, "
            f"{r.optimizer} lr {r.lr}, {r.scheduler} schedule, amp {amp}, channels_last {channels_last}")


def resume_line(was: int, share: Share, cfg: TrainConfig) -> str:
    """A resume's line when this world shares the run's global batch otherwise than its first start did."""
    if was == share.world and share.slots == share.world * cfg.accumulate:
        return ""
    batch = cfg.recipe.batch_size
    how = share.describe(batch)
    return (f"resume: world size {was} → {share.world}; the run's global batch stays "
            f"{_global_batch(share.slots, batch)}, and so do its steps and the lr at each"
            + (f": {how}" if how else ""))


def final_line(cfg: TrainConfig, d: Dist, progress: Progress, outcome: str | None, result: EvalResult) -> str:
    """The accuracy, and how the run ended against --target-accuracy if one was set."""
    r, target, done = cfg.recipe, f"{cfg.target_accuracy or 0:.2%}", progress.epoch
    score = f"test accuracy {100 * result.accuracy:.2f}% ({result.correct}/{result.count}) on {cfg.data.dataset}"
    where = f"world size {d.world_size}; outputs in {cfg.out}"
    if outcome == "already":
        return (f"final: already done: an earlier epoch reached the target {target} (best test accuracy "
                f"{progress.best_accuracy:.2%}), so nothing was trained; raise --target-accuracy or leave "
                f"it out to train on; outputs in {cfg.out}")
    if outcome == "reached":
        return f"final: reached the target {target} after epoch {done} of {r.epochs}: {score}, {where}"
    if outcome == "missed":
        return f"final: did not reach the target {target} in {counted(r.epochs, 'epoch')}: {score}, {where}"
    return f"final: {score} after {counted(r.epochs, 'epoch')}, {where}"


def epoch_record(epoch: int, cfg: TrainConfig, d: Dist, p: Progress, result: EvalResult, images_per_second: float,
                 seconds: float, lr: float, global_batch: int, dataset: str) -> dict[str, Any]:
    """One finished epoch, as metrics.jsonl records it (and the console's epoch line shows it)."""
    return {
        "epoch": epoch + 1, "epochs": cfg.recipe.epochs,
        "train_loss": p.loss_sum / max(p.seen, 1),
        "test_loss": result.loss, "test_accuracy": result.accuracy,
        "test_correct": result.correct, "test_count": result.count,
        "train_samples": p.seen,  # over all ranks, the sampler's padding included
        "images_per_second": images_per_second, "epoch_seconds": seconds, "lr": lr,
        "world_size": d.world_size, "batch_size": cfg.recipe.batch_size, "global_batch": global_batch,
        "dataset": dataset,
    }
