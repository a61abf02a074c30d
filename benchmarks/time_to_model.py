"""Time to a trained model: what a run spends outside its epochs, source trees side by side.

Runs `mnist-ddp train --dataset fashion-mnist` (the default recipe: 2 epochs, plots on, as a user runs it) with
each source tree in turn, round after round, so that a busy machine slows both alike. For each run: the wall time
from launch to exit, to the `final:` line, the epochs' seconds (metrics.jsonl's epoch_seconds: training and
evaluation), the rest (wall − epochs: start, data, the model's set-up, outputs, exit) and, where the tree
writes one, the run's own split (timing.jsonl); and whether every run saved the same model (SHA-256 of its
state). Then the synthetic digits (60k + 10k) made by each tree's generator, interleaved too, and whether
their bytes are the same. Prints medians, the spread and the ratios; asserts nothing.

    python benchmarks/time_to_model.py --src /tmp/base/src src            # 3 rounds
    python benchmarks/time_to_model.py --src /tmp/base/src src --rounds 5 --only synthetic
"""

import argparse
import hashlib
import importlib.util
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import bitwise_check  # beside this file: the saved model's SHA-256 (it imports mnist_ddp from this checkout)
from mnist_ddp.data import idx

RUN = ("train", "--dataset", "fashion-mnist")
PARTS = ("start", "join", "data", "warm-up", "training", "evaluation", "outputs")


def one_run(src: Path, out: Path, extra: list[str]) -> dict[str, Any]:
    """One `mnist-ddp train` with the package in `src`: its times, and its own split where it writes one."""
    cmd = [sys.executable, "-c", f"import sys; sys.path.insert(0, {str(src)!r}); from mnist_ddp.cli import console; "
           "console()", *RUN, "--out", str(out), *extra]
    began = time.perf_counter()
    p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True,
                         env=os.environ | {"PYTHONUNBUFFERED": "1", "PYTHONPATH": str(src)})  # see startup.py
    final = None
    assert p.stdout is not None
    for line in p.stdout:
        if line.startswith("final: "):
            final = time.perf_counter() - began
    if p.wait() != 0 or final is None:
        raise SystemExit(f"`{' '.join(cmd)}` failed (exit {p.returncode})")
    wall = time.perf_counter() - began
    epochs = sum(json.loads(line)["epoch_seconds"] for line in (out / "metrics.jsonl").read_text().splitlines())
    timed = out / "timing.jsonl"
    split = json.loads(timed.read_text().splitlines()[-1]) if timed.is_file() else {}
    return {"wall": wall, "final": final, "epochs": epochs, "outside": wall - epochs, **split,
            "model": bitwise_check.model_hash(out)}


def generator(src: Path) -> Any:
    """The synthetic module of the tree in `src`, loaded under its own name."""
    path = src / "mnist_ddp" / "data" / "synthetic.py"
    if not path.is_file():  # a tree from before the datasets moved into mnist_ddp/data/
        path = src / "mnist_ddp" / "synthetic.py"
    spec = importlib.util.spec_from_file_location(f"synthetic_{abs(hash(src))}", path)
    assert spec and spec.loader
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def spread(values: list[float]) -> str:
    return f"{statistics.median(values):6.2f} ({min(values):.2f}-{max(values):.2f})"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--src", type=Path, nargs="+", default=[Path(__file__).resolve().parents[1] / "src"],
                   help="source trees (folders holding mnist_ddp/), the baseline first")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--only", choices=("fashion", "synthetic"), help="one of the two comparisons")
    p.add_argument("--extra", default="", help="more flags for every run, e.g. '--no-plots'")
    args = p.parse_args()
    names = [str(src) for src in args.src]
    if args.only != "synthetic":
        runs: dict[str, list[dict[str, Any]]] = {name: [] for name in names}
        with tempfile.TemporaryDirectory(prefix="time-to-model-") as tmp:
            for r in range(args.rounds):
                for src, name in zip(args.src, names):
                    got = one_run(src, Path(tmp) / f"{r}-{len(runs[name])}-{src.parent.name}", args.extra.split())
                    runs[name].append(got)
                    print(f"round {r + 1} {name}: " + ", ".join(f"{k} {v:.2f}" for k, v in got.items() if k != "model"),
                          flush=True)
        print(f"\nmedians (min-max) of {args.rounds} rounds, seconds: mnist-ddp train {' '.join(RUN[1:])} "
              f"{args.extra}")
        print(f"{'source':40s} {'wall':>18s} {'final: line':>18s} {'epochs':>18s} {'wall - epochs':>18s}")
        for name, rows in runs.items():
            print(f"{name[-40:]:40s} " + " ".join(f"{spread([r[k] for r in rows]):>18s}"
                                                  for k in ("wall", "final", "epochs", "outside")))
            if all(part in rows[0] for part in PARTS):
                print(f"{'':40s} its split: " + " + ".join(
                    f"{part} {statistics.median(r[part] for r in rows):.2f}" for part in PARTS)
                    + f" = {statistics.median(r['total'] for r in rows):.2f}, then the exit "
                    f"{statistics.median(r['wall'] - r['total'] for r in rows):.2f}")
        models = {r["model"] for rows in runs.values() for r in rows}
        print(f"saved models: {'one SHA-256, ' + next(iter(models)) if len(models) == 1 else f'{len(models)} DIFFER'}")
        if len(names) > 1:
            base, last = runs[names[0]], runs[names[-1]]
            for k in ("wall", "final", "outside"):
                print(f"{k}: {statistics.median(r[k] for r in last) / statistics.median(r[k] for r in base):.2f}x "
                      f"of the baseline's (medians)")
    if args.only != "fashion":
        made: dict[str, list[float]] = {name: [] for name in names}
        modules = [generator(src) for src in args.src]
        digests = set()
        for _ in range(args.rounds):
            for module, name in zip(modules, names):
                began = time.perf_counter()
                train, test = module.generate(60_000, 20_240_601), module.generate(10_000, 20_240_602)
                made[name].append(time.perf_counter() - began)
                digests.add(hashlib.sha256(b"".join(idx.encode(t) for t in (*train, *test))).hexdigest())
        print(f"\nsynthetic digits, 60k + 10k, medians (min-max) of {args.rounds} rounds, seconds; "
              f"{'the same bytes' if len(digests) == 1 else 'DIFFERENT BYTES'} (SHA-256 of images and labels)")
        for name, seconds in made.items():
            print(f"{name[-40:]:40s} {spread(seconds)}")
        if len(names) > 1:
            print(f"ratio: {statistics.median(made[names[-1]]) / statistics.median(made[names[0]]):.2f}x "
                  f"of the baseline's")


if __name__ == "__main__":
    main()
