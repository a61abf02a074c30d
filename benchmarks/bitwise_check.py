"""What --bitwise promises, shown on this machine's device: SHA-256 of saved models side by side. Prints; asserts
nothing (the tests assert on CPU: tests/test_bitwise.py).

    python benchmarks/bitwise_check.py                  # CPU: worlds 1, 2, 4 (~1 min)
    python benchmarks/bitwise_check.py --device cuda    # one GPU: world 1 (gpu_check.py runs these too)

Every run is the same chaotic recipe (fp32 SGD, lr 0.05, momentum 0.9, 2 epochs of 30 synthetic steps) with
--bitwise, except where a line says otherwise:
- `--accumulate 4 --batch-size 16`, twice in one process: the same run must save the same bytes (on a GPU
  that is what deterministic algorithms buy: cuDNN's autotuning and atomics would change them run to run);
  on a CPU also at `-g 2 --accumulate 2` and `-g 4`;
- `--accumulate 2 --batch-size 32`: the same images per step, NOT the same run, so other bytes. A run is
  defined by its M micro-batches of B: slot j holds the samples rank j of a world of M would take, and
  BatchNorm normalises each micro-batch on its own, so 2 micro-batches of 32 normalise other groups of
  samples than 4 of 16: another function of the weights, not the same sum in another order;
- DDP's mean reduction (no --bitwise), twice: equal or not, it promises nothing (on a GPU, cuDNN autotunes).
"""

import argparse
import os
import subprocess
import sys
import tempfile
from pathlib import Path

from mnist_ddp.joining import identity
from mnist_ddp.outputs import checkpoint

RECIPE = ["--dataset", "synthetic", "--train-samples", "960", "--test-samples", "100", "--epochs", "2",
          "--optimizer", "sgd", "--lr", "0.05", "--momentum", "0.9", "--scheduler", "none", "--amp", "off",
          "--no-progress", "--no-plots"]


def model_hash(out: Path) -> str:
    """SHA-256 of every tensor of the saved model's state_dict, buffers included (checkpoint.digest)."""
    return checkpoint.digest(checkpoint.load(out / "checkpoint.pt")["model"])


def train(out: Path, device: str, args: list[str]) -> str:
    env = identity.without_launcher_vars(os.environ) | {"PYTHONUNBUFFERED": "1"}
    r = subprocess.run([sys.executable, "-m", "mnist_ddp", "train", *RECIPE, "--device", device, *args, "--out",
                        str(out)], env=env, capture_output=True, text=True)
    if r.returncode:
        raise SystemExit(f"bitwise_check: `{' '.join(args)}` failed ({r.returncode}):\n{r.stdout}{r.stderr}")
    return model_hash(out)


def runs(device: str) -> dict[str, list[str]]:
    """name → flags. Several processes only on CPU: one GPU holds one rank."""
    same = {"--accumulate 4 --batch-size 16": ["--accumulate", "4", "--batch-size", "16", "--bitwise"],
            "the same, again": ["--accumulate", "4", "--batch-size", "16", "--bitwise"]}
    if device == "cpu":
        same |= {"-g 2 --accumulate 2": ["-g", "2", "--accumulate", "2", "--batch-size", "16", "--bitwise"],
                 "-g 4": ["-g", "4", "--batch-size", "16", "--bitwise"]}
    return same | {"--accumulate 2 --batch-size 32 (another run)": ["--accumulate", "2", "--batch-size", "32",
                                                                   "--bitwise"],
                   "DDP's mean, --accumulate 4": ["--accumulate", "4", "--batch-size", "16"],
                   "DDP's mean, again": ["--accumulate", "4", "--batch-size", "16"]}


def verdict(device: str, hashes: dict[str, str]) -> str:
    """What the hashes of `runs(device)` show, in one line."""
    same = [h for name, h in hashes.items() if "another" not in name and "mean" not in name]
    other = hashes["--accumulate 2 --batch-size 32 (another run)"]
    means = {h for name, h in hashes.items() if "mean" in name}
    return (f"bitwise_check ({device}): {len(same)} runs of the same run saved "
            f"{'the same bytes' if len(set(same)) == 1 else f'{len(set(same))} different ones'}; 2 micro-batches of "
            f"32 {'differ, as they must' if other not in same else 'DID NOT differ'}; DDP's mean twice: "
            f"{'equal' if len(means) == 1 else 'different'} (not promised)")


def check(device: str, folder: Path) -> dict[str, str]:
    """Train every run of `runs(device)` into `folder`; print and return name → model hash."""
    hashes = {}
    for i, (name, args) in enumerate(runs(device).items()):
        hashes[name] = train(folder / f"run{i}", device, args)
        print(f"  {name:46s} {hashes[name]}", flush=True)
    print(verdict(device, hashes))
    return hashes


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    a = p.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        check(a.device, Path(tmp))


if __name__ == "__main__":
    main()
