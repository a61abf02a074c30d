"""Where `-g G`'s processes come from: a fork server that imports torch and torch._dynamo once, started before the
launcher imports torch (so no torch here); every child is a clean fork of it (docs/design/forkserver.md)."""

import contextlib
import importlib
import multiprocessing
import multiprocessing.connection
import multiprocessing.forkserver
import os
import select
import signal
import sys
import threading
import time

# What every child needs before its first step: the package (torch with it) and torch._dynamo; last, what makes
# every child hold Ctrl-C until it can unwind (forkserver_preload.py).
PRELOAD = ["mnist_ddp.launchers.launch", "torch._dynamo", "mnist_ddp.launchers.forkserver_preload"]


def start() -> None:
    """Start the fork server and its imports now, in the background (nothing happens if it runs already)."""
    multiprocessing.get_context("forkserver").set_forkserver_preload(PRELOAD)
    multiprocessing.forkserver.ensure_running()


def import_in_background() -> None:
    """In a rank that is no fork of the server (one process; torchrun's, srun's, mpirun's ranks): import
    torch._dynamo in a thread, while this one reads the data; the first optimizer, which imports it, then waits
    only for the rest. Call it where this thread imports nothing more of torch's: two threads importing one
    package's modules in crossing orders could deadlock (docs/speed.md#where-the-time-went)."""
    if "torch._dynamo" not in sys.modules:  # a fork of the server has it
        threading.Thread(target=_import, args=("torch._dynamo",), name="import torch._dynamo", daemon=True).start()


def _import(name: str) -> None:
    with contextlib.suppress(BaseException):  # the optimizer's own import raises it again, where it is reported
        importlib.import_module(name)


def release_interrupts() -> None:
    """In a child, first, where a Ctrl-C can unwind it: take the SIGINT it held since it was forked, if one came
    (forkserver_preload.py)."""
    signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})


def die_with_launcher() -> None:
    """In a child: Ctrl-C itself (SIGINT, which unwinds it) when the launcher dies, however it dies, as a thread
    sees the launcher's pipe (multiprocessing's parent sentinel) end; PR_SET_PDEATHSIG would watch the server."""
    parent = multiprocessing.parent_process()
    if parent is None:
        return

    def watch() -> None:
        multiprocessing.connection.wait([parent.sentinel])
        os.kill(os.getpid(), signal.SIGINT)
    threading.Thread(target=watch, name="launcher-watch", daemon=True).start()


def adopt(environ: dict[str, str]) -> None:
    """In a child: the launcher's environment as it is now, not the server's (which may be many launches old).
    What torch read when the server imported it (OMP_NUM_THREADS, for one) stays the server's."""
    os.environ.clear()
    os.environ.update(environ)


class Workers:
    """The launcher's own hold on its workers, which are the fork server's children, not the launcher's: a pidfd
    per worker (Linux; elsewhere `kill(pid, 0)`), which still tells after a SIGTERM to the process group ended
    the server and multiprocessing reports every worker ended (docs/design/forkserver.md)."""

    def __init__(self, pids: list[int]) -> None:
        self.handles: dict[int, int | None] = {}
        for pid in pids:
            try:
                self.handles[pid] = os.pidfd_open(pid)
            except ProcessLookupError:  # already ended
                pass
            except (AttributeError, OSError):  # not Linux, or a kernel before 5.3
                self.handles[pid] = None

    def alive(self) -> list[int]:
        """The workers that have not ended (a zombie has)."""
        def running(pid: int, fd: int | None) -> bool:
            if fd is not None:  # a pidfd reads as ready once its process ended (poll: fds past 1,024 are usual here)
                ready = select.poll()
                ready.register(fd, select.POLLIN)
                return not ready.poll(0)
            try:
                os.kill(pid, 0)
            except ProcessLookupError:
                return False
            return True
        return [pid for pid, fd in self.handles.items() if running(pid, fd)]

    def stop(self, grace: float) -> None:
        """SIGTERM every worker still running (which unwinds it like Ctrl-C), SIGKILL any still there after
        `grace` seconds (stuck in a C++ call, or stopped) with a line that names it, and return only when every
        one has ended."""
        for sig, wait in ((signal.SIGTERM, grace), (signal.SIGKILL, None)):
            for pid in self.alive():
                if sig == signal.SIGKILL:
                    print(f"mnist-ddp: worker pid {pid} was still there {grace:g} s after it was told to stop; killed "
                          f"it (SIGKILL).", file=sys.stderr, flush=True)
                self._send(pid, sig)
            deadline = None if wait is None else time.monotonic() + wait
            while self.alive() and (deadline is None or time.monotonic() < deadline):
                time.sleep(0.05)
        for fd in self.handles.values():
            if fd is not None:
                os.close(fd)
        self.handles = {}  # nothing left to watch: a pid alone could be another process's by now

    def _send(self, pid: int, sig: int) -> None:
        fd = self.handles[pid]
        try:
            if fd is not None:
                signal.pidfd_send_signal(fd, sig)
            else:
                os.kill(pid, sig)
        except ProcessLookupError:  # it ended in between
            pass
