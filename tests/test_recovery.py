"""--recover: a lost rank costs no step. Real -g runs in which a rank is SIGKILLed at a chosen step (the test hook
lossplan.LOSE_VAR) or frozen (SIGSTOP), against the same run undisturbed: the same saved bytes under --bitwise
(SHA-256 of every tensor, BatchNorm's buffers included), the same weights up to float rounding without it, and the
same epochs, samples, global batch and lr in metrics.jsonl; also on two machines (network namespaces).

The run is test_bitwise.py's chaotic one (fp32 SGD, momentum 0.9: any deviation grows), 2 epochs of 480 images in
micro-batches of 8, so M = 3 gives 20 steps an epoch and M = 4 gives 15.
"""

import json
import multiprocessing
import multiprocessing.process
import os
import re
import signal
import socket
import subprocess
import threading
import time
import uuid
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from conftest import metrics, progress, run_cli, spawn_gloo, tiny
from datafiles import ONE_THREAD
from mnist_ddp.common.config import TrainConfig
from mnist_ddp.common.errors import UserError
from mnist_ddp.core.distributed import Dist, PeerFailure
from mnist_ddp.joining.identity import Identity
from mnist_ddp.launchers import launch, worker
from mnist_ddp.outputs import checkpoint
from mnist_ddp.recovery import lossplan, recovery
from netns import netns_pair
from procfs import finish, marked_env, needs_proc, reaped, spawned_workers, start, wait_for

pytestmark = needs_proc

ARGS = [*tiny(480, 100, epochs=2), "--batch-size", "8", "--optimizer", "sgd", "--lr", "0.05", "--momentum", "0.9",
        "--scheduler", "none", "--amp", "off", "--seed", "3"]
RUN_TIMEOUT = 240  # seconds: a hang detector on a shared box, not a timing assertion
SAME = ("epoch", "train_samples", "global_batch", "lr", "batch_size")  # what metrics.jsonl must repeat


def _train(out: Path, *extra: str, lose: str = "") -> str:
    env = {**ONE_THREAD, **({lossplan.LOSE_VAR: lose} if lose else {})}
    r = run_cli("train", *extra, "--out", str(out), cwd=out.parent, env=env, timeout=RUN_TIMEOUT)
    assert r.returncode == 0, r.stdout + r.stderr
    return r.stdout + r.stderr


def _model(out: Path) -> dict[str, torch.Tensor]:
    return checkpoint.load(out / "checkpoint.pt")["model"]


def _weights(out: Path) -> torch.Tensor:
    """The trained parameters (not BatchNorm's running statistics, which only evaluation uses), as one vector."""
    return torch.cat([v.flatten().float() for k, v in _model(out).items() if "running" not in k and "num_" not in k])


def _recover_lines(log: str) -> list[str]:
    return [line for line in log.splitlines() if line.startswith("recover: ")]


def _same_record(a: Path, b: Path) -> None:
    assert [{k: m[k] for k in SAME} for m in metrics(a)] == [{k: m[k] for k in SAME} for m in metrics(b)]


@pytest.fixture(scope="module")
def bitwise(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[Path, str]]:
    """Each world undisturbed, and with one rank lost in epoch 1; M = 4 also with two losses, rank 0 first and
    the second where epoch 2 begins (step 15 done)."""
    root, found = tmp_path_factory.mktemp("recover"), {}
    runs = (("2", 2, ""), ("2, lost 1 at 7", 2, "1:7"), ("3", 3, ""), ("3, lost 2 at 5", 3, "2:5"),
            ("4", 4, ""), ("4, lost 3 at 9", 4, "3:9"), ("4, lost 0 at 4 and 2 at 15", 4, "0:4,2:15"))
    for name, world, lose in runs:
        out = root / name.replace(" ", "_").replace(",", "")
        found[name] = (out, _train(out, *ARGS, "--bitwise", "-g", str(world), "--recover", lose=lose))
    return found


@pytest.mark.parametrize("world, lost", [(2, "1 at 7"), (3, "2 at 5"), (4, "3 at 9"), (4, "0 at 4 and 2 at 15")])
def test_survivors_save_the_undisturbed_runs_bytes(bitwise: dict[str, tuple[Path, str]], world: int,
                                                   lost: str) -> None:
    """SIGKILL a rank at a step: the others re-form, redo that step and finish the same run, to the bit."""
    calm, (out, log) = bitwise[str(world)][0], bitwise[f"{world}, lost {lost}"]
    lines = _recover_lines(log)
    assert len(lines) == lost.count(" and ") + 1, log
    for line, (rank, step) in zip(lines, [part.split(" at ") for part in lost.split(" and ")]):
        assert line.startswith(f"recover: rank {rank} (") and "re-formed as generation" in line, line
        epoch, in_epoch = divmod(int(step), 20 if world == 3 else 15 if world == 4 else 30)
        assert f"lost at epoch {epoch + 1}, step {in_epoch + 1} " in line, line
    assert f"after 2 epochs, world size {world - len(lines)};" in log, log
    assert checkpoint.digest(_model(out)) == checkpoint.digest(_model(calm))
    _same_record(out, calm)
    assert progress(out) == progress(calm)
    assert not _recover_lines(bitwise[str(world)][1])


def test_two_machines_lose_a_rank_each_and_save_the_same_bytes(bitwise: dict[str, tuple[Path, str]],
                                                               tmp_path: Path) -> None:
    """-n 2 -g 2 on two network namespaces: rank 2 (node 1) is lost in epoch 1 and rank 0 (node 0) in epoch 2;
    the two left, one on each machine, re-form over the veth cable and save the bytes of the undisturbed run."""
    addrs = ("10.79.0.1", "10.79.0.2")
    env, mark = marked_env({**ONE_THREAD, lossplan.LOSE_VAR: "2:5,0:20"})
    outs = [tmp_path / f"node{n}-disk" for n in range(2)]
    with netns_pair(f"mrec-{uuid.uuid4().hex[:6]}", addrs) as names, reaped(mark):
        nodes = [start(["mnist_ddp", "train", *ARGS, "--bitwise", "--recover", "-n", "2", "-g", "2", "-nr", str(n),
                        "--master-addr", addrs[0], "--master-port", "29420", "--out", str(outs[n])], env, tmp_path,
                       tmp_path / f"node{n}.log", prefix=["ip", "netns", "exec", names[n]]) for n in range(2)]
        results = [finish(p, tmp_path / f"node{n}.log", RUN_TIMEOUT) for n, p in enumerate(nodes)]
    for rc, log in results:
        assert rc == 0, log
    lines = _recover_lines(results[0][1] + results[1][1])
    assert [line.split(" (")[0] for line in lines] == ["recover: rank 2", "recover: rank 0"], lines
    # rank 0 was lost: the new rank 0, rank 1 on node 0, wrote the rest of --out there
    assert checkpoint.digest(_model(outs[0])) == checkpoint.digest(_model(bitwise["4"][0]))
    _same_record(outs[0], bitwise["4"][0])


@pytest.mark.parametrize("gpus", [1, 2])
def test_node_0s_launcher_is_lost_and_node_1s_takes_the_store_over(bitwise: dict[str, tuple[Path, str]],
                                                                   tmp_path: Path, gpus: int) -> None:
    """-n 2 -g G on two network namespaces: node 0's launcher, which holds the store, is SIGKILLed where step 3
    begins ("0:2:launcher") and node 0's ranks end with it; node 1's meet at the standby store node 1's launcher
    held from the start, once it proved it holds the job's secret, and finish the run in node 1's --out with the
    undisturbed run's bytes."""
    addrs = ("10.79.2.1", "10.79.2.2")
    env, mark = marked_env({**ONE_THREAD, "MNIST_DDP_SECRET": "a shared secret", lossplan.LOSE_VAR: "0:2:launcher"})
    outs = [tmp_path / f"node{n}-disk" for n in range(2)]
    with netns_pair(f"msuc-{uuid.uuid4().hex[:6]}", addrs) as names, reaped(mark):
        nodes = [start(["mnist_ddp", "train", *ARGS, "--bitwise", "--recover", "-n", "2", "-g", str(gpus), "-nr",
                        str(n), "--master-addr", addrs[0], "--master-port", "29421", "--out", str(outs[n])], env,
                       tmp_path, tmp_path / f"node{n}.log", prefix=["ip", "netns", "exec", names[n]]) for n in range(2)]
        results = [finish(p, tmp_path / f"node{n}.log", RUN_TIMEOUT) for n, p in enumerate(nodes)]
    assert results[0][0] == -signal.SIGKILL, results[0][1]
    assert results[1][0] == 0, results[1][1]
    lines = _recover_lines(results[1][1])
    assert len(lines) == 1 and "lost at epoch 1," in lines[0], lines
    assert re.findall(r"rank (\d+) \(", lines[0].split(" lost at")[0]) == [str(r) for r in range(gpus)], lines
    assert (f"node 0's launcher, which held the rendezvous store, is gone: node 1's ({addrs[1]}:" in lines[0]
            and "re-formed as generation 1 " in lines[0]), lines
    calm = bitwise[str(2 * gpus)][0]
    assert checkpoint.digest(_model(outs[1])) == checkpoint.digest(_model(calm))
    _same_record(outs[1], calm)


def test_the_runs_differ_where_they_should(bitwise: dict[str, tuple[Path, str]]) -> None:
    """Control: other global batches (M = 2, 3, 4) are other runs, so the hash above can fail."""
    hashes = {checkpoint.digest(_model(bitwise[w][0])) for w in ("2", "3", "4")}
    assert len(hashes) == 3


def test_without_bitwise_the_same_run_up_to_rounding(tmp_path: Path) -> None:
    """DDP's mean over 2 survivors instead of 3 sums in another order: 10 steps later the weights agree to float
    rounding, where another seed (the control) is far off."""
    args = [*ARGS[:3], "240", *ARGS[4:], "-g", "3", "--recover"]  # 240 images: 10 steps an epoch
    calm, lost, other = tmp_path / "calm", tmp_path / "lost", tmp_path / "other"
    _train(calm, *args, "--epochs", "1")
    log = _train(lost, *args, "--epochs", "1", lose="1:3")
    _train(other, *args, "--epochs", "1", "--seed", "4")
    assert len(_recover_lines(log)) == 1, log
    a, b, c = _weights(calm), _weights(lost), _weights(other)
    assert 0 < float((a - b).norm() / a.norm()) < 1e-6
    assert float((a - c).norm() / a.norm()) > 1e-2
    _same_record(lost, calm)


def test_a_frozen_rank_is_presumed_lost_and_refused_when_it_wakes(tmp_path: Path) -> None:
    """SIGSTOP a rank: the others' collective times out (--timeout), its beat stands still, and they go on without
    it; woken (SIGCONT), it finds the run re-formed without it and leaves with one line, and the job succeeds.
    Three epochs after the loss give the woken rank seconds to speak on a loaded machine: the launcher stops a
    rank still running SETTLE_S after another finished the run."""
    env, mark = marked_env()
    out, log = tmp_path / "out", tmp_path / "log"
    with reaped(mark):
        run = start(["mnist_ddp", "train", *tiny(4800, 100, epochs=4), "-g", "3", "--recover", "--timeout", "10",
                     "--checkpoint-every", "2", "--out", str(out)], env, tmp_path, log)
        wait_for("training", lambda: progress(out), RUN_TIMEOUT, running=run)
        frozen = spawned_workers(run.pid)[2]
        os.kill(frozen, signal.SIGSTOP)
        try:
            wait_for("a recovery", lambda: "recover: " in log.read_text(), RUN_TIMEOUT, running=run)
        finally:
            os.kill(frozen, signal.SIGCONT)
        rc, said = finish(run, log, RUN_TIMEOUT)
    assert rc == 0, said
    lines = _recover_lines(said)
    assert len(lines) == 1 and lines[0].startswith("recover: rank 2 ("), said
    presumed = [line for line in said.splitlines() if "was presumed lost" in line]
    assert presumed == ["mnist-ddp: rank 2 was presumed lost by the other processes, which went on without "
                        "it (generation 1); this process stops."], said
    assert [m["epoch"] for m in metrics(out)] == [1, 2, 3, 4]


@pytest.mark.parametrize("launcher", ["torchrun", "SLURM"])
def test_recover_is_refused_where_the_store_dies_with_a_rank(launcher: str) -> None:
    """Under torchrun the agent restarts the ranks, under srun rank 0 holds the store: --recover is refused."""
    ident = Identity(rank=1, world_size=2, store_host="agent" if launcher == "torchrun" else "rank0",
                     launcher=launcher)
    with pytest.raises(UserError, match=f"--recover needs mnist-ddp's own launcher .* under {launcher}"):
        recovery.for_run(ident, TrainConfig(recover=True))
    assert recovery.for_run(ident, TrainConfig()) is None


def _two_nodes(tmp_path: Path, env: dict[str, str]) -> Callable[..., subprocess.Popen]:
    """Starts node n of a `-n 2 -g 1 --recover --bitwise` run on loopback, its output in tmp_path/log."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = str(s.getsockname()[1])

    def node(n: int, log: str, *more: str, **extra: str) -> subprocess.Popen:
        return start(["mnist_ddp", "train", *ARGS, "--bitwise", "--recover", "--timeout", "120", "-n", "2", "-g", "1",
                      "-nr", str(n), "--master-addr", "127.0.0.1", "--master-port", port,
                      "--out", str(tmp_path / f"node{n}"), *more], {**env, **extra}, tmp_path, tmp_path / log)
    return node


@pytest.mark.parametrize("gpus", ["2", "1"])
def test_a_rank_that_wakes_after_the_run_finished_writes_nothing(tmp_path: Path, gpus: str) -> None:
    """-n 2 --recover: node 1's first rank is frozen for good, the others re-form and finish, and node 0's launcher
    ends with the store. Woken then, while node 1's launcher still stands, the rank must not re-form alone at node
    1's standby and train on from where it froze, writing its own outputs (before: it became rank 0 of a world of
    one; docs/design/recovery.md, "After the run"). With -g 2 node 1's launcher retired its standby when its other
    rank finished, so the rank stops and node 1 exits 0. With -g 1 no rank of node 1 finished: the rank finds at its
    standby the finish rank 0 signed there with the job's secret, and stops in one line, exit 1."""
    env, mark = marked_env({"MNIST_DDP_SECRET": "a shared secret"})
    node, outs = _two_nodes(tmp_path, env), [tmp_path / "node0", tmp_path / "node1"]
    # -g 1: node 1's launcher kills its only rank once stopped for its --timeout: let that outlast node 0's run
    more = [["--timeout", "10", "--checkpoint-every", "2"]] * 2 if gpus == "2" else [["--timeout", "10"],
                                                                                     ["--timeout", "120"]]
    with reaped(mark):
        nodes = [node(n, f"node{n}.log", "-g", gpus, *more[n]) for n in range(2)]
        wait_for("training", lambda: progress(outs[0]), RUN_TIMEOUT, running=nodes[0])
        frozen = spawned_workers(nodes[1].pid)[0]
        os.kill(frozen, signal.SIGSTOP)
        try:
            rc0, said0 = finish(nodes[0], tmp_path / "node0.log", RUN_TIMEOUT)
        finally:
            os.kill(frozen, signal.SIGCONT)  # the store's host gone, node 1's launcher still there
        rc1, said1 = finish(nodes[1], tmp_path / "node1.log", RUN_TIMEOUT)
    assert rc0 == 0 and len(_recover_lines(said0)) == 1, said0
    assert [m["epoch"] for m in metrics(outs[0])] == [1, 2]
    lines = said1.strip().splitlines()
    if gpus == "1":
        assert rc1 == 1 and len(lines) == 1 and "the run finished without it" in lines[0], said1
    else:
        assert rc1 == 0 and "re-formed" not in said1, said1
    assert not outs[1].exists() or not any(outs[1].iterdir()), (sorted(outs[1].iterdir()), said1)


def test_a_replacement_joins_and_the_world_grows_back(tmp_path: Path, bitwise: dict[str, tuple[Path, str]]) -> None:
    """-n 2 -g 1 on loopback: node 1's rank is lost at step 7 and node 1 is started again with the same command;
    it checks in, joins where step 41 begins (recovery.JOIN_VAR holds the run there for it), gets rank 0's state
    as bytes, and the run ends with the undisturbed run's bytes, at world 1 in epoch 1 and 2 in epoch 2."""
    calm, other = bitwise["2"][0], tmp_path / "other"
    _train(other, *ARGS, "--bitwise")  # the control: one process, M = 1, another run
    env, mark = marked_env({**ONE_THREAD, "MNIST_DDP_SECRET": "a shared secret"})
    node, out = _two_nodes(tmp_path, env), tmp_path / "node0"
    with reaped(mark):
        first = node(0, "node0.log", **{recovery.JOIN_VAR: "40"})
        lost = node(1, "lost.log", **{lossplan.LOSE_VAR: "1:7"})
        rc, said = finish(lost, tmp_path / "lost.log", RUN_TIMEOUT)
        assert rc != 0, said
        replacement = node(1, "replacement.log")
        results = [finish(p, tmp_path / log, RUN_TIMEOUT) for p, log in ((first, "node0.log"),
                                                                         (replacement, "replacement.log"))]
    for rc, log in results:
        assert rc == 0, log
    lines = _recover_lines(results[0][1])
    assert [line.split(" (")[0].split(";")[0] for line in lines] == [
        "recover: rank 1", "recover: rank 1 joined at epoch 2, step 11"], lines
    assert checkpoint.digest(_model(out)) == checkpoint.digest(_model(calm))
    assert checkpoint.digest(_model(other)) != checkpoint.digest(_model(calm))
    assert [m["world_size"] for m in metrics(out)] == [1, 2]
    assert [m["world_size"] for m in metrics(calm)] == [2, 2]
    _same_record(out, calm)


@pytest.mark.parametrize("again", ["40", "50"])
def test_another_runs_replacement_is_refused_and_a_regrown_world_survives_a_loss(
        tmp_path: Path, bitwise: dict[str, tuple[Path, str]], again: str) -> None:
    """Node 1 is lost at step 7; a replacement started with another --lr is refused (one line, exit 2) and the run
    goes on; the right replacement joins where step 41 begins and is lost in its turn where step `again` + 1
    begins (its first step, or later): node 0 finishes alone (a third generation) with the undisturbed run's
    bytes."""
    calm = bitwise["2"][0]
    env, mark = marked_env({**ONE_THREAD, "MNIST_DDP_SECRET": "a shared secret"})
    node, out = _two_nodes(tmp_path, env), tmp_path / "node0"
    with reaped(mark):
        first = node(0, "node0.log", **{recovery.JOIN_VAR: "40"})
        rc, said = finish(node(1, "lost.log", **{lossplan.LOSE_VAR: "1:7"}), tmp_path / "lost.log", RUN_TIMEOUT)
        assert rc != 0, said
        rc, refused = finish(node(1, "wrong.log", "--lr", "0.04"), tmp_path / "wrong.log", RUN_TIMEOUT)
        rc_again, lost_again = finish(node(1, "again.log", **{lossplan.LOSE_VAR: f"1:{again}"}), tmp_path / "again.log",
                                      RUN_TIMEOUT)
        rc_first, log = finish(first, tmp_path / "node0.log", RUN_TIMEOUT)
    sentences = [line for line in refused.splitlines() if line.startswith("mnist-ddp: ")]
    assert rc == 2 and len(sentences) == 1 and "lr 0.04" in sentences[0], refused
    assert rc_again != 0 and "run the same command again to rejoin them" in lost_again, lost_again
    assert rc_first == 0, log
    assert "refused " in log and "lr 0.04" in log, log
    assert [line.split(" (")[0].split(";")[0] for line in _recover_lines(log)] == [
        "recover: rank 1", "recover: rank 1 joined at epoch 2, step 11", "recover: rank 1"], log
    assert "as generation 3" in _recover_lines(log)[-1] and not _recover_lines(log)[1].endswith(":"), log
    assert checkpoint.digest(_model(out)) == checkpoint.digest(_model(calm))
    assert [m["world_size"] for m in metrics(out)] == [1, 1]
    _same_record(out, calm)


def _exit_at(deadline: float, code: int) -> None:
    time.sleep(max(0.0, deadline - time.monotonic()))
    os._exit(code)


class _SlowToRead:
    """A real child whose exit code takes 0.1 s to read: the window in which the other children end, widened."""

    def __init__(self, p: multiprocessing.process.BaseProcess) -> None:
        self.p = p

    @property
    def sentinel(self) -> int:
        return self.p.sentinel

    @property
    def exitcode(self) -> int | None:
        time.sleep(0.1)
        return self.p.exitcode


@pytest.mark.parametrize("codes, finished", [((1, 0, 0), True), ((1, 1, 1), False)])
def test_the_launcher_sees_its_last_children_end_while_it_looks(codes: tuple[int, ...], finished: bool) -> None:
    """Under --recover the launcher waits for every child. One child ends, and the last two end while the launcher
    reads the exit codes (0.35 s later, each read taking 0.1 s): it must still return, and say whether any finished
    the run, not wait on an empty list of running children for ever."""
    ctx, ends = multiprocessing.get_context("fork"), time.monotonic() + 1.0
    children = [ctx.Process(target=_exit_at, args=(ends + (0.35 if i else 0.0), code)) for i, code in enumerate(codes)]
    for p in children:
        p.start()
    result: list[bool] = []
    waiting = threading.Thread(target=lambda: result.append(launch.await_every_child(
        [_SlowToRead(p) for p in children])), daemon=True)
    waiting.start()
    waiting.join(30)
    for p in children:
        p.join(5)
    assert not waiting.is_alive(), "the launcher still waits after every child ended"
    assert result == [finished]


def _freeze() -> None:
    os.kill(os.getpid(), signal.SIGSTOP)
    os._exit(1)


def test_the_launcher_does_not_wait_for_ever_on_a_child_frozen_for_good() -> None:
    """A rank frozen for good (SIGSTOP, a machine half gone) is presumed lost and the others finish the run: the
    launcher must then end too, not wait for the frozen child for ever. One child finishes, the other is frozen;
    await_every_child returns (the run finished) while the frozen one is still there, for the launcher to stop."""
    ctx = multiprocessing.get_context("fork")
    children = [ctx.Process(target=os._exit, args=(0,)), ctx.Process(target=_freeze)]
    for p in children:
        p.start()
    result: list[bool] = []
    retired: list[int | None] = []  # the frozen child's exit code when the standby was retired, once per call
    waiting = threading.Thread(target=lambda: result.append(launch.await_every_child(
        children, finished_run=lambda: retired.append(children[1].exitcode))), daemon=True)
    try:
        waiting.start()
        waiting.join(30)
        assert not waiting.is_alive(), "the launcher still waits for the frozen child after the run finished"
        assert result == [True] and children[1].exitcode is None
        assert retired == [None], "the standby must be retired once, as soon as a child finished the run"
    finally:
        children[1].kill()
        for p in children:
            p.join(5)


@pytest.mark.parametrize("reported", [True, False])
def test_the_launcher_stops_waiting_once_a_child_failed_on_its_own(reported: bool) -> None:
    """A child that ended with a failure of its own (a world that never formed: its peer froze before joining)
    ends the job under --recover too: await_every_child returns, the run not finished, while the frozen child is
    still there, for the launcher to stop. The control: a child lost (no failure of its own reported) leaves the
    launcher waiting for the other, until that one ends."""
    ctx = multiprocessing.get_context("fork")
    children = [ctx.Process(target=os._exit, args=(2,)), ctx.Process(target=_freeze)]
    for p in children:
        p.start()
    result: list[tuple[bool, bool]] = []  # what it returned, and whether the frozen child had been killed by then
    killed = threading.Event()
    retired: list[bool] = []  # no child finished the run: the standby stays, for the survivors to meet at
    waiting = threading.Thread(target=lambda: result.append(
        (launch.await_every_child(children, lambda: reported, finished_run=lambda: retired.append(True)),
         killed.is_set())), daemon=True)
    try:
        waiting.start()
        waiting.join(30 if reported else 3)
        assert waiting.is_alive() != reported, "returned" if waiting.is_alive() else "still waits"
        assert result == ([(False, False)] if reported else []) and children[1].exitcode is None
    finally:
        killed.set()
        children[1].kill()
        for p in children:
            p.join(5)
        waiting.join(30)
    assert result == [(False, not reported)]  # the control returned once the frozen child ended, not before
    assert retired == []


def test_a_rank_frozen_before_it_joined_ends_the_job_in_one_line(tmp_path: Path) -> None:
    """Under --recover, a rank frozen for good before the world formed: there is nothing to recover, the other
    gives up after --timeout as without --recover (a peer that never arrived, exit 2), and the launcher stops the
    frozen one and ends, naming it."""
    env, mark = marked_env()
    out, log = tmp_path / "out", tmp_path / "log"
    with reaped(mark):
        run = start(["mnist_ddp", "train", *tiny(480, 100, epochs=1), "-g", "2", "--recover", "--timeout", "4",
                     "--out", str(out)], env, tmp_path, log)
        first = wait_for("a worker", lambda: spawned_workers(run.pid), RUN_TIMEOUT, poll=0.002, running=run)[0]
        os.kill(first, signal.SIGSTOP)  # just forked: rank 0, long before it joins
        rc, said = finish(run, log, RUN_TIMEOUT)
    assert rc == 2 and "could not join the 1 other process" in said and "Traceback" not in said, said


@pytest.mark.parametrize("lose", ["0:10:SIGTERM,1:20:SIGSTOP", "0:10:SIGSTOP,1:10:SIGSTOP"])
def test_a_job_whose_last_running_ranks_froze_for_good_ends_in_one_line(tmp_path: Path, lose: str) -> None:
    """Under --recover, rank 0 lost and the survivor then frozen for good (SIGSTOP), or both frozen at once: no
    rank is left to give up on them, so the launcher does, --timeout after every child it waits on stopped. One
    line that names them, exit 1, no process left behind."""
    env, mark = marked_env({lossplan.LOSE_VAR: lose})
    out, log = tmp_path / "out", tmp_path / "log"
    with reaped(mark):
        run = start(["mnist_ddp", "train", *ARGS, "-g", "2", "--recover", "--timeout", "15", "--out", str(out)], env,
                    tmp_path, log)
        rc, said = finish(run, log, RUN_TIMEOUT)
    frozen = [int(r) for r, *rest in (item.split(":") for item in lose.split(",")) if "SIGSTOP" in rest]
    named = re.search(r"ranks? ([\d, ()pid]+) stopped answering: stopped \(SIGSTOP, or a debugger\) for --timeout 15 s",
                      said)
    assert rc == 1 and named and "Traceback" not in said, said
    assert [int(r) for r in re.findall(r"(\d+) \(pid", named[1])] == frozen, said


def _lost_after_the_last_step(d: Dist, said: str) -> None:
    """Rank 1 leaves for good once both have passed a last collective; rank 0, done too, leaves the group as a
    finished rank does, and writes what that raised to `said`."""
    d.all_sum(torch.ones(1))
    if d.rank == 1:
        os._exit(0)
    try:
        worker.leave_group(d.rank, finished=True)
        Path(said).write_text("left without a word")
    except PeerFailure as e:
        Path(said).write_text(str(e))


def test_a_peer_lost_after_the_last_step_is_one_line_not_a_traceback(tmp_path: Path) -> None:
    """A rank lost after the run's last collective (rank 0 while it saves the final checkpoint, say) fails the
    others' last wait for every rank, in a `finally`: one line that says what may be missing, not a traceback."""
    said = tmp_path / "said"
    spawn_gloo(_lost_after_the_last_step, 2, str(said))
    assert said.read_text().startswith("rank 0 lost contact with the other processes after the run's last step ("), \
        said.read_text()
    assert "run again with --resume" in said.read_text()


def test_rank_0_lost_once_the_final_checkpoint_is_saved_is_redone(bitwise: dict[str, tuple[Path, str]],
                                                                  tmp_path: Path) -> None:
    """Rank 0 lost after the run's last collective, once it saved the final checkpoint (LOSE_VAR at the last step,
    60): the other rank cannot know whether that save was made, so under --recover every epoch ends in one more
    all-reduce, which fails inside the loop; the survivor redoes the epoch's end (evaluation, metrics, saves) as
    rank 0, and the job finishes with the undisturbed bytes and record."""
    out, calm = tmp_path / "out", bitwise["2"][0]
    log = _train(out, *ARGS, "--bitwise", "-g", "2", "--recover", lose="0:60:saved")
    lines = _recover_lines(log)
    assert len(lines) == 1 and lines[0].startswith("recover: rank 0 (") and "lost at the end of epoch 2 " in lines[0], \
        log
    assert checkpoint.digest(_model(out)) == checkpoint.digest(_model(calm))
    _same_record(out, calm)


# --- a rank lost at an epoch's edge ---------------------------------------------------------------------------------
# 470 images at M = 3: slots of 157 (the sampler pads 470 to 471), 20 steps an epoch, the last one partial (5 of 8
# rows): the end of an epoch is not a whole number of global batches.
EDGE_ARGS = [*tiny(470, 100, epochs=2), *ARGS[ARGS.index("--batch-size"):], "--bitwise", "-g", "3", "--recover",
             "--log-every", "1"]
EDGE_STEP = 20  # the steps of epoch 1: every point below is passed after it
EDGES = [(point, rank, sig) for point in lossplan.POINTS for rank in (0, 1) for sig in ("SIGKILL", "SIGTERM")]
# CI: each point once, rank 0 and another, SIGKILL and SIGTERM in turn; EDGES=all for all of them.
EDGES_RUN = EDGES if os.environ.get("EDGES") == "all" else [
    ("step", 0, "SIGKILL"), ("fold", 0, "SIGTERM"), ("folded", 0, "SIGTERM"), ("evaluation", 1, "SIGKILL"),
    ("save", 1, "SIGTERM"), ("saved", 0, "SIGKILL")]


def _steps(out: Path) -> list[tuple[int, float]]:
    """steps.jsonl with --log-every 1: every optimizer step's samples done and lr."""
    return [(s["samples"], s["lr"]) for s in map(json.loads, (out / "steps.jsonl").read_text().splitlines())]


@pytest.fixture(scope="module")
def edge_calm(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("edge") / "calm"
    _train(out, *EDGE_ARGS)
    return out


@pytest.mark.parametrize("point, rank, sig", EDGES_RUN)
def test_a_rank_lost_at_an_epochs_end_costs_nothing(edge_calm: Path, tmp_path: Path, point: str, rank: int,
                                                    sig: str) -> None:
    """A rank lost (SIGKILL, or SIGTERM, which unwinds it) at each point between epoch 1's last step and epoch 2's
    first — the fold, its all-reduce done before rank 0 writes the steps, the evaluation, rank 0's saves, the
    all-reduce after them, the next step — where the epoch's
    last step is partial: the survivors go back and finish with the undisturbed run's steps, record and bytes."""
    out = tmp_path / "out"
    log = _train(out, *EDGE_ARGS, lose=f"{rank}:{EDGE_STEP}:{point}:{sig}")
    lines = _recover_lines(log)
    where = "epoch 2, step 1 " if point == "step" else "the end of epoch 1 "
    assert len(lines) == 1 and lines[0].startswith(f"recover: rank {rank} (") and f"lost at {where}" in lines[0], log
    assert _steps(out) == _steps(edge_calm)
    _same_record(out, edge_calm)
    assert progress(out) == progress(edge_calm)
    assert checkpoint.digest(_model(out)) == checkpoint.digest(_model(edge_calm))


def test_rank_0_lost_between_a_fold_and_writing_its_steps_loses_none(tmp_path: Path) -> None:
    """--checkpoint-every folds inside an epoch: rank 0 lost once the fold's all-reduce is done, before it wrote the
    steps it added up. The survivor holds the same sums and writes them: steps.jsonl as undisturbed, step by step."""
    args = [*ARGS, "--bitwise", "-g", "2", "--recover", "--checkpoint-every", "5", "--log-every", "1"]
    calm, out = tmp_path / "calm", tmp_path / "out"
    _train(calm, *args)
    log = _train(out, *args, lose="0:15:folded:SIGTERM")
    assert len(_recover_lines(log)) == 1 and "lost at epoch 1, step 16" in log, log
    assert _steps(out) == _steps(calm)
