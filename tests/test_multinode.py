"""Two machines on one box: two network namespaces joined by a veth pair, two workers in each.

Each namespace has its own interfaces, addresses and ports, so the two "nodes" meet only over the
virtual cable, as real machines would: a process that used a loopback address or the host's network
would not find its peers. Traffic goes only to the addresses this test gives the namespaces. World 4,
gloo; the final weights must equal those of a one-machine `-n 1 -g 4` run with the same seed.
"""

import os
import shlex
import signal
import socket
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

from conftest import cli_env, metrics, progress, tiny
from mnist_ddp.outputs import checkpoint
from netns import netns_pair
from procfs import (
    children,
    env_of,
    finish,
    marked_env,
    marked_pids,
    reaped,
    socket_inodes,
    spawned_workers,
    start,
    wait_for,
)

ADDRS = ("10.77.0.1", "10.77.0.2")
# Two epochs of three steps per rank at world 4; --timeout bounds any wait if a node fails to show up.
ARGS = ["train", *tiny(1200, 200, epochs=2), "--seed", "3", "--timeout", "90"]
RUN_TIMEOUT = 240  # seconds; generous, the box is shared: a hang detector, not a timing assertion


@dataclass(frozen=True)
class Machines:
    names: tuple[str, str]

    def prefix(self, node: int) -> list[str]:
        return ["ip", "netns", "exec", self.names[node]]


@pytest.fixture(scope="module")
def machines() -> Iterator[Machines]:
    """Two namespaces, one veth pair between them, made for this module and always deleted."""
    with netns_pair(f"mddp-{uuid.uuid4().hex[:6]}", ADDRS) as names:
        yield Machines(names)


class Background:
    """A run started now and collected later, so that it overlaps with the tests that need it."""

    def __init__(self, args: list[str], cwd: Path) -> None:
        self.env, self.mark = marked_env()
        self.log = cwd / "reference.log"
        self.proc = start(args, self.env, cwd, self.log)
        self.result: tuple[int, str] | None = None

    def wait(self) -> tuple[int, str]:
        if self.result is None:
            with reaped(self.mark):
                self.result = finish(self.proc, self.log, RUN_TIMEOUT)
        return self.result


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Background, Path]]:
    """The same job on one machine: `-n 1 -g 4`, started once for both multi-machine tests."""
    where = tmp_path_factory.mktemp("one-machine")
    run = Background(["mnist_ddp", *ARGS, "-n", "1", "-g", "4", "--out", str(where / "out")], where)
    yield run, where / "out"
    run.wait()


def _weights(out: Path) -> dict[str, torch.Tensor]:
    return torch.load(out / "checkpoint.pt", weights_only=True)["model"]


def _check(nodes: list[tuple[int, str]], outs: tuple[Path, Path], reference: tuple[Background, Path]) -> None:
    for rc, log in nodes:
        assert rc == 0, log
    assert "world size 4" in nodes[0][1]
    assert not outs[1].exists(), f"node 1 wrote {sorted(p.name for p in outs[1].rglob('*'))}"  # rank 0 only
    assert {p.name for p in outs[0].iterdir()} == {"checkpoint.pt", "checkpoint.prev.pt", "best.pt", "metrics.jsonl",
                                                   "model.safetensors", "timing.jsonl"}
    assert [m["world_size"] for m in metrics(outs[0])] == [4, 4]
    ref_run, ref_out = reference
    rc, log = ref_run.wait()
    assert rc == 0, log
    mine, theirs = _weights(outs[0]), _weights(ref_out)
    assert mine.keys() == theirs.keys()
    for key in mine:
        assert torch.allclose(mine[key].float(), theirs[key].float(), rtol=0, atol=1e-6), key
    worst = max((mine[k].float() - theirs[k].float()).abs().max().item() for k in mine)
    print(f"largest weight difference from the one-machine run: {worst:g}")
    assert metrics(outs[0])[-1]["test_accuracy"] == metrics(ref_out)[-1]["test_accuracy"]


def _run_nodes(commands: list[list[str]], machines: Machines, tmp_path: Path, module: bool) -> list[tuple[int, str]]:
    env, mark = marked_env()
    started = time.perf_counter()
    with reaped(mark):
        procs = [start(cmd, env, tmp_path, tmp_path / f"node{n}.log", prefix=machines.prefix(n), module=module)
                 for n, cmd in enumerate(commands)]
        results = [finish(p, tmp_path / f"node{n}.log", RUN_TIMEOUT) for n, p in enumerate(procs)]
    print(f"two-machine run: {time.perf_counter() - started:.1f} s wall")
    return results


def test_spawn_on_two_machines(machines: Machines, reference: tuple[Background, Path], tmp_path: Path) -> None:
    """The tutorial's way: `-n 2 -g 2 -nr R --master-addr <node 0>` typed on each machine."""
    outs = (tmp_path / "node0-disk", tmp_path / "node1-disk")  # each machine its own disk
    commands = [["mnist_ddp", *ARGS, "-n", "2", "-g", "2", "-nr", str(n), "--master-addr", ADDRS[0],
                 "--master-port", "29400", "--out", str(outs[n])] for n in range(2)]
    _check(_run_nodes(commands, machines, tmp_path, module=True), outs, reference)


def test_torchrun_on_two_machines(machines: Machines, reference: tuple[Background, Path], tmp_path: Path) -> None:
    """torchrun with c10d rendezvous at node 0. These machines' hostname resolves to 127.0.0.1, as on many
    hosts, so each agent is told its address (--local-addr) and node 0 that it hosts the rendezvous."""
    outs = (tmp_path / "node0-disk", tmp_path / "node1-disk")
    commands = [["torch.distributed.run", "--nnodes", "2", "--nproc-per-node", "2", "--rdzv-backend", "c10d",
                 "--rdzv-endpoint", f"{ADDRS[0]}:29401", "--rdzv-id", "x", "--local-addr", ADDRS[n],
                 "--rdzv-conf", f"is_host={int(n == 0)}", "-m", "mnist_ddp", *ARGS, "--out", str(outs[n])]
                for n in range(2)]
    _check(_run_nodes(commands, machines, tmp_path, module=True), outs, reference)


# The survivor's next rendezvous round waits until the killed node's agent has missed its keep-alives: 3 beats
# of 2 s here instead of the default 3 of 5 s (torch/distributed/elastic/rendezvous/dynamic_rendezvous.py), which
# took the test from ~47 to ~40 s; a live agent's keep-alive thread is idle otherwise, so 6 s is no tight bound.
KEEP_ALIVE = "keep_alive_interval=2,keep_alive_max_attempt=3"


def test_torchrun_loses_a_node_and_continues_alone(machines: Machines, tmp_path: Path) -> None:
    """Elastic membership: `--nnodes 1:2` on both machines, one shared --out (the same file system on this
    box). Mid-epoch 2 the agent of the node that does not host the rendezvous is SIGKILLed with its workers;
    the survivor's workers lose their peers, its agent restarts them, the rendezvous closes with one node,
    and they continue at world size 2 from the world-4 checkpoint, without --resume, to the end."""
    out, samples = tmp_path / "shared", 24000  # 60 steps per rank per epoch at world 4, a checkpoint every 5
    args = ["train", *tiny(samples, 200, epochs=3), "--seed", "3", "--timeout", "30", "--checkpoint-every", "5"]
    commands = [["torch.distributed.run", "--nnodes", "1:2", "--nproc-per-node", "2", "--rdzv-backend", "c10d",
                 "--rdzv-endpoint", f"{ADDRS[0]}:29402", "--rdzv-id", "elastic-job", "--local-addr", ADDRS[n],
                 "--rdzv-conf", f"is_host={int(n == 0)},last_call_timeout=10,{KEEP_ALIVE}", "--max-restarts", "1",
                 "--monitor-interval", "0.2", "-m", "mnist_ddp", *args, "--out", str(out)] for n in range(2)]
    # Restarts on several nodes need a fresh store per rendezvous round (README, "When things go wrong").
    env, mark = marked_env({"TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"})
    with reaped(mark):
        nodes = [start(cmd, env, tmp_path, tmp_path / f"node{n}.log", prefix=machines.prefix(n))
                 for n, cmd in enumerate(commands)]
        inside_epoch_2 = lambda: (p := progress(out)) and p["epoch"] == 1 and p["consumed"] > 0  # noqa: E731
        wait_for("a checkpoint inside epoch 2", inside_epoch_2, RUN_TIMEOUT, 0.01, running=nodes[0])
        workers = children(nodes[1].pid)  # torchrun starts each worker in a session of its own
        assert len(workers) == 2, workers
        os.killpg(nodes[1].pid, signal.SIGKILL)  # the agent's process group, then its workers: the machine is gone
        for pid in workers:
            os.kill(pid, signal.SIGKILL)
        nodes[1].wait()
        rc, log = finish(nodes[0], tmp_path / "node0.log", RUN_TIMEOUT)
    assert rc == 0, log
    assert "restart: torchrun restarted job elastic-job" in log, log
    assert ("world size 4 → 2; the run's global batch stays 400 (4 micro-batches of 100), and so do its steps and "
            "the lr at each: each of the 2 processes accumulates 2 micro-batches of 100") in log, log
    consumed = int(log.split("resume: from ")[1].split("epoch 2, ")[1].split()[0].replace(",", ""))
    assert 0 < consumed < samples
    history = metrics(out)
    assert [m["epoch"] for m in history] == [1, 2, 3], history  # complete, none twice
    assert [m["world_size"] for m in history] == [4, 2, 2]
    assert [m["train_samples"] for m in history] == [samples] * 3  # every epoch the run's steps: no new padding
    assert [m["global_batch"] for m in history] == [400] * 3
    final = checkpoint.load(out / "checkpoint.pt")
    assert final["progress"]["epoch"] == 3 and final["config"]["world_size"] == 2


# --- which network gloo uses ---------------------------------------------------------------------------------

def _address(hex_address: str) -> str:
    """/proc/net/tcp's `0100007F` (little-endian IPv4) as 127.0.0.1."""
    return socket.inet_ntoa(bytes.fromhex(hex_address)[::-1])


def _listening(pid: int) -> set[tuple[str, int]]:
    """(address, port) of each TCP socket `pid` listens on, in its own network namespace (/proc/PID/net/tcp)."""
    held, found = socket_inodes(pid), set()
    for line in Path(f"/proc/{pid}/net/tcp").read_text().splitlines()[1:]:
        fields = line.split()
        if fields[3] == "0A" and int(fields[9]) in held:  # LISTEN
            address, port = fields[1].split(":")
            found.add((_address(address), int(port, 16)))
    return found


def _interface_of(machines: Machines, address: str) -> str:
    """The interface of machine 0 that holds `address`, as iproute2 lists it."""
    r = subprocess.run(["ip", "-n", machines.names[0], "-o", "-4", "addr", "show"], capture_output=True, text=True,
                       check=True)
    return next(line.split()[1] for line in r.stdout.splitlines() if f" {address}/" in line)


def test_gloo_listens_on_loopback_for_one_node_unless_told(machines: Machines, tmp_path: Path) -> None:
    """On machine 0, `-g 2 --master-addr <its veth address>`: rendezvous.interface_to picks the veth towards that
    address (and lo towards 127.0.0.1), but a job on one node keeps gloo on loopback, where nothing from
    outside reaches it; with GLOO_SOCKET_IFNAME=<the veth> set, the workers listen on the veth's address. What
    they listen on is read from /proc, not from our code."""
    veth = _interface_of(machines, ADDRS[0])
    ask = (f"from mnist_ddp.joining.rendezvous import interface_to as g; "
           f"print(*(g(a) for a in {(*ADDRS, '127.0.0.1')!r}))")
    picked = subprocess.run([*machines.prefix(0), sys.executable, "-c", ask], env=cli_env(), capture_output=True,
                            text=True, timeout=60)
    assert picked.stdout.split() == [veth, veth, "lo"], picked
    env, mark = marked_env()
    cases = {"chosen": ({}, "127.0.0.1"), "GLOO_SOCKET_IFNAME=<veth>": ({"GLOO_SOCKET_IFNAME": veth}, ADDRS[0])}
    with reaped(mark):
        runs = {case: start(["mnist_ddp", "train", *tiny(4000, 100, epochs=50), "-n", "1", "-g", "2", "--master-addr",
                             ADDRS[0], "--master-port", str(29410 + n), "--out", str(tmp_path / str(n))],
                            env | extra, tmp_path, tmp_path / f"{n}.log", prefix=machines.prefix(0))
                for n, (case, (extra, _)) in enumerate(cases.items())}
        for n, (case, proc) in enumerate(runs.items()):
            wait_for(f"{case}: training", lambda n=n: progress(tmp_path / str(n)), RUN_TIMEOUT, running=proc)
            heard = {pid: {address for address, _ in _listening(pid)} for pid in spawned_workers(proc.pid)}
            assert len(heard) == 2 and all(addresses == {cases[case][1]} for addresses in heard.values()), (case, heard)
            proc.send_signal(signal.SIGTERM)
        for n, proc in enumerate(runs.values()):
            rc, log = finish(proc, tmp_path / f"{n}.log", RUN_TIMEOUT)
            assert rc == 130, log


# --- a rank's fate, told by a survivor on its machine ---------------------------------------------------------

def _pid_inside(pid: int) -> int:
    """`pid`'s number in its own pid namespace (the last of /proc/PID/status's NSpid), the one it reports itself."""
    line = next(line for line in Path(f"/proc/{pid}/status").read_text().splitlines() if line.startswith("NSpid:"))
    return int(line.split()[-1])


def test_a_survivor_on_the_frozen_ranks_machine_tells_the_others_its_fate(machines: Machines, tmp_path: Path) -> None:
    """World 3 started by hand: rank 0 on machine 0, ranks 1 and 2 on machine 1, which is a pid namespace of its
    own as well (a machine's /proc shows only its own processes). Rank 2 is frozen with SIGSTOP: rank 1 sees it in
    its /proc and writes what it saw to the store; rank 0, which cannot look, names it from there, with the pid
    rank 2 has on its machine. --heartbeat 4: the survivors' readings, which start when their collectives time
    out at about the same moment, overlap by 2.5 beats."""
    env, mark = marked_env({"WORLD_SIZE": "3", "MASTER_ADDR": ADDRS[0], "MASTER_PORT": "29420"})
    train = ["-m", "mnist_ddp", "train", *tiny(6000, 100, epochs=50), "--timeout", "10", "--heartbeat", "4",
             "--checkpoint-every", "2", "--out"]
    rank = lambda r: shlex.join([sys.executable, *train, str(tmp_path / f"out{r}")])  # noqa: E731
    machine_1 = "".join(f"RANK={r} {rank(r)} >{shlex.quote(str(tmp_path / f'{r}.log'))} 2>&1 & " for r in (1, 2))
    with reaped(mark):
        rank0 = start([sys.executable, *train, str(tmp_path / "out0")], env | {"RANK": "0"}, tmp_path,
                      tmp_path / "0.log", prefix=machines.prefix(0), module=False)
        node1 = start(["unshare", "--pid", "--fork", "--mount-proc", "bash", "-c", machine_1 + "wait"], env, tmp_path,
                      tmp_path / "node1.log", prefix=machines.prefix(1), module=False)
        wait_for("training", lambda: progress(tmp_path / "out0"), RUN_TIMEOUT, running=rank0)
        rank2 = next(pid for pid in marked_pids(mark) if env_of(pid).get("RANK") == "2" and "mnist_ddp" in
                     Path(f"/proc/{pid}/cmdline").read_text(errors="replace"))
        inside = _pid_inside(rank2)
        assert inside != rank2  # it lives in a pid namespace of its own
        os.kill(rank2, signal.SIGSTOP)
        rc0, log0 = finish(rank0, tmp_path / "0.log", RUN_TIMEOUT)
        os.kill(rank2, signal.SIGKILL)
        finish(node1, tmp_path / "node1.log", RUN_TIMEOUT)
    log1 = (tmp_path / "1.log").read_text()
    fate = (f"rank 2 ({socket.gethostname()}, pid {inside}) stopped answering: stopped (SIGSTOP, or a debugger); its "
            f"last beat said it was ")
    assert rc0 == 1 and fate in log0, log0  # told by rank 1
    assert "on a machine where no survivor could look" not in log0, log0
    assert fate in log1, log1  # rank 1 looked for itself
