"""BatchNorm's running statistics across the ranks. With DDP's buffer broadcast off (ddp.py), each rank trains with its
own; before an evaluation or a save their mean over the ranks goes into the model (one all-gather), and each rank then
trains on with its own again: `RankStats`, a default run's. The general step keeps a set per part of the step
(`PartStats`, docs/design/slots.md)."""

from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Protocol

import torch
from torch import nn

from .batches import Share
from .distributed import Dist
from .parts import all_parts, ordered_sum


def running_stats(model: nn.Module) -> list[torch.Tensor]:
    """BatchNorm's running statistics (not num_batches_tracked: a count, not an estimate)."""
    return [b for b in model.buffers() if b.is_floating_point()]


def _flat(buffers: Sequence[torch.Tensor]) -> torch.Tensor:
    return torch.cat([b.reshape(-1) for b in buffers])


def _load(buffers: Sequence[torch.Tensor], flat: torch.Tensor) -> None:
    for b, value in zip(buffers, flat.split([b.numel() for b in buffers])):
        b.copy_(value.view_as(b))


class Statistics(Protocol):
    """What the loop asks of BatchNorm's statistics across the ranks: `RankStats` or `PartStats`."""

    parts: torch.Tensor | None  # every rank's (or part's) set, as the last average gathered them: for checkpoints

    def average(self, steps: int) -> None: ...

    def use_own(self) -> None: ...


class RankStats:
    """A default run's BatchNorm statistics: each rank trains with its own; `average` loads their mean over the ranks
    into the model (every rank's set gathered, added in rank order), and `use_own` puts this rank's own back.
    `parts` (every rank's set, as the last average gathered them) goes into checkpoints, so that a resume at another
    world continues each (PartStats)."""

    def __init__(self, model: nn.Module, d: Dist) -> None:
        self.live, self.d = running_stats(model), d
        # num_batches_tracked counts a module's training forwards: one a step on every rank (`average` sets it)
        self.counts = [b for b in model.buffers() if not b.is_floating_point()]
        self.own: torch.Tensor | None = None  # this rank's statistics, while the model holds the mean
        self.parts: torch.Tensor | None = None

    def average(self, steps: int) -> None:
        """The model's buffers become the mean of every rank's, and every num_batches_tracked the `steps` trained."""
        if not self.live:
            return
        own = _flat(self.live)
        every = self.d.all_gather(own)
        _load(self.live, ordered_sum(every).div_(len(every)))
        for count in self.counts:
            count.fill_(steps)
        self.own, self.parts = own, torch.stack(every)

    def use_own(self) -> None:
        """Before training on: this rank's own statistics back in the model, where it holds the mean."""
        if self.own is not None:
            _load(self.live, self.own)
            self.own = None


class PartStats:
    """BatchNorm's running statistics, one set per part of the step this rank trains, as if each part ran on a
    rank of its own; `average` loads their mean over every part of every rank into the model, in part order.

    Where each rank trains one part, the statistics stay in the model, as `RankStats` keeps them; `average` puts the
    mean there for an evaluation or save, and `use_own` puts the rank's own back. A rank that trains several parts
    swaps each part's set in around its forward (`use`). `parts` (every
    set, as the last average gathered them) goes into checkpoints, so a resume at any world continues each part's."""

    def __init__(self, model: nn.Module, share: Share, rank: int, saved: torch.Tensor | None = None) -> None:
        self.live, self.share, self.mine = running_stats(model), share, list(share.parts_of(rank))
        self.in_model = len(self.mine) == 1
        # num_batches_tracked counts a module's training forwards: K a step on a rank training K parts.
        self.counts = [b for b in model.buffers() if not b.is_floating_point()]
        start = saved if saved is not None and len(saved) == share.parts else None  # else: from the saved mean
        self.sets = {p: _flat(self.live) if start is None else _flat(self.live).copy_(start[p]) for p in self.mine}
        self.parts: torch.Tensor | None = start

    def use_own(self) -> None:
        """Before training on: a rank with one part gets its own set back in the model (it may hold the mean)."""
        if self.in_model and self.live:
            _load(self.live, self.sets[self.mine[0]])

    def held(self) -> dict[int, torch.Tensor]:
        """This rank's set of each of its parts, up to date (recovery hands them to the new world)."""
        if self.in_model and self.live:
            self.sets[self.mine[0]] = _flat(self.live)
        return self.sets

    @contextmanager
    def use(self, part: int | None) -> Iterator[None]:
        """The model's buffers hold `part`'s statistics for the forward pass inside (None: no part's)."""
        if part is None or self.in_model:
            yield
            return
        _load(self.live, self.sets[part])
        yield
        self.sets[part] = _flat(self.live)

    def average(self, steps: int) -> None:
        """The model's buffers become the mean over all parts of all ranks (one all-gather), and every
        num_batches_tracked the `steps` trained, which each part counts once per step, at any world."""
        if not self.live:
            return
        if self.in_model:
            self.sets[self.mine[0]] = _flat(self.live)
        every = all_parts([self.sets[p] for p in self.mine], self.share, _flat(self.live))
        _load(self.live, ordered_sum(every).div_(self.share.parts))
        for count in self.counts:
            count.fill_(steps)
        self.parts = torch.stack(every)
