"""What --recover costs an undisturbed run: the snapshot at each step boundary (snapshot.Snapshots.take), timed
alone, and images/s of the same `-g 2` run with and without --recover, in interleaved rounds. Asserts nothing.

    python benchmarks/recover_cost.py              # 3 rounds, 6,000 synthetic images, the default recipe
    python benchmarks/recover_cost.py --rounds 5
"""

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from mnist_ddp.common.config import TrainConfig
from mnist_ddp.core import schedule, state
from mnist_ddp.core.batches import Share
from mnist_ddp.core.bnstats import PartStats
from mnist_ddp.model import ConvNet
from mnist_ddp.recovery.snapshot import Snapshots


def snapshot_us(repeats: int = 2000) -> float:
    """Microseconds per `take` of the default recipe's state (AdamW's moments filled by one step)."""
    torch.set_num_threads(1)
    model = ConvNet()
    opt, _ = schedule.build_optimizer(TrainConfig().recipe, model)
    model(torch.randn(8, 1, 28, 28)).sum().backward()
    opt.step()
    t = state.Training(model, opt, None, state.Progress())
    snaps, stats = Snapshots(t), PartStats(model, Share(1, 1), 0)
    stretch = state.Stretch(torch.zeros(()))
    start = time.perf_counter()
    for _ in range(repeats):
        snaps.take(stats, stretch, {})
    return (time.perf_counter() - start) / repeats * 1e6


def images_per_second(recover: bool, samples: int) -> float:
    with tempfile.TemporaryDirectory() as out:
        subprocess.run([sys.executable, "-m", "mnist_ddp", "train", "-g", "2", "--dataset", "synthetic",
                        "--train-samples", str(samples), "--test-samples", "500", "--epochs", "1", "--no-progress",
                        "--no-plots", "--out", out, *(["--recover"] if recover else [])], check=True,
                       capture_output=True)
        return json.loads((Path(out) / "metrics.jsonl").read_text().splitlines()[-1])["images_per_second"]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--samples", type=int, default=6000)
    a = p.parse_args()
    print(f"snapshot at a step boundary: {snapshot_us():.0f} µs (one thread)")
    found: dict[bool, list[float]] = {False: [], True: []}
    for _ in range(a.rounds):
        for recover in (False, True):
            found[recover].append(images_per_second(recover, a.samples))
    off, on = (statistics.median(found[k]) for k in (False, True))
    rounds = {k: [round(v) for v in found[k]] for k in found}
    print(f"-g 2 images/s, median of {a.rounds} rounds: without --recover {off:,.0f} {rounds[False]}, "
          f"with {on:,.0f} {rounds[True]}; ratio {on / off:.3f}")


if __name__ == "__main__":
    main()
