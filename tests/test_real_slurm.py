"""A real SLURM cluster, made for these tests: srun, sbatch, scancel and requeue, as a cluster's users run them.

One cluster on this machine (slurmctld + one slurmd, 127.0.0.1) and one of two "machines" (one slurmd per
network namespace, slurmctld on the first), both started from a generated slurm.conf (see launchers.py).
The tasks find their rank, world and master from SLURM's own variables: nothing is set by hand.
"""

import re
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from conftest import REPO, metrics, progress, tiny
from launchers import SLURM_TOOLS, Cluster, local_cluster, machines, need, slurm_cluster
from procfs import marked_env, reaped, wait_for

pytestmark = [pytest.mark.skipif(sys.platform != "linux", reason="SLURM's daemons run on Linux"),
              pytest.mark.timeout(600)]  # a cluster to start and jobs with several HANG-guarded phases each
TRAIN = [sys.executable, "-m", "mnist_ddp", "train"]
HANG = 240  # seconds: a hang detector on a shared machine, not a timing assertion
LONG = [*tiny(1200, 100, epochs=50), "--checkpoint-every", "2", "--batch-size", "50"]  # stopped long before its end


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    with local_cluster(tmp_path_factory.mktemp("slurm")) as c:
        yield c


def _env(**extra: str) -> tuple[dict[str, str], str]:
    """A task environment that marks every process of the test (see procfs.reaped)."""
    return marked_env(extra)


def _timed(what: str, began: float) -> None:
    print(f"{what}: {time.monotonic() - began:.1f} s")  # for the closing note: shown with pytest -s or on failure


def test_srun_trains_a_world_of_two_slurm(cluster: Cluster, tmp_path: Path) -> None:
    """`srun -n 2 mnist-ddp train`: SLURM_PROCID/SLURM_NTASKS give the ranks, the port comes from the job id."""
    env, mark = _env()
    began = time.monotonic()
    with reaped(mark):
        r = cluster.run("srun", "-n", "2", *TRAIN, *tiny(600, 100), "--out", str(tmp_path / "o"), env=env,
                        cwd=tmp_path, timeout=HANG)
    _timed("srun -n 2", began)
    assert r.returncode == 0, r.stdout + r.stderr + cluster.logs()
    assert "world size 2" in r.stdout and r.stdout.count("final: test accuracy") == 1, r.stdout
    assert [row["world_size"] for row in metrics(tmp_path / "o")] == [2]


def _batch_script(tmp_path: Path, extra: str) -> Path:
    """The batch script in docs/many-machines.md, adapted to this cluster: one node with two CPU tasks (no
    --gpus-per-task), python -m mnist_ddp for the installed command, a tiny run, and the output folder in the
    test's folder."""
    page = (REPO / "docs" / "many-machines.md").read_text()
    script = re.search(r"```bash\n(#!/bin/bash\n#SBATCH.*?)```", page, re.S)
    assert script, "docs/many-machines.md has no batch script"
    text = script.group(1)
    text = re.sub(r"#SBATCH --gpus-per-task.*\n", "", text)
    text = re.sub(r"--nodes=\d+", "--nodes=1", text)
    text = re.sub(r"--ntasks-per-node=\d+", "--ntasks-per-node=2", text)
    text = re.sub(r"--cpus-per-task=\d+", "--cpus-per-task=1", text)
    text = text.replace("/shared/runs", str(tmp_path))
    text = text.replace("srun mnist-ddp train", f"srun {' '.join(TRAIN)} {' '.join(tiny(600, 100))} {extra}")
    assert f"{' '.join(TRAIN)}" in text and "--resume" in text, text
    path = tmp_path / "job.sh"
    path.write_text(text)
    return path


def _job_id(sbatch_stdout: str) -> str:
    found = re.search(r"Submitted batch job (\d+)", sbatch_stdout)
    assert found, sbatch_stdout
    return found.group(1)


def test_sbatch_runs_the_readmes_batch_script_slurm(cluster: Cluster, tmp_path: Path) -> None:
    """`sbatch --wait` of the documented script trains a world of 2; its exit code is the job's: 0, then 2 for
    the same script with a bad flag."""
    env, mark = _env()
    good, bad = tmp_path / "good", tmp_path / "bad"
    good.mkdir(), bad.mkdir()
    began = time.monotonic()
    with reaped(mark):
        r = cluster.run("sbatch", "--wait", "-o", str(good / "job.log"), str(_batch_script(good, "")), env=env,
                        cwd=good, timeout=HANG)
        _timed("sbatch --wait (documented script)", began)
        log = (good / "job.log").read_text()
        assert r.returncode == 0, r.stdout + r.stderr + log + cluster.logs()
        out = good / f"mnist-{_job_id(r.stdout)}"
        assert [row["world_size"] for row in metrics(out)] == [2], log
        assert log.count("final: test accuracy") == 1, log

        r = cluster.run("sbatch", "--wait", "-o", str(bad / "job.log"), str(_batch_script(bad, "--epochs 0")),
                        env=env, cwd=bad, timeout=HANG)
    assert r.returncode == 2, r.stdout + r.stderr + (bad / "job.log").read_text()
    assert "--epochs" in (bad / "job.log").read_text()


def _task_exits(log: str) -> list[int]:
    """The exit codes the tasks' wrapper shell recorded, by rank."""
    return [int(code) for _, code in sorted(re.findall(r"task (\d+) exit (\d+)", log))]


def test_scancel_stops_every_task_and_resume_continues_slurm(cluster: Cluster, tmp_path: Path) -> None:
    """scancel sends the tasks SIGTERM: each exits 130 with the checkpoint kept, and --resume goes on from it."""
    out = tmp_path / "o"
    # A shell per task records its python's exit code; it traps SIGTERM only to outlive it (python gets the
    # default disposition back on exec, and its own handler).
    wrapped = f'trap : TERM; {" ".join(TRAIN)} {" ".join(LONG)} --out {out} --resume; echo "task $SLURM_PROCID exit $?"'
    env, mark = _env()
    with reaped(mark):
        job = cluster.start(["srun", "-n", "2", "--job-name", "cancel-me", "sh", "-c", wrapped], tmp_path / "srun.log",
                            env=env, cwd=tmp_path)
        wait_for("a checkpoint", lambda: progress(out), HANG, running=job)
        saved = progress(out)
        jobs = cluster.run("squeue", "-h", "-n", "cancel-me", "-o", "%i").stdout.split()
        assert len(jobs) == 1, jobs
        began = time.monotonic()
        assert cluster.run("scancel", jobs[0]).returncode == 0
        job.wait(HANG)
        _timed("scancel to srun's exit", began)
        log = (tmp_path / "srun.log").read_text()
        assert _task_exits(log) == [130, 130], log + cluster.logs()
        assert log.count("mnist-ddp: interrupted.") == 2, log
        kept = progress(out)
        assert kept is not None and (kept["epoch"], kept["consumed"]) >= (saved["epoch"], saved["consumed"])

        # Resumed, it stops at the end of the epoch it was in (any accuracy reaches 1%): continued, not restarted.
        r = cluster.run("srun", "-n", "2", *TRAIN, *LONG, "--out", str(out), "--resume", "--target-accuracy", "0.01",
                        env=env, cwd=tmp_path, timeout=HANG)
    assert r.returncode == 0, r.stdout + r.stderr
    assert f"resume: from {out / 'checkpoint.pt'}, epoch {kept['epoch'] + 1}, {kept['consumed']:,} of" in r.stdout, \
        r.stdout
    assert metrics(out)[-1]["epoch"] == kept["epoch"] + 1


def test_requeued_job_continues_from_its_checkpoint_slurm(cluster: Cluster, tmp_path: Path) -> None:
    """`scontrol requeue` stops a running batch job and starts it again; with --resume in its script the second
    start continues from the checkpoint the first one left."""
    out = tmp_path / "o"
    script = tmp_path / "job.sh"
    script.write_text(f"#!/bin/bash\n#SBATCH --ntasks=2\n#SBATCH --requeue\n#SBATCH --open-mode=append\n"
                      f"srun {' '.join(TRAIN)} {' '.join(tiny(2000, 100, epochs=2))} --batch-size 50 "
                      f"--checkpoint-every 2 --out {out} --resume\n")
    env, mark = _env()
    with reaped(mark):
        job = cluster.submit(script, tmp_path / "job.log", env, tmp_path)
        wait_for("a checkpoint", lambda: progress(out), HANG)
        began = time.monotonic()
        assert cluster.run("scontrol", "requeue", job).returncode == 0
        # SLURM makes a requeued job wait ~2 minutes before it may start again (Reason=BeginTime); waive it.
        wait_for("the job to be pending again", lambda: cluster.job(job)[0] == "PENDING", HANG, poll=0.2)
        assert cluster.run("scontrol", "update", f"JobId={job}", "StartTime=now").returncode == 0
        state = cluster.finished(job, HANG)
        _timed("requeue to the job's end", began)
    log = (tmp_path / "job.log").read_text()
    assert state == ("COMPLETED", "0:0"), log + cluster.logs()
    assert f"resume: from {out / 'checkpoint.pt'}" in log, log
    assert [row["epoch"] for row in metrics(out)][-1] == 2, log
    assert torch.load(out / "checkpoint.pt", weights_only=True)["config"]["world_size"] == 2


def test_srun_across_two_machines_slurm(tmp_path: Path) -> None:
    """Two slurmd, each in a network namespace of its own (its own address, host name and /etc/hosts):
    `srun -N 2 -n 2` puts one task on each, and they meet at the first node of the step's node list."""
    need(*SLURM_TOOLS)
    env, mark = _env()
    with machines() as nodes, slurm_cluster(tmp_path / "slurm", nodes) as two:
        began = time.monotonic()
        with reaped(mark):
            r = two.run("srun", "-N", "2", "-n", "2", *TRAIN, *tiny(600, 100), "--out", str(tmp_path / "o"), env=env,
                        cwd=tmp_path, timeout=HANG)
        _timed("srun -N 2 -n 2 (two namespaces)", began)
    assert r.returncode == 0, r.stdout + r.stderr + two.logs()
    assert "world size 2" in r.stdout, r.stdout
    assert [row["world_size"] for row in metrics(tmp_path / "o")] == [2]
