"""`shard_indices` gives exactly what torch's DistributedSampler gives, and eval shards count each sample once."""

import itertools

import pytest
import torch
from torch.utils.data import DistributedSampler

from mnist_ddp.batches import ShardedBatches, shard_indices

SIZES = [1, 2, 3, 7, 10, 11, 64, 101]  # divisible and not, and smaller than the world


@pytest.mark.parametrize("world", [1, 2, 3])
@pytest.mark.parametrize("shuffle", [True, False])
def test_same_indices_as_distributed_sampler(world: int, shuffle: bool) -> None:
    for n, seed, epoch in itertools.product(SIZES, (0, 1234), (0, 1, 5)):
        for rank in range(world):
            sampler = DistributedSampler(range(n), num_replicas=world, rank=rank, shuffle=shuffle, seed=seed)
            sampler.set_epoch(epoch)
            ours = shard_indices(n, rank, world, shuffle=shuffle, seed=seed, epoch=epoch)
            assert ours.tolist() == list(sampler), (n, rank, world, seed, epoch)


def test_epochs_reshuffle_and_ranks_partition() -> None:
    n, world = 50, 2
    orders = [torch.cat([shard_indices(n, r, world, shuffle=True, seed=3, epoch=e) for r in range(world)])
              for e in range(3)]
    assert all(sorted(o.tolist()) == list(range(n)) for o in orders)  # divisible: a partition, no padding
    assert orders[0].tolist() != orders[1].tolist() != orders[2].tolist()


@pytest.mark.parametrize("world", [1, 2, 3, 4])
@pytest.mark.parametrize("n", [1, 2, 3, 10, 11, 997])
@pytest.mark.parametrize("shuffle", [True, False])
def test_eval_shards_cover_every_index_once(world: int, n: int, shuffle: bool) -> None:
    shards = [shard_indices(n, rank, world, shuffle=shuffle, seed=0, epoch=2, pad=False) for rank in range(world)]
    assert sorted(torch.cat(shards).tolist()) == list(range(n))
    assert max(map(len, shards)) - min(map(len, shards)) <= 1


def test_sharded_batches_follow_the_shard_and_the_epoch() -> None:
    n, world, batch = 23, 3, 3
    images = torch.arange(n, dtype=torch.uint8)[:, None, None].expand(n, 28, 28).contiguous()
    labels = torch.arange(n)
    for rank in range(world):
        batches = ShardedBatches(images, labels, batch, rank=rank, world=world, device=torch.device("cpu"),
                                 shuffle=True, seed=9, normalize=False)
        for epoch in (0, 1):
            batches.set_epoch(epoch)
            got = [y for _, y in batches]
            expected = shard_indices(n, rank, world, shuffle=True, seed=9, epoch=epoch)
            assert torch.cat(got).tolist() == expected.tolist() and len(got) == len(batches)
            assert all(torch.equal((x[:, 0, 0, 0] * 255).round().long(), y) for x, y in batches)  # image matches label
            assert torch.cat([y for _, y in batches.iterate(skip=2)]).tolist() == expected[2 * batch:].tolist()
