"""Operators per training step, and images/s: mnist-ddp's loop against a hand-written loop, in one run.

Both train the same ConvNet (in the memory layout mnist-ddp picks for the device: channels_last on a CPU) on
the same in-memory batches with fused AdamW, one process, fp32. Operators are counted with a TorchDispatchMode
(views and profiler markers excluded); the per-step count is the difference between an epoch of 20 steps and
one of 10, so per-epoch work (evaluation, the fold) cancels. Prints both and their ratio; asserts nothing. On a
GPU every operator is a kernel launch, which is what bounds a step of this small model.

    python benchmarks/ops_per_step.py [--device cpu] [--steps 60] [--rounds 3]
"""

import argparse
import inspect
import statistics
import tempfile
import time
from collections import Counter
from pathlib import Path
from typing import Any, cast

import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

from mnist_ddp.common.config import DataConfig, TrainConfig, recipe
from mnist_ddp.core.batches import model_input
from mnist_ddp.core.compute import sync
from mnist_ddp.core.distributed import Dist, pick_device
from mnist_ddp.data import datasets
from mnist_ddp.model import ConvNet
from mnist_ddp.outputs.report import Reporter
from mnist_ddp.trainer import Trainer

BATCH = 100


class Count(TorchDispatchMode):
    """Counts every operator dispatched inside it, views and the profiler's markers excluded."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: Counter[str] = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if not func.is_view and func.namespace != "profiler":
            self.ops[str(func.overloadpacket)] += 1
        return func(*args, **(kwargs or {}))


def ours(device: torch.device, samples: int, out: Path) -> Trainer:
    cfg = TrainConfig(data=DataConfig("synthetic", data_dir=out / "data", train_samples=samples, test_samples=100),
                      recipe=recipe("default", amp="off", epochs=1), out=str(out), progress=False, plots=False)
    d = Dist(rank=0, local_rank=0, world_size=1, local_world_size=1, device=device)
    return Trainer(cfg, d, datasets.load(cfg.data), Reporter(out, False, False, False, False))


def our_epoch(t: Trainer) -> None:
    t.train_batches.set_epoch(0)
    # (also runs on older trees: before the re-cut the Trainer held the model itself; before the textbook Trainer,
    # _train_epoch took the model as its first argument)
    model = t.t.model if hasattr(t, "t") else cast(Any, t).model
    if "net" in inspect.signature(t._train_epoch).parameters:
        cast(Any, t)._train_epoch(model, 0, time.perf_counter())
    else:
        t._train_epoch(0, time.perf_counter())


def hand_epoch(model: torch.nn.Module, opt: torch.optim.Optimizer, images: torch.Tensor, labels: torch.Tensor,
               channels_last: bool) -> None:
    """The textbook loop: shuffle, gather a batch, forward, backward, step."""
    order = torch.randperm(len(labels), device=images.device)
    for lo in range(0, len(order), BATCH):
        idx = order[lo : lo + BATCH]
        x, y = model_input(images[idx], True, channels_last), labels[idx]
        opt.zero_grad(set_to_none=True)
        F.cross_entropy(model(x), y).backward()
        opt.step()


def per_step(run, short: int, long: int) -> float:
    counts = []
    for steps in (short, long):
        run(steps)  # a first call makes the optimizer's state: not a step's work
        with Count() as c:
            run(steps)
        counts.append(sum(c.ops.values()))
    return (counts[1] - counts[0]) / (long - short)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", default="cpu")
    p.add_argument("--steps", type=int, default=60, help="steps per timed epoch")
    p.add_argument("--rounds", type=int, default=3)
    a = p.parse_args()
    device = pick_device(a.device, 0, 1)  # a CUDA device with its index
    torch.manual_seed(0)
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp)
        trainers = {n: ours(device, n * BATCH, out / f"o{n}") for n in (10, 20, a.steps)}
        data = trainers[a.steps].data.train
        images, labels = data.images.to(device), data.labels.to(device)
        layout = trainers[10].channels_last
        memory_format = torch.channels_last if layout else torch.contiguous_format
        model = ConvNet().to(device, memory_format=memory_format)  # type: ignore[call-overload]  # not in torch's stubs
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True)
        ops = {"mnist-ddp": per_step(lambda n: our_epoch(trainers[n]), 10, 20),
               "hand loop": per_step(lambda n: hand_epoch(model, opt, images[: n * BATCH], labels[: n * BATCH], layout),
                                     10, 20)}
        speed: dict[str, list[float]] = {"mnist-ddp": [], "hand loop": []}
        for _ in range(a.rounds):  # interleaved, so that a neighbour's load hits both alike
            for name, run in (("mnist-ddp", lambda: our_epoch(trainers[a.steps])),
                              ("hand loop", lambda: hand_epoch(model, opt, images, labels, layout))):
                sync(device)
                start = time.perf_counter()
                run()
                sync(device)
                speed[name].append(len(labels) / (time.perf_counter() - start))
    print(f"device {device}, torch {torch.__version__}, {torch.get_num_threads()} thread(s), batch {BATCH}, fp32")
    for name in ops:
        print(f"{name:10s} {ops[name]:6.1f} operators/step  {statistics.median(speed[name]):9,.0f} img/s (median of "
              f"{a.rounds})")
    print(f"ratio      {ops['mnist-ddp'] / ops['hand loop']:6.2f}x operators  "
          f"{statistics.median(speed['mnist-ddp']) / statistics.median(speed['hand loop']):.2f}x img/s")


if __name__ == "__main__":
    main()
