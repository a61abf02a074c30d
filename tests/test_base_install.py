"""A base install works: `pip install torch mnist-ddp` into a fresh venv, no extras, nothing else.

The rest of the suite runs in the dev venv, whose extras (matplotlib, tensorboard) bring numpy along, so a
code path that needs numpy without saying so passes there and fails for a user: torch's object collectives
call `tensor.numpy()`, and `-g 2 --resume` and torchrun died on rank 1 with "Numpy is not available". Here a
venv made by `python -m venv` (without the system's site-packages, which hold numpy) gets torch and the
package from a copy of this checkout, and runs what a user runs first: `-g 2`, `-g 2 --resume`, torchrun,
`evaluate` and `predict`. `TORCH_INDEX` is passed on to pip as the Makefile does.
"""

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from conftest import REPO, tiny
from mnist_ddp import identity

INSTALL_S = 600  # a hang guard for pip, not a timing assertion
RUN_S = 180
# Plots left on: without matplotlib a run says it draws none, and must still succeed.
TINY = [arg for arg in tiny(400, 100) if arg != "--no-plots"]


@pytest.fixture(scope="module")
def base(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, str]]:
    """A fresh venv with torch and the package alone, and an environment that leaves this checkout out of
    reach (no PYTHONPATH): its bin folder and the environment to run it in."""
    root = tmp_path_factory.mktemp("base")
    source = root / "source"  # pip builds in the tree it is given: a copy keeps build/ out of the checkout
    shutil.copytree(REPO / "src", source / "src", ignore=shutil.ignore_patterns("*.egg-info", "__pycache__"))
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(REPO / name, source / name)
    subprocess.run([sys.executable, "-m", "venv", str(root / "venv")], check=True, timeout=INSTALL_S)
    bin_ = root / "venv" / "bin"
    index = ["--index-url", os.environ["TORCH_INDEX"]] if os.environ.get("TORCH_INDEX") else []
    # --no-compile: byte-compiling all of torch took two thirds of the install; what runs compiles as it imports
    pip = subprocess.run([str(bin_ / "pip"), "install", "-q", "--disable-pip-version-check", "--no-compile",
                          f"torch=={torch.__version__.split('+')[0]}", str(source), *index],
                         capture_output=True, text=True, timeout=INSTALL_S)
    assert pip.returncode == 0, pip.stdout + pip.stderr
    env = identity.without_launcher_vars(os.environ)
    env.pop("PYTHONPATH", None)
    env |= {"OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    return bin_, env


def _run(base: tuple[Path, dict[str, str]], cwd: Path, *cmd: str) -> str:
    bin_, env = base
    r = subprocess.run([str(bin_ / cmd[0]), *cmd[1:]], cwd=cwd, env=env, capture_output=True, text=True,
                       timeout=RUN_S)
    said = r.stdout + r.stderr
    assert r.returncode == 0 and "Traceback" not in said, said
    return said


def test_the_venv_has_no_numpy_and_runs_the_copy(base: tuple[Path, dict[str, str]], tmp_path: Path) -> None:
    """What the other tests prove is only worth something if numpy is really missing and the package that runs
    is the installed one (not this checkout's src/)."""
    bin_, env = base
    r = subprocess.run([str(bin_ / "python"), "-c", "import numpy"], env=env, capture_output=True, text=True)
    assert r.returncode != 0 and "No module named 'numpy'" in r.stderr, r.stderr
    where = _run(base, tmp_path, "python", "-c", "import mnist_ddp; print(mnist_ddp.__file__)").strip()
    assert Path(where).is_relative_to(bin_.parent), where


def test_spawn_resume_and_predict(base: tuple[Path, dict[str, str]], tmp_path: Path) -> None:
    """`-g 2`, then `-g 2 --resume` of its checkpoint (rank 0 reads it and sends it to rank 1), then `predict`
    with it (Pillow's pixels into a tensor); torch's numpy warning is silenced in our own processes."""
    out = str(tmp_path / "run")
    said = _run(base, tmp_path, "mnist-ddp", "train", "-g", "2", *TINY, "--out", out)
    assert "final: test accuracy" in said and "world size 2" in said, said
    said = _run(base, tmp_path, "mnist-ddp", "train", "-g", "2", *TINY, "--out", out, "--resume")
    assert f"resume: from {out}/checkpoint.pt" in said and "final: " in said, said
    assert "NumPy" not in said, said
    image = tmp_path / "blank.png"
    _run(base, tmp_path, "python", "-c", f"from PIL import Image; Image.new('L', (28, 28)).save({str(image)!r})")
    said = _run(base, tmp_path, "mnist-ddp", "predict", f"{out}/checkpoint.pt", str(image))
    assert "blank.png" in said, said


def test_torchrun(base: tuple[Path, dict[str, str]], tmp_path: Path) -> None:
    """torchrun's workers share rank 0's look at --out (`Dist.from_main`) on a base install too."""
    said = _run(base, tmp_path, "torchrun", "--standalone", "--nproc-per-node", "2", "-m", "mnist_ddp", "train",
                *TINY, "--out", str(tmp_path / "run"))
    assert "final: test accuracy" in said and "world size 2" in said, said
