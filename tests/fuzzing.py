"""Run the real `mnist-ddp` entry point on generated input, hundreds of times a minute, and judge the bad-input
contract on every run (tests/test_fuzz.py; docs/testing.md).

A `Runner` is one server process that imported mnist-ddp and torch once; each case is a child forked from it
(a few milliseconds, where a new interpreter would take seconds) that runs `cli.main(argv)` in the case's folder
with the case's environment, its own process group, its address space capped at `HEADROOM` above the server's
(far above `MEMORY`, so that a blow-up happens, and is measured, rather than fail an allocation that the code
under test might report as a clean refusal), and an alarm after `seconds`. The server reports the child's exit
status and peak resident memory (`wait4`) above what it started with.
`broken` lists every promise a run broke, not the first: exit 2 with one sentence, no traceback, no file of the
folder changed, memory within `MEMORY`, done in time.
"""

import contextlib
import hashlib
import json
import os
import re
import resource
import signal
import socket
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

from conftest import cli_env

MEMORY = 1 << 30  # the most a hostile input may make a command use, above what the server holds
HEADROOM = 6 << 30  # the address space a case may add (of this machine's 24 GiB): past it an allocation fails
ALLOCATION_FAILED = re.compile(r"can't allocate|cannot allocate|out of memory|insufficient memory|MemoryError")


@dataclass(frozen=True)
class Outcome:
    """How one case ended: its exit code (-N: killed by signal N), what it printed, its memory above the server's."""

    code: int
    out: str
    err: str
    grew: int  # bytes of peak resident memory above the server's
    timed_out: bool


def fingerprint(folder: Path) -> dict[str, str]:
    """Every file and link under `folder`, by content (a link by its target), to tell whether a run changed any;
    but the synthetic digits' cache, which a run may fill before it reads what it refuses."""
    found = {}
    for p in sorted(folder.rglob("*")):
        if p.is_relative_to(folder / "data" / "synthetic"):
            continue
        if p.is_symlink():
            found[str(p.relative_to(folder))] = "-> " + os.readlink(p)
        elif p.is_file():
            found[str(p.relative_to(folder))] = hashlib.sha256(p.read_bytes()).hexdigest()
    return found


def broken(o: Outcome, before: dict[str, str], after: dict[str, str], ok: tuple[int, ...] = (2,)) -> list[str]:
    """Every promise of the bad-input contract that `o` broke (`ok`: the exit codes allowed; 0 where the input may
    have been good after all, 1 where a valid world may wait for peers that never come)."""
    lines = o.err.strip().splitlines()
    said = [line for line in lines if not line.startswith("mnist-ddp: warning: ")]
    found = []
    if o.timed_out:
        found.append("hung: still running at its time limit")
    elif o.code not in ok:
        found.append(f"exit code {o.code}, not one of {ok}")
    if "Traceback" in o.err:
        found.append("a traceback")
    if o.code not in (0,) and not o.timed_out and (len(said) != 1 or not said[0].startswith("mnist-ddp: ")):
        found.append(f"{len(said)} lines on stderr, not one sentence")
    if any(len(line) > 2100 or "\x1b" in line for line in lines):
        found.append("a line too long, or with an escape sequence")
    if ALLOCATION_FAILED.search(o.err):
        found.append("an allocation past the memory limit")
    if o.grew > MEMORY:
        found.append(f"used {o.grew / 2**20:,.0f} MiB, more than {MEMORY / 2**20:,.0f}")
    if before != after:
        changed = sorted(k for k in before.keys() | after.keys() if before.get(k) != after.get(k))
        found.append(f"files changed: {changed[:5]}")
    return found


def make_fifo(path: Path) -> None:
    """A named pipe at `path`, with no writer: what blocks an open or a read for ever."""
    os.mkfifo(path)


def make_socket(path: Path) -> None:
    """A Unix socket at `path`, left bound and closed: a file system entry no open can read."""
    s = socket.socket(socket.AF_UNIX)
    s.bind(str(path))
    s.close()


class Runner:
    """The server that forks one child per case (see the module's docstring)."""

    def __init__(self) -> None:
        self.proc = subprocess.Popen([sys.executable, __file__, "--serve"], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, env=cli_env(), text=True)

    def run(self, argv: list[str], cwd: Path, env: dict[str, str] | None = None, seconds: float = 30) -> Outcome:
        out, err = cwd.parent / f".{cwd.name}.out", cwd.parent / f".{cwd.name}.err"
        case = {"argv": argv, "cwd": str(cwd), "env": cli_env() | (env or {}), "seconds": seconds,
                "out": str(out), "err": str(err)}
        assert self.proc.stdin and self.proc.stdout
        self.proc.stdin.write(json.dumps(case) + "\n")
        self.proc.stdin.flush()
        said = json.loads(self.proc.stdout.readline())
        outcome = Outcome(said["code"], out.read_text(errors="replace"), err.read_text(errors="replace"),
                          said["grew"], said["timed_out"])
        out.unlink()
        err.unlink()
        return outcome

    def close(self) -> None:
        if self.proc.stdin:
            self.proc.stdin.close()
        self.proc.wait(30)


def _status(field: str) -> int:
    """A size this process's /proc/self/status gives, in bytes."""
    return int(re.search(rf"{field}:\s+(\d+)", Path("/proc/self/status").read_text()).group(1)) * 1024


def _serve() -> None:
    """The server's loop: one JSON case a line in, one JSON outcome a line out."""
    import torch  # noqa: F401  (imported once, here, for every case)

    from mnist_ddp import cli

    def child(case: dict) -> int:
        Path(case["err"] + ".rss").write_text(str(_status("VmRSS")))  # what it starts with: pages it shares
        os.setpgid(0, 0)
        for fd, name in ((1, case["out"]), (2, case["err"])):
            os.dup2(os.open(name, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600), fd)
        os.chdir(case["cwd"])
        os.environ.clear()
        os.environ.update(case["env"])
        vm = _status("VmSize")
        resource.setrlimit(resource.RLIMIT_AS, (vm + HEADROOM, vm + HEADROOM))
        signal.setitimer(signal.ITIMER_REAL, case["seconds"])  # SIGALRM ends it: a hang
        return cli.main(case["argv"])

    for line in sys.stdin:
        case = json.loads(line)
        sys.stdout.flush()
        pid = os.fork()
        if pid == 0:
            code = 1
            try:
                code = child(case)
            except BaseException:
                import traceback

                traceback.print_exc()
            finally:
                sys.stdout.flush()
                sys.stderr.flush()
                os._exit(code)
        _, status, usage = os.wait4(pid, 0)
        with contextlib.suppress(ProcessLookupError):
            os.killpg(pid, signal.SIGKILL)  # whatever the case started (a fork server, workers)
        code = os.waitstatus_to_exitcode(status)
        started = Path(case["err"] + ".rss")
        base = int(started.read_text() or 0) if started.exists() else 0
        started.unlink(missing_ok=True)
        print(json.dumps({"code": code, "timed_out": code == -signal.SIGALRM,
                          "grew": max(0, usage.ru_maxrss * 1024 - base)}), flush=True)


if __name__ == "__main__" and sys.argv[1:] == ["--serve"]:
    _serve()
