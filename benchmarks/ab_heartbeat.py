"""A/B of the heartbeat (heartbeat.py): `mnist-ddp train -g 2` with it off, at its default and beating 10x as often.

Each setting trains the same run in fresh processes, in interleaved rounds (off, default, fast, off, …) so a
neighbour's load hits all of them alike; a run's speed is the median images/s of its epochs (metrics.jsonl,
training only, all ranks). Prints the medians and the ratios to "off"; asserts nothing.

    python benchmarks/ab_heartbeat.py                   # 3 rounds, 6,000 synthetic images, 3 epochs per run
    python benchmarks/ab_heartbeat.py --rounds 5 --procs 3
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from mnist_ddp.identity import without_launcher_vars

SETTINGS = {"off": "0", "default (1 s)": "1", "10x as often (0.1 s)": "0.1"}


def images_per_second(out: Path, heartbeat: str, args: argparse.Namespace) -> float:
    """One run's median images/s over its epochs."""
    cmd = [sys.executable, "-m", "mnist_ddp", "train", "-g", str(args.procs), "--dataset", "synthetic",
           "--train-samples", str(args.samples), "--test-samples", "1000", "--epochs", str(args.epochs),
           "--no-progress", "--no-plots", "--heartbeat", heartbeat, "--out", str(out)]
    subprocess.run(cmd, check=True, capture_output=True, env=without_launcher_vars(os.environ))
    lines = (out / "metrics.jsonl").read_text().splitlines()
    return statistics.median(json.loads(line)["images_per_second"] for line in lines)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--procs", type=int, default=2)
    p.add_argument("--samples", type=int, default=6000)
    p.add_argument("--epochs", type=int, default=3)
    args = p.parse_args()
    speeds: dict[str, list[float]] = {name: [] for name in SETTINGS}
    with tempfile.TemporaryDirectory() as tmp:
        for rnd in range(args.rounds):
            for name, heartbeat in SETTINGS.items():
                speeds[name].append(images_per_second(Path(tmp) / f"{rnd}-{heartbeat}", heartbeat, args))
    base = statistics.median(speeds["off"])
    print(f"-g {args.procs}, {args.samples:,} synthetic images, {args.epochs} epochs per run, {args.rounds} rounds; "
          f"images/s (all ranks)")
    for name, values in speeds.items():
        med = statistics.median(values)
        print(f"  heartbeat {name:22s} median {med:8,.0f}  ({med / base:.3f}x off)   runs: "
              f"{', '.join(f'{v:,.0f}' for v in values)}")


if __name__ == "__main__":
    main()
