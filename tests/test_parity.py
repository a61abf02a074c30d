"""DDP parity: 2 real gloo ranks x batch B/2 train exactly like one process doing 2 micro-batches of B/2.

Each rank's BatchNorm normalises its own half-batch, so the single-process reference runs
the two halves as separate forward passes and averages their gradients, which is what DDP's
all-reduce computes. Built from the real pieces: ConvNet, `ddp.wrap` (our DDP settings),
DistributedSampler and `schedule.build_optimizer`.
"""

import os
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from conftest import spawn_gloo
from datafiles import one_thread
from mnist_ddp.common.config import TrainConfig, recipe
from mnist_ddp.core import ddp, schedule
from mnist_ddp.core.distributed import Dist
from mnist_ddp.model import ConvNet
from test_sharding import sampler_indices

WORLD, HALF, STEPS, N = 2, 16, 6, 2 * 16 * 6 + 5  # n not a multiple of the world: the sampler pads
CPU = torch.device("cpu")


def _data() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(7)
    return torch.randn(N, 1, 28, 28, generator=g), torch.randint(0, 10, (N,), generator=g)


def _config(optimizer: str) -> TrainConfig:
    return TrainConfig(recipe=recipe("default", optimizer=optimizer, lr=0.05, momentum=0.9, weight_decay=1e-4,
                                     scheduler="onecycle", batch_size=HALF, epochs=1, normalize=True,
                                     label_smoothing=0.0))


def _batch(rank: int, step: int, epoch: int) -> torch.Tensor:
    """Rank `rank`'s sample indices at `step`, exactly as the training loop slices its shard."""
    shard = sampler_indices(N, rank, WORLD, seed=0, epoch=epoch)
    return shard[step * HALF : (step + 1) * HALF]


def _steps() -> list[tuple[int, int]]:
    return [(epoch, step) for epoch in range(2) for step in range(STEPS // 2)]  # crosses an epoch: set_epoch


OPTIMIZERS = ("sgd", "adamw")


def _rank(d: Dist, out: str) -> None:
    for optimizer in OPTIMIZERS:
        torch.manual_seed(d.rank)  # different initial weights per rank: DDP must broadcast rank 0's
        model = ConvNet()
        cfg = _config(optimizer)
        net = ddp.wrap(model, d)
        assert isinstance(net, torch.nn.parallel.DistributedDataParallel)
        opt, set_lr = schedule.build_optimizer(cfg.recipe, model)
        x, y = _data()
        for n, (epoch, step) in enumerate(_steps()):
            i = _batch(d.rank, step, epoch)
            set_lr(n / len(_steps()))
            opt.zero_grad(set_to_none=True)
            F.cross_entropy(net(x[i]), y[i]).backward()
            opt.step()
        torch.save(model.state_dict(), os.path.join(out, f"{optimizer}-rank{d.rank}.pt"))


def _reference(optimizer: str) -> dict[str, torch.Tensor]:
    torch.manual_seed(0)  # rank 0's initial weights
    model = ConvNet()
    cfg = _config(optimizer)
    opt, set_lr = schedule.build_optimizer(cfg.recipe, model)
    x, y = _data()
    for n, (epoch, step) in enumerate(_steps()):
        set_lr(n / len(_steps()))
        opt.zero_grad(set_to_none=True)
        for rank in range(WORLD):  # one micro-batch per rank; BatchNorm sees each half on its own
            i = _batch(rank, step, epoch)
            (F.cross_entropy(model(x[i]), y[i]) / WORLD).backward()  # the mean of the ranks' gradients
        opt.step()
    return model.state_dict()


@pytest.fixture(scope="module")
def trained(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Both optimizers trained by 2 spawned gloo ranks (one spawn: starting processes is the slow part)."""
    out = tmp_path_factory.mktemp("parity")
    spawn_gloo(_rank, WORLD, str(out))
    return out


@pytest.mark.parametrize("optimizer", OPTIMIZERS)
def test_two_ranks_equal_one_process_with_micro_batches(trained: Path, optimizer: str) -> None:
    ranks = [torch.load(trained / f"{optimizer}-rank{r}.pt", weights_only=True) for r in range(WORLD)]
    torch.manual_seed(0)
    before = ConvNet().state_dict()
    with one_thread():
        expected = _reference(optimizer)
    for name, _ in ConvNet().named_parameters():
        assert torch.equal(ranks[0][name], ranks[1][name]), name  # DDP keeps the replicas identical
        torch.testing.assert_close(ranks[0][name], expected[name], rtol=1e-4, atol=1e-5, msg=name)
        assert not torch.allclose(expected[name], before[name])  # it did train
