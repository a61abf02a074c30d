"""Fresh virtual environments for the install tests: torch and a copy of this checkout, nothing else."""

import os
import shutil
import subprocess
import sys
from pathlib import Path

import torch

from conftest import REPO
from mnist_ddp.joining import identity

INSTALL_S = 600  # a hang guard for pip, not a timing assertion


def fresh_venv(root: Path, extras: str = "") -> tuple[Path, dict[str, str]]:
    """A venv made by `python -m venv` in `root` (without the system's site-packages) into which pip installs this
    torch and a copy of the package, with `extras` (`notebook`: `pip install "mnist-ddp[notebook]"`). Returns its
    bin folder and an environment that leaves this checkout out of reach (no PYTHONPATH). `TORCH_INDEX` is passed
    on to pip as the Makefile does."""
    source = root / "source"  # pip builds in the tree it is given: a copy keeps build/ out of the checkout
    shutil.copytree(REPO / "src", source / "src", ignore=shutil.ignore_patterns("*.egg-info", "__pycache__"))
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(REPO / name, source / name)
    subprocess.run([sys.executable, "-m", "venv", str(root / "venv")], check=True, timeout=INSTALL_S)
    bin_ = root / "venv" / "bin"
    index = ["--index-url", os.environ["TORCH_INDEX"]] if os.environ.get("TORCH_INDEX") else []
    # --no-compile: byte-compiling all of torch took two thirds of the install; what runs compiles as it imports
    pip = subprocess.run([str(bin_ / "pip"), "install", "-q", "--disable-pip-version-check", "--no-compile",
                          f"torch=={torch.__version__.split('+')[0]}", f"{source}[{extras}]" if extras else str(source),
                          *index], capture_output=True, text=True, timeout=INSTALL_S)
    assert pip.returncode == 0, pip.stdout + pip.stderr
    env = identity.without_launcher_vars(os.environ)
    env.pop("PYTHONPATH", None)
    env |= {"OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    return bin_, env
