"""What real clusters do to a job: kill a worker, lose a peer, never start one, press Ctrl-C.

Every test starts real processes and looks at them from the outside (/proc): a fault must end in a
clear message and an exit code, never a hang, never an orphan process (`reaped` checks that every
process of the run is gone), never a broken checkpoint.
Independent runs of one test go concurrently, to keep the wall time down on a small box.
"""

import copyreg
import errno
import inspect
import multiprocessing.synchronize
import os
import random
import re
import select
import signal
import socket
import subprocess
import sys
import time
from contextlib import suppress
from datetime import timedelta
from pathlib import Path
from types import FrameType

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from conftest import cli_env, metrics, progress, tiny
from mnist_ddp.core import distributed
from mnist_ddp.joining import identity, rendezvous
from mnist_ddp.launchers import worker
from mnist_ddp.outputs import checkpoint
from procfs import (
    children,
    describe,
    env_of,
    finish,
    free_port,
    marked_env,
    marked_pids,
    needs_proc,
    reaped,
    spawned_workers,
    start,
    wait_for,
)

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
    # Deterministic resume: the same steps in the same order, so the very same accuracy (not just a band).
    assert metrics(killed)[-1]["test_accuracy"] == metrics(calm)[-1]["test_accuracy"]
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

BIG = 2_000_000  # floats: 8 MB, each save takes a while


def _payload(i: int, size: int = BIG) -> dict:
    return {"model": {"w": torch.full((size,), float(i))}, "i": i}


def _consistent(path: Path, size: int = BIG) -> int:
    """The checkpoint's counter, after checking that every byte of it belongs to that one save."""
    ckpt = checkpoint.load(path)
    assert torch.equal(ckpt["model"]["w"], torch.full((size,), float(ckpt["i"])))
    return ckpt["i"]


def _save_forever(path: Path, first: int, keep_previous: bool, size: int = BIG, ready: int | None = None) -> None:
    """The writer, in a forked child: save, save, save… until it is killed, or interrupted (SIGINT is a
    KeyboardInterrupt, as in a run). `ready`: a pipe it writes one byte to once it handles SIGINT so."""
    try:
        torch.set_num_threads(1)  # the parent's OpenMP threads did not survive the fork; run without them
        signal.signal(signal.SIGINT, signal.default_int_handler)
        if ready is not None:
            os.write(ready, b"!")
        i = first
        while True:
            i += 1
            checkpoint.save(path, _payload(i, size), keep_previous=keep_previous)
    finally:
        os._exit(1)


def _reap(writer: int, after: str) -> None:
    """Wait for the forked `writer` to end; past HANG seconds, SIGKILL it and fail (a hang guard)."""
    handle = os.pidfd_open(writer)
    try:
        if not select.select([handle], [], [], HANG)[0]:
            os.kill(writer, signal.SIGKILL)
            os.waitpid(writer, 0)
            pytest.fail(f"the writer was still saving {HANG} s after {after}")
    finally:
        os.close(handle)
    os.waitpid(writer, 0)


@pytest.mark.parametrize("keep_previous", [False, True], ids=["plain", "rotating (checkpoint.prev.pt)"])
def test_sigkill_during_save_leaves_the_old_or_the_new_checkpoint(tmp_path: Path, keep_previous: bool) -> None:
    """Ten writers, each SIGKILLed at a random moment; after every kill the newest checkpoint loads and is
    whole, and a kept previous one is whole and older."""
    path = tmp_path / "checkpoint.pt"
    checkpoint.save(path, _payload(0))
    interrupted, rng = 0, random.Random(0)
    for round_ in range(1, 11):
        first = round_ * 1_000_000
        writer = os.fork()  # milliseconds, where a fresh interpreter would take seconds
        if writer == 0:
            _save_forever(path, first, keep_previous)
        wait_for("the writer's first save", lambda first=first: _consistent(path) > first, HANG, 0.01)
        time.sleep(rng.uniform(0, 0.1))  # a save takes tens of milliseconds: most kills land inside one
        os.kill(writer, signal.SIGKILL)
        _reap(writer, "its SIGKILL")
        now = _consistent(path)  # there, loads, and is whole
        assert now > first  # the newest complete save, or one before it: never garbage, never lost
        if keep_previous:
            assert _consistent(checkpoint.previous(path)) <= now  # the same file while a save was rotating
        interrupted += bool(_temp_files(tmp_path))
    assert interrupted > 0, "no kill landed inside a save; the test proved nothing"
    checkpoint.save(path, _payload(-1))  # the next save clears what killed writers left behind
    assert _temp_files(tmp_path) == []
    assert _consistent(path) == -1


def test_ctrl_c_during_rotating_saves_never_loses_checkpoint_pt(tmp_path: Path) -> None:
    """Ctrl-C (or the launcher's death, which a worker turns into one) while rank 0 saves: 200 writers, each
    interrupted at a random moment; checkpoint.pt and checkpoint.prev.pt are there and load after every one.
    (CI found a run's checkpoint.pt gone: renaming the old file aside and then the new one in left a moment
    without it, and an interrupt there also removed the new one; about 1 round in 15 lost it.)"""
    path, rng = tmp_path / "checkpoint.pt", random.Random(0)
    for _ in range(2):
        checkpoint.save(path, _payload(0, size=4), keep_previous=True)
    for round_ in range(1, 201):
        ready, said = os.pipe()
        writer = os.fork()
        if writer == 0:
            _save_forever(path, round_ * 1_000_000, keep_previous=True, size=4, ready=said)
        os.read(ready, 1)
        os.close(ready), os.close(said)
        time.sleep(rng.uniform(0, 0.01))
        os.kill(writer, signal.SIGINT)
        _reap(writer, "its SIGINT")
        assert _consistent(path, size=4) >= _consistent(checkpoint.previous(path), size=4)


def test_ctrl_c_where_torch_saves_pickler_swallows_it_still_stops_the_save(tmp_path: Path) -> None:
    """The interrupt lands inside copyreg._slotnames's `try: cls.__slotnames__ = names`, whose bare `except:`
    swallows a KeyboardInterrupt. torch.save's pickler runs it for every tensor (the OrderedDict of hooks cannot
    keep the answer), so a Ctrl-C handled there would be lost and a writer of the test above would save on
    (interrupts.py). A tracer sends SIGINT at that very line: the save still ends in a KeyboardInterrupt, and
    leaves no temp file."""
    source, first = inspect.getsourcelines(copyreg._slotnames)
    line = first + next(i for i, text in enumerate(source) if "cls.__slotnames__ = names" in text)
    landed = []

    def at_the_line(frame: FrameType, event: str, arg: object) -> object:  # sys.settrace's local tracer
        if event == "line" and frame.f_lineno == line and not landed:
            landed.append(line)
            signal.raise_signal(signal.SIGINT)
        return at_the_line

    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    sys.settrace(lambda frame, event, arg: at_the_line if frame.f_code is copyreg._slotnames.__code__ else None)
    try:
        with pytest.raises(KeyboardInterrupt):
            checkpoint.save(tmp_path / "checkpoint.pt", _payload(1, size=4))
    finally:
        sys.settrace(None)
        signal.signal(signal.SIGINT, previous)
    assert landed, "no SIGINT landed inside copyreg._slotnames: the test proved nothing"
    assert _temp_files(tmp_path) == []


def test_rotating_save_without_hard_links_still_keeps_the_previous(tmp_path: Path, monkeypatch) -> None:
    """Where the file system refuses hard links (some FUSE and SMB mounts: EPERM), the old file is renamed aside."""
    path = tmp_path / "checkpoint.pt"
    checkpoint.save(path, _payload(1))

    def refused(src: Path, dst: Path) -> None:
        raise PermissionError(errno.EPERM, "Operation not permitted")
    monkeypatch.setattr(os, "link", refused)
    checkpoint.save(path, _payload(2), keep_previous=True)
    assert (_consistent(path), _consistent(checkpoint.previous(path))) == (2, 1)
    assert _temp_files(tmp_path) == []


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
                                  ("could not join the 1 other process", "rank 1 never reached the rendezvous store")),
    "node 1 alone (-n 2 -nr 1)": (["-n", "2", "-g", "1", "-nr", "1", "--master-addr", "127.0.0.1"], {},
                                  ("found nobody listening",)),
    "torchrun-style env, rank 1 never started": ([], {"RANK": "0", "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1"},
                                                  ("could not join the 1 other process",
                                                   "rank 1 never reached the rendezvous store")),
    "torchrun-style env, rank 0 never started": ([], {"RANK": "1", "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1"},
                                                  ("found nobody listening",)),
    "srun-style env, task 0 never started": ([], {"SLURM_PROCID": "1", "SLURM_NTASKS": "2",
                                                  "SLURM_NODELIST": "127.0.0.1"}, ("found nobody listening",)),
}


def test_peer_that_never_arrives_ends_in_a_clear_error(tmp_path: Path) -> None:
    """Each case its own --timeout (4, 5, … s), and each process's one line says it waited that long: the wait it
    gave up after is the flag's, not a default (torch's is 30 minutes). The seconds each took are printed, not
    asserted: HANG only catches a process that never gives up."""
    env, mark = marked_env()
    runs = {}
    with reaped(mark):
        for n, (case, (args, extra, _)) in enumerate(NEVER.items()):
            port = str(free_port())
            case_env = env | extra | ({"MASTER_PORT": port} if extra else {})
            runs[case] = (time.monotonic(), start(
                [*_train(tmp_path / f"out{n}"), "--timeout", str(4 + n), *args,
                 *([] if extra else ["--master-port", port])], case_env, tmp_path, tmp_path / f"{n}.log"))
        for n, (case, (started, proc)) in enumerate(runs.items()):
            rc, log = finish(proc, tmp_path / f"{n}.log", HANG)
            print(f"{case}: exit {rc} after {time.monotonic() - started:.1f} s (--timeout {4 + n})")
            assert rc == 2, f"{case}: {log}"
            assert all(said in log for said in NEVER[case][2]), f"{case}: {log}"
            assert f" within {4 + n} s " in _last_error(log), f"{case}: {log}"
            assert "Traceback" not in log, f"{case}: {log}"


# --- a peer that dies or hangs, with nobody to restart it ----------------------------------------------

def _last_error(log: str) -> str:
    return next(line for line in reversed(log.splitlines()) if line.startswith("mnist-ddp: error: "))


# case -> (launched by: hand (RANK/WORLD_SIZE, rank 0 hosts the store) or spawn (-g 3), the rank hit, the signal)
HIT = {"rank 2 killed": ("hand", 2, "SIGKILL"), "rank 2 frozen": ("hand", 2, "SIGSTOP"),
       "rank 0 frozen, with the store it hosts": ("hand", 0, "SIGSTOP"),
       "spawned child frozen": ("spawn", None, "SIGSTOP")}


def test_survivors_name_the_rank_that_died_or_froze(tmp_path: Path) -> None:
    """Worlds of 3, nobody to restart the rank that is SIGKILLed or frozen with SIGSTOP; started by hand with
    RANK and WORLD_SIZE (as srun or a static launcher would), or by our own spawn (whose parent prints a child's
    line). Every survivor exits 1 with one line naming the rank, its host and pid, dead or stopped, and what its
    last beat said; the checkpoint still loads. The seconds from the signal to each survivor's line are printed
    (a freeze first waits --timeout 10)."""
    env, mark = marked_env({"WORLD_SIZE": "3", "MASTER_ADDR": "127.0.0.1"})
    args, host = ("--epochs", "50", "--timeout", "10", "--checkpoint-every", "2"), socket.gethostname()
    jobs: dict[str, list] = {}
    with reaped(mark):
        for n, (case, (launcher, _, _)) in enumerate(HIT.items()):
            out = tmp_path / str(n)
            if launcher == "hand":
                port = str(free_port())
                jobs[case] = [start(_train(out, *args), env | {"RANK": str(r), "MASTER_PORT": port}, tmp_path,
                                    tmp_path / f"{n}-{r}.log") for r in range(3)]
            else:
                plain = {k: v for k, v in env.items() if k != "WORLD_SIZE"}
                jobs[case] = [start(_train(out, *args, "-n", "1", "-g", "3"), plain, tmp_path, tmp_path / f"{n}.log")]
        victims, sent = {}, {}
        for n, (case, procs) in enumerate(jobs.items()):
            _, rank, how = HIT[case]
            wait_for(f"{case}: training", lambda out=tmp_path / str(n): progress(out), HANG, running=procs[0])
            victims[case] = procs[rank].pid if rank is not None else max(spawned_workers(procs[0].pid))
            os.kill(victims[case], getattr(signal, how))
            sent[case] = time.time()
        for n, (case, procs) in enumerate(jobs.items()):
            _, rank, how = HIT[case]
            waits = []
            for r, proc in enumerate(procs):
                if r == rank:
                    continue
                path = tmp_path / (f"{n}-{r}.log" if rank is not None else f"{n}.log")
                rc, log = finish(proc, path, HANG)
                print(f"{case}: survivor {r} said so {path.stat().st_mtime - sent[case]:.1f} s after the signal")
                line = _last_error(log)
                assert rc == 1 and "Traceback" not in log, f"{case}: {log}"
                assert "lost contact with the other processes" in line and "--resume" in line, line
                waited = re.search(r"\(Timed out waiting (\d+)ms for (send|recv) operation to complete\)", line)
                waits.append(waited[1] if waited else "closed" if "Connection closed by peer" in line else line)
                who = f"{'' if rank is None else f'rank {rank} '}({host}, pid {victims[case]})"
                if rank == 0:  # it took the store down with it: no last beat to quote
                    assert f"{who}, which hosts the rendezvous store, stopped answering: stopped (SIGSTOP" in line, line
                else:
                    fate = "gone (" if how == "SIGKILL" else "stopped (SIGSTOP"
                    assert f"{who} stopped answering: {fate}" in line, line
                    assert re.search(r"; its last beat said it was (training \(epoch \d+, step \d+\)|evaluating)\.",
                                     line), line
            # How long they waited, in gloo's words. A dead peer: not at all, its connection closed at once. A frozen
            # one: the survivor waiting on it, the whole --timeout 10; another survivor may have been waiting on
            # that one instead (gloo's ring), and then hears its connection close when it gives up.
            if how == "SIGKILL":
                assert not any(w.isdigit() for w in waits), waits  # no survivor timed out, whatever the wait
            else:
                assert "10000" in waits and set(waits) <= {"10000", "closed"}, waits
            with suppress(ProcessLookupError):  # spawn's parent killed its frozen child already
                os.kill(victims[case], signal.SIGKILL)
            assert progress(tmp_path / str(n)) is not None


def _beats(port: int) -> list[str]:
    """The heartbeat records in a job's rendezvous store (rank 0 hosts it): keys mnist_ddp/heartbeat/<rank>."""
    store = dist.TCPStore("127.0.0.1", port, None, False, timedelta(seconds=10))
    return [f"rank {r}" for r in range(2) if store.check([f"mnist_ddp/heartbeat/{r}"])]


def test_heartbeat_0_turns_it_off(tmp_path: Path) -> None:
    """Two jobs of 2 ranks started by hand, `--heartbeat 0` and the default. Once both train and the default's
    beats are in its store, the other's store holds none; rank 1 of each is SIGKILLed: the default names it, the
    one without beats cannot, and says so."""
    env, mark = marked_env({"WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1"})
    args = ("--epochs", "50", "--timeout", "30", "--checkpoint-every", "2")
    with reaped(mark):
        jobs = {beat: (port := free_port(), [start(_train(tmp_path / beat, *args, "--heartbeat", beat),
                                                   env | {"RANK": str(r), "MASTER_PORT": str(port)}, tmp_path,
                                                   tmp_path / f"{beat}-{r}.log") for r in range(2)])
                for beat in ("0", "1")}
        for beat, (_, procs) in jobs.items():
            wait_for(f"--heartbeat {beat}: training", lambda beat=beat: progress(tmp_path / beat), HANG,
                     running=procs[0])
        wait_for("the default's beats", lambda: _beats(jobs["1"][0]) == ["rank 0", "rank 1"], HANG)
        assert _beats(jobs["0"][0]) == []
        for _, procs in jobs.values():
            os.kill(procs[1].pid, signal.SIGKILL)
        lines = {}
        for beat, (_, procs) in jobs.items():
            rc, log = finish(procs[0], tmp_path / f"{beat}-0.log", HANG)
            assert rc == 1 and "Traceback" not in log, log
            lines[beat] = _last_error(log)
    assert f"rank 1 ({socket.gethostname()}, pid {jobs['1'][1][1].pid}) stopped answering: gone" in lines["1"], lines
    assert "stopped answering:" not in lines["0"] and "one of them crashed, was killed or stopped answering for " \
        "--timeout 30 s (see its log)" in lines["0"], lines


def _leave_a_frozen_peer(rank: int, port: int, said: str) -> None:
    """Rank 1 waits in an all-reduce that rank 0 never joins, then leaves the group as after an error, and writes
    what teardown returned to `said`; rank 0, frozen as far as the group can tell, stays until then."""
    torch.set_num_threads(1)
    distributed.join(identity.spawned(0, rank, 2, 1, "127.0.0.1", port), torch.device("cpu"), "gloo", 60)
    if rank == 0:
        wait_for("rank 1 to leave", Path(said).exists, HANG)
    else:
        dist.all_reduce(torch.ones(4), async_op=True)
        Path(said).write_text(str(distributed.teardown(together=False)))
    os._exit(0)  # what a failed -g child does (worker.leave): the group may still be closing


def test_a_rank_leaves_the_group_at_once_when_its_peer_froze(tmp_path: Path) -> None:
    """After an error a rank must not wait on a peer that froze: closing the group joins gloo's threads, which wait
    on it for --timeout (60 s here). teardown gives up on closing and says so (False), while the peer is still
    there: it never answered, and it ends only once rank 1 has written what teardown returned."""
    store = rendezvous.host_store("127.0.0.1", 0, 2, timedelta(seconds=60))
    said = tmp_path / "teardown"
    mp.spawn(_leave_a_frozen_peer, args=(store.port, str(said)), nprocs=2, join=True)
    del store
    assert said.read_text() == "False"


def test_spawned_worker_killed_stops_the_job(tmp_path: Path) -> None:
    """Without a restart policy, mnist-ddp's own launcher stops the other workers and names the dead one; the
    survivor, told to stop with its peer gone, ends by itself: the launcher never has to SIGKILL it."""
    env, mark = marked_env()
    out = tmp_path / "out"
    with reaped(mark):
        parent = start([*_train(out, "-n", "1", "-g", "2", "--epochs", "50", "--checkpoint-every", "2")], env,
                       tmp_path, tmp_path / "log")
        wait_for("training", lambda: progress(out), HANG, running=parent)
        victim = spawned_workers(parent.pid)[0]
        os.kill(victim, signal.SIGKILL)
        rc, log = finish(parent, tmp_path / "log", HANG)
    assert rc == 1, log
    assert "was killed by SIGKILL" in log and "--resume" in log, log
    assert "was still there" not in log, log  # forkserver.Workers.stop's line for a worker it had to kill
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


def test_sigterm_to_the_group_returns_only_when_every_worker_has_ended(tmp_path: Path) -> None:
    """SIGTERM to the whole process group (`kill -- -PGID`, scancel, a container's stop) ends the fork server at
    once, and multiprocessing then reports every worker ended while they still run (a CI run found them alive 20 s
    after the launcher had returned). With one worker that cannot unwind (SIGSTOPped), the launcher still returns
    only once every worker has ended: it kills the stopped one after its grace. Nothing of the job is left at that
    moment, looked at without waiting: before the fix the stopped one was."""
    env, mark = marked_env()
    out = tmp_path / "run"
    with reaped(mark):
        proc = start([*_train(out, "-g", "2", "--epochs", "500", "--timeout", "90")], env, tmp_path,
                     tmp_path / "log")
        wait_for("training", lambda: progress(out), HANG, running=proc)
        workers = spawned_workers(proc.pid)
        os.kill(workers[1], signal.SIGSTOP)
        os.killpg(proc.pid, signal.SIGTERM)
        rc, log = finish(proc, tmp_path / "log", HANG)
        # (multiprocessing's resource tracker, no worker, ends by itself a moment after the launcher: not counted)
        left = [pid for pid in marked_pids(mark) if pid in workers]
        assert left == [], f"still there when the launcher returned: {describe(left)}\n{log}"
        assert rc == 130 and "mnist-ddp: interrupted." in log and "Traceback" not in log, log


CTRL_C_AT_FORK = """
import multiprocessing, signal, sys
from mnist_ddp import cli
from mnist_ddp.launchers import forkserver, launch

class CtrlC:  # unpickled in the child with the other arguments, before launch._spawned runs: Ctrl-C then
    def __reduce__(self):
        return signal.raise_signal, (signal.SIGINT,)

signal.signal(signal.SIGINT, signal.default_int_handler)  # as from a terminal (in the background it is ignored)
forkserver.start()
cfg = cli.configure(["train", "-g", "1", "--dataset", "synthetic", "--out", sys.argv[1]])
child = multiprocessing.get_context("forkserver").Process(
    target=launch._spawned, args=(0, cfg, "127.0.0.1", 1, None, None, {}, None, CtrlC()))
child.start()
child.join(60)
print(child.exitcode)
"""


def test_ctrl_c_while_a_worker_is_being_started_ends_it_as_interrupted(tmp_path: Path) -> None:
    """A Ctrl-C that reaches a `-g` worker while multiprocessing still starts it (here: as its arguments are
    unpickled), before our code could catch it, is held and then unwinds the worker as any Ctrl-C does: exit 130,
    which its launcher reports as interrupted, not a silent exit code 1."""
    r = subprocess.run([sys.executable, "-c", CTRL_C_AT_FORK, str(tmp_path / "run")], env=cli_env(),
                       capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert r.returncode == 0 and r.stdout.split() == ["130"], r.stdout + r.stderr


def _report_while_joined(local_rank: int, port: int, out: str, seen: str) -> None:
    """A rank of a `-g 2` job (as launch.spawn starts one) whose rank 0 refuses an --out that holds a run: every
    rank's error is reported through `report`, which writes down whether the rank was still in the group."""
    from mnist_ddp import cli

    cfg = cli.configure(["train", *tiny(), "--out", out])
    ident = identity.spawned(0, local_rank, 2, 1, "127.0.0.1", port)
    report = lambda e: Path(seen, str(local_rank)).write_text(f"{dist.is_initialized()} {type(e).__name__}")  # noqa: E731
    with suppress(Exception):
        worker.run_worker(ident, cfg, claim_out=True, report=report)


def test_a_rank_reports_its_error_before_it_leaves_the_group(tmp_path: Path) -> None:
    """Leaving the group is what makes a peer fail next ("Connection closed by peer"), so a child hands its error
    to the launcher while still in the group: the launcher then shows the first failure's words, not an echo
    (docs/design/heartbeat.md). Two real gloo ranks; rank 0's error is its own, rank 1's the relayed one."""
    out, seen = tmp_path / "run", tmp_path / "seen"
    out.mkdir()
    (out / "metrics.jsonl").write_text("{}\n")  # a run is there already: rank 0 refuses the --out, inside the group
    seen.mkdir()
    store = rendezvous.host_store("127.0.0.1", 0, 2, timedelta(seconds=60))
    mp.spawn(_report_while_joined, args=(store.port, str(out), str(seen)), nprocs=2, join=True)
    del store
    assert sorted(p.read_text() for p in seen.iterdir()) == ["True UserError", "True UserError"]


STILL_CLOSING = """
import atexit, sys
from mnist_ddp import cli
from mnist_ddp.core import distributed
from mnist_ddp.launchers import worker
from mnist_ddp.joining.identity import Identity
distributed.teardown = lambda together: False  # as when a dead peer holds the group's threads past LEAVE_S
atexit.register(lambda: print("the interpreter's exit ran", flush=True))
cfg = cli.configure(["train", "--dataset", "synthetic", "--out", sys.argv[1]])
worker.run_worker(Identity(), cfg, claim_out=True)
"""


def test_a_rank_whose_group_is_still_closing_ends_at_once_with_its_line(tmp_path: Path) -> None:
    """A rank started by a launcher not ours (torchrun, srun, mpirun) whose process group is still closing after an
    error ends at once (os._exit: the interpreter's exit would wait on the group's threads, up to --timeout), its
    error said once, as the command says it, with its exit code. Here --out holds a run: exit 2."""
    out = tmp_path / "run"
    out.mkdir()
    (out / "metrics.jsonl").write_text("{}\n")
    r = subprocess.run([sys.executable, "-c", STILL_CLOSING, str(out)], env=cli_env(), capture_output=True, text=True,
                       timeout=120, cwd=tmp_path)
    assert r.returncode == 2, r.stdout + r.stderr
    assert r.stderr.count("mnist-ddp: error:") == 1 and "already holds a run" in r.stderr, r.stderr
    assert "the interpreter's exit ran" not in r.stdout and "Traceback" not in r.stderr


def _frozen_after_the_last_step(rank: int, port: int, said: str, up: multiprocessing.synchronize.Barrier) -> None:
    """Both ranks pass a last collective; rank 1 then freezes (SIGSTOP) and rank 0, done, leaves as a finished
    rank does: its wait for rank 1 fails after --timeout, and it writes what that raised to `said`. `up`: a barrier
    both pass once started, so the join's 4 s count no start-up."""
    torch.set_num_threads(1)
    up.wait(HANG)
    d = distributed.join(identity.spawned(0, rank, 2, 1, "127.0.0.1", port), torch.device("cpu"), "gloo", 4,
                         heartbeat_s=0.2)
    d.all_sum(torch.ones(1))
    if rank == 1:
        os.kill(os.getpid(), signal.SIGSTOP)
    assert d.heartbeat is not None
    d.heartbeat.stop("finished", culprit=False)
    try:
        worker.leave_group(rank, finished=True, diagnose=d.heartbeat.diagnose)
        Path(said).write_text("left without a word")
    except distributed.PeerFailure as e:
        Path(said).write_text(str(e))


def test_a_rank_frozen_after_the_last_step_is_named_by_the_one_left_waiting(tmp_path: Path) -> None:
    """A rank frozen after the run's last collective (while rank 0 saves the final checkpoint, say), without
    --recover: the other's last wait fails after --timeout, and its one line names the frozen rank by its pid (the
    heartbeat's diagnosis), as a collective's failure does during training."""
    said = tmp_path / "said"
    store = rendezvous.host_store("127.0.0.1", 0, 2, timedelta(seconds=60))
    ctx = mp.get_context("spawn")
    up = ctx.Barrier(2)
    ranks = [ctx.Process(target=_frozen_after_the_last_step, args=(r, store.port, str(said), up)) for r in range(2)]
    for p in ranks:
        p.start()
    try:
        ranks[0].join(HANG)
        frozen = ranks[1].pid
        assert said.read_text().startswith("rank 0 lost contact with the other processes after the run's last step"), \
            said.read_text()
        assert f"pid {frozen})" in said.read_text() and "stopped (SIGSTOP" in said.read_text(), said.read_text()
    finally:
        for p in ranks:
            p.kill()
            p.join(30)
