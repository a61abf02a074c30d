"""The divergence guard: a run whose numbers stopped being finite stops, on every rank at the same step,
before it saves anything."""

import torch
from torch import nn

from ..common.errors import UserError


class Diverged(UserError):
    """The loss, the weights or BatchNorm's statistics stopped being finite: not bad input, so exit code 1."""

    exit_code = 1


def nonfinite(model: nn.Module) -> torch.Tensor:
    """How many of the model's weights and BatchNorm statistics are not finite (a count on the device)."""
    values = [t.reshape(-1) for t in (*model.parameters(), *model.buffers()) if t.is_floating_point()]
    return (~torch.cat(values).isfinite()).sum().float()


def check(finite: bool, scaler: torch.amp.GradScaler | None, epoch: int, step: int, lr: float, peak: float) -> None:
    """Raise `Diverged` unless `finite` (a verdict every rank shares) and fp16's loss scale is still at least 1
    (below 1, gradients overflow even unscaled)."""
    if finite and (scaler is None or scaler.get_scale() >= 1):
        return
    raise Diverged(f"training diverged in epoch {epoch} by step {step} at lr {lr:.4g}: the loss, the weights or "
                   f"BatchNorm's statistics are no longer finite. The checkpoints keep the last finite weights; "
                   f"start again with a smaller --lr (e.g. {peak / 10:.4g}) in a new --out.")


FP16_NEEDS_CUDA = "--amp fp16 needs CUDA; use --amp bf16 without a GPU."


def grad_scaler(device: torch.device, amp: str) -> torch.amp.GradScaler | None:
    """fp16's loss scaler (None in any other precision: no scaling is needed there). Never one that torch
    would disable, with a warning, for want of CUDA: fp16 without loss scaling would underflow unseen."""
    if amp != "fp16":
        return None
    if device.type == "cuda" and not torch.cuda.is_available():
        raise UserError(FP16_NEEDS_CUDA)
    return torch.amp.GradScaler(device.type)
