"""BatchNorm, max-pool and ReLU fused by hand in eager PyTorch, against the default step, in one run.

Issue 44 asked whether the memory-bound half of the step (BatchNorm, max-pool, ReLU: each reads and writes the
whole activation) can be fused another way than by torch.compile. In training, BatchNorm is the batch's statistics
and then a per-channel affine map `a·y + b`; where `a ≥ 0` the map is monotone and commutes with the max-pool (where
`a < 0`, with the min-pool), so the map can be applied after the pool, to a quarter of the values, and the full-size
normalised activation is never written. `PoolFirst` does that, forward and backward, with ATen's own kernels; it
computes the same function up to rounding (the gradients are printed against the default's). The question is only
whether it is faster: the default model and `PoolFirstConvNet` train the same batches in interleaved rounds
(ab_compute.step_speeds). Prints; asserts nothing.

    PYTHONPATH=src:benchmarks python benchmarks/pool_first.py [--rounds 5] [--steps 30]
"""

import argparse
import statistics
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from ab_compute import step_speeds
from mnist_ddp.core import compute
from mnist_ddp.model import ConvNet


class PoolFirst(torch.autograd.Function):
    """relu(max_pool2d(batch_norm(y))) of a training step, the norm's affine map applied after the pool."""

    @staticmethod
    def forward(ctx: Any, y: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor,
                eps: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        var, mean = torch.var_mean(y, dim=(0, 2, 3), unbiased=False)
        invstd = torch.rsqrt(var + eps)
        a = weight * invstd
        b = bias - mean * a
        sign = torch.where(a >= 0, 1.0, -1.0).to(y.dtype).view(1, -1, 1, 1)  # a max-pool of -y is -(y's min-pool)
        pooled, where = F.max_pool2d_with_indices(y if bool((a >= 0).all()) else y * sign, [2, 2], [2, 2])
        out = torch.relu(pooled * (a.view(1, -1, 1, 1) * sign) + b.view(1, -1, 1, 1))
        ctx.save_for_backward(y, out, where, mean, invstd, a, weight)
        return out, mean, var

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor, *_: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        y, out, where, mean, invstd, a, weight = ctx.saved_tensors
        g = grad * (out > 0)  # through the ReLU
        picked = torch.gather(y.flatten(2), 2, where.flatten(2)).view_as(g)  # the y each window chose
        db, da = g.sum((0, 2, 3)), (g * picked).sum((0, 2, 3))  # out = a·picked + b
        dy = torch.ops.aten.max_pool2d_with_indices_backward(g * a.view(1, -1, 1, 1), y, [2, 2], [2, 2], [0, 0],
                                                             [1, 1], False, where)
        # a = weight·invstd, b = bias − mean·a, invstd = (var + eps)^-½; then mean and var's own gradient in y
        da_total = da - db * mean
        dvar = da_total * weight * -0.5 * invstd ** 3
        dmean = -db * a
        n = y.numel() // y.shape[1]
        dy.addcmul_(y, (2 * dvar / n).view(1, -1, 1, 1)).add_(((dmean - 2 * dvar * mean) / n).view(1, -1, 1, 1))
        return dy, da_total * invstd, db, None


class PoolFirstConvNet(ConvNet):
    """ConvNet, its parameters and buffers the same, training through `PoolFirst` (eval: ConvNet's own forward)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.training:
            return super().forward(x)
        for conv, bn, _, _ in (self.layer1, self.layer2):
            assert isinstance(bn, nn.BatchNorm2d) and bn.momentum is not None
            assert bn.running_mean is not None and bn.running_var is not None
            y = conv(x)
            x, mean, var = PoolFirst.apply(y, bn.weight, bn.bias, bn.eps)
            with torch.no_grad():  # the running statistics, as BatchNorm2d keeps them (unbiased variance)
                n = y.numel() // y.shape[1]
                bn.running_mean.lerp_(mean, bn.momentum)
                bn.running_var.lerp_(var * n / (n - 1), bn.momentum)
        return self.fc(x.flatten(1))


def gradient_gap(channels_last: bool) -> float:
    """The largest difference between the two models' weight gradients on one batch, relative to the gradient's
    largest value, with some BatchNorm weights negative (the min-pool's case)."""
    torch.manual_seed(0)
    a, b = ConvNet(), PoolFirstConvNet()
    with torch.no_grad():
        for _, bn, _, _ in (a.layer1, a.layer2):
            assert isinstance(bn, nn.BatchNorm2d)
            bn.weight[::3].neg_()
    b.load_state_dict(a.state_dict())
    x, y = torch.randn(100, 1, 28, 28), torch.randint(0, 10, (100,))
    layout = torch.channels_last if channels_last else torch.contiguous_format
    for model in (a, b):
        model.to(memory_format=layout)  # type: ignore[call-overload]
        F.cross_entropy(model(x.to(memory_format=layout)), y).backward()
    return max(float((p.grad - q.grad).abs().max() / p.grad.abs().max()) for (name, p), q in
               zip(a.named_parameters(), b.parameters()) if p.grad is not None and q.grad is not None
               and not name.endswith("0.bias"))  # a conv's bias before BatchNorm has no gradient but rounding


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--steps", type=int, default=30)
    args = p.parse_args()
    device = torch.device("cpu")
    amp, channels_last = compute.amp_for("auto", device), compute.channels_last_for(None, device)
    print(f"cpu, {torch.get_num_threads()} threads ({torch.backends.cpu.get_cpu_capability()}); amp {amp}, "
          f"channels_last {channels_last}")
    print(f"weight gradients, PoolFirst against the default: {gradient_gap(channels_last):.1e} of the largest")
    runs = step_speeds([(amp, channels_last, False, ConvNet), (amp, channels_last, False, PoolFirstConvNet)],
                       device, 100, args.steps, args.rounds)
    base = statistics.median(runs[0][1])
    for label, (_, speeds) in zip(("the default step", "PoolFirst"), runs):
        print(f"  {label:18s} {statistics.median(speeds):8,.0f} images/s  ({statistics.median(speeds) / base:.2f}x)")


if __name__ == "__main__":
    main()
