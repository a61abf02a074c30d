"""One optimizer step on one rank.

`train_step` is the textbook DDP step, and the one a run takes wherever each rank trains one whole
micro-batch of the step (the world is the run's M micro-batches; no --bitwise, no --profile). `slot_step` is
the general step for every other case (docs/design/slots.md); its `accumulate` is the textbook's `no_sync` loop,
and its weighting and per-part BatchNorm statistics are what a first reading can skip.
"""

from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager, nullcontext

import torch
import torch.nn.functional as F
from torch import nn

from .batches import Share, Step
from .compute import autocast
from .reduction import Reduction, all_parts, ordered_sum


def train_step(net: nn.Module, opt: torch.optim.Optimizer, x: torch.Tensor, y: torch.Tensor, *, amp: str = "off",
               label_smoothing: float = 0.0, scaler: torch.amp.GradScaler | None = None) -> torch.Tensor:
    """Forward, backward (inside it DDP all-reduces the gradients' mean over the ranks), optimizer step.
    Returns the batch's mean loss, left on the device (reading it would wait for the GPU)."""
    opt.zero_grad(set_to_none=True)
    with autocast(x.device, amp):
        loss = F.cross_entropy(net(x), y, label_smoothing=label_smoothing)
    if scaler is None:
        loss.backward()
        opt.step()
    else:  # fp16: the loss scaled so that small gradients survive; a step whose gradients overflowed is skipped
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()
    return loss.detach()


# --- The general step: several micro-batches per rank, unequal parts, --bitwise, --profile -----------------


def slot_step(net: nn.Module, opt: torch.optim.Optimizer, step: Step, stats: "PartStats", reduction: Reduction, *,
              amp: str, label_smoothing: float, scaler: torch.amp.GradScaler | None = None,
              phase: Callable[[str], AbstractContextManager] = lambda name: nullcontext()) -> torch.Tensor:
    """`train_step` for this rank's micro-batches of `step`; returns the sum of their losses (on the device)."""
    opt.zero_grad(set_to_none=True)
    loss_sum = accumulate(net, step, stats, reduction, amp=amp, label_smoothing=label_smoothing, scaler=scaler,
                          phase=phase)
    with phase("optimizer"):
        if scaler is None:
            opt.step()
        else:
            scaler.step(opt)
            scaler.update()
    return loss_sum


def accumulate(net: nn.Module, step: Step, stats: "PartStats", reduction: Reduction, *, amp: str = "off",
               label_smoothing: float = 0.0, scaler: torch.amp.GradScaler | None = None,
               phase: Callable[[str], AbstractContextManager] = lambda name: nullcontext()) -> torch.Tensor:
    """Forward and backward of this rank's micro-batches, all but the last under `no_sync`, so the gradients
    are reduced once, into the mean over the step's samples; returns the sum of their losses.

    Each loss is summed over its samples and weighted by the reduction (world / step samples for the mean),
    so parts of any size add up to the global batch's mean. The gradients must have been zeroed."""
    device = next(net.parameters()).device
    loss_sum = torch.zeros((), device=device)
    last = len(step.micro_batches) - 1
    weight = reduction.loss_weight(step.samples)
    for i, mb in enumerate(step.micro_batches):
        # Every backward but the step's last runs under no_sync: it only adds into .grad, and the last one's
        # all-reduce carries the sum (one reduction per step). One process has no DDP, so no no_sync.
        held = i < last and hasattr(net, "no_sync")
        with net.no_sync() if held else nullcontext():  # type: ignore[operator]  # DDP's, where `held`
            with stats.use(mb.part), autocast(device, amp), phase("forward"):
                loss = F.cross_entropy(net(mb.x), mb.y, label_smoothing=label_smoothing, reduction="sum")
            with phase("backward"):
                weighted = loss * weight
                (weighted if scaler is None else scaler.scale(weighted)).backward()
        if held:
            reduction.keep()
        loss_sum += loss.detach().float()
    return loss_sum


def running_stats(model: nn.Module) -> list[torch.Tensor]:
    """BatchNorm's running statistics (not num_batches_tracked: a count, not an estimate)."""
    return [b for b in model.buffers() if b.is_floating_point()]


class PartStats:
    """BatchNorm's running statistics, one set per part of the step this rank trains, as if each part ran on a
    rank of its own; `average` loads their mean over every part of every rank into the model, in part order.

    The default run (one part per rank) trains with each rank's own statistics in the model, as DDP does without
    its buffer broadcast; `average` puts the mean there for an evaluation or save, and `train` puts the rank's own
    back. A rank that trains several parts swaps each part's set in around its forward (`use`). `parts` (every
    set, as the last average gathered them) goes into checkpoints, so a resume at any world continues each part's."""

    def __init__(self, model: nn.Module, share: Share, rank: int, saved: torch.Tensor | None = None) -> None:
        self.live, self.share, self.mine = running_stats(model), share, list(share.parts_of(rank))
        self.in_model = len(self.mine) == 1
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

    def train(self) -> None:
        """Before training on: a rank with one part gets its own set back in the model (it may hold the mean)."""
        if self.in_model and self.live:
            self._load(self.sets[self.mine[0]])

    def held(self) -> dict[int, torch.Tensor]:
        """This rank's set of each of its parts, up to date (recovery hands them to the new world)."""
        if self.in_model and self.live:
            self.sets[self.mine[0]] = self._flat()
        return self.sets

    @contextmanager
    def use(self, part: int | None) -> Iterator[None]:
        """The model's buffers hold `part`'s statistics for the forward pass inside (None: no part's)."""
        if part is None or self.in_model:
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
        if self.in_model:
            self.sets[self.mine[0]] = self._flat()
        every = all_parts([self.sets[p] for p in self.mine], self.share, self._flat())
        self._load(ordered_sum(every).div_(self.share.parts))
        for count in self.counts:
            count.fill_(steps)
        self.parts = torch.stack(every)
