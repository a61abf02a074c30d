"""The in-memory batches: sizes by arithmetic, normalisation on the batch, per-device compute defaults."""

import pytest
import torch

from mnist_ddp import compute
from mnist_ddp.batches import MEAN, STD, ShardedBatches, shard_indices, shard_size
from mnist_ddp.config import TrainConfig

CPU = torch.device("cpu")


@pytest.mark.parametrize("pad", [True, False])
@pytest.mark.parametrize("drop_last", [True, False])
def test_shard_size_is_the_length_of_the_shard(pad: bool, drop_last: bool) -> None:
    for n in (1, 2, 3, 7, 10, 11, 100):
        for world in (1, 2, 3, 4):
            for rank in range(world):
                got = shard_size(n, rank, world, drop_last=drop_last, pad=pad)
                want = len(shard_indices(n, rank, world, shuffle=True, seed=1, epoch=0, drop_last=drop_last, pad=pad))
                assert got == want, (n, rank, world)


@pytest.mark.parametrize("world", [1, 3])
def test_len_is_the_number_of_batches_yielded(world: int) -> None:
    n = 101
    images, labels = torch.zeros(n, 28, 28, dtype=torch.uint8), torch.arange(n)
    for pad in (True, False):
        for rank in range(world):
            b = ShardedBatches(images, labels, 8, rank=rank, world=world, device=CPU, shuffle=False, pad=pad)
            assert len(b) == len(list(b))


@pytest.mark.parametrize("channels_last", [True, False])
def test_batches_are_normalised_floats_in_nchw_shape(channels_last: bool) -> None:
    g = torch.Generator().manual_seed(0)
    images = torch.randint(0, 256, (10, 28, 28), dtype=torch.uint8, generator=g)
    b = ShardedBatches(images, torch.arange(10), 10, rank=0, world=1, device=CPU, shuffle=False,
                       channels_last=channels_last)
    x, _ = next(iter(b))
    assert x.shape == (10, 1, 28, 28) and x.dtype == torch.float32
    torch.testing.assert_close(x, ((images.float() / 255 - MEAN) / STD).unsqueeze(1))
    assert x.is_contiguous(memory_format=torch.channels_last if channels_last else torch.contiguous_format)


def test_compute_defaults_follow_the_device_and_explicit_flags_win(monkeypatch: pytest.MonkeyPatch) -> None:
    auto = TrainConfig().resolve()  # the default recipe asks for amp "auto"
    monkeypatch.setattr(compute, "cpu_has_fast_bf16", lambda: True)
    assert (compute.resolve(auto, CPU).amp, compute.resolve(auto, CPU).channels_last) == ("bf16", True)
    assert compute.resolve(TrainConfig(recipe="tutorial").resolve(), CPU).amp == "off"  # the tutorial's fp32
    monkeypatch.setattr(compute, "cpu_has_fast_bf16", lambda: False)
    assert compute.resolve(auto, CPU).amp == "off"  # emulated bf16 would be slower than fp32
    for device in ("cuda", "mps"):
        resolved = compute.resolve(auto, torch.device(device))
        assert (resolved.amp, resolved.channels_last) == ("off", False)
    explicit = TrainConfig(amp="bf16", channels_last=False)
    assert (compute.resolve(explicit, CPU).amp, compute.resolve(explicit, CPU).channels_last) == ("bf16", False)
