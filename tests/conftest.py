"""Shared test helpers: run the real CLI in a subprocess, on tiny synthetic data."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
SHARED = REPO.parent / "shared"
MNIST_T10K = SHARED / "data" / "mnist-t10k"
FASHION = Path("/usr/share/datasets/fashion-mnist")

# A run that takes a few seconds: 800 synthetic training images, one epoch.
TINY = ["--dataset", "synthetic", "--train-samples", "800", "--test-samples", "200", "--epochs", "1",
        "--no-progress", "--no-plots"]


def cli_env(extra: dict[str, str] | None = None) -> dict[str, str]:
    """The environment for a child: no inherited launcher variables, src/ importable."""
    env = {k: v for k, v in os.environ.items()
           if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
           and not k.startswith(("SLURM_", "TORCHELASTIC_"))}
    env["PYTHONPATH"] = str(REPO / "src") + os.pathsep + env.get("PYTHONPATH", "")
    env["PYTHONUNBUFFERED"] = "1"
    return env | (extra or {})


def run_cli(*args: str, cwd: Path | None = None, timeout: float = 180, env: dict[str, str] | None = None,
            module: str = "mnist_ddp") -> subprocess.CompletedProcess:
    """`python -m mnist_ddp ARGS` as a user would run it; output captured as text."""
    return subprocess.run([sys.executable, "-m", module, *args], cwd=cwd, env=cli_env(env), text=True,
                          capture_output=True, timeout=timeout)


def metrics(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines() if line.strip()]


@pytest.fixture
def cli(tmp_path: Path):
    """Run the CLI with the test's temp folder as the working directory."""
    def run(*args: str, **kw) -> subprocess.CompletedProcess:
        kw.setdefault("cwd", tmp_path)
        return run_cli(*args, **kw)
    return run
