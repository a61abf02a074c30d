"""A base install works: `pip install torch mnist-ddp` into a fresh venv, no extras, nothing else.

The rest of the suite runs in the dev venv, whose extras (matplotlib, tensorboard) bring numpy along, so a
code path that needs numpy without saying so passes there and fails for a user: torch's object collectives
call `tensor.numpy()`, and `-g 2 --resume` and torchrun died on rank 1 with "Numpy is not available". Here a
venv made by `python -m venv` (without the system's site-packages, which hold numpy) gets torch and the
package from a copy of this checkout, and runs what a user runs first: `-g 2`, `-g 2 --resume`, torchrun,
`evaluate` and `predict` (tests/venvs.py makes the venv).
"""

import subprocess
from pathlib import Path

import pytest

from conftest import tiny
from venvs import fresh_venv

RUN_S = 180
pytestmark = pytest.mark.timeout(900)  # the first test includes the venv's install (venvs.INSTALL_S)
# Plots left on: without matplotlib a run says it draws none, and must still succeed.
TINY = [arg for arg in tiny(400, 100) if arg != "--no-plots"]


@pytest.fixture(scope="module")
def base(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, str]]:
    """A fresh venv with torch and the package alone: its bin folder and the environment to run it in."""
    return fresh_venv(tmp_path_factory.mktemp("base"))


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


@pytest.mark.parametrize("flags", [["train", "-g", "2", "--mlflow"], ["train", "-g", "2", "--tensorboard"],
                                   ["export", "run", "--onnx", "m.onnx"]], ids=["mlflow", "tensorboard", "onnx"])
def test_a_flag_whose_extra_is_missing_is_one_line_before_anything_starts(
        base: tuple[Path, dict[str, str]], tmp_path: Path, flags: list[str]) -> None:
    """Here the extras are really missing (not hidden from one process): --mlflow, --tensorboard and export --onnx
    are each refused in one sentence that names the extra, exit 2, and no run folder is made."""
    bin_, env = base
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "model.safetensors").write_bytes(b"never read")
    argv = [*flags, *TINY, "--out", "out"] if flags[0] == "train" else flags
    r = subprocess.run([str(bin_ / "mnist-ddp"), *argv], cwd=tmp_path, env=env, capture_output=True, text=True,
                       timeout=RUN_S)
    extra = {"--mlflow": "mlflow", "--tensorboard": "tensorboard", "export": "onnx"}[flags[-1] if flags[0] == "train"
                                                                                      else "export"]
    assert r.returncode == 2 and r.stdout == "" and len(r.stderr.splitlines()) == 1, r.stderr
    assert extra in r.stderr and "pip install" in r.stderr, r.stderr
    assert not (tmp_path / "out").exists() and not (tmp_path / "m.onnx").exists()


def test_torchrun(base: tuple[Path, dict[str, str]], tmp_path: Path) -> None:
    """torchrun's workers share rank 0's look at --out (`Dist.from_main`) on a base install too."""
    said = _run(base, tmp_path, "torchrun", "--standalone", "--nproc-per-node", "2", "-m", "mnist_ddp", "train",
                *TINY, "--out", str(tmp_path / "run"))
    assert "final: test accuracy" in said and "world size 2" in said, said
