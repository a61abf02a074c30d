"""Where a training step's time goes: data, forward, backward, all-reduce, optimizer.

Runs the real pieces (ShardedBatches, ConvNet, ddp.wrap's DDP settings, schedule.build_optimizer,
the per-device compute defaults) for a number of steps in 1 process and in G processes (gloo,
cores shared and pinned as distributed.join does), with a timer around each phase; on CUDA the
timers synchronise first. The all-reduce is timed by a DDP comm hook, from the moment the
gradient bucket is ready until the reduced gradients are back, and taken out of backward
(with one bucket for this tiny model nothing overlaps). Prints a table; asserts nothing.

    python benchmarks/profile_epoch.py                  # 1 and 2 processes, defaults
    python benchmarks/profile_epoch.py --amp off --no-channels-last --procs 1
"""

import argparse
import statistics
import time
from datetime import timedelta

import torch
import torch.multiprocessing as mp
import torch.nn.functional as F

from mnist_ddp.common.config import DataConfig, Dataset, TrainConfig, recipe
from mnist_ddp.core import compute, ddp, distributed, reduction, schedule
from mnist_ddp.core.batches import ShardedBatches
from mnist_ddp.core.compute import autocast
from mnist_ddp.data import datasets
from mnist_ddp.joining import identity, rendezvous
from mnist_ddp.model import ConvNet
from mnist_ddp.outputs import timeline

PHASES = ("data", "forward", "backward", "all-reduce", "optimizer")


class _Seconds(list):
    """Each bucket's all-reduce seconds, from the clock `mnist-ddp train --profile` puts on the comm hook."""

    def bucket(self, handed_over: float, back: float) -> None:
        self.append(back - handed_over)


def _load(name: Dataset) -> datasets.Dataset:
    try:
        return datasets.load(DataConfig(name, download=False))
    except datasets.DataNotFound:
        return datasets.load(DataConfig("synthetic"))


def _profile(rank: int, world: int, args: argparse.Namespace, port: int, results: "mp.SimpleQueue") -> None:
    device = distributed.pick_device(args.device, rank, world)  # cuda:<rank>, as worker.run_worker picks it
    if device.type == "cpu":  # as worker.run_worker does
        compute.share_cores(rank, world)
    compute.configure_backends(device, deterministic=False)  # cuDNN autotuning and TF32 on CUDA, as in training
    if args.threads:
        torch.set_num_threads(args.threads)
    d = distributed.join(identity.spawned(0, rank, world, 1, "127.0.0.1", port), device, None, 120)
    cfg = TrainConfig(recipe=recipe("default", amp=args.amp), channels_last=args.channels_last)
    amp, channels_last = compute.amp_for(cfg.recipe.amp, device), compute.channels_last_for(cfg.channels_last, device)
    data = _load(args.dataset)
    batches = ShardedBatches(data.train.images, data.train.labels, cfg.recipe.batch_size, rank=rank, world=world,
                             device=device, shuffle=True, channels_last=channels_last)
    model = ConvNet().to(device)
    if channels_last:
        model = model.to(memory_format=torch.channels_last)  # type: ignore[call-overload]  # not in torch's stubs
    opt, set_lr = schedule.build_optimizer(cfg.recipe, model)
    reduce_seconds, mean = _Seconds(), reduction.MeanReduction(world)
    clock = mean.observer = timeline.BucketClock(reduce_seconds.bucket, device)  # as --profile times it
    net = ddp.wrap(model, d, hook=mean)

    def tick() -> float:
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        return time.perf_counter()

    totals = dict.fromkeys(PHASES, 0.0)
    it = iter(batches)
    steps = min(args.steps + args.warmup, len(batches))
    for step in range(steps):
        if step == args.warmup:
            totals = dict.fromkeys(PHASES, 0.0)
            reduce_seconds.clear()
            t_start = tick()
        t0 = tick()
        clock.start(t0)  # on a GPU the clock's CUDA events are read from here
        x, y = next(it)
        t1 = tick()
        with autocast(device, amp):
            loss = F.cross_entropy(net(x), y)
        t2 = tick()
        opt.zero_grad(set_to_none=True)
        loss.backward()
        t3 = tick()
        clock.settle()
        opt.step()
        set_lr((step + 1) / steps)  # the lr for the next step, as the training loop sets it
        t4 = tick()
        for phase, seconds in zip(("data", "forward", "backward", "optimizer"), (t1 - t0, t2 - t1, t3 - t2, t4 - t3)):
            totals[phase] += seconds
    wall = tick() - t_start
    totals["all-reduce"] = sum(reduce_seconds)
    totals["backward"] -= totals["all-reduce"]  # backward() waited for it: one bucket, nothing overlaps
    results.put((rank, {k: v / args.steps for k, v in totals.items()}, wall / args.steps, torch.get_num_threads(),
                 amp, channels_last, cfg.recipe.batch_size))
    distributed.teardown(together=True)


def run(world: int, args: argparse.Namespace) -> None:
    ctx = mp.get_context("spawn")
    results = ctx.SimpleQueue()
    store = rendezvous.host_store("127.0.0.1", 0, world, timedelta(seconds=120)) if world > 1 else None
    mp.start_processes(_profile, args=(world, args, store.port if store else 0, results), nprocs=world,
                       start_method="spawn")
    got = sorted(results.get() for _ in range(world))
    _, _, _, threads, amp, channels_last, batch = got[0]
    per_rank = [phases for _, phases, _, *_ in got]
    step = statistics.mean(wall for _, _, wall, *_ in got)
    images_per_second = batch * world / step
    print(f"\n{world} process(es) x {threads} thread(s), amp {amp}, channels_last {channels_last}, batch {batch} "
          f"per process, {args.steps} steps (mean over ranks)")
    for phase in PHASES:
        ms = statistics.mean(p[phase] for p in per_rank) * 1e3
        print(f"  {phase:11s} {ms:7.2f} ms  {100 * ms / (step * 1e3):5.1f}%")
    other = step * 1e3 - sum(statistics.mean(p[ph] for p in per_rank) * 1e3 for ph in PHASES)
    print(f"  {'other':11s} {other:7.2f} ms  {100 * other / (step * 1e3):5.1f}%   (timers, Python between phases)")
    print(f"  step        {step * 1e3:7.2f} ms  -> {images_per_second:,.0f} images/s, "
          f"{60000 / images_per_second:.1f} s per 60k-image epoch (training only)")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--procs", type=int, nargs="+", default=[1, 2], help="process counts to profile")
    p.add_argument("--steps", type=int, default=200, help="timed steps per process")
    p.add_argument("--warmup", type=int, default=20, help="untimed steps first")
    p.add_argument("--dataset", default="fashion-mnist", help="falls back to synthetic if not found")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--amp", default="auto", choices=("auto", "off", "bf16"))
    p.add_argument("--channels-last", action=argparse.BooleanOptionalAction, default=None)
    p.add_argument("--threads", type=int, default=0, help="threads per process (0: its share of the cores)")
    args = p.parse_args()
    for world in args.procs:
        run(world, args)


if __name__ == "__main__":
    main()
