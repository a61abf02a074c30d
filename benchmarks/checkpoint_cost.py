"""What proving a checkpoint whole costs: the digest alone, and save/load with it against without it.

A real checkpoint of the default recipe (the ConvNet, AdamW's state after a step, RNG, config) is saved the
way a run saves it (atomic: temp file, fsync, rename; `checkpoint.save`) and the way it would be without a
digest (the same write of the bare payload); loaded with `checkpoint.load` (which verifies) and with
`torch.load` alone. The four are interleaved, many times; medians in ms are printed. Asserts nothing.

    python benchmarks/checkpoint_cost.py [--repeats 50] [--dir /some/disk]
"""

import argparse
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import torch

from mnist_ddp.common import atomic
from mnist_ddp.common.config import TrainConfig
from mnist_ddp.core import schedule, state
from mnist_ddp.model import ConvNet
from mnist_ddp.outputs import checkpoint


def payload() -> dict:
    cfg = TrainConfig()
    model = ConvNet()
    opt, _ = schedule.build_optimizer(cfg.recipe, model)
    model(torch.randn(4, 1, 28, 28)).sum().backward()
    opt.step()
    return {"model": model.state_dict(), "optimizer": opt.state_dict(), "progress": vars(state.Progress()),
            "rng": torch.get_rng_state(), "config": cfg.to_dict(), "run_id": ""}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--repeats", type=int, default=50)
    p.add_argument("--dir", help="where to write (default: a temp folder)")
    args = p.parse_args()
    torch.set_num_threads(1)
    state = payload()
    with tempfile.TemporaryDirectory(dir=args.dir) as tmp:
        with_digest, without = Path(tmp) / "checkpoint.pt", Path(tmp) / "plain.pt"
        steps: dict[str, Callable[[], object]] = {
            "digest alone": lambda: checkpoint.digest(state),
            "save, with digest": lambda: checkpoint.save(with_digest, state),
            "save, without": lambda: atomic.write(without, lambda f: torch.save(state, f)),
            "load, verified": lambda: checkpoint.load(with_digest),
            "load, torch.load alone": lambda: torch.load(without, map_location="cpu", weights_only=True),
        }
        times: dict[str, list[float]] = {name: [] for name in steps}
        for rnd in range(args.repeats + 1):  # round 0 warms up: not counted
            for name, step in steps.items():
                start = time.perf_counter()
                step()
                if rnd:
                    times[name].append(1e3 * (time.perf_counter() - start))
        size = with_digest.stat().st_size
    print(f"checkpoint of {size / 1e3:,.0f} kB, {args.repeats} repeats, median ms")
    for name, values in times.items():
        print(f"  {name:24s} {statistics.median(values):7.2f} ms")
    for what in ("save", "load"):
        a, b = (statistics.median(v) for k, v in times.items() if k.startswith(what))
        print(f"  {what}: the digest adds {a - b:+.2f} ms ({a / b:.2f}x)")


if __name__ == "__main__":
    main()
