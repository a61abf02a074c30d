"""Lesson 0 (src/mnist_ddp/lesson.py), the tutorial's program fixed, runs as README.md says: two real processes
over gloo, each essential in play, and the weights rank 0 saves are the model whose accuracy it printed."""

import json
import os
from pathlib import Path

import torch
import torch.distributed as dist

from conftest import REPO, run_cli, spawn_gloo
from mnist_ddp.common.config import DataConfig
from mnist_ddp.core.distributed import Dist
from mnist_ddp.data.datasets import Split, load
from mnist_ddp.lesson import evaluate
from mnist_ddp.model import ConvNet

# Loaded by every Python process of the lesson (sitecustomize), the parent and its spawned ranks: each rank writes
# its rank, its no_sync entries and the gradient all-reduces its DDP made (counted by a comm hook that does DDP's
# own all-reduce), so the test can count what ran where.
SPY = """
import json, os
import torch.distributed as dist
from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook
from torch.nn.parallel import DistributedDataParallel as DDP

seen = {"rank": None, "no_sync": 0, "all_reduces": 0}

def _note():
    with open(os.path.join(os.environ["LESSON_SPY"], f"{os.getpid()}.json"), "w") as f:
        json.dump(seen, f)

def _counted(state, bucket):
    seen["all_reduces"] += 1
    _note()
    return allreduce_hook(state, bucket)

_init, _no_sync = DDP.__init__, DDP.no_sync

def __init__(self, *args, **kwargs):
    _init(self, *args, **kwargs)
    seen["rank"] = dist.get_rank()
    self.register_comm_hook(None, _counted)
    _note()

def no_sync(self):
    seen["no_sync"] += 1
    _note()
    return _no_sync(self)

DDP.__init__, DDP.no_sync = __init__, no_sync
"""


def test_lesson_0_trains_with_two_processes_and_saves_what_it_printed(tmp_path: Path) -> None:
    """`python -m mnist_ddp.lesson -g 2` on 800 synthetic digits, 2 epochs, 2 micro-batches a step: exit 0, one line
    per epoch from rank 0 alone; two ranks (0 and 1) each entered no_sync for the first micro-batch of each of its 4
    steps and all-reduced its gradients once a step (2 batches of 100 a step, 4 a rank and epoch); the saved
    state_dict loads into a plain ConvNet and scores on the test images exactly the accuracy the last line printed
    (evaluated here as the lesson does, over two ranks: a near tie's argmax may follow the batch's shape on some
    CPUs), 10 points above the untrained model's."""
    out, spy = tmp_path / "lesson.pt", tmp_path / "spy"
    spy.mkdir()
    (spy / "sitecustomize.py").write_text(SPY)
    r = run_cli("-g", "2", "--epochs", "2", "--accumulate", "2", "--dataset", "synthetic", "--train-samples", "800",
                "--test-samples", "200", "--out", str(out), cwd=tmp_path, module="mnist_ddp.lesson", timeout=300,
                env={"LESSON_SPY": str(spy), "PYTHONPATH": f"{spy}{os.pathsep}{REPO / 'src'}"})
    assert r.returncode == 0, r.stdout + r.stderr
    lines = r.stdout.strip().splitlines()
    assert [line.split()[1] for line in lines] == ["1/2", "2/2"], r.stdout
    ranks = sorted((s["rank"], s["no_sync"], s["all_reduces"]) for f in spy.glob("*.json")
                   for s in [json.loads(f.read_text())])
    assert ranks == [(0, 4, 4), (1, 4, 4)], ranks
    printed = float(lines[-1].rsplit(" ", 1)[1].rstrip("%")) / 100
    said = tmp_path / "accuracy"
    spawn_gloo(_evaluate_saved, 2, str(out), str(tmp_path / "data"), str(said))
    accuracy = float(said.read_text())
    assert abs(accuracy - printed) < 0.00005, (accuracy, printed)
    data = load(DataConfig("synthetic", tmp_path / "data", train_samples=800, test_samples=200))
    torch.manual_seed(0)  # the lesson's initial weights
    untrained = evaluate_alone(ConvNet(), data.test)
    assert accuracy > untrained + 0.1, (accuracy, untrained)  # it learned


def _evaluate_saved(d: Dist, saved: str, root: str, said: str) -> None:
    """The lesson's evaluate of the saved state_dict, on rank `d.rank` of two, as the lesson ran it."""
    model = ConvNet()
    model.load_state_dict(torch.load(saved, weights_only=True))
    data = load(DataConfig("synthetic", Path(root), train_samples=800, test_samples=200))
    accuracy = evaluate(model, data.test, d.rank, d.world_size, torch.device("cpu"))
    if d.rank == 0:
        Path(said).write_text(repr(accuracy))


def evaluate_alone(model: ConvNet, test: Split) -> float:
    """The lesson's evaluate in a world of one (a gloo group of one process, so its all_reduce runs)."""
    store = dist.HashStore()
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    try:
        return evaluate(model, test, 0, 1, torch.device("cpu"))
    finally:
        dist.destroy_process_group()


def test_lesson_0_wants_node_0s_address_for_several_nodes(tmp_path: Path) -> None:
    """The tutorial hard-coded MASTER_ADDR; lesson 0 takes it from the environment, and with several nodes refuses to
    guess (a node that guessed this machine would wait for a master that is not there)."""
    r = run_cli("-n", "2", "-nr", "1", "--dataset", "synthetic", cwd=tmp_path, module="mnist_ddp.lesson",
                timeout=120)  # run_cli's environment has no MASTER_ADDR or MASTER_PORT
    assert r.returncode != 0 and "set MASTER_ADDR and MASTER_PORT" in r.stderr, r.stderr
