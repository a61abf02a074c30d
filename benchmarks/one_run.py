"""One run at any world size, measured: how far apart the final weights of the same run at different worlds
are (DDP's mean, and --bitwise), what --accumulate does to images/s, and what --bitwise costs. Prints; asserts
nothing.

    python benchmarks/one_run.py            # ~12 min on 2 loaded cores
    python benchmarks/one_run.py --quick    # distances only for 15 steps, one round of each speed
    python benchmarks/one_run.py --only speed|cost|distances

Distances: fp32 SGD (constant lr, no momentum), synthetic data, a global batch of 4 micro-batches of 25, one
thread per process (the thread count changes the kernels' summation order too). The same run as `-g 1
--accumulate 4`, `-g 2 --accumulate 2` and `-g 4`, and `-g 4` stopped by SIGTERM inside its last epoch and
resumed at `-g 2`, each against the uninterrupted `-g 4`; the control is `-g 2` without --accumulate, a
global batch of 2 micro-batches: another run. Relative L2 distance over every float tensor of the model; all of
it once with DDP's mean reduction and once with --bitwise.

Speed: `-g 2 --accumulate K` for K = 1, 2, 4 on Fashion-MNIST if installed (else synthetic 60k), one epoch
each, interleaved over rounds; images/s from metrics.jsonl (K micro-batches of 100 per process per step, so
one all-reduce per 200·K images).

Cost: the same run (default recipe, a global batch of 4 micro-batches of 100) at `-g 1 --accumulate 4`,
`-g 2 --accumulate 2` and `-g 4`, with DDP's mean and with --bitwise, one epoch each, the six interleaved in
every round; images/s from metrics.jsonl, and the ratio bitwise / mean per world.
"""

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from mnist_ddp.common.errors import UserError
from mnist_ddp.joining import identity
from mnist_ddp.outputs import checkpoint

FASHION = Path("/usr/share/datasets/fashion-mnist")
SGD = ["--dataset", "synthetic", "--test-samples", "500", "--batch-size", "25", "--optimizer", "sgd", "--lr", "0.05",
       "--momentum", "0", "--scheduler", "none", "--amp", "off", "--no-progress", "--no-plots"]
WORLDS = {"-g 1 --accumulate 4": ["--accumulate", "4"], "-g 2 --accumulate 2": ["-g", "2", "--accumulate", "2"],
          "-g 4": ["-g", "4"], "control: -g 2 (global batch 50)": ["-g", "2"]}


def _env(threads: int | None) -> dict[str, str]:
    env = identity.without_launcher_vars(os.environ) | {"PYTHONUNBUFFERED": "1"}
    return env | {"OMP_NUM_THREADS": str(threads)} if threads else env


def train(out: Path, args: list[str], threads: int | None = 1) -> None:
    subprocess.run([sys.executable, "-m", "mnist_ddp", "train", *args, "--out", str(out)], env=_env(threads),
                   check=True, capture_output=True, text=True)


def stopped_and_resumed(out: Path, args: list[str], epochs: int) -> None:
    """`-g 4` SIGTERMed after a mid-epoch checkpoint of its last epoch, then resumed at `-g 2`."""
    run = subprocess.Popen([sys.executable, "-m", "mnist_ddp", "train", *args, "-g", "4", "--checkpoint-every", "5",
                            "--out", str(out)], env=_env(1), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    p = None
    while run.poll() is None and not (p and p["epoch"] == epochs - 1 and p["consumed"] > 0):
        time.sleep(0.02)
        try:
            p = checkpoint.load(out / "checkpoint.pt")["progress"]
        except UserError:  # not written yet
            p = None
    run.send_signal(signal.SIGTERM)
    run.wait()
    print(f"  (-g 4 stopped with exit code {run.returncode} after {p and p['consumed']} samples of epoch {epochs})")
    train(out, [*args, "-g", "2", "--checkpoint-every", "5", "--resume"])


def weights(out: Path) -> torch.Tensor:
    state = checkpoint.load(out / "checkpoint.pt")["model"]
    return torch.cat([v.reshape(-1).double() for v in state.values() if v.is_floating_point()])


def distances(tmp: Path, steps: int, mode: list[str]) -> None:
    epochs = steps // 15  # 1,500 images in 4 slots of 25: 15 steps per epoch
    args = [*SGD, "--train-samples", "1500", "--epochs", str(epochs), *mode]
    runs: dict[str, Path] = {}  # each run's name: its --out
    for name, extra in WORLDS.items():
        runs[name] = tmp / f"{steps}{''.join(mode)}-{len(runs)}"
        train(runs[name], [*args, *extra])
    runs["-g 4 stopped, resumed at -g 2"] = tmp / f"{steps}{''.join(mode)}-resumed"
    stopped_and_resumed(runs["-g 4 stopped, resumed at -g 2"], args, epochs)
    reference = weights(runs["-g 4"])
    print(f"\n{' '.join(mode) or 'DDP mean'}: after {steps} steps, relative L2 distance of the final weights from "
          f"uninterrupted -g 4:")
    for name, out in runs.items():
        if name != "-g 4":
            print(f"  {name:34s} {float((weights(out) - reference).norm() / reference.norm()):.2e}")


def _fashion() -> list[str]:
    return (["--dataset", "fashion-mnist", "--data-dir", str(FASHION)] if FASHION.is_dir()
            else ["--dataset", "synthetic"])


def speed(tmp: Path, rounds: int) -> None:
    data = _fashion()
    seen: dict[int, list[float]] = {1: [], 2: [], 4: []}
    for r in range(rounds):
        for k in seen:
            out = tmp / f"speed-{r}-{k}"
            train(out, [*data, "-g", "2", "--accumulate", str(k), "--epochs", "1", "--no-progress", "--no-plots"],
                  threads=None)
            seen[k].append(json.loads((out / "metrics.jsonl").read_text().splitlines()[-1])["images_per_second"])
    print(f"\n-g 2 --accumulate K on {data[1]}, one epoch each, {rounds} interleaved round(s), median images/s:")
    base = statistics.median(seen[1])
    for k, values in seen.items():
        rounds_seen = ", ".join(f"{v:,.0f}" for v in values)
        print(f"  K={k}: global batch {200 * k:4d}  {statistics.median(values):8,.0f} images/s  "
              f"ratio to K=1 {statistics.median(values) / base:.2f}x  (rounds: {rounds_seen})")


SAME_RUN = {"-g 1 --accumulate 4": ["--accumulate", "4"], "-g 2 --accumulate 2": ["-g", "2", "--accumulate", "2"],
            "-g 4": ["-g", "4"]}
MODES = {"mean": [], "bitwise": ["--bitwise"]}


def cost(tmp: Path, rounds: int) -> None:
    """images/s of the same run at each world, DDP's mean against --bitwise, all six interleaved in each round."""
    seen: dict[tuple[str, str], list[float]] = {(w, m): [] for w in SAME_RUN for m in MODES}
    for r in range(rounds):
        for i, (world, mode) in enumerate(seen):
            out = tmp / f"cost-{r}-{i}"
            train(out, [*_fashion(), *SAME_RUN[world], *MODES[mode], "--epochs", "1", "--no-progress", "--no-plots"],
                  threads=None)
            seen[world, mode].append(json.loads((out / "metrics.jsonl").read_text().splitlines()[-1])
                                     ["images_per_second"])
    print(f"\nthe same run (global batch 400 = 4 micro-batches of 100, default recipe) on {_fashion()[1]}, one epoch "
          f"each, {rounds} interleaved round(s), images/s (on a busy machine the best round is the least disturbed):")
    print(f"  {'':22s}{'mean':>18s}{'bitwise':>18s}   bitwise/mean   (rounds: mean | bitwise)")
    print(f"  {'':22s}{'median   best':>18s}{'median   best':>18s}   median  best")
    for world in SAME_RUN:
        (mean, best_mean), (bitwise, best_bitwise) = ((statistics.median(seen[world, m]), max(seen[world, m]))
                                                      for m in MODES)
        rounds_seen = " | ".join(", ".join(f"{v:,.0f}" for v in seen[world, m]) for m in MODES)
        print(f"  {world:22s}{mean:10,.0f}{best_mean:8,.0f}{bitwise:10,.0f}{best_bitwise:8,.0f}   "
              f"{bitwise / mean:5.2f}x {best_bitwise / best_mean:5.2f}x   ({rounds_seen})")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="15 steps only, one round of each speed")
    p.add_argument("--only", choices=("distances", "speed", "cost"), help="measure only this")
    a = p.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        if a.only in (None, "distances"):
            for steps in (15,) if a.quick else (15, 30):
                for mode in MODES.values():
                    distances(Path(tmp), steps, mode)
        if a.only in (None, "speed"):
            speed(Path(tmp), 1 if a.quick else 3)
        if a.only in (None, "cost"):
            cost(Path(tmp), 1 if a.quick else 3)


if __name__ == "__main__":
    main()
