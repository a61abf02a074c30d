"""What --recover keeps at every step boundary: an in-memory copy of the run's state (weights, optimizer, BatchNorm
sets, progress), the last two, so that survivors one step apart can all go back to the step that failed
(docs/design/recovery.md)."""

from collections import deque
from collections.abc import Mapping
from copy import deepcopy
from dataclasses import dataclass, replace
from typing import Any

import torch

from ..core.bnstats import PartStats
from ..core.state import Progress, Stretch, Training


def _copied(state: dict[str, Any]) -> dict[str, Any]:
    return {k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in state.items()}


@dataclass
class Snapshot:
    """The run's state where position `position` (a step, or a fold) began."""

    position: int
    tensors: list[torch.Tensor]  # the model's parameters and buffers, in `Snapshots.live` order
    optimizer: dict[torch.Tensor, dict[str, Any]]
    groups: list[dict[str, Any]]  # the optimizer's param_groups, without their params
    scaler: dict[str, Any] | None
    sets: dict[int, torch.Tensor]  # PartStats.sets: this rank's BatchNorm set per part
    progress: Progress
    stretch: Stretch
    known: Mapping[int, torch.Tensor]  # every part's BatchNorm set as the last reduction carried it (--bitwise)


class Snapshots:
    """The last two positions' states of one rank; every rank passes the same positions in the same order."""

    def __init__(self, t: Training) -> None:
        self.t, self.position = t, 0
        self.live = [*t.model.parameters(), *t.model.buffers()]
        self.kept: deque[Snapshot] = deque(maxlen=2)

    def take(self, stats: PartStats, stretch: Stretch, known: Mapping[int, torch.Tensor]) -> None:
        """A new position begins (a fold, or a step): copy the state it starts from."""
        self.position += 1
        t = self.t
        with torch.no_grad():
            self.kept.append(Snapshot(
                self.position, [x.detach().clone() for x in self.live],
                {p: _copied(s) for p, s in t.opt.state.items()},
                [{k: v for k, v in g.items() if k != "params"} for g in t.opt.param_groups],
                deepcopy(t.scaler.state_dict()) if t.scaler is not None else None,
                {p: s.clone() for p, s in stats.sets.items()}, replace(t.progress), stretch.copy(), known))

    def restore(self, position: int) -> Snapshot:
        """Put the state where `position` began back (the model, optimizer and progress; the caller takes the
        BatchNorm sets and stretch from the snapshot returned); the next `take` is `position` again."""
        found = next((s for s in self.kept if s.position == position), None)
        if found is None:
            raise RuntimeError(f"no snapshot of position {position} (kept: {[s.position for s in self.kept]})")
        t = self.t
        with torch.no_grad():
            for x, saved in zip(self.live, found.tensors, strict=True):
                x.copy_(saved)
        t.opt.state.clear()
        t.opt.state.update({p: _copied(s) for p, s in found.optimizer.items()})
        for group, settings in zip(t.opt.param_groups, found.groups, strict=True):
            group.update(settings)
        if t.scaler is not None and found.scaler is not None:
            t.scaler.load_state_dict(found.scaler)
        t.progress = replace(found.progress)
        self.position = position - 1
        while self.kept and self.kept[-1].position >= position:
            self.kept.pop()
        return found
