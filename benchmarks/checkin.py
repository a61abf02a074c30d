"""The check-in's cost: seconds until every rank of a world is in, with membership.py's check-in and without.

"Without" is what the ranks did before it (each set an arrival key and polled until all were there). Real
processes on loopback, one store hosted by this process as `-g N`'s launcher hosts it; both kinds run in the
same processes, round by round, alternating, so that a loaded machine slows both alike. Each round starts
all ranks together (a barrier over the store) and takes the time until the last rank is through. Prints
the medians and their difference; asserts nothing.

    python benchmarks/checkin.py                 # worlds 2, 4 and 8, 15 rounds each
    python benchmarks/checkin.py --worlds 16 --rounds 5
"""

import argparse
import statistics
import time
from datetime import timedelta

import torch.distributed as dist
import torch.multiprocessing as mp

from mnist_ddp.joining import membership, rendezvous
from mnist_ddp.joining.identity import Identity

KINDS = ("arrivals (before)", "check-in")
SETTINGS = {"seed": "0", "lr": "0.003"}  # a run's settings (config.run_settings gives a dozen)


def _arrivals(store: dist.Store, rank: int, world: int) -> None:
    """What the ranks did before the check-in: an arrival key each, polled for until all are there."""
    store.set(f"arrived/{rank}", "1")
    keys, pause = [f"arrived/{r}" for r in range(world)], 0.01
    while not store.check(keys):
        time.sleep(pause)
        pause = min(1.0, pause * 1.5)


def _barrier(store: dist.Store, rank: int, world: int) -> None:
    store.set(f"ready/{rank}", "1")
    while not store.check([f"ready/{r}" for r in range(world)]):
        time.sleep(0.001)


def _rank(rank: int, world: int, port: int, rounds: int, times: "mp.SimpleQueue") -> None:
    ident = Identity(rank=rank, world_size=world, local_world_size=world, store_host="parent",
                     master_port=port)
    creds = membership.Credentials(b"a secret", SETTINGS)
    store = rendezvous.connect(ident, timedelta(seconds=120))
    for r in range(rounds):
        for kind in KINDS:
            place = dist.PrefixStore(f"round{r}/{kind}", store)
            _barrier(place, rank, world)
            start = time.perf_counter()
            if kind == "check-in":
                deadline = time.monotonic() + 120
                entry = membership.check_in(place, ident, creds, deadline)
                membership.wait_for_all(place, ident, creds, entry, deadline)
            else:
                _arrivals(place, rank, world)
            times.put((r, kind, time.perf_counter() - start))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--worlds", type=int, nargs="+", default=[2, 4, 8])
    p.add_argument("--rounds", type=int, default=15)
    args = p.parse_args()
    print(f"{'world':>5s} {KINDS[0]:>18s} {KINDS[1]:>10s} {'difference':>11s}   (medians of {args.rounds} rounds: "
          f"seconds until the last rank is in)")
    for world in args.worlds:
        store = rendezvous.host_store("127.0.0.1", 0, world, timedelta(seconds=120))
        times = mp.get_context("spawn").SimpleQueue()
        procs = mp.start_processes(_rank, args=(world, store.port, args.rounds, times), nprocs=world, join=False,
                                   start_method="spawn")
        slowest: dict[tuple[int, str], float] = {}
        for _ in range(world * args.rounds * len(KINDS)):
            r, kind, seconds = times.get()
            slowest[r, kind] = max(slowest.get((r, kind), 0.0), seconds)
        procs.join()
        before, after = (statistics.median(slowest[r, k] for r in range(args.rounds)) for k in KINDS)
        print(f"{world:5d} {before:17.4f}s {after:9.4f}s {after - before:+10.4f}s")
        del store


if __name__ == "__main__":
    main()
