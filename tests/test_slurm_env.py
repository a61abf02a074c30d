"""Who am I under SLURM (and under torchrun): the environment parsing, then two real processes.

There is no srun here, so the real-process test does what srun does: start one process per task with
SLURM_PROCID/SLURM_NTASKS/SLURM_LOCALID/SLURM_NODELIST set, and nothing else.
"""

from pathlib import Path

import pytest
import torch

from conftest import metrics, tiny
from launchers import quiet_job_id
from mnist_ddp.common.errors import UserError
from mnist_ddp.core.distributed import pick_device
from mnist_ddp.joining.identity import first_host, tasks_on_node
from mnist_ddp.joining.identity import from_env as identity_from_env
from procfs import finish, marked_env, reaped, start

SLURM = {"SLURM_PROCID": "5", "SLURM_NTASKS": "8", "SLURM_LOCALID": "1", "SLURM_NODEID": "2",
         "SLURM_TASKS_PER_NODE": "2(x4)", "SLURM_NODELIST": "node[01-04,07]", "SLURM_JOB_ID": "123456"}


@pytest.mark.parametrize(("nodelist", "first"), [
    ("node[01-04,07]", "node01"),
    ("node[07,01-04]", "node07"),  # SLURM keeps the order it gives, so the first is the first
    ("a,b", "a"),
    ("plain", "plain"),
    ("gpu[3-5],cpu[1-2]", "gpu3"),
    ("rack[1-2]-node[08-09]", "rack1-node08"),
    ("gpu-a100-[001-008]", "gpu-a100-001"),
])
def test_first_host_of_hostlist(nodelist: str, first: str) -> None:
    assert first_host(nodelist) == first


@pytest.mark.parametrize("nodelist", ["node[01", "node]", "x[]", ",a"])
def test_malformed_hostlist_is_a_clear_error(nodelist: str) -> None:
    with pytest.raises(UserError, match="not a node list"):
        first_host(nodelist)


def test_tasks_per_node_expands_slurms_compressed_form() -> None:
    assert [tasks_on_node("4(x2),3", n) for n in range(4)] == [4, 4, 3, None]
    assert tasks_on_node("", 0) is None


def test_slurm_identity() -> None:
    ident = identity_from_env(SLURM)
    assert ident is not None
    assert (ident.rank, ident.local_rank, ident.world_size, ident.local_world_size) == (5, 1, 8, 2)
    assert (ident.launcher, ident.store_host, ident.master_addr) == ("SLURM", "rank0", "node01")
    assert ident.master_port == 20000 + 123456 % 10000  # the same number on every node of the job


def test_slurm_master_from_environment_wins() -> None:
    ident = identity_from_env(SLURM | {"MASTER_ADDR": "10.0.0.9", "MASTER_PORT": "4242"})
    assert ident is not None and (ident.master_addr, ident.master_port) == ("10.0.0.9", 4242)


def test_slurm_step_nodelist_is_where_the_tasks_run() -> None:
    ident = identity_from_env(SLURM | {"SLURM_STEP_NODELIST": "gpu[5-6]"})
    assert ident is not None and ident.master_addr == "gpu5"


def test_slurm_without_job_id_uses_torchs_default_port() -> None:
    env = {k: v for k, v in SLURM.items() if k != "SLURM_JOB_ID"}
    ident = identity_from_env(env)
    assert ident is not None and ident.master_port == 29500


def test_one_slurm_task_needs_no_process_group() -> None:
    ident = identity_from_env({"SLURM_PROCID": "0", "SLURM_NTASKS": "1", "SLURM_NODELIST": "n1"})
    assert ident is not None and (ident.world_size, ident.store_host) == (1, "none")


def test_torchrun_variables_win_over_slurm() -> None:
    """`srun torchrun …`: torchrun's numbers describe the processes it started, SLURM's the tasks."""
    env = SLURM | {"RANK": "3", "WORLD_SIZE": "4", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "2",
                   "MASTER_ADDR": "10.1.2.3", "MASTER_PORT": "29400"}
    ident = identity_from_env(env)
    assert ident is not None
    assert (ident.launcher, ident.rank, ident.world_size, ident.local_rank, ident.local_world_size) == \
        ("torchrun", 3, 4, 1, 2)
    assert (ident.store_host, ident.master_addr, ident.master_port) == ("rank0", "10.1.2.3", 29400)


def test_no_launcher_means_no_identity() -> None:
    assert identity_from_env({"SLURM_JOB_ID": "7", "PATH": "/bin"}) is None  # sbatch alone sets no task


@pytest.mark.parametrize(("env", "message"), [
    ({"RANK": "2", "WORLD_SIZE": "2"}, "RANK=2 does not fit WORLD_SIZE=2"),
    ({"RANK": "-1", "WORLD_SIZE": "2"}, "RANK='-1' is not a whole number from 0"),
    ({"RANK": "0", "WORLD_SIZE": "99999999999999999999"}, "WORLD_SIZE='99999999999999999999' is not a whole number"),
    ({"RANK": "0", "WORLD_SIZE": "2", "LOCAL_RANK": "-1"}, "LOCAL_RANK='-1' is not a whole number from 0"),
    ({"RANK": "0", "WORLD_SIZE": "0"}, "at least one process"),
    ({"RANK": "0", "WORLD_SIZE": "2", "LOCAL_RANK": "2", "LOCAL_WORLD_SIZE": "2"}, "LOCAL_RANK=2 does not fit"),
    ({"RANK": "x", "WORLD_SIZE": "2"}, "RANK='x' is not a whole number"),
    ({"SLURM_PROCID": "8", "SLURM_NTASKS": "8"}, "SLURM_PROCID=8 does not fit SLURM_NTASKS=8"),
    ({"SLURM_PROCID": "0", "SLURM_NTASKS": "2", "SLURM_LOCALID": "3", "SLURM_TASKS_PER_NODE": "2"},
     "SLURM_LOCALID=3 does not fit"),
    ({"SLURM_PROCID": "0", "SLURM_NTASKS": "2", "SLURM_NODELIST": "n[1-2"}, "not a node list"),
])
def test_impossible_launcher_numbers_are_clear_errors(env: dict[str, str], message: str) -> None:
    with pytest.raises(UserError, match=message.replace("[", r"\[")):
        identity_from_env(env)


@pytest.mark.parametrize(("visible", "local_rank", "env", "device"), [
    (4, 3, {}, "cuda:3"), (1, 3, {"CUDA_VISIBLE_DEVICES": "3"}, "cuda:0"),
    (1, 3, {"SLURM_GPUS_PER_TASK": "1"}, "cuda:0"), (1, 0, {}, "cuda:0")])
def test_each_task_gets_its_gpu(monkeypatch: pytest.MonkeyPatch, visible: int, local_rank: int, env: dict[str, str],
                                device: str) -> None:
    """All GPUs visible: local rank N takes GPU N. `--gpus-per-task 1`: each task sees one, as device 0."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: visible)
    assert pick_device("cuda", local_rank, 4 if visible > 1 or local_rank else 1, env) == torch.device(device)


def test_more_tasks_than_gpus_is_a_clear_error(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    with pytest.raises(UserError, match="3 processes run on this machine but this one sees 2 GPUs"):
        pick_device("auto", 2, 3, {})


def test_two_processes_started_like_srun_train_together(tmp_path: Path) -> None:
    """What `srun --ntasks 2 mnist-ddp train …` does on one node; the port comes from SLURM_JOB_ID."""
    job_id = quiet_job_id()  # 20000 + id % 10000 is a free port
    out = tmp_path / "run"
    args = ["mnist_ddp", "train", *tiny(600, 100), "--timeout", "60", "--out", str(out)]
    tasks = {"SLURM_NTASKS": "2", "SLURM_TASKS_PER_NODE": "2", "SLURM_NODELIST": "localhost",
             "SLURM_NODEID": "0", "SLURM_JOB_ID": str(job_id)}
    env, mark = marked_env(tasks)
    with reaped(mark):
        procs = [start(args, env | {"SLURM_PROCID": str(r), "SLURM_LOCALID": str(r)}, tmp_path, tmp_path / f"{r}.log")
                 for r in range(2)]
        results = [finish(p, tmp_path / f"{r}.log", timeout=150) for r, p in enumerate(procs)]
    for rc, log in results:
        assert rc == 0, log
    assert "world size 2" in results[0][1] and "final: test accuracy" in results[0][1]
    assert "final:" not in results[1][1]  # rank 1 says nothing: rank 0 alone reports
    rows = metrics(out)
    assert [r["world_size"] for r in rows] == [2]
    ckpt = torch.load(out / "checkpoint.pt", weights_only=True)
    assert ckpt["config"]["world_size"] == 2
