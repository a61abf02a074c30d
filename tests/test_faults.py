"""What real clusters do to a job: kill a worker, lose a peer, never start one, press Ctrl-C.

Every test starts real processes and looks at them from the outside (/proc): a fault must end in a
clear message and an exit code, never a hang, never an orphan process (`reaped` checks that every
process of the run is gone), never a broken checkpoint.
Independent runs of one test go concurrently, to keep the wall time down on a small box.
"""

import os
import random
import signal
import time
from pathlib import Path

import pytest
import torch

from conftest import metrics, progress, tiny
from mnist_ddp import checkpoint
from procfs import children, env_of, finish, free_port, marked_env, needs_proc, reaped, start, wait_for

pytestmark = needs_proc

HANG = 180  # seconds before a test calls a run hung: a hang detector, not a timing assertion


def _train(out: Path, *extra: str, samples: int = 600) -> list[str]:
    return ["mnist_ddp", "train", *tiny(samples, 100, epochs=None), "--out", str(out), *extra]


def _temp_files(out: Path) -> list[str]:
    return sorted(p.name for p in out.glob(".*tmp*"))


# --- elastic restart under torchrun -------------------------------------------------------------------

def test_torchrun_restart_resumes_from_checkpoint_and_matches_undisturbed_run(tmp_path: Path) -> None:
    """SIGKILL rank 0 in the middle of epoch 2 of 3 under `--max-restarts 1`, no --resume: the agent restarts
    the workers, they see a restart of their own job and resume from the mid-epoch checkpoint by themselves,
    and the end result is exactly an undisturbed run's. A fresh torchrun with the same run id is refused."""
    job = ["torch.distributed.run", "--standalone", "--nproc-per-node", "2", "--max-restarts", "1",
           "--monitor-interval", "0.2", "-m"]
    extra = ["--epochs", "3", "--checkpoint-every", "4", "--timeout", "60"]
    env, mark = marked_env()
    killed, calm = tmp_path / "killed", tmp_path / "calm"
    with reaped(mark):
        runs = {name: start([*job, *_train(out, *extra, samples=6000)], env, tmp_path, tmp_path / f"{name}.log")
                for name, out in (("killed", killed), ("calm", calm))}
        # 30 steps per epoch per rank; a checkpoint every 4 steps: (1, 4) is the first save inside epoch 2,
        # and the kill lands before (2, 0), the end of epoch 2, with 26 steps to spare.
        inside_epoch_2 = lambda: (p := progress(killed)) and p["epoch"] == 1 and p["consumed"] > 0 and p  # noqa: E731
        at = wait_for("a checkpoint inside epoch 2", inside_epoch_2, HANG, 0.01, running=runs["killed"])
        workers = [pid for pid in children(runs["killed"].pid) if "RANK" in env_of(pid)]
        assert len(workers) == 2, workers
        rank0 = next(pid for pid in workers if env_of(pid)["RANK"] == "0")
        os.kill(rank0, signal.SIGKILL)
        results = {name: finish(proc, tmp_path / f"{name}.log", HANG) for name, proc in runs.items()}
    for rc, log in results.values():
        assert rc == 0, log
    log = results["killed"][1]
    assert log.count("restart: torchrun restarted job") == 1 and "continuing" in log, log
    assert f"resume: from {killed / 'checkpoint.pt'}, epoch 2, " in log, log
    resumed = int(log.split(f"resume: from {killed / 'checkpoint.pt'}, epoch 2, ")[1].split()[0].replace(",", ""))
    assert resumed >= at["consumed"]  # the restart picked up the newest checkpoint, not an older one
    assert "resume:" not in results["calm"][1].replace("resume: no checkpoint", "")
    # Nothing was repeated in the record, and the end is the same as if nothing had happened.
    assert [m["epoch"] for m in metrics(killed)] == [1, 2, 3]
    acc_killed, acc_calm = metrics(killed)[-1]["test_accuracy"], metrics(calm)[-1]["test_accuracy"]
    assert abs(acc_killed - acc_calm) <= 0.005
    assert acc_killed == acc_calm  # deterministic resume: the same steps in the same order
    a, b = (torch.load(out / "checkpoint.pt", weights_only=True)["model"] for out in (killed, calm))
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert _temp_files(killed) == []  # the killed writer's temp file, if any, was cleaned up

    # --standalone draws a run id per torchrun; a new torchrun given that same id is a new job (restart
    # count 0), not a restart: it must not take over the finished run's --out.
    run_id = checkpoint.load(killed / "checkpoint.pt")["run_id"]
    assert run_id
    before = (killed / "checkpoint.pt").read_bytes()
    again = ["torch.distributed.run", "--nnodes", "1", "--nproc-per-node", "1", "--rdzv-backend", "c10d",
             "--rdzv-endpoint", f"127.0.0.1:{free_port()}", "--rdzv-id", run_id, "-m"]
    with reaped(mark):
        rc, log = finish(start([*again, *_train(killed, *extra)], env, tmp_path, tmp_path / "again.log"),
                         tmp_path / "again.log", HANG)
    assert rc != 0 and "already holds a run; pass --resume" in log, log
    assert "restart: torchrun" not in log, log
    assert (killed / "checkpoint.pt").read_bytes() == before


# --- checkpoints survive a crash in the middle of writing them ------------------------------------------

def _payload(i: int) -> dict:
    return {"model": {"w": torch.full((2_000_000,), float(i))}, "i": i}  # 8 MB: each save takes a while


def _consistent(path: Path) -> int:
    """The checkpoint's counter, after checking that every byte of it belongs to that one save."""
    ckpt = checkpoint.load(path)
    assert torch.equal(ckpt["model"]["w"], torch.full((2_000_000,), float(ckpt["i"])))
    return ckpt["i"]


def _save_forever(path: Path, first: int) -> None:
    """The writer, in a forked child: save, save, save… until it is killed."""
    try:
        torch.set_num_threads(1)  # the parent's OpenMP threads did not survive the fork; run without them
        i = first
        while True:
            i += 1
            checkpoint.save(path, _payload(i))
    finally:
        os._exit(1)


def test_sigkill_during_save_leaves_the_old_or_the_new_checkpoint(tmp_path: Path) -> None:
    """Ten writers, each SIGKILLed at a random moment; after every kill the checkpoint loads and is whole."""
    path = tmp_path / "checkpoint.pt"
    checkpoint.save(path, _payload(0))
    interrupted, rng = 0, random.Random(0)
    for round_ in range(1, 11):
        first = round_ * 1_000_000
        writer = os.fork()  # milliseconds, where a fresh interpreter would take seconds
        if writer == 0:
            _save_forever(path, first)
        wait_for("the writer's first save", lambda first=first: _consistent(path) > first, HANG, 0.01)
        time.sleep(rng.uniform(0, 0.1))  # a save takes tens of milliseconds: most kills land inside one
        os.kill(writer, signal.SIGKILL)
        os.waitpid(writer, 0)
        now = _consistent(path)  # loads, and is whole
        assert now > first  # the newest complete save, or one before it: never garbage, never lost
        interrupted += bool(_temp_files(tmp_path))
    assert interrupted > 0, "no kill landed inside a save; the test proved nothing"
    checkpoint.save(path, _payload(-1))  # the next save clears what killed writers left behind
    assert _temp_files(tmp_path) == []
    assert _consistent(path) == -1


def test_failed_save_keeps_the_previous_checkpoint(tmp_path: Path) -> None:
    path = tmp_path / "checkpoint.pt"
    checkpoint.save(path, _payload(7))
    with pytest.raises(Exception):  # noqa: B017 - whatever torch.save raises for an unpicklable object
        checkpoint.save(path, {**_payload(8), "oops": lambda: None})
    assert _consistent(path) == 7
    assert _temp_files(tmp_path) == []


# --- a peer that never arrives: every process gives up within --timeout --------------------------------

NEVER = {  # case -> (arguments after `train`, extra environment, what the message must say)
    "node 0 alone (-n 2 -nr 0)": (["-n", "2", "-g", "1", "-nr", "0", "--master-addr", "127.0.0.1"], {},
                                  "could not join the 1 other process"),
    "node 1 alone (-n 2 -nr 1)": (["-n", "2", "-g", "1", "-nr", "1", "--master-addr", "127.0.0.1"], {},
                                  "found nobody listening"),
    "torchrun-style env, rank 1 never started": ([], {"RANK": "0", "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1"},
                                                  "could not join the 1 other process"),
    "torchrun-style env, rank 0 never started": ([], {"RANK": "1", "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1"},
                                                  "found nobody listening"),
    "srun-style env, task 0 never started": ([], {"SLURM_PROCID": "1", "SLURM_NTASKS": "2",
                                                  "SLURM_NODELIST": "127.0.0.1"}, "found nobody listening"),
}


def test_peer_that_never_arrives_ends_in_a_clear_error(tmp_path: Path) -> None:
    env, mark = marked_env()
    runs = {}
    with reaped(mark):
        for n, (case, (args, extra, _)) in enumerate(NEVER.items()):
            port = str(free_port())
            case_env = env | extra | ({"MASTER_PORT": port} if extra else {})
            runs[case] = (time.monotonic(), start(
                [*_train(tmp_path / f"out{n}"), "--timeout", "5", *args, *([] if extra else ["--master-port", port])],
                case_env, tmp_path, tmp_path / f"{n}.log"))
        for n, (case, (started, proc)) in enumerate(runs.items()):
            rc, log = finish(proc, tmp_path / f"{n}.log", HANG)
            print(f"{case}: exit {rc} after {time.monotonic() - started:.1f} s")
            assert rc == 2, f"{case}: {log}"
            assert NEVER[case][2] in log, f"{case}: {log}"
            assert "Traceback" not in log, f"{case}: {log}"


# --- a peer that dies or hangs, with nobody to restart it ----------------------------------------------

def test_survivor_of_a_dead_or_frozen_peer_exits_with_a_clear_error(tmp_path: Path) -> None:
    """Two processes started by hand (as a static launcher would); one is SIGKILLed, in another pair one
    is frozen with SIGSTOP. The survivor says what happened and exits 1: after the dead peer's socket
    closes, or after --timeout of silence from the frozen one."""
    env, mark = marked_env({"WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1"})
    pairs = {}
    with reaped(mark):
        for how in ("SIGKILL", "SIGSTOP"):
            port = str(free_port())
            out = tmp_path / how
            pairs[how] = [start(_train(out, "--epochs", "50", "--timeout", "6", "--checkpoint-every", "2"),
                                env | {"RANK": str(r), "MASTER_PORT": port}, tmp_path, tmp_path / f"{how}{r}.log")
                          for r in range(2)]
        for how, (_, rank1) in pairs.items():
            wait_for(f"{how} pair to train", lambda out=tmp_path / how: progress(out), HANG, running=rank1)
            os.kill(rank1.pid, getattr(signal, how))
        for how, (rank0, rank1) in pairs.items():
            rc, log = finish(rank0, tmp_path / f"{how}0.log", HANG)
            assert rc == 1, f"{how}: {log}"
            assert "rank 0 lost contact with the other processes" in log and "--resume" in log, f"{how}: {log}"
            assert "Traceback" not in log, log
            assert progress(tmp_path / how) is not None  # the last checkpoint still loads
            os.kill(rank1.pid, signal.SIGKILL)
            rank1.wait()


def test_spawned_worker_killed_stops_the_job(tmp_path: Path) -> None:
    """Without a restart policy, mnist-ddp's own launcher stops the other workers and names the dead one."""
    env, mark = marked_env()
    out = tmp_path / "out"
    with reaped(mark):
        parent = start([*_train(out, "-n", "1", "-g", "2", "--epochs", "50", "--checkpoint-every", "2")], env,
                       tmp_path, tmp_path / "log")
        wait_for("training", lambda: progress(out), HANG, running=parent)
        # The workers are forked from the launcher's fork server (forkserver.py), the one child of it that is.
        server = next(pid for pid in children(parent.pid) if "MNIST_DDP_TEST_MARK" in env_of(pid)
                      and "forkserver" in Path(f"/proc/{pid}/cmdline").read_text(errors="replace"))
        victim = children(server)[0]
        os.kill(victim, signal.SIGKILL)
        rc, log = finish(parent, tmp_path / "log", HANG)
    assert rc == 1, log
    assert "was killed by SIGKILL" in log and "--resume" in log, log
    assert progress(out) is not None


# --- Ctrl-C and SIGTERM: the whole job stops, cleanly --------------------------------------------------

def test_interrupt_tears_down_every_process_and_keeps_the_checkpoint(tmp_path: Path) -> None:
    """During spawn training: Ctrl-C (SIGINT to the whole process group) and SIGTERM to the parent alone
    unwind every process (exit 130); even SIGKILL of the parent, which it cannot handle, leaves no
    orphan (the children are told by the kernel, PR_SET_PDEATHSIG). The checkpoint loads afterwards."""
    env, mark = marked_env()
    jobs = {}
    signals = {"SIGINT to the group": (signal.SIGINT, True, 130), "SIGTERM to the parent": (signal.SIGTERM, False, 130),
               "SIGKILL to the parent": (signal.SIGKILL, False, -signal.SIGKILL)}
    with reaped(mark):
        for how in signals:
            out = tmp_path / how.split()[0]
            jobs[how] = (out, start([*_train(out, "-n", "1", "-g", "2", "--epochs", "50", "--checkpoint-every", "1")],
                                    env, tmp_path, tmp_path / f"{how.split()[0]}.log"))
        for how, (out, proc) in jobs.items():
            wait_for(f"{how}: training", lambda out=out: progress(out), HANG, running=proc)
            signum, group, _ = signals[how]
            (os.killpg if group else os.kill)(proc.pid, signum)
        for how, (out, proc) in jobs.items():
            rc, log = finish(proc, tmp_path / f"{how.split()[0]}.log", HANG)
            assert rc == signals[how][2], f"{how}: {log}"
            assert rc < 0 or "mnist-ddp: interrupted." in log, f"{how}: {log}"
            assert "Traceback" not in log, f"{how}: {log}"
            assert progress(out) is not None, how  # checkpoint.pt loads
    for how, (out, _) in jobs.items():  # every process is gone: an interrupted save removed its temp file
        assert _temp_files(out) == [], how
