"""BatchNorm's running statistics across the ranks. With DDP's buffer broadcast off (ddp.py), each rank trains with
its own; before an evaluation or a save their mean over the ranks goes into the model (one all-gather), and each
rank then trains on with its own again. The general step keeps a set per part of the step (docs/design/slots.md)."""

from collections.abc import Iterator
from contextlib import contextmanager

import torch
from torch import nn

from .batches import Share
from .parts import all_parts, ordered_sum


def running_stats(model: nn.Module) -> list[torch.Tensor]:
    """BatchNorm's running statistics (not num_batches_tracked: a count, not an estimate)."""
    return [b for b in model.buffers() if b.is_floating_point()]


class PartStats:
    """BatchNorm's running statistics, one set per part of the step this rank trains, as if each part ran on a
    rank of its own; `average` loads their mean over every part of every rank into the model, in part order.

    The default run (one part per rank) trains with each rank's own statistics in the model, as DDP does without
    its buffer broadcast; `average` puts the mean there for an evaluation or save, and `use_own` puts the rank's own
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

    def use_own(self) -> None:
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
        num_batches_tracked the `steps` trained, which each part counts once per step, at any world. In a default run
        (one part per rank) that is `all_reduce(own) / world`; every set is gathered because checkpoints keep each."""
        if not self.live:
            return
        if self.in_model:
            self.sets[self.mine[0]] = self._flat()
        every = all_parts([self.sets[p] for p in self.mine], self.share, self._flat())
        self._load(ordered_sum(every).div_(self.share.parts))
        for count in self.counts:
            count.fill_(steps)
        self.parts = torch.stack(every)
