"""The package's shape, which readers rely on: imports run one way, and each DDP essential sits in one place."""

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import mnist_ddp
from mnist_ddp import extended
from mnist_ddp.common.config import DataConfig, TrainConfig
from mnist_ddp.core.distributed import Dist
from mnist_ddp.data import datasets
from mnist_ddp.outputs.report import Reporter
from mnist_ddp.trainer import Trainer

PACKAGE = Path(mnist_ddp.__file__).parent
REPO = PACKAGE.parents[1]
BASELINE = {"tutorial", "lesson"}  # the tutorial's pipeline (bench's baseline) and lesson 0: their own DDP on purpose


def _lint_imports(src: Path, cwd: Path) -> subprocess.CompletedProcess:
    """import-linter with pyproject.toml's contracts over the package under `src`."""
    if cwd != REPO:
        shutil.copy(REPO / "pyproject.toml", cwd / "pyproject.toml")
    return subprocess.run([str(Path(sys.executable).parent / "lint-imports"), "--no-cache"], cwd=cwd,
                          env={**os.environ, "PYTHONPATH": str(src)}, capture_output=True, text=True, timeout=120)


def test_the_layers_hold() -> None:
    """Each folder imports only the layers below it ([tool.importlinter]; also run by `make lint`)."""
    r = _lint_imports(REPO / "src", REPO)
    assert r.returncode == 0 and "1 kept, 0 broken" in r.stdout, r.stdout + r.stderr


@pytest.mark.parametrize(("module", "upward"), [
    ("core/state.py", "from ..outputs import checkpoint"),  # the training state reaching for its save
    ("data/datasets.py", "from ..core import batches"),  # siblings: data never imports the DDP program
    ("common/errors.py", "from .. import model"),  # siblings at the bottom
    ("trainer.py", "from .recovery import recovery"),  # the textbook loop reaching for an extension
])
def test_an_import_against_the_layers_breaks_the_contract(tmp_path: Path, module: str, upward: str) -> None:
    """The contract can fail: one upward (or sideways) import in a copy of the package is reported, by name."""
    shutil.copytree(PACKAGE, tmp_path / "src" / "mnist_ddp", ignore=shutil.ignore_patterns("__pycache__"))
    target = tmp_path / "src" / "mnist_ddp" / module
    target.write_text(target.read_text() + f"\n{upward}\n")
    r = _lint_imports(tmp_path / "src", tmp_path)
    importer = "mnist_ddp." + module.removesuffix(".py").replace("/", ".")
    assert r.returncode == 1 and "BROKEN" in r.stdout and importer in r.stdout, r.stdout + r.stderr


def test_each_ddp_essential_is_written_once() -> None:
    """In the DDP program each essential call is made in one place (the samplers: in batches.py, once for the
    textbook shard and once for the slots of the general case). Not counted: lesson 0 and the tutorial's baseline,
    and recovery/, which re-forms a smaller group by the same init_process_group (and only that)."""
    sources = {p.stem: p.read_text() for p in PACKAGE.rglob("*.py")
               if p.stem not in BASELINE and p.parent.name != "recovery"}
    recovery = "".join(p.read_text() for p in (PACKAGE / "recovery").glob("*.py"))
    assert re.findall(r"\b(init_process_group|DDP|destroy_process_group|set_epoch|DistributedSampler|no_sync)\(",
                      recovery) == ["init_process_group"]
    # set_epoch: torch's own, on the DistributedSampler (the trainer reaches it through ShardedBatches.set_epoch)
    for call in (r"\binit_process_group\(", r"\bDDP\(", r"\bdestroy_process_group\(", r"\bsampler\.set_epoch\(",
                 r"\bDistributedSampler\(", r"\bno_sync\("):
        where = [f"{name}:{text[:m.start()].count(chr(10)) + 1}" for name, text in sources.items()
                 for m in re.finditer(call, text) if not text[:m.start()].rstrip().endswith("def")]
        if "ampler" in call:  # the textbook shard and the general case's slots: both batches.py's samplers
            assert {w.split(":")[0] for w in where} == {"batches"} and len(where) == 2, (call, where)
        else:
            assert len(where) == 1, (call, where)


@pytest.mark.parametrize("flags", [{}, {"accumulate": 2}, {"bitwise": True}, {"profile": 2}, {"resume": True},
                                   {"graph_step": "on"}])
def test_a_default_cpu_run_trains_with_the_textbook_trainer(tmp_path: Path, flags: dict) -> None:
    """What the README and docs/ddp-path.md promise a reader: with every flag at its default, a CPU run's loop is
    trainer.Trainer itself, none of ExtendedTrainer's methods; each extension's flag builds ExtendedTrainer."""
    data = datasets.load(DataConfig("synthetic", data_dir=tmp_path, train_samples=400, test_samples=100))
    d = Dist(rank=0, local_rank=0, world_size=2, local_world_size=2, device=torch.device("cpu"))  # no group needed
    cfg = TrainConfig(out=str(tmp_path / "o"), **flags)
    loop = extended.trainer_for(cfg, d, data, Reporter(tmp_path / "o", False, False, False, False))
    assert type(loop) is (extended.ExtendedTrainer if flags else Trainer)
