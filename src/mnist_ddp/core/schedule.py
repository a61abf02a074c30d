"""The recipe's optimizer, and its learning-rate schedule as a function of how far the run is: the fraction
of its training samples seen.

Not of optimizer steps: a run's steps are fixed by its global batch (batches.py), but the fraction needs no
state of its own and no count of steps: the checkpoint's progress (epoch, samples consumed) is its state,
and the lr at every step is the same at any world size and across a resume.

"onecycle" is torch's OneCycleLR with its defaults, drawn over the fraction instead of the step count:
a quarter of the run warms up from lr/25 to lr along a half cosine, the rest anneals to lr/25/1e4. Like
OneCycleLR it also cycles the momentum (SGD's momentum, AdamW's beta1) from 0.95 down to 0.85 and back,
inversely to the lr; the default recipe was tuned with it. "cosine" is CosineAnnealingLR to zero.
"""

import math
from collections.abc import Callable

import torch
from torch import nn

from ..common.config import Recipe
from . import compute

WARMUP = 0.25  # OneCycleLR's pct_start
START_DIV, FINAL_DIV = 25.0, 1e4  # OneCycleLR's div_factor and final_div_factor
MOMENTUM_LOW, MOMENTUM_HIGH = 0.85, 0.95  # OneCycleLR's base_momentum and max_momentum

Schedule = Callable[[float], None]  # set the optimizer's lr (and momentum) for the fraction of the run done


def _cos(start: float, end: float, t: float) -> float:
    """From `start` at t=0 to `end` at t=1 along half a cosine (OneCycleLR's anneal_strategy='cos')."""
    return end + (start - end) / 2 * (math.cos(math.pi * min(max(t, 0.0), 1.0)) + 1)


def one_cycle(peak: float, done: float) -> tuple[float, float]:
    """The one-cycle lr and momentum when a fraction `done` of the run's samples has been trained on."""
    if done < WARMUP:
        t = done / WARMUP
        return _cos(peak / START_DIV, peak, t), _cos(MOMENTUM_HIGH, MOMENTUM_LOW, t)
    t = (done - WARMUP) / (1 - WARMUP)
    return _cos(peak, peak / START_DIV / FINAL_DIV, t), _cos(MOMENTUM_LOW, MOMENTUM_HIGH, t)


def at(r: Recipe, done: float) -> tuple[float, float | None]:
    """The recipe's lr, and momentum (None: the recipe's own, unchanged), when a fraction `done` of the run is done."""
    if r.scheduler == "onecycle":
        return one_cycle(r.lr, done)
    return (_cos(r.lr, 0.0, done) if r.scheduler == "cosine" else r.lr), None


def build(r: Recipe, opt: torch.optim.Optimizer) -> Schedule:
    """The recipe's schedule, to call before every step with the fraction of the run done (0 to 1)."""
    def set_for(done: float) -> None:
        lr, momentum = at(r, done)
        for group in opt.param_groups:
            group["lr"] = lr
            if momentum is not None and "betas" in group:
                group["betas"] = (momentum, group["betas"][1])
            elif momentum is not None:
                group["momentum"] = momentum
    return set_for


def build_optimizer(r: Recipe, model: nn.Module) -> tuple[torch.optim.Optimizer, Schedule]:
    """The recipe's optimizer, and its schedule: call it with the fraction of the run done before each step."""
    # One fused kernel per step instead of a handful per parameter: ~3x less optimizer time on the CPU.
    fused = {"fused": True} if compute.fused_optimizers(next(model.parameters()).device) else {}
    if r.optimizer == "sgd":
        opt: torch.optim.Optimizer = torch.optim.SGD(model.parameters(), lr=r.lr, momentum=r.momentum,
                                                     weight_decay=r.weight_decay, **fused)
    else:
        opt = torch.optim.AdamW(model.parameters(), lr=r.lr, betas=(r.momentum, 0.999),
                                weight_decay=r.weight_decay, **fused)
    return opt, build(r, opt)
