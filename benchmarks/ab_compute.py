"""A/B of the compute settings in one process: fp32 vs bf16 autocast, NCHW vs channels_last (and --compile).

The evidence behind compute.py's defaults (amp_for, channels_last_for). Every setting trains its own model on the same
batches, in interleaved rounds (A B C D A B C D …), so a neighbour's load hits all of them alike;
the median and best round are printed. Full training steps from the real pieces: ShardedBatches,
ConvNet, schedule.build_optimizer (the default recipe). Prints; asserts nothing.

    python benchmarks/ab_compute.py                      # this machine's cores, batch 100
    python benchmarks/ab_compute.py --threads 1 --compile
"""

import argparse
import itertools
import statistics
import time
from collections.abc import Callable
from dataclasses import replace

import torch
import torch.nn.functional as F

from mnist_ddp.common.config import RECIPES
from mnist_ddp.core import distributed, schedule
from mnist_ddp.core.batches import ShardedBatches
from mnist_ddp.core.compute import autocast
from mnist_ddp.model import ConvNet
from mnist_ddp.tutorial import TutorialConvNet

Setting = tuple[str, bool, bool, type[ConvNet]]  # amp ("off", "bf16"), channels_last, torch.compile, the model


def step_speeds(settings: list[Setting], device: torch.device, batch_size: int, steps: int,
                rounds: int) -> list[tuple[str, list[float]]]:
    """Each setting's images/s per round (after a warm-up round), the settings interleaved round by round: a
    name and its speeds, in the order given. Full training steps of the default recipe's optimizer."""
    g = torch.Generator().manual_seed(0)
    n = steps * batch_size
    images, labels = torch.randint(0, 256, (n, 28, 28), dtype=torch.uint8, generator=g), torch.randint(0, 10, (n,))
    recipe = replace(RECIPES["default"], scheduler="none")  # the default optimizer; a schedule costs nothing
    # name, amp, the model (compiled or not), its optimizer, its batches, its images/s per round
    runs: list[tuple[str, str, Callable[..., torch.Tensor], torch.optim.Optimizer, ShardedBatches, list[float]]] = []
    for amp, channels_last, compiled, model_class in settings:
        model = model_class().to(device)
        if channels_last:
            model = model.to(memory_format=torch.channels_last)  # type: ignore[call-overload]  # not in torch's stubs
        opt, _ = schedule.build_optimizer(recipe, model)
        batches = ShardedBatches(images, labels, batch_size, rank=0, world=1, device=device, shuffle=True,
                                 channels_last=channels_last)
        name = f"amp {amp:4s} channels_last {channels_last!s:5s}" + (" compile" if compiled else "") + \
            (", ReLU before the pool" if model_class is TutorialConvNet else "")
        runs.append((name, amp, torch.compile(model) if compiled else model, opt, batches, []))
    for rnd in range(rounds + 1):  # round 0 warms up (oneDNN primitives, compilation): not counted
        for _, amp, net, opt, batches, speeds in runs:
            batches.set_epoch(rnd)
            start = time.perf_counter()
            for x, y in batches:
                with autocast(device, amp):
                    loss = F.cross_entropy(net(x), y)
                opt.zero_grad(set_to_none=True)
                loss.backward()
                opt.step()
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            if rnd:
                speeds.append(n / (time.perf_counter() - start))
    return [(name, speeds) for name, *_, speeds in runs]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--threads", type=int, default=0, help="0: torch's default (all cores)")
    p.add_argument("--batch-size", type=int, default=100)
    p.add_argument("--steps", type=int, default=30, help="steps per setting per round")
    p.add_argument("--rounds", type=int, default=6)
    p.add_argument("--compile", action="store_true", help="also bf16 + channels_last + torch.compile")
    args = p.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    device = distributed.pick_device(args.device, 0, 1)  # with its index, as training picks it
    settings = [(amp, cl, False, ConvNet) for amp, cl in itertools.product(("off", "bf16"), (False, True))]
    settings += [("bf16", True, True, ConvNet)] if args.compile else []
    runs = step_speeds(settings, device, args.batch_size, args.steps, args.rounds)
    print(f"{device.type}, {torch.get_num_threads()} threads, batch {args.batch_size}, {args.rounds} rounds "
          f"of {args.steps} steps; images/s")
    base = statistics.median(runs[0][1])
    for name, speeds in runs:
        med = statistics.median(speeds)
        print(f"  {name:34s} median {med:8,.0f}  best {max(speeds):8,.0f}  ({med / base:.2f}x the first)")


if __name__ == "__main__":
    main()
