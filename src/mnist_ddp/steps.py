"""One optimizer step on one rank: forward and backward of its micro-batches, gradients reduced once.

A step's global batch is cut into parts (batches.py: the run's M micro-batch slots, dealt over the
world). A rank that trains several parts runs every backward but the last inside DDP's `no_sync`, which
skips the collective, so the last backward reduces the step's gradients once — K micro-batches per step
cost one collective, not K. What happens to the gradients of the parts before the last, and how they are
reduced, is the run's reduction (reduction.py): DDP's mean accumulates them in `.grad`; `--bitwise` keeps
each apart, to be summed in slot order over the whole world.

The weighting makes the step's gradient the mean over every sample of the global batch, however the
parts are sized (an epoch's last, shorter step; a world that does not divide M): each part's loss is
*summed* over its samples and multiplied by the reduction's weight (world / samples for the mean, whose
all-reduce then divides by the world; 1 / samples for `--bitwise`, the same number at any world size).

BatchNorm's running statistics are kept per part (`PartStats`): a world of M processes keeps M sets,
each updated once per step from its own micro-batch, and a rank training K parts keeps K, so that the
sets, and their average, are the same whatever the world.
"""

from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager, nullcontext

import torch
import torch.nn.functional as F
from torch import nn

from .batches import Share, Step
from .compute import autocast
from .reduction import Reduction, all_parts, ordered_sum


def running_stats(model: nn.Module) -> list[torch.Tensor]:
    """BatchNorm's running statistics (not num_batches_tracked: a count, not an estimate)."""
    return [b for b in model.buffers() if b.is_floating_point()]


class PartStats:
    """BatchNorm's running statistics, one set for each part of the step this rank trains.

    Before a part's forward pass its set is loaded into the model's buffers, and afterwards taken back
    (`use`): no broadcast before every forward (trainer.wrap), each part's statistics evolve as on a rank of
    its own. `average` makes the model's buffers the mean over all the step's parts, added in part order
    whatever the world, before the model is evaluated or saved, so every rank scores, and rank 0 saves,
    the same model, estimated from every rank's data; the sets themselves train on untouched, so when
    averages happen (checkpoints, evaluations) changes nothing. `parts` (every part's set, as the last
    average gathered them) goes into checkpoints, so a resume at any world continues every part's own.
    """

    def __init__(self, model: nn.Module, share: Share, rank: int, saved: torch.Tensor | None = None) -> None:
        self.live, self.share, self.mine = running_stats(model), share, list(share.mine(rank))
        # num_batches_tracked counts a module's training forwards: K a step on a rank training K parts.
        self.counts = [b for b in model.buffers() if not b.is_floating_point()]
        start = saved if saved is not None and len(saved) == share.parts else None  # else: from the saved mean
        self.sets = {p: self._flat() if start is None else self._flat().copy_(start[p]) for p in self.mine}
        self.parts: torch.Tensor | None = start

    def _flat(self) -> torch.Tensor:
        return torch.cat([b.reshape(-1) for b in self.live])

    def _load(self, flat: torch.Tensor) -> None:
        for b, value in zip(self.live, flat.split([b.numel() for b in self.live])):
            b.copy_(value.view_as(b))

    @contextmanager
    def use(self, part: int | None) -> Iterator[None]:
        """The model's buffers hold `part`'s statistics for the forward pass inside (None: no part's)."""
        if part is None:
            yield
            return
        self._load(self.sets[part])
        yield
        self.sets[part] = self._flat()

    def average(self, steps: int) -> None:
        """The model's buffers become the mean over all parts of all ranks (one all-gather), and every
        num_batches_tracked the `steps` trained, which each part counts once per step, at any world."""
        if not self.live:
            return
        every = all_parts([self.sets[p] for p in self.mine], self.share, self._flat())
        self._load(ordered_sum(every).div_(self.share.parts))
        for count in self.counts:
            count.fill_(steps)
        self.parts = torch.stack(every)


def accumulate(net: nn.Module, step: Step, stats: PartStats, reduction: Reduction, scaler: torch.amp.GradScaler,
               amp: str, label_smoothing: float,
               phase: Callable[[str], AbstractContextManager] = lambda name: nullcontext()) -> torch.Tensor:
    """Forward and backward of this rank's micro-batches of `step`; returns the sum of their losses.

    The gradients must have been zeroed; afterwards they hold the global batch's mean gradient on every rank.
    `phase` times the forward and backward passes (--profile: timeline.py).
    """
    device = next(net.parameters()).device
    loss_sum = torch.zeros((), device=device)
    last = len(step.micro_batches) - 1
    weight = reduction.loss_weight(step.samples)
    for i, mb in enumerate(step.micro_batches):
        # DDP reduces the gradients during backward, unless inside no_sync: only the last part's backward does.
        held = i < last and hasattr(net, "no_sync")
        with net.no_sync() if held else nullcontext():
            with stats.use(mb.part), autocast(device, amp), phase("forward"):
                loss = F.cross_entropy(net(mb.x), mb.y, label_smoothing=label_smoothing, reduction="sum")
            with phase("backward"):
                scaler.scale(loss * weight).backward()
        if held:
            reduction.keep()
        loss_sum += loss.detach().float()
    return loss_sum
