"""Batches straight from an in-memory uint8 tensor, sharded by torch's DistributedSampler: one index gather
per batch, no DataLoader. Training deals the run's M micro-batch slots over the world, so a step's samples are
the same at any world size (docs/design/slots.md)."""

import math
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any, Protocol

import torch
from torch.utils.data import DistributedSampler

MEAN, STD = 0.1307, 0.3081  # MNIST's pixel statistics, applied on the device


class Batches(Protocol):
    """What the loop takes of a rank's training batches, epoch by epoch: `ShardedBatches` (the textbook's),
    `StepBatches` (the run's slots), `graphstep.GraphBatches` (the CUDA graph's step indices)."""

    @property
    def first(self) -> int:
        """The epoch's first step to train (a resume or a recovery inside it starts later)."""

    @property
    def global_batch(self) -> int: ...

    @property
    def steps_per_epoch(self) -> int: ...

    def set_epoch(self, epoch: int, start: int = 0) -> None: ...

    def __len__(self) -> int: ...

    def __iter__(self) -> Iterator[Any]: ...


class ShardedBatches:
    """One rank's shard of a split, in batches normalised on the device: what each rank trains on in the textbook
    case (one whole micro-batch per rank), and what it evaluates. The data stays one tensor on the device; torch's
    own DistributedSampler decides which of its samples this rank trains each epoch."""

    def __init__(self, images: torch.Tensor, labels: torch.Tensor, batch_size: int, *, rank: int, world: int,
                 device: torch.device, shuffle: bool, seed: int = 0, each_sample_once: bool = False,
                 normalize: bool = True, channels_last: bool = False) -> None:
        self.data = DeviceData(images, labels, device, normalize, channels_last)
        self.batch_size, self.rank, self.world = batch_size, rank, world
        n = len(labels)
        # Training: every world-th index of a permutation seeded by seed + epoch, padded to a multiple of the world.
        # Evaluation (`each_sample_once`): every world-th sample, no sampler and no padding, so that the ranks' totals
        # count each sample once.
        self.sampler: DistributedSampler | range = (  # a range of indices serves the sampler as its dataset
            DistributedSampler(range(n), num_replicas=world, rank=rank, shuffle=shuffle, seed=seed)  # type: ignore[arg-type]
            if not each_sample_once else range(rank, n, world))
        self.first = 0

    @property
    def global_batch(self) -> int:
        return self.world * self.batch_size

    @property
    def steps_per_epoch(self) -> int:
        return math.ceil(len(self.sampler) / self.batch_size)

    def set_epoch(self, epoch: int, start: int = 0) -> None:
        """Reshuffle for `epoch` (the call the tutorial forgot: without it every epoch repeats the first's
        order), leaving out the steps that trained the first `start` samples of the epoch (all ranks'): every step
        whole, the last one too where it was partial (`start` the epoch's size)."""
        assert isinstance(self.sampler, DistributedSampler), "evaluation's batches have no epochs"
        self.sampler.set_epoch(epoch)
        self.first = math.ceil(start / self.global_batch)

    def indices(self) -> torch.Tensor:
        """This rank's samples of the epoch, in order."""
        return torch.tensor(list(self.sampler), dtype=torch.long)

    def __len__(self) -> int:
        return self.steps_per_epoch - self.first

    def __iter__(self) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        order = self.data.to_device(self.indices())
        for lo in range(self.first * self.batch_size, len(order), self.batch_size):
            yield self.data.batch(order[lo : lo + self.batch_size])


@dataclass(frozen=True)
class Share:
    """How a world of `world` processes shares the run's `slots` (M) micro-batches of every step."""

    slots: int  # M: the run's global batch is M micro-batches of --batch-size, fixed at its first start
    world: int
    whole: bool = False  # never cut a slot (--bitwise): with more processes than slots, the extra ones train none

    @property
    def parts(self) -> int:
        """The micro-batches a step is cut into: the M slots, or one per process when there are more processes
        (unless the slots are kept whole)."""
        return self.slots if self.whole else max(self.slots, self.world)

    def parts_of(self, rank: int) -> range:
        """The parts `rank` trains: every world-th from `rank`, DistributedSampler's rule applied to the parts."""
        return range(rank, self.parts, self.world)

    def describe(self, batch: int) -> str:
        """How the step's work is shared, in words (empty when every process trains one whole slot)."""
        m, w = self.slots, self.world
        if w > m and self.whole:
            idle, s = (f"rank {m}", "s") if w == m + 1 else (f"ranks {m}-{w - 1}", "")
            return (f"{idle} train{s} none of its {m} micro-batches of {batch} (--bitwise keeps them whole: cut, "
                    f"BatchNorm would normalise other groups) and only join{s} each step's reduction")
        if w > m:
            size = m * batch / w
            return (f"its {m * batch} samples cut into {w} micro-batches of ~{size:.3g}, one per process "
                    f"(BatchNorm normalises ~{size:.3g} samples at a time, not {batch})")
        if m == w:
            return ""
        if m % w == 0:
            who = "one process accumulates" if w == 1 else f"each of the {w} processes accumulates"
            return f"{who} {m // w} micro-batches of {batch}"
        more = m % w
        ranks = "rank 0 takes" if more == 1 else f"ranks 0-{more - 1} take"
        return (f"{w} processes share {m} micro-batches of {batch} unevenly: {ranks} {m // w + 1}, "
                f"the others {m // w}")


class DeviceData:
    """A split resident on the device (on the GPU when training there: no per-batch copy), and the one way
    a batch of it is made: an index gather, then `model_input`."""

    def __init__(self, images: torch.Tensor, labels: torch.Tensor, device: torch.device, normalize: bool,
                 channels_last: bool) -> None:
        self.images, self.labels = images.to(device), labels.to(device)
        self.device, self.normalize, self.channels_last = device, normalize, channels_last

    def to_device(self, indices: torch.Tensor) -> torch.Tensor:
        """An epoch's indices where the data is: one small copy per epoch, queued without waiting for the GPU."""
        return indices.pin_memory().to(self.device, non_blocking=True) if self.device.type == "cuda" else indices

    def batch(self, idx: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return model_input(self.images[idx], self.normalize, self.channels_last), self.labels[idx]


@dataclass
class MicroBatch:
    part: int | None  # which part of the step's global batch (BatchNorm keeps running statistics per part);
    # None: an empty batch of a rank that trains no part, so that it still joins the step's reduction
    x: torch.Tensor
    y: torch.Tensor


@dataclass
class Step:
    """One optimizer step, seen from one rank: its micro-batches, and how many samples the whole step has."""

    micro_batches: list[MicroBatch]
    samples: int  # over all ranks: the divisor that makes the step's gradient the global batch's mean


class StepBatches:
    """The optimizer steps of an epoch for one rank, each its micro-batches of the run's global batch. Slot j of the
    run's M is what torch's DistributedSampler gives rank j of a world of M, so a step holds the same samples at
    any world size (docs/design/slots.md)."""

    def __init__(self, images: torch.Tensor, labels: torch.Tensor, batch_size: int, share: Share, *, rank: int,
                 device: torch.device, seed: int, normalize: bool = True, channels_last: bool = False) -> None:
        self.data = DeviceData(images, labels, device, normalize, channels_last)
        self.batch_size, self.share, self.rank = batch_size, share, rank
        self.mine = share.parts_of(rank)
        # The slots this rank draws from: its own where each part is a slot, else (more processes than slots, each
        # step cut into W parts) all of them.
        drawn = self.mine if share.parts == share.slots else range(share.slots)
        n = len(labels)  # a range of indices serves each sampler as its dataset
        self.samplers: dict[int, DistributedSampler] = {
            j: DistributedSampler(range(n), num_replicas=share.slots, rank=j, shuffle=True, seed=seed)  # type: ignore[arg-type]
            for j in drawn}
        self.first = 0

    @property
    def global_batch(self) -> int:
        return self.share.slots * self.batch_size

    @property
    def slot_length(self) -> int:
        """Every slot's samples in an epoch: n / M, rounded up (DistributedSampler pads)."""
        return math.ceil(len(self.data.labels) / self.share.slots)

    @property
    def steps_per_epoch(self) -> int:
        """ceil(slot length / batch): the same at any world size."""
        return math.ceil(self.slot_length / self.batch_size)

    def set_epoch(self, epoch: int, start: int = 0) -> None:
        """Reshuffle for `epoch` (the step the tutorial forgot: without it every epoch repeats), leaving out the
        steps that trained the first `start` samples of its permutation (the last one too where it was partial)."""
        for sampler in self.samplers.values():
            sampler.set_epoch(epoch)
        self.first = math.ceil(start / self.global_batch)

    def __len__(self) -> int:
        return self.steps_per_epoch - self.first

    def __iter__(self) -> Iterator[Step]:
        slots = {j: self.data.to_device(torch.tensor(list(sampler))) for j, sampler in self.samplers.items()}
        for s in range(self.first, self.steps_per_epoch):
            lo, hi = s * self.batch_size, min((s + 1) * self.batch_size, self.slot_length)
            if self.share.parts == self.share.slots:  # each part one slot's micro-batch
                parts = {j: slots[j][lo:hi] for j in self.mine}
            else:  # the step's samples, slot after slot, cut into W parts
                parts = dict(enumerate(torch.cat([slots[j][lo:hi] for j in sorted(slots)]).tensor_split(
                    self.share.parts)))
            mbs = [MicroBatch(j, *self.data.batch(parts[j])) for j in self.mine] or [self._empty()]
            yield Step(mbs, (hi - lo) * self.share.slots)

    def _empty(self) -> MicroBatch:
        """The micro-batch of a rank with no part (--bitwise, more processes than slots): none of the step's
        samples, so that it still joins the step's reduction."""
        return MicroBatch(None, *self.data.batch(torch.empty(0, dtype=torch.long, device=self.data.device)))


def model_input(raw: torch.Tensor, normalize: bool, channels_last: bool = False) -> torch.Tensor:
    """uint8 (B, 28, 28) -> float (B, 1, 28, 28), scaled to [0, 1] and, if `normalize`, normalised.

    The one definition of what the ConvNet sees, for training, evaluation and `predict` alike.
    """
    x = raw.unsqueeze(1).float()
    # (x / 255 - MEAN) / STD as one multiply and one subtract: two passes over the batch, not three.
    x = x.mul_(1 / (255 * STD)).sub_(MEAN / STD) if normalize else x.div_(255)
    return x.contiguous(memory_format=torch.channels_last) if channels_last else x
