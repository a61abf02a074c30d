"""The optimizer's update as a few operations on flat buffers, its lr and momentum read from device tensors: no
host synchronisation, so a CUDA graph can hold it (graphstep.py). Its state lives in torch's own optimizer, so
checkpoints are unchanged (docs/design/graph-step.md)."""

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import nn


@dataclass
class Flat:
    """Every parameter, gradient and optimizer state tensor as a view into one flat buffer of its kind."""

    params: torch.Tensor
    grads: torch.Tensor
    state: dict[str, torch.Tensor]  # AdamW: exp_avg, exp_avg_sq; SGD: momentum_buffer
    step: torch.Tensor  # AdamW's step count, shared by every parameter (they are always stepped together)


def _views(flat: torch.Tensor, like: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """Views of `flat` laid out like `like`, one after another, each with its tensor's strides (channels_last too)."""
    out, at = [], 0
    for t in like:
        out.append(flat.as_strided(t.size(), t.stride(), at))
        at += t.numel()
    return out


def flatten(model: nn.Module, opt: torch.optim.Optimizer, grads: torch.Tensor) -> Flat:
    """Move `model`'s parameters, gradients (into `grads`, one element per parameter's) and `opt`'s state into flat
    buffers, values kept (state a resume loaded, else zeros: the same first step as torch's). Parameters stay the
    same objects: `opt` still holds them."""
    params = list(model.parameters())
    first = params[0]
    flat = Flat(torch.empty_like(grads), grads, {}, torch.zeros((), dtype=first.dtype, device=first.device))
    names = ("exp_avg", "exp_avg_sq") if isinstance(opt, torch.optim.AdamW) else ("momentum_buffer",)
    for name in names:
        flat.state[name] = torch.zeros_like(flat.params)
    for p, pv, gv, *state in zip(params, _views(flat.params, params), _views(flat.grads, params),
                                 *(_views(flat.state[n], params) for n in names), strict=True):
        pv.copy_(p.detach())
        p.data = pv
        p.grad = gv
        saved = opt.state.get(p, {})
        for name, view in zip(names, state, strict=True):
            if saved.get(name) is not None:
                view.copy_(saved[name])
        if "step" in saved:
            flat.step.fill_(float(saved["step"]))  # once, while building: never inside a step
        opt.state[p] = dict(zip(names, state, strict=True)) | ({"step": flat.step} if "exp_avg" in names else {})
    return flat


def unflatten(opt: torch.optim.Optimizer, flat: Flat) -> None:
    """Hand `opt` back to torch's own step: each parameter its own step count (torch increments each one), and no
    gradients yet. Parameters and moments stay views of the flat buffers, which torch's step updates in place."""
    for p in (p for group in opt.param_groups for p in group["params"]):
        p.grad = None
        if "step" in opt.state[p]:
            opt.state[p]["step"] = flat.step.clone()


def adamw(flat: Flat, lr: torch.Tensor, beta1: torch.Tensor, beta2: float, eps: float, weight_decay: float) -> None:
    """One AdamW step (decoupled weight decay), the arithmetic of torch's capturable AdamW on one flat buffer."""
    p, g, m, v = flat.params, flat.grads, flat.state["exp_avg"], flat.state["exp_avg_sq"]
    flat.step.add_(1)
    if weight_decay:
        p.mul_(1 - lr * weight_decay)
    m.lerp_(g, 1 - beta1)
    v.mul_(beta2).addcmul_(g, g, value=1 - beta2)
    step_size = lr / (1 - beta1 ** flat.step)
    bias2_sqrt = (1 - beta2 ** flat.step).sqrt()
    p.addcdiv_(m, v.sqrt().div_(bias2_sqrt).add_(eps).div_(-step_size))


def sgd(flat: Flat, lr: torch.Tensor, momentum: torch.Tensor, weight_decay: float) -> None:
    """One SGD step with momentum (torch's: the buffer starts as the first gradient, here 0·0 + g)."""
    p, buf = flat.params, flat.state["momentum_buffer"]
    grad = flat.grads.add(p, alpha=weight_decay) if weight_decay else flat.grads
    buf.mul_(momentum).add_(grad)
    p.addcmul_(buf, lr, value=-1)


def update(opt: torch.optim.Optimizer, flat: Flat, lr: torch.Tensor, momentum: torch.Tensor) -> None:
    """`opt`'s kind of step on `flat`, with its group's fixed settings and this step's `lr` and `momentum`."""
    group = opt.param_groups[0]
    if isinstance(opt, torch.optim.AdamW):
        adamw(flat, lr, momentum, group["betas"][1], group["eps"], group["weight_decay"])
    else:
        sgd(flat, lr, momentum, group["weight_decay"])
