"""Bad rendezvous input fails fast on every rank, and a process still waiting for its peers stops when told.

Real processes, as a launcher starts them (here by hand, RANK/WORLD_SIZE): a master address that does not
resolve ends rank 0 as it ends the others, at once, with one line; SIGTERM or Ctrl-C reach a process waiting
for peers that never come (inside C++ it would not see them until --timeout), and it exits 130.
"""

import multiprocessing
import signal
import socket
import subprocess
import sys
from datetime import timedelta
from pathlib import Path

import pytest
import torch.distributed as dist
from torch.multiprocessing.spawn import _wrap as torch_wrap

from conftest import cli_env, tiny
from mnist_ddp.common.config import TrainConfig
from mnist_ddp.joining import rendezvous
from mnist_ddp.launchers import forkserver, launch
from procfs import finish, free_port, marked_env, reaped, socket_inodes, start, wait_for

TRAIN = ["mnist_ddp", "train", *tiny(200, 50)]
HANG = 120  # seconds: a hang detector only; the waits under test are --timeout 600


@pytest.mark.parametrize("rank", [0, 1])
def test_an_unresolvable_master_address_stops_every_rank_at_once(rank: int, tmp_path: Path) -> None:
    env, mark = marked_env({"RANK": str(rank), "WORLD_SIZE": "2", "MASTER_ADDR": "no-such-host.invalid",
                            "MASTER_PORT": str(free_port())})
    with reaped(mark):
        proc = start([*TRAIN, "--timeout", "600", "--out", str(tmp_path / "o")], env, tmp_path, tmp_path / "log")
        rc, log = finish(proc, tmp_path / "log", HANG)
    assert rc == 2, log
    # What this machine's resolver says ("[Errno -2] Name or service not known"; offline, "[Errno -3] Temporary
    # failure in name resolution"), quoted whole.
    with pytest.raises(socket.gaierror) as why:
        socket.getaddrinfo("no-such-host.invalid", None, type=socket.SOCK_STREAM)
    assert log.strip().splitlines() == ["mnist-ddp: error: the master address 'no-such-host.invalid' is not a host "
                                        f"name this machine can resolve ({why.value})."], log


def _tcp(pid: int, port: int, state: str, side: int) -> bool:
    """Whether `pid` holds a TCP socket in `state` ('0A' listen, '01' established) whose local (side 1) or
    remote (side 2) port is `port`."""
    rows = [line.split() for table in ("/proc/net/tcp", "/proc/net/tcp6")
            for line in Path(table).read_text().splitlines()[1:]]
    held = socket_inodes(pid)
    return any(int(r[side].rsplit(":", 1)[1], 16) == port and r[3] == state and int(r[9]) in held for r in rows)


@pytest.mark.skipif(sys.platform != "linux", reason="reads /proc/net/tcp")
@pytest.mark.parametrize("how", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "Ctrl-C"])
def test_ranks_waiting_for_a_peer_stop_when_told(how: signal.Signals, tmp_path: Path) -> None:
    """World 3, rank 2 never comes: rank 0 has opened the store and waits there, rank 1 has joined it and
    waits too; the signal stops both (before, they sat in C++ until --timeout, deaf to it)."""
    port = free_port()
    env, mark = marked_env({"WORLD_SIZE": "3", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)})
    with reaped(mark):
        procs = [start([*TRAIN, "--timeout", "600", "--out", str(tmp_path / "o")], env | {"RANK": str(r)}, tmp_path,
                       tmp_path / f"{r}.log") for r in range(2)]
        wait_for("rank 0's store", lambda: _tcp(procs[0].pid, port, "0A", 1), HANG, running=procs[0])
        wait_for("rank 1 to join it", lambda: _tcp(procs[1].pid, port, "01", 2), HANG, running=procs[1])
        for proc in procs:
            proc.send_signal(how)
        results = [finish(proc, tmp_path / f"{r}.log", HANG) for r, proc in enumerate(procs)]
    for rc, out in results:
        assert rc == 130, out
        assert out.strip().splitlines() == ["mnist-ddp: interrupted."], out


def test_a_store_that_closes_under_a_waiting_rank_is_no_wall_of_cpp_frames(tmp_path: Path) -> None:
    """The race both ranks above run when told to stop together: node 0 ends first and closes its store while
    a joiner is inside a store call. torch's C++ side logs that failure with its own stack on stderr; in a
    process of ours only our one line may follow, so the call's error reaches Python and nothing is printed."""
    host = dist.TCPStore("127.0.0.1", 0, 2, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=30))
    code = ("import sys, mnist_ddp, torch.distributed as dist\n"
            f"s = dist.TCPStore('127.0.0.1', {host.port}, 2, is_master=False)\n"
            "s.set('joined', '1'); sys.stdin.readline()\n"
            "try:\n    s.check(['k'])\nexcept Exception as e:\n    print(type(e).__name__)\n")
    env = {k: v for k, v in cli_env().items() if k != "TORCH_CPP_LOG_LEVEL"}
    proc = subprocess.Popen([sys.executable, "-c", code], env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    try:
        host.wait(["joined"])
        del host  # the store's server closes with its last reference
        out, err = proc.communicate("\n", timeout=HANG)
    finally:
        proc.kill()
    assert out.strip() == "DistNetworkError" and err == "", err


def test_the_summary_of_an_error_inside_the_comm_hook_is_the_collectives_own() -> None:
    """A collective that fails inside our comm hook's future arrives wrapped in torch's callback error and led by
    gloo's source location: the summary is gloo's sentence alone (the message that names the cause quotes it)."""
    wrapped = RuntimeError("Got the following error when running the callback: RuntimeError: [/__w/pytorch/third_"
                           "party/gloo/gloo/transport/tcp/unbound_buffer.cc:129] Timed out waiting 10000ms for send "
                           "operation to complete. More text.\nA second line.")
    assert rendezvous.error_summary(wrapped) == "Timed out waiting 10000ms for send operation to complete"
    assert rendezvous.error_summary(RuntimeError("[x.cc:1] Connection closed by peer")) == "Connection closed by peer"


def test_sigterm_while_the_command_still_starts_is_an_interrupt() -> None:
    """A SIGTERM (scancel, a container's stop) that comes while the command still starts — parsing its flags,
    importing torch, before the launcher handles signals — ends it as Ctrl-C does: one line, exit 130, not killed
    by the signal with nothing said. The moment is made exact: the command sends itself SIGTERM where it would go on
    to start the run (cli._dispatch)."""
    code = ("import os, signal, sys; from mnist_ddp import cli; "
            "cli._dispatch = lambda argv: (os.kill(os.getpid(), signal.SIGTERM), signal.pause()); "
            "sys.exit(cli.main(['train']))")
    r = subprocess.run([sys.executable, "-c", code], env=cli_env(), capture_output=True, text=True, timeout=HANG)
    assert (r.returncode, r.stderr.strip()) == (130, "mnist-ddp: interrupted."), (r.returncode, r.stderr)


def test_a_worker_interrupted_before_it_runs_ends_130_not_0(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A -g child interrupted in its first moments, before it reaches run_worker (here: as it takes the launcher's
    environment), must not end with exit 0: torch's wrapper swallows a KeyboardInterrupt, and the launcher reads 0
    as a rank that finished the run (under --recover, the job's success). It ends as an interrupted rank, 130."""
    def interrupted(environ: dict[str, str]) -> None:
        raise KeyboardInterrupt

    monkeypatch.setattr(forkserver, "adopt", interrupted)
    child = multiprocessing.get_context("fork").Process(target=torch_wrap, args=(
        launch._spawned, 0, (TrainConfig(), "127.0.0.1", 0, None, None, {}, None), str(tmp_path / "error")))
    child.start()
    child.join(HANG)
    assert child.exitcode == 130
