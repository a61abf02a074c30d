"""Start-up: seconds from launching `mnist-ddp train` to its first training step, against one epoch.

Runs the real command (synthetic 60k/10k, generated once into a shared cache first) for 1 process,
`-g 2`, `-g 4` and, as root with iproute2, two network namespaces joined by a veth pair (`-n 2 -g 2`,
one launcher in each: two "machines"). Each run's output is read line by line as it comes: launch →
`data:` (imports, starting the processes, the process group, reading the data) → `run:` (the model and
its optimizer: the last line before the first step), with the CPU seconds its processes (node 0's) used
until then, and the run is stopped there (SIGTERM, which it
takes as Ctrl-C). `--src A B` compares source trees (e.g. a `git archive` of main's) run by run,
interleaved, so that a loaded machine slows both alike. Then one whole epoch per setting, with the last
tree, for the ratio start-up / epoch (training only, from metrics.jsonl). `--cold`: every run gets an empty
data folder, as on a new machine, so the synthetic set is made before the first step. Prints a table; asserts
nothing.

    python benchmarks/startup.py                        # this tree, 3 rounds
    python benchmarks/startup.py --src /tmp/main/src src --rounds 5
    python benchmarks/startup.py --src /tmp/main/src src --configs "-g 4" --cold
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
from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext
from pathlib import Path

from scaling import _netns_unavailable, _stop, two_machines

SAMPLES = ("--dataset", "synthetic", "--train-samples", "60000", "--test-samples", "10000")
RUN = ("train", *SAMPLES, "--epochs", "1", "--no-progress", "--no-plots")
TWO_NAMESPACES = "2 namespaces, -n 2 -g 2"
CONFIGS = {"1 process": (), "-g 2": ("-g", "2"), "-g 4": ("-g", "4"), TWO_NAMESPACES: ()}
NET = "10.80.0"  # only inside the namespaces this script creates


def _command(src: Path, data: Path, out: Path, extra: tuple[str, ...]) -> list[str]:
    return [sys.executable, "-c", f"import sys; sys.path.insert(0, {str(src)!r}); from mnist_ddp.cli import console; "
            "console()", *RUN, "--data-dir", str(data), "--out", str(out), *extra]


def _session_cpu(session: int) -> float:
    """CPU seconds used so far by the live processes of a session (a launcher, its fork server, its workers):
    unlike wall time, hardly changed by other work on the machine."""
    total = 0
    for entry in Path("/proc").iterdir():
        try:
            fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue
        if entry.name.isdigit() and int(fields[3]) == session:  # after ")": state ppid pgrp session ...
            total += int(fields[11]) + int(fields[12])  # utime, stime
    return total / os.sysconf("SC_CLK_TCK")


def _timed(cmd: list[str], env: dict[str, str], whole: bool) -> dict[str, float]:
    """Seconds from launch to the `data:` and `run:` lines of one run, and the CPU seconds its processes
    used until `run:`; stopped there unless `whole`."""
    start = time.perf_counter()
    seen: dict[str, float] = {}
    log = []
    p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env,
                         start_new_session=True)
    try:
        assert p.stdout is not None
        for line in p.stdout:
            log.append(line)
            mark = line.split(" ")[0]
            if mark in ("data:", "run:") and mark not in seen:
                seen[mark] = time.perf_counter() - start
                if mark == "run:":
                    seen["cpu"] = _session_cpu(p.pid)
            if mark == "run:" and not whole:
                break
    finally:
        if not whole and p.poll() is None:
            os.killpg(p.pid, signal.SIGTERM)  # the launcher and its workers stop as on Ctrl-C
        p.wait(timeout=600)
    if (whole and p.returncode != 0) or len(seen) < 2:
        raise SystemExit(f"`{' '.join(cmd)}` failed (exit {p.returncode}):\n{''.join(log)}")
    return {"data": seen["data:"], "first step": seen["run:"], "cpu": seen["cpu"]}


def _one(src: Path, config: str, data: Path | None, work: Path, places: list, whole: bool = False) -> dict[str, float]:
    """One run of `config` with the package in `src`: its start-up, and its epoch's seconds if `whole`. `data`
    None: a data folder of its own, empty."""
    out = Path(tempfile.mkdtemp(dir=work))
    data = data or out / "data"
    # PYTHONPATH too: the fork server of Python 3.11 imports its preload from its own default path (it ignores the
    # launcher's sys.path), which an editable install points at the checkout's own src.
    env = os.environ | {"PYTHONUNBUFFERED": "1", "PYTHONPATH": str(src)}
    if config != TWO_NAMESPACES:
        result = _timed(_command(src, data, out / "run", CONFIGS[config]), env, whole)
    else:
        (_, _, master), port = places[0], "29581"
        flags = ("-n", "2", "-g", "2", "--master-addr", master, "--master-port", port)
        other = subprocess.Popen([*places[1][0], *_command(src, data, out / "node1", (*flags, "-nr", "1"))],
                                 stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=env, start_new_session=True)
        try:
            result = _timed([*places[0][0], *_command(src, data, out / "run", (*flags, "-nr", "0"))], env, whole)
        finally:
            if not whole:
                os.killpg(other.pid, signal.SIGTERM)
            other.wait(timeout=600)
    if not whole:
        return result
    metrics = [json.loads(line) for line in (out / "run" / "metrics.jsonl").read_text().splitlines()]
    return result | {"epoch": metrics[0]["epoch_seconds"]}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--src", type=Path, nargs="+", default=[Path(__file__).resolve().parents[1] / "src"],
                   help="source trees (folders holding mnist_ddp/) to compare")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--configs", nargs="+", default=list(CONFIGS), choices=list(CONFIGS))
    p.add_argument("--cold", action="store_true", help="no data cache: each run makes the synthetic set first")
    args = p.parse_args()
    signal.signal(signal.SIGTERM, _stop)  # namespaces deleted, runs stopped, as on Ctrl-C
    configs = list(args.configs)
    why = _netns_unavailable()
    if TWO_NAMESPACES in configs and why:
        print(f"skipping {TWO_NAMESPACES}: {why}")
        configs.remove(TWO_NAMESPACES)
    # the places (command prefix, link, address) and scaling's shape(rate); none without the namespaces
    namespaces: AbstractContextManager[tuple[list[tuple[list[str], str, str]], Callable[[float | None], None] | None]]
    namespaces = two_machines(NET, f"prof{os.getpid()}") if TWO_NAMESPACES in configs else nullcontext(([], None))
    with tempfile.TemporaryDirectory(prefix="startup-") as tmp, namespaces as (places, _):
        work, data = Path(tmp), Path(tmp) / "data"
        _timed(_command(args.src[-1], data, work / "warm", ()), os.environ.copy(), False)  # fills the data cache
        results: dict[tuple[str, str], list[dict[str, float]]] = {}
        for r in range(args.rounds):
            for config in configs:
                for src in args.src:
                    got = _one(src, config, None if args.cold else data, work, places)
                    results.setdefault((str(src), config), []).append(got)
                    print(f"round {r + 1} {config:24s} {src}: " + ", ".join(f"{k} {v:.2f} s" for k, v in got.items()),
                          flush=True)
        epochs = {config: _one(args.src[-1], config, data, work, places, whole=True)["epoch"] for config in configs}
    print(f"\nmedians of {args.rounds} rounds{', each with an empty data folder' if args.cold else ''}: launch -> the "
          f"data: line, -> the run: line (the first step); one epoch's training seconds with {args.src[-1]}")
    print(f"{'run':24s} {'source':32s} {'data':>7s} {'first step':>11s} {'CPU s':>7s} {'epoch':>7s} "
          f"{'start/epoch':>12s}")
    for (src, config), rows in results.items():
        data_s, first, cpu = (statistics.median(r[k] for r in rows) for k in ("data", "first step", "cpu"))
        print(f"{config:24s} {src[-32:]:32s} {data_s:6.2f}s {first:10.2f}s {cpu:6.1f}s {epochs[config]:6.2f}s "
              f"{first / epochs[config]:11.2f}x")


if __name__ == "__main__":
    main()
