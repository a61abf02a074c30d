"""A run's training state: what the step changes, and a checkpoint saves and restores (saving.py)."""

from dataclasses import dataclass, field

import torch

from ..model import ConvNet


@dataclass
class Progress:
    """Where the run stands; saved in every checkpoint."""

    epoch: int = 0  # epochs completed
    consumed: int = 0  # samples of the current epoch's permutation trained on, over all ranks (padding not counted)
    loss_sum: float = 0.0  # over all ranks, for the current epoch so far
    seen: int = 0  # training images over all ranks, current epoch so far
    best_accuracy: float = -1.0


@dataclass
class Stretch:
    """What a rank adds up between two folds (trainer.Trainer._fold)."""

    loss_sum: torch.Tensor  # this rank's, on the device (no sync per step)
    seen: int = 0  # this rank's samples
    samples: int = 0  # the whole steps' samples, all ranks'
    # (samples done, lr, this rank's loss sum, the step's samples) of every --log-every-th step
    logged: list[tuple[int, float, torch.Tensor, int]] = field(default_factory=list)

    def add(self, step_loss: torch.Tensor, here: int, samples: int) -> None:
        """One step's: this rank's mean loss over its `here` samples, of the step's `samples` over all ranks."""
        self.loss_sum.add_(step_loss, alpha=here)
        self.seen += here
        self.samples += samples

    def copy(self) -> "Stretch":
        return Stretch(self.loss_sum.clone(), self.seen, self.samples, list(self.logged))


@dataclass
class Training:
    """What training changes, and a checkpoint saves and restores."""

    model: ConvNet  # the plain ConvNet, holding BatchNorm statistics averaged over every part
    opt: torch.optim.Optimizer
    scaler: torch.amp.GradScaler | None  # fp16's
    progress: Progress
