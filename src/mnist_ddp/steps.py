"""One optimizer step on one rank: forward and backward of its micro-batches, gradients all-reduced once.

A step's global batch is cut into parts (batches.py: the run's M micro-batch slots, dealt over the
world). A rank that trains several parts accumulates their gradients in `.grad`: every backward but
the last runs inside DDP's `no_sync`, which skips the all-reduce, so the last backward all-reduces
the sum once — K micro-batches per step cost one all-reduce, not K.

The weighting makes the step's gradient the mean over every sample of the global batch, however the
parts are sized (an epoch's last, shorter step; a world that does not divide M): each part's loss is
*summed* over its samples and scaled by world / (samples in the whole step), and DDP's all-reduce then
averages over the world. So `-g 1 --accumulate 4`, `-g 2 --accumulate 2` and `-g 4` compute the same
gradient up to float summation order.

BatchNorm's running statistics are kept per part (`PartStats`): a world of M processes keeps M sets,
each updated once per step from its own micro-batch, and a rank training K parts keeps K, so that the
sets, and their average, are the same whatever the world.
"""

from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager, nullcontext

import torch
import torch.nn.functional as F
from torch import nn

from .batches import Step
from .compute import autocast
from .distributed import Dist


def running_stats(model: nn.Module) -> list[torch.Tensor]:
    """BatchNorm's running statistics (not num_batches_tracked: a count, not an estimate)."""
    return [b for b in model.buffers() if b.is_floating_point()]


class PartStats:
    """BatchNorm's running statistics, one set for each part of the step this rank trains.

    Each rank keeps its own statistics while training (no broadcast before every forward: trainer.wrap),
    and `average` replaces every set by the mean over all the step's parts (one all-reduce) before the
    model is evaluated or saved, so every rank scores, and rank 0 saves, the same model, estimated
    from every rank's data. With one part per rank there is one set, the model's own buffers.
    """

    def __init__(self, model: nn.Module, parts: range, total: int, d: Dist) -> None:
        self.live, self.total, self.d = running_stats(model), total, d
        self.sets = {p: self._flat() for p in parts} if len(parts) > 1 else {}

    def _flat(self) -> torch.Tensor:
        return torch.cat([b.reshape(-1) for b in self.live])

    def _load(self, flat: torch.Tensor) -> None:
        for b, value in zip(self.live, flat.split([b.numel() for b in self.live])):
            b.copy_(value.view_as(b))

    @contextmanager
    def use(self, part: int) -> Iterator[None]:
        """The model's buffers hold `part`'s statistics for the forward pass inside."""
        if part not in self.sets:
            yield
            return
        self._load(self.sets[part])
        yield
        self.sets[part] = self._flat()

    def average(self) -> None:
        """Every set, and the model's buffers, become the mean over all parts of all ranks."""
        if self.total == 1 or not self.live:
            return
        mine = torch.stack(list(self.sets.values())).sum(0) if self.sets else self._flat()
        mean = self.d.all_sum(mine).div_(self.total)
        self._load(mean)
        self.sets = {p: mean.clone() for p in self.sets}


def _untimed(name: str) -> AbstractContextManager:
    return nullcontext()


def accumulate(net: nn.Module, step: Step, stats: PartStats, scaler: torch.amp.GradScaler, world: int, amp: str,
               label_smoothing: float, phase: Callable[[str], AbstractContextManager] = _untimed) -> torch.Tensor:
    """Forward and backward of this rank's micro-batches of `step`; returns the sum of their losses.

    The gradients must have been zeroed; afterwards they hold the global batch's mean gradient on every rank.
    `phase` times the forward and backward passes (--profile: timeline.py).
    """
    device = next(net.parameters()).device
    loss_sum = torch.zeros((), device=device)
    last = len(step.micro_batches) - 1
    for i, mb in enumerate(step.micro_batches):
        # DDP all-reduces the gradients during backward, unless inside no_sync: only the last part's backward does.
        with net.no_sync() if i < last and hasattr(net, "no_sync") else nullcontext():
            with stats.use(mb.part), autocast(device, amp), phase("forward"):
                loss = F.cross_entropy(net(mb.x), mb.y, label_smoothing=label_smoothing, reduction="sum")
            with phase("backward"):
                scaler.scale(loss * (world / step.samples)).backward()
        loss_sum += loss.detach().float()
    return loss_sum
