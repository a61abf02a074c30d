"""The learning-rate schedule (schedule.py) as a function of the fraction of the run done: OneCycleLR's shape
(warm-up to the peak over the first quarter, then annealing to peak/25/1e4, the momentum the other way), cosine to
zero, or none; and what `build` sets in each optimizer's groups."""

import itertools

import pytest
import torch

from mnist_ddp.common.config import recipe
from mnist_ddp.core import compute, schedule
from mnist_ddp.model import ConvNet

PEAK = 3e-3


@pytest.mark.parametrize(("done", "lr", "momentum"), [
    (0.0, PEAK / 25, 0.95), (0.125, (PEAK + PEAK / 25) / 2, 0.90), (0.25, PEAK, 0.85),
    (0.625, (PEAK + PEAK / 25 / 1e4) / 2, 0.90), (1.0, PEAK / 25 / 1e4, 0.95), (1.5, PEAK / 25 / 1e4, 0.95),
])
def test_one_cycle_at_its_landmarks(done: float, lr: float, momentum: float) -> None:
    """Halfway through a half cosine is the mean of its ends; past the end it stays at the end."""
    got = schedule.one_cycle(PEAK, done)
    assert got == (pytest.approx(lr, rel=1e-12), pytest.approx(momentum, rel=1e-12))


def test_one_cycle_rises_then_falls() -> None:
    lrs = [schedule.one_cycle(PEAK, i / 100)[0] for i in range(101)]
    assert all(a < b for a, b in itertools.pairwise(lrs[:26])) and all(a > b for a, b in itertools.pairwise(lrs[25:]))
    assert lrs.index(max(lrs)) == 25


@pytest.mark.parametrize(("scheduler", "done", "lr"), [
    ("cosine", 0.0, PEAK), ("cosine", 0.5, PEAK / 2), ("cosine", 1.0, 0.0), ("none", 0.0, PEAK), ("none", 0.7, PEAK),
])
def test_cosine_and_none(scheduler: str, done: float, lr: float) -> None:
    r = recipe("default", scheduler=scheduler, lr=PEAK)
    got, momentum = schedule.at(r, done)
    assert got == pytest.approx(lr, abs=1e-15) and momentum is None


@pytest.mark.parametrize("optimizer", ["adamw", "sgd"])
def test_build_sets_every_groups_lr_and_the_momentum_it_cycles(optimizer: str) -> None:
    r = recipe("default", optimizer=optimizer, lr=PEAK)
    opt = torch.optim.SGD([{"params": [torch.zeros(1)]}, {"params": [torch.zeros(1)]}], lr=1.0, momentum=0.5) \
        if optimizer == "sgd" else torch.optim.AdamW([{"params": [torch.zeros(1)]}, {"params": [torch.zeros(1)]}],
                                                     lr=1.0, betas=(0.5, 0.999))
    schedule.build(r, opt)(0.25)
    for group in opt.param_groups:
        assert group["lr"] == pytest.approx(PEAK)
        if optimizer == "sgd":
            assert group["momentum"] == pytest.approx(0.85)
        else:
            assert group["betas"] == (pytest.approx(0.85), 0.999)
    flat = recipe("default", optimizer=optimizer, lr=PEAK, scheduler="cosine")
    schedule.build(flat, opt)(0.5)
    assert all(g["lr"] == pytest.approx(PEAK / 2) for g in opt.param_groups)
    assert all(g.get("momentum", g.get("betas", (0.85,))[0]) == pytest.approx(0.85) for g in opt.param_groups)


@pytest.mark.parametrize("optimizer", ["sgd", "adamw"])
def test_the_recipes_optimizer_and_schedule(optimizer: str) -> None:
    """The recipe's every setting reaches the optimizer (with torch's fused kernel where compute.py says it pays),
    and the schedule returned with it drives that optimizer."""
    model = ConvNet()
    r = recipe("default", optimizer=optimizer, lr=2e-3, momentum=0.8, weight_decay=1e-3)
    opt, set_for = schedule.build_optimizer(r, model)
    kind = torch.optim.SGD if optimizer == "sgd" else torch.optim.AdamW
    assert isinstance(opt, kind) and opt.defaults["lr"] == 2e-3 and opt.defaults["weight_decay"] == 1e-3
    assert opt.defaults["momentum"] == 0.8 if optimizer == "sgd" else opt.defaults["betas"] == (0.8, 0.999)
    assert bool(opt.defaults["fused"]) == compute.fused_optimizers(torch.device("cpu"))
    set_for(0.25)
    assert opt.param_groups[0]["lr"] == pytest.approx(2e-3)


def test_the_unfused_kernel_where_compute_says_fused_does_not_pay(monkeypatch: pytest.MonkeyPatch) -> None:
    """Where compute.py says the fused kernel does not pay (a device or a torch without it), it is not asked for."""
    monkeypatch.setattr(compute, "fused_optimizers", lambda device: False)
    for optimizer in ("sgd", "adamw"):
        opt, _ = schedule.build_optimizer(recipe("default", optimizer=optimizer), ConvNet())
        assert not opt.defaults.get("fused"), opt.defaults
