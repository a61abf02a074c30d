"""One optimizer step on one rank.

`train_step` is the textbook DDP step, and the one a run takes wherever each rank trains one whole
micro-batch of the step (the world is the run's M micro-batches; no --bitwise, no --profile). `slot_step` is
the general step for every other case (docs/design/slots.md); its `accumulate` is the textbook's `no_sync` loop,
and its weighting and per-part BatchNorm statistics (bnstats.py) are what a first reading can skip.
"""

from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext

import torch
import torch.nn.functional as F
from torch import nn

from .batches import Step
from .bnstats import PartStats
from .compute import autocast
from .reduction import Reduction


def train_step(net: nn.Module, opt: torch.optim.Optimizer, x: torch.Tensor, y: torch.Tensor, *, amp: str = "off",
               label_smoothing: float = 0.0, scaler: torch.amp.GradScaler | None = None) -> torch.Tensor:
    """Forward, backward (inside it DDP all-reduces the gradients' mean over the ranks), optimizer step.
    Returns the batch's mean loss, left on the device (reading it would wait for the GPU)."""
    opt.zero_grad(set_to_none=True)
    with autocast(x.device, amp):
        loss = F.cross_entropy(net(x), y, label_smoothing=label_smoothing)
    if scaler is None:
        loss.backward()
        opt.step()
    else:  # fp16: the loss scaled so that small gradients survive; a step whose gradients overflowed is skipped
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()
    return loss.detach()


# --- The general step: several micro-batches per rank, unequal parts, --bitwise, --profile -----------------


def slot_step(net: nn.Module, opt: torch.optim.Optimizer, step: Step, stats: PartStats, reduction: Reduction, *,
              amp: str, label_smoothing: float, scaler: torch.amp.GradScaler | None = None,
              phase: Callable[[str], AbstractContextManager] = lambda name: nullcontext()) -> torch.Tensor:
    """`train_step` for this rank's micro-batches of `step`; returns the sum of their losses (on the device)."""
    opt.zero_grad(set_to_none=True)
    loss_sum = accumulate(net, step, stats, reduction, amp=amp, label_smoothing=label_smoothing, scaler=scaler,
                          phase=phase)
    with phase("optimizer"):
        if scaler is None:
            opt.step()
        else:
            scaler.step(opt)
            scaler.update()
    return loss_sum


def accumulate(net: nn.Module, step: Step, stats: PartStats, reduction: Reduction, *, amp: str = "off",
               label_smoothing: float = 0.0, scaler: torch.amp.GradScaler | None = None,
               phase: Callable[[str], AbstractContextManager] = lambda name: nullcontext()) -> torch.Tensor:
    """Forward and backward of this rank's micro-batches, all but the last under `no_sync`, so the gradients
    are reduced once, into the mean over the step's samples; returns the sum of their losses.

    Each loss is summed over its samples and weighted by the reduction (world / step samples for the mean),
    so parts of any size add up to the global batch's mean. The gradients must have been zeroed."""
    device = next(net.parameters()).device
    loss_sum = torch.zeros((), device=device)
    last = len(step.micro_batches) - 1
    weight = reduction.loss_weight(step.samples)
    for i, mb in enumerate(step.micro_batches):
        # Every backward but the step's last runs under no_sync: it only adds into .grad, and the last one's
        # all-reduce carries the sum (one reduction per step). One process has no DDP, so no no_sync.
        held = i < last and hasattr(net, "no_sync")
        with net.no_sync() if held else nullcontext():  # type: ignore[operator]  # DDP's, where `held`
            with stats.use(mb.part), autocast(device, amp), phase("forward"):
                loss = F.cross_entropy(net(mb.x), mb.y, label_smoothing=label_smoothing, reduction="sum")
            with phase("backward"):
                weighted = loss * weight
                (weighted if scaler is None else scaler.scale(weighted)).backward()
        if held:
            reduction.keep()
        loss_sum += loss.detach().float()
    return loss_sum
