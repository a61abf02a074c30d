"""The general step's reductions (a reader of the textbook step can skip this): the DDP comm hooks of `--bitwise`
(`SlotReduction`: summed in slot order) and `--profile` (`MeanReduction`, which it times), and the loss weights of
micro-batches of any size (docs/design/bitwise.md). Every other run keeps DDP's own all-reduce, with no hook."""

from abc import ABC, abstractmethod
from collections.abc import Callable, Mapping, Sequence
from types import MappingProxyType
from typing import Protocol

import torch
import torch.distributed as dist
from torch import nn

from .batches import Share
from .parts import gather, in_part_order, ordered_sum


class BucketObserver(Protocol):
    """Told when each gradient bucket was handed to the reduction and when its reduced values were back."""

    def handed_over(self, bucket: int) -> None: ...

    def back(self, bucket: int) -> None: ...


class Reduction(ABC):
    """One way of reducing the step's gradients over the world, as a DDP comm hook (`comm_hook`)."""

    observer: BucketObserver | None = None
    # --recover: every part's BatchNorm set, as the last reduction carried it
    sets: Mapping[int, torch.Tensor] = MappingProxyType({})

    @abstractmethod
    def loss_weight(self, samples: int) -> float:
        """What each micro-batch's summed loss is multiplied by, so that the reduced gradient is the mean over
        the step's `samples` (all ranks')."""

    @abstractmethod
    def keep(self) -> None:
        """After a backward under `no_sync`: what becomes of the micro-batch's gradients in `.grad`."""

    @abstractmethod
    def reduce(self, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
        """Start reducing the bucket (on every rank); the future holds the reduced bucket."""


def comm_hook(reduction: Reduction, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """The hook DDP calls with each bucket backward filled: `reduction` reduces it, its observer watches."""
    observer = reduction.observer
    if observer is None:
        return reduction.reduce(bucket)
    index = bucket.index()
    observer.handed_over(index)

    def back(fut: torch.futures.Future[torch.Tensor]) -> torch.Tensor:
        observer.back(index)
        return fut.value()
    return reduction.reduce(bucket).then(back)


class MeanReduction(Reduction):
    """DDP's own, bit for bit: each rank's gradient times 1/world, summed over the ranks; each micro-batch's loss
    weighs world/samples."""

    def __init__(self, world: int) -> None:
        self.world = world

    def loss_weight(self, samples: int) -> float:
        return self.world / samples

    def keep(self) -> None:
        """Nothing: the next backward adds its gradients to them, in `.grad`."""

    def reduce(self, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
        buffer = bucket.buffer().mul_(1 / self.world)
        return dist.all_reduce(buffer, async_op=True).get_future().then(lambda f: f.value()[0])


class SlotReduction(Reduction):
    """`--bitwise`: every micro-batch slot's gradient gathered, and summed in slot order on every rank; each
    micro-batch's loss weighs 1/samples, the same at any world (docs/design/bitwise.md)."""

    def __init__(self, model: nn.Module, share: Share, rank: int) -> None:
        self.params, self.share, self.rank = list(model.parameters()), share, rank
        self.trains = len(share.parts_of(rank)) > 0  # an idle rank (more ranks than slots) adds no slot of its own
        self.kept: dict[torch.Tensor, list[torch.Tensor]] = {}  # this step's earlier slots, per parameter
        self.held: Callable[[], Mapping[int, torch.Tensor]] | None = None  # `carry_sets`
        self.width = 0

    def carry_sets(self, held: Callable[[], Mapping[int, torch.Tensor]], width: int,
                   known: torch.Tensor | None = None) -> None:
        """--recover: send this rank's BatchNorm sets (`held()`, by part, `width` numbers each) with each step's
        gradients, so that every rank knows every part's (`sets`) when one is lost; `known` (a row per part,
        after a re-forming) stands for them until the first step."""
        self.held, self.width = held, width
        if known is not None:
            self.sets = dict(enumerate(known))

    def loss_weight(self, samples: int) -> float:
        return 1 / samples

    def keep(self) -> None:
        """Set the micro-batch's gradients apart (no copy), so the next backward starts from none."""
        for p in self.params:
            assert p.grad is not None  # every parameter takes part in the ConvNet's forward
            self.kept.setdefault(p, []).append(p.grad)
            p.grad = None

    def reduce(self, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
        params, buffer = bucket.parameters(), bucket.buffer()
        earlier = [laid_out(params, slot, buffer) for slot in zip(*(self.kept.pop(p, []) for p in params))]
        mine = [*earlier, buffer] if self.trains else []  # the buffer holds the rank's last slot
        n, held = buffer.numel(), self.held() if self.held is not None and bucket.index() == 0 else None
        if held is not None:  # each row: the part's gradients, then its BatchNorm set
            mine = [torch.cat([row, held[p]]) for row, p in zip(mine, self.share.parts_of(self.rank))]
        like = buffer if held is None else buffer.new_empty(n + self.width)
        work, gathered = gather(mine, self.share, like, async_op=True)

        def summed(done: torch.futures.Future) -> torch.Tensor:
            done.value()  # raises what the gather raised (a lost peer), rather than summing what it left
            parts = in_part_order(gathered, self.share)
            if held is not None:
                self.sets = {j: part[n:].clone() for j, part in enumerate(parts)}
            return ordered_sum([part[:n] for part in parts], out=buffer)
        assert work is not None  # async_op
        return work.get_future().then(summed)


def laid_out(params: Sequence[torch.Tensor], grads: Sequence[torch.Tensor], buffer: torch.Tensor) -> torch.Tensor:
    """`grads` (of `params`) as one row laid out like DDP's bucket `buffer`, each in its parameter's own memory
    layout (a channels_last weight's, not its logical order: reshape would pair the wrong elements)."""
    row, offset = torch.empty_like(buffer), 0
    for p, g in zip(params, grads, strict=True):
        row.as_strided(p.shape, p.stride(), offset).copy_(g)
        offset += p.numel()
    return row


def for_run(bitwise: bool, model: nn.Module, share: Share, rank: int) -> Reduction:
    """The run's reduction: `--bitwise`'s slot order, or DDP's mean."""
    return SlotReduction(model, share, rank) if bitwise else MeanReduction(share.world)
