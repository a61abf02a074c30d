"""What the fault, multi-node and soak tests look at from the outside: processes, ports and files.

Read straight from Linux's /proc (no psutil), so a test sees what really runs and listens, not what
our own code believes it started.
"""

import os
import signal
import socket
import subprocess
import sys
import time
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager, suppress
from pathlib import Path

import pytest

from conftest import cli_env

MARK = "MNIST_DDP_TEST_MARK"  # an environment variable every process of one test run inherits

needs_proc = pytest.mark.skipif(not Path("/proc/net/tcp").exists(), reason="needs Linux's /proc")


def marked_env(extra: dict[str, str] | None = None) -> tuple[dict[str, str], str]:
    """A child environment carrying a fresh marker, and the marker (to find every descendant later).

    One thread per process: these tests start many processes on a few shared cores, where idle
    OpenMP threads spinning against each other would make tiny runs many times slower.
    """
    mark = uuid.uuid4().hex
    return cli_env({MARK: mark, "OMP_NUM_THREADS": "1", **(extra or {})}), mark


def _environ(pid: int) -> bytes:
    try:
        return Path(f"/proc/{pid}/environ").read_bytes()
    except OSError:  # gone, or not ours to read
        return b""


def _pids() -> Iterator[int]:
    for entry in os.scandir("/proc"):
        if entry.name.isdigit():
            yield int(entry.name)


def _state_and_parent(pid: int) -> tuple[str, int] | None:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    fields = stat[stat.rindex(")") + 2:].split()  # the command name may contain spaces and parentheses
    return fields[0], int(fields[1])


def marked_pids(mark: str) -> list[int]:
    """Live processes (zombies excluded) whose environment carries `mark`."""
    needle = f"{MARK}={mark}".encode()
    found = []
    for pid in _pids():
        if needle in _environ(pid).split(b"\0"):
            info = _state_and_parent(pid)
            if info and info[0] != "Z":
                found.append(pid)
    return found


def describe(pids: list[int]) -> str:
    """Each process as /proc shows it (pid, state, parent, command line, the thread names): what a leak was."""
    def one(pid: int) -> str:
        try:
            cmd = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace").strip()
            threads = sorted({Path(t, "comm").read_text().strip() for t in Path(f"/proc/{pid}/task").iterdir()})
        except OSError:
            return f"{pid} (gone)"
        state, parent = _state_and_parent(pid) or ("?", 0)
        return f"{pid} (state {state}, parent {parent}: {cmd[:200]}; threads {', '.join(threads)})"
    return "; ".join(map(one, pids)) or "none"


def children(pid: int) -> list[int]:
    """Direct, live children of `pid`."""
    return [p for p in _pids() if (info := _state_and_parent(p)) and info[1] == pid and info[0] != "Z"]


def spawned_workers(parent: int) -> list[int]:
    """The -g workers of launcher `parent`: forked from its fork server (forkserver.py), the one child of it that is
    (none before it started)."""
    server = next((pid for pid in children(parent) if MARK in env_of(pid) and "forkserver" in cmdline(pid)), None)
    return children(server) if server is not None else []


def cmdline(pid: int) -> str:
    """`pid`'s command line, its arguments NUL-separated ('' once it is gone)."""
    try:
        return Path(f"/proc/{pid}/cmdline").read_text(errors="replace")
    except OSError:
        return ""


def env_of(pid: int) -> dict[str, str]:
    pairs = (item.split(b"=", 1) for item in _environ(pid).split(b"\0") if b"=" in item)
    return {k.decode(errors="replace"): v.decode(errors="replace") for k, v in pairs}


def listening_inodes() -> set[int]:
    """Socket inodes of the TCP sockets in LISTEN state in this network namespace, IPv4 and IPv6."""
    inodes = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            lines = Path(table).read_text().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            fields = line.split()
            if fields[3] == "0A":  # st: LISTEN
                inodes.add(int(fields[9]))
    return inodes


def socket_inodes(pid: int) -> set[int]:
    """Inodes of the sockets process `pid` holds open (its /proc/PID/fd links read 'socket:[INODE]')."""
    found = set()
    try:
        fds = os.listdir(f"/proc/{pid}/fd")
    except OSError:
        return found
    for fd in fds:
        try:
            target = os.readlink(f"/proc/{pid}/fd/{fd}")
        except OSError:
            continue
        if target.startswith("socket:["):
            found.add(int(target[8:-1]))
    return found


def free_port() -> int:
    """A port nobody listens on right now (the OS's pick)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_for(what: str, ok: Callable[[], object], timeout: float, poll: float = 0.05,
             running: subprocess.Popen | None = None) -> object:
    """Poll until `ok()` is truthy and return it; fail the test after `timeout` seconds, or as soon as
    the process `running` (the one expected to bring `what` about) has exited."""
    deadline = time.monotonic() + timeout
    while True:
        value = ok()
        if value:
            return value
        if running is not None and running.poll() is not None:
            pytest.fail(f"{running.args} exited with {running.returncode} before {what}")
        if time.monotonic() > deadline:
            pytest.fail(f"timed out after {timeout:.0f} s waiting for {what}")
        time.sleep(poll)


def start(args: list[str], env: dict[str, str], cwd: Path, log: Path, prefix: list[str] | None = None,
          module: bool = True) -> subprocess.Popen:
    """Start `python -m ARGS` (or a plain command) in its own process group, output to `log`."""
    cmd = [*(prefix or []), *([sys.executable, "-m"] if module else []), *args]
    with open(log, "wb") as out:
        return subprocess.Popen(cmd, cwd=cwd, env=env, stdout=out, stderr=subprocess.STDOUT,
                                start_new_session=True)


def finish(proc: subprocess.Popen, log: Path, timeout: float) -> tuple[int, str]:
    """Wait for `proc`; on a hang kill its whole process group and fail with its output."""
    try:
        rc = proc.wait(timeout)
    except subprocess.TimeoutExpired:
        kill_group(proc)
        pytest.fail(f"{proc.args} hung for {timeout:.0f} s; output:\n{log.read_text(errors='replace')[-3000:]}")
    return rc, log.read_text(errors="replace")


def kill_group(proc: subprocess.Popen) -> None:
    """SIGKILL the process group `proc` leads (what `start` made), if anything is left of it."""
    with suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()


@contextmanager
def reaped(mark: str, grace: float = 20) -> Iterator[None]:
    """Check, when the block ends normally, that no process carrying `mark` is left (no orphans: not a
    worker, not a grandchild); and kill any that are, whatever happened, so a failed test leaks nothing."""
    try:
        yield
        try:
            wait_for("every process of the run to exit", lambda: not marked_pids(mark), grace, 0.2)
        except pytest.fail.Exception:
            pytest.fail(f"after {grace:.0f} s, processes of the run are still there: {describe(marked_pids(mark))}")
    finally:
        for pid in marked_pids(mark):
            with suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
