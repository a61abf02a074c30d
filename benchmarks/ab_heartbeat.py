"""A/B of the heartbeat (heartbeat.py) in one run: DDP training steps with it off, at its default, 10x as often.

G real gloo ranks (cores shared and pinned as `-g G` does) train the real pieces (ConvNet, the default recipe,
ddp.wrap's DDP) in interleaved blocks of steps — off, default, fast, off, … — so a neighbour's load hits all
settings alike; each block with the heartbeat on beats to the job's store and reports every step
(`Dist.at`), as the training loop does. Prints images/s (all ranks) per setting, median of the blocks, and
the ratios to "off"; asserts nothing.

    python benchmarks/ab_heartbeat.py                   # -g 2, 12 rounds of 20 steps per setting
    python benchmarks/ab_heartbeat.py --procs 3 --rounds 20
"""

import argparse
import statistics
import time
from dataclasses import replace
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F

from mnist_ddp.common.config import DataConfig, TrainConfig
from mnist_ddp.core import compute, ddp, distributed, schedule
from mnist_ddp.core.batches import ShardedBatches
from mnist_ddp.core.compute import autocast
from mnist_ddp.data import datasets
from mnist_ddp.joining import identity, rendezvous
from mnist_ddp.joining.heartbeat import Heartbeat
from mnist_ddp.model import ConvNet

SETTINGS = {"off": 0.0, "default (1 s)": 1.0, "10x as often (0.1 s)": 0.1}  # seconds between beats


def _rank(rank: int, world: int, args: argparse.Namespace, port: int, results: "mp.SimpleQueue") -> None:
    device = torch.device("cpu")
    compute.share_cores(rank, world)  # as worker.run_worker does
    ident = identity.spawned(0, rank, world, 1, "127.0.0.1", port)
    d = distributed.join(ident, device, None, 120)  # no heartbeat: each block starts its own
    beats = dist.PrefixStore("mnist_ddp/heartbeat", rendezvous.connect(ident, timedelta(seconds=2), joining=False))
    cfg = TrainConfig()
    amp, channels_last = compute.amp_for(cfg.recipe.amp, device), compute.channels_last_for(None, device)
    data = datasets.load(DataConfig("synthetic", train_samples=args.steps * cfg.recipe.batch_size * world,
                                    test_samples=100))
    batches = ShardedBatches(data.train.images, data.train.labels, cfg.recipe.batch_size, rank=rank, world=world,
                             device=device, shuffle=True, channels_last=channels_last)
    layout = torch.channels_last if channels_last else torch.contiguous_format
    model = ConvNet().to(memory_format=layout)  # type: ignore[call-overload]  # not in torch's stubs
    opt, _ = schedule.build_optimizer(cfg.recipe, model)
    net = ddp.wrap(model, d)
    speeds: dict[str, list[float]] = {name: [] for name in SETTINGS}
    for rnd in range(args.rounds + 1):  # round 0 warms up (oneDNN primitives, the first beats): not counted
        for name, interval in SETTINGS.items():
            beat = Heartbeat(beats, rank, world, interval, store_host=None) if interval else None
            here = replace(d, heartbeat=beat)
            batches.set_epoch(rnd)
            dist.barrier()
            start = time.perf_counter()
            for step, (x, y) in enumerate(batches, 1):
                here.set_phase("training", rnd + 1, step)
                with autocast(device, amp):
                    loss = F.cross_entropy(net(x), y)
                opt.zero_grad(set_to_none=True)
                loss.backward()
                opt.step()
            seconds = time.perf_counter() - start
            if beat:
                beat.stop("finished", culprit=False)
            if rnd:
                speeds[name].append(len(batches) * cfg.recipe.batch_size * world / seconds)
    if rank == 0:
        results.put(speeds)
    distributed.teardown(together=True)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--procs", type=int, default=2)
    p.add_argument("--rounds", type=int, default=12)
    p.add_argument("--steps", type=int, default=20, help="steps per setting per round")
    args = p.parse_args()
    store = rendezvous.host_store("127.0.0.1", 0, args.procs, timedelta(seconds=120))
    results = mp.get_context("spawn").SimpleQueue()
    mp.spawn(_rank, args=(args.procs, args, store.port, results), nprocs=args.procs, join=True)
    speeds = results.get()
    base = statistics.median(speeds["off"])
    print(f"-g {args.procs}, {args.rounds} rounds of {args.steps} steps per setting, interleaved; images/s (all ranks)")
    for name, values in speeds.items():
        med = statistics.median(values)
        print(f"  heartbeat {name:22s} median {med:8,.0f}  ({med / base:.3f}x off)  best {max(values):8,.0f}")


if __name__ == "__main__":
    main()
