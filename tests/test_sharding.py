"""`shard_indices` gives exactly what torch's DistributedSampler gives, and eval shards count each sample once."""

import itertools
import math
from collections import Counter

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
            batches.set_epoch(epoch, start=2 * batch * world)  # resumed after 2 steps at the same world size
            assert torch.cat([y for _, y in batches]).tolist() == expected[2 * batch:].tolist()


# --- resuming mid-epoch at another world size ------------------------------------------------------------

def _trained(n: int, batch: int, segments: list[tuple[int, int | None]], seed: int = 5,
             epoch: int = 1) -> tuple[list[int], list[int]]:
    """The samples one epoch trains on when it runs `steps` steps at world `world` for each (world, steps) in
    turn (None: to the end of the epoch), each segment resuming where the last stopped, as the Trainer does;
    and the position (samples of the permutation consumed) at which each segment started."""
    consumed, trained, starts = 0, [], []
    for world, steps in segments:
        starts.append(consumed)
        shards = [shard_indices(n, r, world, shuffle=True, seed=seed, epoch=epoch, start=consumed)
                  for r in range(world)]
        taken = [s[: len(s) if steps is None else steps * batch] for s in shards]
        trained += torch.cat(taken).tolist()
        consumed = min(n, consumed + max(map(len, taken)) * world)
    return trained, starts


@pytest.mark.parametrize(("n", "batch", "segments"), [
    (101, 8, [(2, 3), (1, None)]),  # 2 → 1
    (101, 8, [(1, 5), (2, None)]),  # 1 → 2
    (103, 4, [(4, 2), (2, None)]),  # 4 → 2
    (103, 4, [(4, 2), (2, 3), (3, None)]),  # 4 → 2 → 3: interrupted twice
    (7, 1, [(2, 1), (4, None)]),  # the remainder is smaller than the new world
])
def test_resume_at_another_world_trains_every_sample_once_plus_the_new_padding(
        n: int, batch: int, segments: list[tuple[int, int | None]]) -> None:
    """Across the interruptions each sample of the epoch is trained on exactly once, plus DistributedSampler's
    padding of the last segment: its remainder of m = n - start samples rounded up to a multiple of the world,
    with the first samples of the epoch's permutation. The earlier segments never reach their padding."""
    trained, starts = _trained(n, batch, segments)
    perm = shard_indices(n, 0, 1, shuffle=True, seed=5, epoch=1)
    last_world, remaining = segments[-1][0], n - starts[-1]
    padding = math.ceil(remaining / last_world) * last_world - remaining
    expected = Counter(range(n)) + Counter(perm.repeat(2)[:padding].tolist())
    assert Counter(trained) == expected
    assert len(trained) == n + padding
    before = _trained(n, batch, segments[:1])[0]
    assert sorted(before) == sorted(perm[: starts[1]].tolist())  # what was consumed is a prefix of the permutation


@pytest.mark.parametrize("world", [1, 2, 3])
def test_resume_at_the_same_world_gives_the_uninterrupted_batches(world: int) -> None:
    n, batch = 101, 4
    uninterrupted = _trained(n, batch, [(world, None)])[0]
    resumed = _trained(n, batch, [(world, 3), (world, None)])[0]
    per_rank = [shard_indices(n, r, world, shuffle=True, seed=5, epoch=1) for r in range(world)]
    assert uninterrupted == torch.cat(per_rank).tolist()
    # Rank by rank, the same samples in the same order: first 3 steps, then the rest.
    assert resumed == (torch.cat([s[: 3 * batch] for s in per_rank]).tolist()
                       + torch.cat([s[3 * batch:] for s in per_rank]).tolist())
