"""DDP from a process that has used torch, as a notebook kernel has: forked from it, or started by our fork server.

Accelerate's `notebook_launcher` (and Lightning's "ddp_notebook") start their workers with
`torch.multiprocessing.start_processes(..., start_method="fork")`: each worker is a copy of the kernel, with
whatever the kernel did to torch. `mnist_ddp.train(processes=2)` starts them from its fork server, a fresh
interpreter exec'd before any of that (forkserver.py). Both sides here run the same worker
(`launch._spawned`: rank 0's output relayed to the launcher, the process group, one epoch), from the same
caller, in a fresh subprocess each, in one of three states:

    fresh    torch imported, nothing else
    touched  set_num_threads(2), a forward, backward and optimizer step of the ConvNet (intra-op threads ran)
    group    touched, and a gloo process group of one still initialised (a cell that tried torch.distributed)

and prints, per side and state, whether the run finished and the seconds from the launch to its first step
(the `run:` line, printed just before it) and to its end. Rounds are interleaved (fork, ours, fork, ours, …)
so that a loaded machine slows both alike. Asserts nothing.

CUDA, the case that notebook users hit, is argued from torch's code rather than measured where there is no
GPU: a CUDA call in the kernel sets torch.cuda's `_initialized`; in a forked child `_after_fork` turns that
into `_in_bad_fork`, and the child's first CUDA call fails in `_lazy_init` with "Cannot re-initialize CUDA
in forked subprocess". The fork server was exec'd fresh and its preload makes no CUDA call
(tests/test_notebook.py checks the preload), so our workers initialise CUDA as a fresh process does.
`--cuda` adds that state (`torch.ones(1, device="cuda")` first) where a GPU is present.

    python benchmarks/notebook_launch.py [--rounds 3] [--samples 6000]
"""

import argparse
import os
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any, Literal, Required, TypedDict, cast

STATES = ("fresh", "touched", "group")
SIDES = ("fork", "ours")
HANG_S = 120  # a side that has not finished by then is reported as hung, and killed
# Seconds from a launch to its first step, to its end; again: from a second launch to its first step.
Column = Literal["first step", "end", "again"]
# One run: whether it finished, else why not; where it did, each Column's seconds.
Timed = TypedDict("Timed", {"ok": Required[bool], "why": Required[str], "first step": float, "end": float,
                            "again": float}, total=False)


def _touch(state: str) -> None:
    """Put this process in `state`, as a notebook's earlier cells would."""
    import torch

    if state == "fresh":
        return
    if state == "cuda":
        torch.ones(1, device="cuda")
    from mnist_ddp.model import ConvNet

    torch.set_num_threads(2)
    model = ConvNet()
    opt = torch.optim.AdamW(model.parameters())
    model(torch.rand(256, 1, 28, 28)).sum().backward()
    opt.step()
    if state == "group":
        import torch.distributed as dist

        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
        dist.all_reduce(torch.ones(1))


def _fork_launch(cfg: Any) -> None:
    """notebook_launcher's way: the same worker as `train(processes=2)`, started by forking this process."""
    from datetime import timedelta

    import torch.multiprocessing as mp

    from mnist_ddp.common import console
    from mnist_ddp.joining import rendezvous
    from mnist_ddp.launchers import launch
    from mnist_ddp.outputs import outdir

    with outdir.claim(Path(cfg.out), False), console.relay() as output:
        store = rendezvous.host_store("127.0.0.1", 0, 2, timedelta(seconds=cfg.timeout))
        errors = mp.get_context("fork").SimpleQueue()
        environ = dict(os.environ)

        def spawned(local_rank: int) -> None:
            """launch._spawned, called here so that mypy checks the call against its signature (an args=(…) tuple is
            not checked). One node, no --recover: no standby store, as launch.spawn passes; `reports` is only .put."""
            launch._spawned(local_rank, cfg, "127.0.0.1", store.port, cast(launch.ErrorPipe, errors), output, environ,
                            None)

        try:
            mp.start_processes(spawned, nprocs=2, start_method="fork")
        except mp.ProcessExitedException:
            while not errors.empty():  # what our own launcher would have raised
                print(f"worker error: {errors.get()}", flush=True)
            raise


def _side(side: str, state: str, samples: int, out: str) -> None:
    """One run, in this (fresh) process: get into `state`, then launch two processes `side`'s way."""
    _touch(state)
    from mnist_ddp import api, cli

    for again in ("", "-again"):  # a second launch from the same process: a notebook's next cell
        options = {"processes": 2, "dataset": "synthetic", "train_samples": samples, "test_samples": 1000,
                   "epochs": 1, "progress": False, "plots": False, "out": out + again}
        print(f"launch: {time.monotonic()}", flush=True)
        if side == "ours":
            api.train(**options)
        else:
            _fork_launch(cli.configure(api.command_line("train", options)))
        print(f"done: {time.monotonic()}", flush=True)


def _timed(side: str, state: str, samples: int, work: Path) -> Timed:
    """Run one side in a fresh subprocess; its seconds from the launch to the first step and to the end."""
    out = tempfile.mkdtemp(dir=work)
    cmd = [sys.executable, __file__, "--side", side, "--state", state, "--samples", str(samples), "--out",
           f"{out}/run"]
    p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=work,
                         env=os.environ | {"PYTHONUNBUFFERED": "1"}, start_new_session=True)
    lines: list[tuple[float, str]] = []  # (when it arrived, the line)
    stdout = p.stdout
    assert stdout is not None  # stdout=PIPE
    reader = threading.Thread(target=lambda: lines.extend((time.monotonic(), line) for line in stdout))
    reader.start()
    try:
        p.wait(HANG_S)
        hung = False
    except subprocess.TimeoutExpired:
        os.killpg(p.pid, signal.SIGKILL)
        p.wait()
        hung = True
    reader.join()
    seen: dict[str, list[float]] = {"launch:": [], "run:": [], "done:": []}
    for arrived, line in lines:
        word = line.split(" ")[0]
        if word in ("launch:", "done:"):
            seen[word].append(float(line.split()[1]))  # the child's time.monotonic(): the same clock as this one's
        elif word == "run:":
            seen[word].append(arrived)
    ok = not hung and p.returncode == 0 and len(seen["done:"]) == 2
    launch, run, done = seen["launch:"], seen["run:"], seen["done:"]
    timed: Timed = {"ok": ok, "why": "hung" if hung else "" if ok else _cause([line for _, line in lines])}
    if ok:
        timed.update({"first step": run[0] - launch[0], "end": done[0] - launch[0], "again": run[1] - launch[1]})
    return timed


def _cause(log: list[str]) -> str:
    """The line of a failed run's output that says why: its last error line."""
    errors = [line.strip() for line in log if line.startswith("worker error:")] or [
        line.strip() for line in log if "Error" in line or "error:" in line]
    return (errors[-1] if errors else (log[-1].strip() if log else "no output"))[:160]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--samples", type=int, default=6000, help="training images of each run's one epoch")
    p.add_argument("--cuda", action="store_true", help="also the state that made a CUDA tensor first (needs a GPU)")
    p.add_argument("--side", choices=SIDES, help=argparse.SUPPRESS)  # one run, in a subprocess of the driver
    p.add_argument("--state", help=argparse.SUPPRESS)
    p.add_argument("--out", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.side:
        return _side(args.side, args.state, args.samples, args.out)
    states = (*STATES, "cuda") if args.cuda else STATES
    results: dict[tuple[str, str], list[Timed]] = {}
    with tempfile.TemporaryDirectory(prefix="notebook-launch-") as tmp:
        _timed("ours", "fresh", 200, Path(tmp))  # fills the synthetic data cache, outside the measured runs
        for r in range(args.rounds):
            for state in states:
                for side in SIDES:
                    got = _timed(side, state, args.samples, Path(tmp))
                    results.setdefault((state, side), []).append(got)
                    print(f"round {r + 1} {state:8s} {side:5s} " + (
                        f"ok, first step after {got['first step']:.2f} s, done after {got['end']:.2f} s; launched "
                        f"again: first step after {got['again']:.2f} s" if got["ok"] else f"FAILED: {got['why']}"),
                          flush=True)
    columns: tuple[Column, ...] = ("first step", "end", "again")
    print(f"\n{'state':8s} {'side':5s} {'finished':>9s} {'first step':>11s} {'end':>8s} {'again':>8s}  (medians of "
          f"finished runs; again: the first step of a second launch from the same process)")
    for (state, side), rows in results.items():
        done = [r for r in rows if r["ok"]]
        cells = [f"{statistics.median(r[c] for r in done):.2f}s" if done else "-" for c in columns]
        print(f"{state:8s} {side:5s} {len(done):>4d} of {len(rows)} {cells[0]:>11s} {cells[1]:>8s} {cells[2]:>8s}")
        for why in sorted({re.sub(r"\d+", "N", str(r["why"])) for r in rows if not r["ok"]}):  # ranks, ports: N
            print(f"{'':15s}failed: {why}")
    for state in states:
        fork, ours = ([r for r in results[(state, side)] if r["ok"]] for side in SIDES)
        compared: tuple[Column, ...] = ("first step", "again") if fork and ours else ()
        for column in compared:
            ratio = statistics.median(r[column] for r in fork) / statistics.median(r[column] for r in ours)
            print(f"{state}: launch to first step{' (again)' if column == 'again' else ''}, fork / ours = {ratio:.2f}x")


if __name__ == "__main__":
    main()
