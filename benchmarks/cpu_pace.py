"""The CPU's pace in one run: this machine's matrix-multiply peak, the training step's images/s as a fraction of it
(the default step, eager; the same with each ReLU before its max-pool, in the tutorial's order; and the default
step under torch.compile), the evaluation at the default batch and at 1,000, and where a 2-epoch Fashion-MNIST run's
seconds go.

The yardstick of docs/speed.md's "the CPU's pace". The peak is measured here, at the threads training uses: a square
bf16 and fp32 matrix product, best of a few. A training step's work is counted from the model's own layers: forward
2 × multiply-adds, backward twice that, less the first layer's input gradient, which nothing needs (16.4 MFLOP an
image). The run is the real command, twice, in a fresh folder: the first decodes and caches the data, the second
is what a user sees from then on; `--src A B` runs each source tree's command so, alternating, in one run (a
`git worktree` of an older commit against this one). Prints; asserts nothing.

    PYTHONPATH=src python benchmarks/cpu_pace.py [--no-run] [--no-compile] [--src OLD/src src] [--rounds-run 2]
"""

import argparse
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
from torch import nn

from ab_compute import step_speeds
from mnist_ddp.common.config import TrainConfig
from mnist_ddp.core import compute
from mnist_ddp.core.batches import ShardedBatches
from mnist_ddp.core.distributed import Dist
from mnist_ddp.core.evaluation import evaluate
from mnist_ddp.model import ConvNet
from mnist_ddp.tutorial import TutorialConvNet

FASHION = Path("/usr/share/datasets/fashion-mnist")


def matmul_peak(dtype: torch.dtype, n: int = 1024, seconds: float = 1.0) -> float:
    """GFLOP/s of an n × n matrix product in `dtype`, the best of three stretches of `seconds`."""
    a, b = torch.randn(n, n).to(dtype), torch.randn(n, n).to(dtype)
    a @ b  # the kernel chosen and warmed
    best = 0.0
    for _ in range(3):
        done, start = 0, time.perf_counter()
        while (took := time.perf_counter() - start) < seconds:
            a @ b
            done += 1
        best = max(best, 2 * n ** 3 * done / took / 1e9)
    return best


def training_flop(model: nn.Module) -> float:
    """FLOP of one image's training step: forward 2 × the multiply-adds of every conv and linear layer, backward
    2 × that again (the input's and the weights' gradients), less the first layer's input gradient."""
    macs: list[int] = []

    def count(layer: nn.Module, inputs: tuple[torch.Tensor], out: torch.Tensor) -> None:
        assert isinstance(layer, nn.Conv2d | nn.Linear)  # the only layers it is registered on
        per_output = layer.weight[0].numel()  # a conv's in_channels × kh × kw, a linear layer's in_features
        macs.append(out[0].numel() * per_output)
    hooks = [m.register_forward_hook(count) for m in model.modules() if isinstance(m, nn.Conv2d | nn.Linear)]
    with torch.no_grad():
        model.eval()(torch.zeros(1, 1, 28, 28))
    for h in hooks:
        h.remove()
    forward = 2 * sum(macs)
    return 3 * forward - 2 * macs[0]


def evaluation_seconds(sizes: list[int], channels_last: bool, rounds: int) -> dict[int, float]:
    """The median seconds of an evaluation of 10,000 images (random pixels) at each batch size, interleaved."""
    device = torch.device("cpu")
    layout = torch.channels_last if channels_last else torch.contiguous_format
    model = ConvNet().to(memory_format=layout)  # type: ignore[call-overload]
    g = torch.Generator().manual_seed(0)
    images, labels = torch.randint(0, 256, (10_000, 28, 28), dtype=torch.uint8, generator=g), torch.randint(0, 10, (
        10_000,), generator=g)
    batches = {n: ShardedBatches(images, labels, n, rank=0, world=1, device=device, shuffle=False,
                                 each_sample_once=True, channels_last=channels_last) for n in sizes}
    seconds: dict[int, list[float]] = {n: [] for n in sizes}
    for rnd in range(rounds + 1):  # round 0 warms up
        for n in sizes:
            start = time.perf_counter()
            evaluate(model, batches[n], Dist(0, 0, 1, 1, device))
            if rnd:
                seconds[n].append(time.perf_counter() - start)
    return {n: statistics.median(s) for n, s in seconds.items()}


def time_line(flags: list[str], cwd: Path, src: Path) -> str:
    """The `time:` line of `mnist-ddp train FLAGS` from source tree `src`, run in `cwd` (the command as a user
    types it)."""
    r = subprocess.run([sys.executable, "-m", "mnist_ddp", "train", *flags, "--no-progress", "--out",
                        f"run-{time.time_ns()}"], cwd=cwd, capture_output=True, text=True, timeout=900,
                       env=os.environ | {"PYTHONPATH": str(src.resolve())})
    said = [line for line in r.stdout.splitlines() if line.startswith("time:")]
    return said[-1] if r.returncode == 0 and said else f"failed ({r.returncode}): {r.stderr.strip()[-300:]}"


def outside_training(line: str) -> str:
    """'N.N s outside the training steps' from a `time:` line."""
    parts = dict((name, float(s)) for name, s in re.findall(r"([a-z-]+) ([0-9.]+)", line.split("=", 1)[-1]))
    total = re.search(r"time: ([0-9.]+) s", line)
    return f"{float(total[1]) - parts.get('training', 0.0):.1f} s outside the training steps" if total else ""


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--no-run", action="store_true", help="skip the 2-epoch Fashion-MNIST runs")
    p.add_argument("--no-compile", action="store_true", help="skip the torch.compile step")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--src", type=Path, nargs="+", default=[Path(__file__).resolve().parents[1] / "src"],
                   help="source trees whose command to run, alternating")
    p.add_argument("--rounds-run", type=int, default=1, help="how many times each tree's next run is repeated")
    args = p.parse_args()
    device = torch.device("cpu")
    amp, channels_last = compute.amp_for("auto", device), compute.channels_last_for(None, device)
    flop = training_flop(ConvNet())
    peaks = {name: matmul_peak(dtype) for name, dtype in (("bf16", torch.bfloat16), ("fp32", torch.float32))}
    print(f"cpu, {torch.get_num_threads()} threads ({torch.backends.cpu.get_cpu_capability()}); --amp auto is "
          f"{amp}, channels_last {channels_last}")
    print(f"matrix product peak: bf16 {peaks['bf16']:,.0f} GFLOP/s, fp32 {peaks['fp32']:,.0f} GFLOP/s; a training "
          f"step: {flop / 1e6:.1f} MFLOP an image")
    peak = peaks["bf16" if amp == "bf16" else "fp32"]
    settings = [(amp, channels_last, False, ConvNet), (amp, channels_last, False, TutorialConvNet)]
    settings += [] if args.no_compile else [(amp, channels_last, True, ConvNet)]
    runs = step_speeds(settings, device, 100, args.steps, args.rounds)
    base = statistics.median(runs[0][1])
    for name, speeds in runs:
        med = statistics.median(speeds)
        rate = med * flop / 1e9
        print(f"  step, {name:34s} {med:8,.0f} images/s  {rate:6,.0f} GFLOP/s = {rate / peak:.1%} of the "
              f"{'bf16' if amp == 'bf16' else 'fp32'} peak  ({med / base:.2f}x the eager step)")
    default = TrainConfig().eval_batch_size
    took = evaluation_seconds(sorted({default, 1000}, reverse=True), channels_last, args.rounds)
    for n, seconds in took.items():
        print(f"  evaluation of 10,000 images at batch {n:5,}: {seconds:.3f} s ({took[1000] / seconds:.2f}x "
              f"batch 1,000){'  (the default)' if n == default else ''}")
    if args.no_run:
        return
    flags = ["--dataset", "fashion-mnist" if FASHION.is_dir() else "synthetic", "--epochs", "2"]
    print(f"mnist-ddp train {' '.join(flags)}:")
    with tempfile.TemporaryDirectory() as tmp:  # its ./data: a first run decodes (or makes) and caches the data
        folders = [Path(tmp) / f"tree{i}" for i in range(len(args.src))]  # each tree its own ./data
        for src, folder in zip(args.src, folders):
            folder.mkdir()
            line = time_line(flags, folder, src)
            print(f"  {src}, first run: {line}; {outside_training(line)}")
        for _ in range(args.rounds_run):
            for src, folder in zip(args.src, folders):
                line = time_line(flags, folder, src)
                print(f"  {src}, next run:  {line}; {outside_training(line)}")


if __name__ == "__main__":
    main()
