"""Batches straight from an in-memory uint8 tensor, sharded across ranks.

No Dataset, no DataLoader, no per-sample Python: the whole split sits in memory
(on the GPU when training on CUDA) and a batch is one index gather. Which indices a
rank sees follows `torch.utils.data.DistributedSampler` exactly — a permutation
seeded by seed + epoch, padded to a multiple of the world size, then
every world_size-th index from `rank` — so results match the standard recipe.

Resuming mid-epoch, possibly at another world size, the position is the number of samples of
the epoch's permutation already trained on, over all ranks (always a prefix of it: step k of every
rank ends at position k × batch × world). What remains is sharded over the new world by the same
rule, as DistributedSampler would shard a dataset of just those samples, except that the padding
continues round the epoch's permutation (its first samples), exactly as it does uninterrupted: so a
resume at the same world size gives the very batches an uninterrupted run gives.
"""

import math
from collections.abc import Iterator

import torch

MEAN, STD = 0.1307, 0.3081  # MNIST's pixel statistics, applied on the device


def shard_size(n: int, rank: int, world: int, *, pad: bool = True, start: int = 0) -> int:
    """len(shard_indices(...)) by arithmetic, without drawing the permutation."""
    return math.ceil((n - start) / world) if pad else len(range(start + rank, n, world))


def shard_indices(n: int, rank: int, world: int, *, shuffle: bool, seed: int, epoch: int,
                  pad: bool = True, start: int = 0) -> torch.Tensor:
    """This rank's sample indices for `epoch`, as DistributedSampler would give them.

    `start`: the first `start` samples of the epoch's permutation were trained on already (a resume);
    the rest are padded, by repeating the permutation from its beginning, to a multiple of `world`.
    `pad=False` is for evaluation: no sample is repeated or dropped, so shards may
    differ in length by one and the all-reduced totals count every sample once.
    """
    if shuffle:
        g = torch.Generator()
        g.manual_seed(seed + epoch)
        indices = torch.randperm(n, generator=g)
    else:
        indices = torch.arange(n)
    if not pad:
        return indices[start + rank::world]
    total = shard_size(n, rank, world, start=start) * world
    if start + total > n:  # repeat from the start, as often as needed, to even out the shards
        indices = indices.repeat(math.ceil((start + total) / n))
    return indices[start : start + total][rank::world]


class ShardedBatches:
    """Iterate (images, labels) batches of one rank's shard, normalised on the device."""

    def __init__(self, images: torch.Tensor, labels: torch.Tensor, batch_size: int, *, rank: int, world: int,
                 device: torch.device, shuffle: bool, seed: int = 0, pad: bool = True, normalize: bool = True,
                 channels_last: bool = False) -> None:
        self.images = images.to(device)  # resident on the GPU when training there: no per-batch copy
        self.labels = labels.to(device)
        self.batch_size, self.rank, self.world = batch_size, rank, world
        self.device, self.shuffle, self.seed, self.pad = device, shuffle, seed, pad
        self.normalize, self.channels_last = normalize, channels_last
        self.epoch, self.start = 0, 0

    def set_epoch(self, epoch: int, start: int = 0) -> None:
        """Reshuffle for `epoch` (the step the tutorial forgot: without it every epoch repeats), leaving out
        the first `start` samples of its permutation, trained on before a resume."""
        self.epoch, self.start = epoch, start

    def indices(self) -> torch.Tensor:
        return shard_indices(len(self.labels), self.rank, self.world, shuffle=self.shuffle,
                             seed=self.seed, epoch=self.epoch, pad=self.pad, start=self.start)

    def __len__(self) -> int:
        return math.ceil(shard_size(len(self.labels), self.rank, self.world, pad=self.pad, start=self.start)
                         / self.batch_size)

    def __iter__(self) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        """Batches of this epoch's shard (of what remains of it after `start`)."""
        order = self.indices()
        if self.device.type == "cuda":  # one small copy per epoch, queued without waiting for the GPU
            order = order.pin_memory().to(self.device, non_blocking=True)
        for lo in range(0, len(order), self.batch_size):
            idx = order[lo : lo + self.batch_size]
            yield model_input(self.images[idx], self.normalize, self.channels_last), self.labels[idx]


def model_input(raw: torch.Tensor, normalize: bool, channels_last: bool = False) -> torch.Tensor:
    """uint8 (B, 28, 28) -> float (B, 1, 28, 28), scaled to [0, 1] and, if `normalize`, normalised.

    The one definition of what the ConvNet sees, for training, evaluation and `predict` alike.
    """
    x = raw.unsqueeze(1).float()
    # (x / 255 - MEAN) / STD as one multiply and one subtract: two passes over the batch, not three.
    x = x.mul_(1 / (255 * STD)).sub_(MEAN / STD) if normalize else x.div_(255)
    return x.contiguous(memory_format=torch.channels_last) if channels_last else x
