"""Start-up: seconds from launching `mnist-ddp train` to its first training step, against one epoch.

Runs the real command (synthetic 60k/10k, one epoch, generated once into a shared cache first) for
1 process, `-g 2`, `-g 4` and, as root with iproute2, two network namespaces joined by a veth pair
(`-n 2 -g 2`, one launcher in each: two "machines"). Each run's output is read line by line as it
comes: launch → `data:` (imports, starting the processes, the process group, reading the data)
→ `run:` (the model and its optimizer, the last thing before the first step). The epoch's seconds
come from metrics.jsonl. `--src A B` compares source trees (e.g. a `git archive` of main's) run by
run, interleaved, so that a loaded machine slows both alike. Prints a table; asserts nothing.

    python benchmarks/startup.py                        # this tree, 2 rounds
    python benchmarks/startup.py --src /tmp/main/src src --rounds 3
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
from contextlib import nullcontext
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


def _timed(cmd: list[str], env: dict[str, str]) -> dict[str, float]:
    """Seconds from launch to the `data:` and `run:` lines, and to the exit, of one run."""
    start = time.perf_counter()
    seen: dict[str, float] = {}
    with subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env) as p:
        assert p.stdout is not None
        log = []
        for line in p.stdout:
            log.append(line)
            for mark in ("data:", "run:"):
                if line.startswith(mark) and mark not in seen:
                    seen[mark] = time.perf_counter() - start
    if p.returncode != 0 or len(seen) < 2:
        raise SystemExit(f"`{' '.join(cmd)}` failed (exit {p.returncode}):\n{''.join(log)}")
    return {"data": seen["data:"], "first step": seen["run:"], "exit": time.perf_counter() - start}


def _one(src: Path, config: str, data: Path, work: Path, places: list | None) -> dict[str, float]:
    out = Path(tempfile.mkdtemp(dir=work))
    env = os.environ | {"PYTHONUNBUFFERED": "1"}
    if config != TWO_NAMESPACES:
        result = _timed(_command(src, data, out / "run", CONFIGS[config]), env)
    else:
        assert places is not None
        (_, _, master), port = places[0], "29581"
        flags = ("-n", "2", "-g", "2", "--master-addr", master, "--master-port", port)
        other = subprocess.Popen([*places[1][0], *_command(src, data, out / "node1", (*flags, "-nr", "1"))],
                                 stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=env)
        try:
            result = _timed([*places[0][0], *_command(src, data, out / "run", (*flags, "-nr", "0"))], env)
        finally:
            other.wait(timeout=600)
    metrics = [json.loads(line) for line in (out / "run" / "metrics.jsonl").read_text().splitlines()]
    return result | {"epoch": metrics[0]["epoch_seconds"]}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--src", type=Path, nargs="+", default=[Path(__file__).resolve().parents[1] / "src"],
                   help="source trees (folders holding mnist_ddp/) to compare")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--configs", nargs="+", default=list(CONFIGS), choices=list(CONFIGS))
    args = p.parse_args()
    signal.signal(signal.SIGTERM, _stop)  # namespaces deleted, runs stopped, as on Ctrl-C
    configs = list(args.configs)
    why = _netns_unavailable()
    if TWO_NAMESPACES in configs and why:
        print(f"skipping {TWO_NAMESPACES}: {why}")
        configs.remove(TWO_NAMESPACES)
    namespaces = two_machines(NET, f"prof{os.getpid()}") if TWO_NAMESPACES in configs else nullcontext(([], None))
    with tempfile.TemporaryDirectory(prefix="startup-") as tmp, namespaces as (places, _):
        work, data = Path(tmp), Path(tmp) / "data"
        _timed(_command(args.src[0], data, work / "warm", ("--epochs", "1")), os.environ.copy())  # the data cache
        results: dict[tuple[str, str], list[dict[str, float]]] = {}
        for r in range(args.rounds):
            for config in configs:
                for src in args.src:
                    got = _one(src, config, data, work, places)
                    results.setdefault((str(src), config), []).append(got)
                    print(f"round {r + 1} {config:24s} {src}: " + ", ".join(f"{k} {v:.2f} s" for k, v in got.items()),
                          flush=True)
    print("\nmedians over rounds: launch -> data: line, -> first step (the run: line), the epoch (training only)")
    print(f"{'run':24s} {'source':40s} {'data':>7s} {'first step':>11s} {'epoch':>7s} {'start/epoch':>12s}")
    for (src, config), rows in results.items():
        med = {k: statistics.median(r[k] for r in rows) for k in rows[0]}
        print(f"{config:24s} {src[-40:]:40s} {med['data']:6.2f}s {med['first step']:10.2f}s {med['epoch']:6.2f}s "
              f"{med['first step'] / med['epoch']:11.2f}x")


if __name__ == "__main__":
    main()
