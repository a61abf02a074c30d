"""Our DDP and CPU settings for speed, checked with real processes: buffers and cores."""

import copy
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from conftest import cli_env, spawn_gloo
from mnist_ddp.core import ddp
from mnist_ddp.core.batches import Share
from mnist_ddp.core.bnstats import PartStats, RankStats
from mnist_ddp.core.distributed import Dist
from mnist_ddp.model import ConvNet

WORLD = 2


def _rank(d: Dist, out: str) -> None:
    torch.manual_seed(0)
    model = ConvNet()
    net = ddp.wrap(model, d)
    for step in range(3):  # each rank its own data, so its own BatchNorm statistics
        net(torch.randn(8, 1, 28, 28, generator=torch.Generator().manual_seed(10 * d.rank + step))).sum().backward()
    before = {k: v.clone() for k, v in model.named_buffers()}
    twin = copy.deepcopy(model)  # the same statistics, averaged as the general step's PartStats does
    PartStats(twin, Share(WORLD, WORLD), d.rank).average(steps=3)
    stats = RankStats(model, d)  # a default run's
    stats.average(steps=3)
    after = {k: v.clone() for k, v in model.named_buffers()}
    stats.use_own()
    torch.save({"before": before, "after": after, "parts": dict(twin.named_buffers()),
                "own again": dict(model.named_buffers())}, os.path.join(out, f"rank{d.rank}.pt"))


def test_buffers_stay_per_rank_while_training_and_are_averaged_on_request(tmp_path: Path) -> None:
    spawn_gloo(_rank, WORLD, str(tmp_path))
    r0, r1 = (torch.load(tmp_path / f"rank{r}.pt", weights_only=True) for r in range(WORLD))
    name = "layer1.1.running_mean"
    assert not torch.allclose(r0["before"][name], r1["before"][name])  # no broadcast before each forward
    for key, value in r0["after"].items():
        assert torch.equal(value, r1["after"][key]), key
        if value.is_floating_point():
            torch.testing.assert_close(value, (r0["before"][key] + r1["before"][key]) / 2)
        else:
            assert torch.equal(value, r0["before"][key])  # num_batches_tracked: the 3 steps trained
    for r in (r0, r1):
        for key, value in r["after"].items():
            assert torch.equal(value, r["parts"][key]), key  # a set per rank or per part: the same bits
            if value.is_floating_point():  # and then each rank trains on with its own
                assert torch.equal(r["own again"][key], r["before"][key]), key


SHARE = ("import json, os, sys, torch; from mnist_ddp.core import compute; "
         "compute.share_cores(*map(int, sys.argv[1:])); "
         "print(json.dumps([sorted(os.sched_getaffinity(0)), torch.get_num_threads()]))")


def _share(local_rank: int, local_world: int, env: dict[str, str]) -> tuple[list[int], int]:
    r = subprocess.run([sys.executable, "-c", SHARE, str(local_rank), str(local_world)], env=env, text=True,
                       capture_output=True, timeout=60, check=True)
    cores, threads = json.loads(r.stdout)
    return cores, threads


@pytest.mark.skipif(not hasattr(os, "sched_getaffinity") or len(os.sched_getaffinity(0)) < 2,
                    reason="needs Linux and at least 2 cores")
def test_local_processes_get_disjoint_cores_and_one_thread_per_core() -> None:
    allowed = sorted(os.sched_getaffinity(0))
    env = {k: v for k, v in cli_env().items() if k != "OMP_NUM_THREADS"}
    shares = [_share(rank, 2, env) for rank in range(2)]
    assert sorted(shares[0][0] + shares[1][0]) == allowed and not set(shares[0][0]) & set(shares[1][0])
    assert [threads for _, threads in shares] == [len(cores) for cores, _ in shares]
    assert _share(0, 1, env) == (allowed, len(allowed))  # one process: every core, not pinned
    assert _share(1, 2, env | {"OMP_NUM_THREADS": "1"})[1] == 1  # an explicit thread count wins
