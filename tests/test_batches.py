"""The in-memory batches: sizes by arithmetic, normalisation on the batch, per-device compute defaults."""

from pathlib import Path

import pytest
import torch

from mnist_ddp.common.config import RECIPES
from mnist_ddp.core import compute
from mnist_ddp.core.batches import MEAN, STD, ShardedBatches, Share, StepBatches

CPU = torch.device("cpu")


@pytest.mark.parametrize("world", [1, 3])
def test_len_is_the_number_of_batches_yielded(world: int) -> None:
    n = 101
    images, labels = torch.zeros(n, 28, 28, dtype=torch.uint8), torch.arange(n)
    for once in (False, True):
        for rank in range(world):
            b = ShardedBatches(images, labels, 8, rank=rank, world=world, device=CPU, shuffle=False,
                               each_sample_once=once)
            assert len(b) == len(list(b))


@pytest.mark.parametrize("kind", ["sharded", "slots"])
def test_an_epoch_goes_on_after_the_steps_its_start_trained(kind: str) -> None:
    """set_epoch(e, start) leaves out the steps that trained `start` samples: k whole steps, or the whole epoch
    where its last step was partial (101 samples, 3 ranks of 8: 5 steps, the last of 5 rows)."""
    n, world = 101, 3
    images, labels = torch.zeros(n, 28, 28, dtype=torch.uint8), torch.arange(n)
    b = ShardedBatches(images, labels, 8, rank=1, world=world, device=CPU, shuffle=True) if kind == "sharded" else \
        StepBatches(images, labels, 8, Share(world, world), rank=1, device=CPU, seed=0)
    assert b.steps_per_epoch == 5
    b.set_epoch(1)
    every = [s[1] if kind == "sharded" else s.micro_batches[0].y for s in b]
    for start, left in ((0, 5), (2 * b.global_batch, 3), (n, 0)):
        b.set_epoch(1, start=start)
        rest = [s[1] if kind == "sharded" else s.micro_batches[0].y for s in b]
        assert len(b) == len(rest) == left
        assert all(torch.equal(x, y) for x, y in zip(rest, every[5 - left:], strict=True))


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
    auto = RECIPES["default"].amp
    assert auto == "auto"  # the default recipe leaves the precision to the device
    monkeypatch.setattr(compute, "cpu_has_fast_bf16", lambda: True)
    assert (compute.amp_for(auto, CPU), compute.channels_last_for(None, CPU)) == ("bf16", True)
    assert compute.amp_for(RECIPES["tutorial"].amp, CPU) == "off"  # the tutorial's fp32
    monkeypatch.setattr(compute, "cpu_has_fast_bf16", lambda: False)
    assert compute.amp_for(auto, CPU) == "off"  # emulated bf16 would be slower than fp32
    for device in map(torch.device, ("cuda", "mps")):
        assert (compute.amp_for(auto, device), compute.channels_last_for(None, device)) == ("off", False)
    assert (compute.amp_for("bf16", CPU), compute.channels_last_for(False, CPU)) == ("bf16", False)


def _cpu_flags() -> set[str]:
    """The feature flags the kernel reports for this machine's CPU (every core's line is the same)."""
    line = next(line for line in Path("/proc/cpuinfo").read_text().splitlines() if line.startswith("flags"))
    return set(line.split(":", 1)[1].split())


@pytest.mark.skipif(not Path("/proc/cpuinfo").exists(), reason="reads Linux's /proc/cpuinfo")
def test_fast_bf16_is_detected_as_the_cpu_reports_it(monkeypatch: pytest.MonkeyPatch) -> None:
    """The detection itself, on this machine: hardware bf16 is AMX tiles or AVX512-BF16, which the kernel lists
    in /proc/cpuinfo (`amx_tile`, `avx512_bf16`) when both the CPU and the OS support them."""
    hardware = bool({"amx_tile", "avx512_bf16"} & _cpu_flags())
    assert compute.cpu_has_fast_bf16() == hardware
    assert compute.amp_for("auto", CPU) == ("bf16" if hardware else "off")
    for name in ("_is_amx_tile_supported", "_is_avx512_bf16_supported"):  # a torch without the private checks
        monkeypatch.delattr(torch.cpu, name, raising=False)
    assert compute.cpu_has_fast_bf16() is False  # the safe answer: fp32
