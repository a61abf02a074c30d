"""Training batches are torch's DistributedSampler's shard, eval shards count each sample once, and the training
steps of the general case (the run's M micro-batch slots, shared by a world) are the same at any world size and,
with one slot per rank, DistributedSampler's."""

import itertools
import math
from collections import Counter

import pytest
import torch
from torch.utils.data import DistributedSampler

from mnist_ddp.core.batches import ShardedBatches, Share, StepBatches

SIZES = [1, 2, 3, 7, 10, 11, 64, 101]  # divisible and not, and smaller than the world


def sampler_indices(n: int, rank: int, world: int, *, seed: int, epoch: int, shuffle: bool = True) -> torch.Tensor:
    """torch's DistributedSampler's indices for `rank` at `epoch`: what the tests hold the batches to."""
    sampler = DistributedSampler(range(n), num_replicas=world, rank=rank, shuffle=shuffle, seed=seed)
    sampler.set_epoch(epoch)
    return torch.tensor(list(sampler), dtype=torch.long)


def _batches(n: int, rank: int, world: int, *, each_sample_once: bool = False, shuffle: bool = True) -> ShardedBatches:
    return ShardedBatches(torch.zeros(n, 28, 28, dtype=torch.uint8), torch.arange(n), 4, rank=rank, world=world,
                          device=torch.device("cpu"), shuffle=shuffle, seed=3,
                          each_sample_once=each_sample_once)


def test_epochs_reshuffle_and_ranks_partition() -> None:
    """set_epoch reshuffles (the tutorial's forgotten call); the ranks' shards of a divisible set partition it."""
    n, world = 50, 2
    orders = []
    for epoch in range(3):
        shards = [_batches(n, r, world) for r in range(world)]
        for b in shards:
            b.set_epoch(epoch)
        orders.append(torch.cat([b.indices() for b in shards]))
    assert all(sorted(o.tolist()) == list(range(n)) for o in orders)  # divisible: a partition, no padding
    assert len({tuple(o.tolist()) for o in orders}) == 3  # each epoch's order differs from each other's


@pytest.mark.parametrize("world", [1, 2, 3, 4])
@pytest.mark.parametrize("n", [1, 2, 3, 10, 11, 997])
@pytest.mark.parametrize("shuffle", [True, False])
def test_eval_shards_cover_every_index_once(world: int, n: int, shuffle: bool) -> None:
    shards = [_batches(n, rank, world, each_sample_once=True, shuffle=shuffle).indices() for rank in range(world)]
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
            expected = sampler_indices(n, rank, world, seed=9, epoch=epoch)
            assert torch.cat(got).tolist() == expected.tolist() and len(got) == len(batches)
            assert all(torch.equal((x[:, 0, 0, 0] * 255).round().long(), y) for x, y in batches)  # image matches label


# --- the run's global batch: M micro-batch slots, shared by any world ---------------------------------------

def _images(n: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Image i is filled with i % 256 and labelled i: a batch's labels say which samples it holds."""
    return torch.arange(n, dtype=torch.uint8)[:, None, None].expand(n, 28, 28).contiguous(), torch.arange(n)


def _steps(n: int, batch: int, slots: int, world: int, epoch: int = 1,
           start: int = 0) -> list[dict[int, list[list[int]]]]:
    """For each step of the epoch from `start` on: {rank: [labels of each of its micro-batches]}."""
    images, labels = _images(n)
    ranks = {}
    for rank in range(world):
        b = StepBatches(images, labels, batch, Share(slots, world), rank=rank, device=torch.device("cpu"), seed=5,
                        normalize=False)
        b.set_epoch(epoch, start=start)
        ranks[rank] = list(b)
        assert len(ranks[rank]) == len(b)
        for step in ranks[rank]:
            for mb in step.micro_batches:
                assert torch.equal((mb.x[:, 0, 0, 0] * 255).round().long(), mb.y % 256)  # image matches label
    steps = len(ranks[0])
    assert all(len(r) == steps for r in ranks.values())  # every rank takes part in every step's all-reduce
    samples = [{r.samples for r in (ranks[k][s] for k in ranks)} for s in range(steps)]
    assert all(len(x) == 1 for x in samples)  # every rank agrees on the step's size: the loss divisor
    out = [{k: [mb.y.tolist() for mb in ranks[k][s].micro_batches] for k in ranks} for s in range(steps)]
    for s, step in enumerate(out):
        assert sum(len(mb) for mbs in step.values() for mb in mbs) == samples[s].pop()
    return out


def _parts(step: dict[int, list[list[int]]], world: int, parts: int) -> list[list[int]]:
    """The step's micro-batches in part order (rank r trains parts r, r + world, …)."""
    ordered = [None] * parts
    for rank, mbs in step.items():
        for i, mb in enumerate(mbs):
            ordered[rank + i * world] = mb
    return ordered


def test_one_slot_per_rank_is_distributed_sampler() -> None:
    """With M = world (no --accumulate), rank r's micro-batch at step s is DistributedSampler's shard, sliced."""
    n, batch, world = 103, 8, 3
    for step_index, step in enumerate(_steps(n, batch, world, world)):
        for rank, (mb,) in step.items():
            shard = sampler_indices(n, rank, world, seed=5, epoch=1)
            assert mb == shard[step_index * batch : (step_index + 1) * batch].tolist()


@pytest.mark.parametrize(("n", "batch"), [(103, 8), (60, 5), (7, 2)])
def test_every_world_sees_the_same_micro_batches(n: int, batch: int) -> None:
    """(W, K) = (4, 1), (2, 2), (1, 4) and 3 ranks sharing 4 slots: the same parts at every step. 8 ranks: the
    same global batch, cut into 8."""
    slots = 4
    reference = [_parts(step, slots, slots) for step in _steps(n, batch, slots, slots)]
    for world in (1, 2, 3):
        steps = _steps(n, batch, slots, world)
        assert [_parts(step, world, slots) for step in steps] == reference, world
        if world == 3:  # uneven: rank 0 takes slots 0 and 3, the others one each
            assert [len(mbs) for mbs in steps[0].values()] == [2, 1, 1]
    for step, ref in zip(_steps(n, batch, slots, 8), reference, strict=True):
        assert all(len(mbs) == 1 for mbs in step.values())
        # The same samples, in slot order.
        assert list(itertools.chain(*_parts(step, 8, 8))) == list(itertools.chain(*ref))
        sizes = [len(mbs[0]) for mbs in step.values()]
        assert max(sizes) - min(sizes) <= 1


@pytest.mark.parametrize(("n", "batch", "slots", "segments"), [
    (101, 8, 2, [(2, 3), (1, None)]),  # 2 → 1
    (101, 8, 1, [(1, 5), (2, None)]),  # 1 → 2: more processes than slots
    (103, 4, 4, [(4, 2), (2, None)]),  # 4 → 2
    (103, 4, 4, [(4, 2), (2, 3), (3, None)]),  # 4 → 2 → 3: interrupted twice, the last uneven
    (7, 1, 2, [(2, 1), (4, None)]),  # the remainder is smaller than the new world
])
def test_a_resume_at_any_world_continues_the_same_steps(n: int, batch: int, slots: int,
                                                        segments: list[tuple[int, int | None]]) -> None:
    """Interrupted after a few steps and resumed at another world, the epoch trains the very samples, step by
    step, of the uninterrupted run: each sample once, plus DistributedSampler's padding of the M slots."""
    def samples(step: dict[int, list[list[int]]]) -> list[int]:
        return sorted(itertools.chain(*itertools.chain(*step.values())))

    uninterrupted = [samples(step) for step in _steps(n, batch, slots, slots)]
    resumed, consumed = [], 0
    for world, steps in segments:
        taken = [samples(step) for step in _steps(n, batch, slots, world, start=consumed)]
        taken = taken if steps is None else taken[:steps]
        resumed += taken
        consumed = min(n, consumed + sum(map(len, taken)))
    assert resumed == uninterrupted
    padding = math.ceil(n / slots) * slots - n
    perm = sampler_indices(n, 0, 1, seed=5, epoch=1)
    assert Counter(itertools.chain(*resumed)) == Counter(range(n)) + Counter(perm[:padding].tolist())


def test_slots_kept_whole_leave_the_extra_ranks_an_empty_micro_batch() -> None:
    """--bitwise never cuts a slot: with 4 ranks and 2 slots, ranks 0-1 train the slots of a world of 2, and
    ranks 2-3 one empty micro-batch of no part (only so that they join the step's reduction)."""
    n, batch = 37, 4
    images, labels = _images(n)
    reference = _steps(n, batch, 2, 2)
    steps = {}
    for rank in range(4):
        b = StepBatches(images, labels, batch, Share(2, 4, whole=True), rank=rank, device=torch.device("cpu"), seed=5,
                        normalize=False)
        b.set_epoch(1)
        steps[rank] = list(b)
    assert all(len(s) == len(reference) for s in steps.values())
    for s, ref in enumerate(reference):
        for rank in (0, 1):
            assert [mb.part for mb in steps[rank][s].micro_batches] == [rank]
            assert [mb.y.tolist() for mb in steps[rank][s].micro_batches] == ref[rank]
        for rank in (2, 3):
            (mb,) = steps[rank][s].micro_batches
            assert mb.part is None and len(mb.y) == 0 and mb.x.shape == (0, 1, 28, 28)
        assert {steps[rank][s].samples for rank in range(4)} == {sum(map(len, ref[0] + ref[1]))}
    assert Share(2, 4, whole=True).describe(batch).startswith("ranks 2-3 train none of its 2 micro-batches of 4")
    assert Share(2, 3, whole=True).describe(batch).startswith("rank 2 trains none of its 2")
