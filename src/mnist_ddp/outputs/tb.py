"""TensorBoard event files under `<out>/tb/` (`--tensorboard`), written by rank 0's Reporter.

The x-axis is the number of training samples of the run so far (over all ranks), for the per-step
train loss as for the per-epoch metrics, so that every curve lines up, and it means the same at any world
size, and across runs of different global batches (optimizer steps would not).
`tensorboard` is imported only here, and only when the writer opens: runs without --tensorboard never
pay its import (~0.25 s).
"""

from pathlib import Path
from typing import Any

from ..common import extras

# The metrics.jsonl keys that also become per-epoch scalars, under "epoch/<key>".
EPOCH_SCALARS = ("train_loss", "test_loss", "test_accuracy", "lr", "images_per_second")


def check_installed() -> None:
    """Refuse --tensorboard at once, before any process starts, when the package is missing."""
    extras.require("--tensorboard", ("tensorboard",), "tensorboard")


class TensorBoard:
    """One SummaryWriter whose events are flushed as they are written, so a killed run loses none
    of the steps its last checkpoint covers."""

    def __init__(self, logdir: Path, start: int) -> None:
        from torch.utils.tensorboard import SummaryWriter

        # A resumed (or restarted) run redoes everything after `start`: purge_step makes TensorBoard
        # drop what the lost run logged there, instead of drawing those steps twice.
        self.writer = SummaryWriter(str(logdir), purge_step=start + 1)

    def scalars(self, step: int, values: dict[str, float]) -> None:
        for tag, value in values.items():
            self.writer.add_scalar(tag, value, step)
        self.writer.flush()

    def epoch(self, step: int, metrics: dict[str, Any], confusion_figure: Any | None) -> None:
        """The epoch's metrics.jsonl values, and the confusion matrix as an image (when matplotlib drew one)."""
        if confusion_figure is not None:
            self.writer.add_figure("epoch/confusion", confusion_figure, step, close=False)
        self.scalars(step, {f"epoch/{key}": metrics[key] for key in EPOCH_SCALARS})

    def close(self) -> None:
        self.writer.close()
