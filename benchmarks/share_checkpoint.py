"""What sharing rank 0's checkpoint costs: torch's pickling object broadcast against our bytes, side by side.

`--resume` has rank 0 read the checkpoint and every other rank get it from rank 0 (`Dist.from_main`). The old
way was `broadcast_object_list`: pickled on rank 0, unpickled with the full unpickler on the others (so whoever
poses as rank 0 runs code there), and it needs numpy. Ours: `checkpoint.pack` (torch.save bytes and a digest),
a length and a uint8 tensor over gloo, `checkpoint.unpack` (weights-only load, digest checked). Both are timed
in the same gloo group of `--world` processes, interleaved, from a barrier to the moment the slowest rank holds
the checkpoint; so is a small result (rank 0's look at --out: None). Also how a 400 kB tensor becomes bytes
without numpy. Medians in ms; asserts nothing. The old side needs numpy (the dev venv has it).

    python benchmarks/share_checkpoint.py [--world 2] [--repeats 30]
"""

import argparse
import ctypes
import importlib.util
import statistics
import time
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from checkpoint_cost import payload
from mnist_ddp.core import distributed
from mnist_ddp.joining import identity, rendezvous
from mnist_ddp.outputs import checkpoint

Found = tuple[Path, dict[str, Any]] | None  # what rank 0 shares: `checkpoint.pack`'s input, `unpack`'s output


def _old(d: distributed.Dist, value: Found) -> Found:
    """What `Dist.from_main` did before: one pickled object, (result, error), from rank 0."""
    box: list[tuple[Found, None] | None] = [(value, None) if d.is_main else None]
    dist.broadcast_object_list(box, src=0)
    sent = box[0]
    assert sent is not None  # every rank's box now holds rank 0's
    return sent[0]


def _rank(rank: int, world: int, port: int, repeats: int, results: "mp.SimpleQueue") -> None:
    torch.set_num_threads(1)
    d = distributed.join(identity.spawned(0, rank, world, 1, "127.0.0.1", port), torch.device("cpu"), "gloo", 60)
    torch.manual_seed(0)  # the same checkpoint on every rank: what arrives can be checked against it
    found = (Path("runs/x/checkpoint.pt"), payload())
    ways: dict[str, Callable[[], Found]] = {
        "checkpoint, pickled (broadcast_object_list)": lambda: _old(d, found),
        "checkpoint, bytes (pack, broadcast, unpack)": lambda: d.from_main(lambda: found, checkpoint.pack,
                                                                           checkpoint.unpack),
        "None, pickled": lambda: _old(d, None),
        "None, JSON bytes": lambda: d.from_main(lambda: None),
    }
    times: dict[str, list[float]] = {name: [] for name in ways}
    try:
        for rnd in range(repeats + 1):  # round 0 warms up: not counted
            for name, way in ways.items():
                dist.barrier()
                start = time.perf_counter()
                got = way()
                took = torch.tensor([time.perf_counter() - start], dtype=torch.float64)
                dist.all_reduce(took, op=dist.ReduceOp.MAX)  # the slowest rank's time
                if rnd:
                    times[name].append(1e3 * float(took))
                if rnd == 1 and got is not None:  # what arrived is what rank 0 had
                    assert checkpoint.digest(got[1]) == checkpoint.digest(found[1])
        if d.is_main:
            results.put((times, len(checkpoint.pack(found))))
    finally:
        distributed.teardown(together=True)


def _to_bytes(repeats: int) -> dict[str, float]:
    """A 400 kB uint8 tensor as bytes, three numpy-free ways: median µs."""
    t = torch.randint(0, 256, (400_000,), dtype=torch.uint8)

    def via_frombuffer() -> bytes:
        out = bytearray(t.numel())
        torch.frombuffer(out, dtype=torch.uint8).copy_(t)
        return bytes(out)
    ways = {"frombuffer + copy_ (ours)": via_frombuffer, "ctypes.string_at": lambda: ctypes.string_at(
        t.data_ptr(), t.numel()), "bytes(t.tolist())": lambda: bytes(t.tolist())}
    assert len({way() for way in ways.values()}) == 1
    times = {}
    for name, way in ways.items():
        samples = []
        for _ in range(max(3, repeats // (30 if "tolist" in name else 1))):
            start = time.perf_counter()
            way()
            samples.append(1e6 * (time.perf_counter() - start))
        times[name] = statistics.median(samples)
    return times


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--world", type=int, default=2)
    p.add_argument("--repeats", type=int, default=30)
    args = p.parse_args()
    if importlib.util.find_spec("numpy") is None:
        raise SystemExit("the pickled side needs numpy (broadcast_object_list calls tensor.numpy()); run this in the "
                         "dev venv")
    store = rendezvous.host_store("127.0.0.1", 0, args.world, timedelta(seconds=60))
    results = mp.get_context("spawn").SimpleQueue()
    mp.spawn(_rank, args=(args.world, store.port, args.repeats, results), nprocs=args.world)
    times, size = results.get()
    print(f"world {args.world}, checkpoint of {size / 1e3:,.0f} kB as packed, {args.repeats} rounds, median ms of "
          f"the slowest rank")
    medians = {name: statistics.median(v) for name, v in times.items()}
    for name, ms in medians.items():
        print(f"  {name:46s} {ms:8.2f} ms")
    names = list(medians)
    for old, new in ((names[0], names[1]), (names[2], names[3])):
        print(f"  {new.split(',')[0]}: ours / pickled = {medians[new] / medians[old]:.2f}x")
    print("a 400 kB tensor as bytes, median µs:")
    for name, us in _to_bytes(args.repeats).items():
        print(f"  {name:28s} {us:10.1f} µs")


if __name__ == "__main__":
    main()
