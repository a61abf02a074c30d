"""What another process sends a job is input: a payload that would run code if unpickled runs none, and
poisoned store values leave the heartbeat alive and its diagnosis right.

The payload (`Evil`) creates a marker file when unpickled — the control shows it does — and is sent where our
code reads bytes from another process: by a rank 0 that runs our real code but sends it instead of what it
should (a compromised or impersonated rank 0, joined to a real gloo group with a real rank 1), and down the
pipe through which spawned workers report to their launcher. Store values are written by a plain TCPStore
client of the test, as anyone who reaches the store could, into the store of a real `-g 3` job.
"""

import io
import json
import os
import pickle
import shlex
import signal
import socket
import sys
import time
from contextlib import suppress
from datetime import timedelta
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from conftest import progress, tiny
from mnist_ddp import cli
from mnist_ddp.common.errors import UserError, WriteFailed
from mnist_ddp.core import distributed
from mnist_ddp.core.distributed import PeerFailure
from mnist_ddp.joining import identity, rendezvous
from mnist_ddp.launchers import launch
from mnist_ddp.model import ConvNet
from mnist_ddp.outputs import checkpoint
from procfs import finish, free_port, marked_env, needs_proc, reaped, start, wait_for

pytestmark = needs_proc
HANG = 180  # seconds: a hang guard, not a timing assertion


class Evil:
    """Unpickled, this runs a shell command that creates `marker`: what a stranger's payload would do, harmlessly."""

    def __init__(self, marker: Path) -> None:
        self.marker = str(marker)

    def __reduce__(self) -> tuple:
        return os.system, (f"touch {shlex.quote(self.marker)}",)


def _pickle(marker: Path) -> bytes:
    return pickle.dumps(Evil(marker))


def _torch_file(marker: Path) -> bytes:
    """A torch.save zip whose data.pkl holds the payload: what a checkpoint's bytes look like."""
    buffer = io.BytesIO()
    torch.save({"model": Evil(marker)}, buffer)
    return buffer.getvalue()


def test_the_payloads_run_code_when_unpickled(tmp_path: Path) -> None:
    """The control: each payload does create its marker when unpickled (and torch.load without weights_only)."""
    pickle.loads(_pickle(tmp_path / "a"))
    torch.load(io.BytesIO(_torch_file(tmp_path / "b")), weights_only=False)
    assert (tmp_path / "a").exists() and (tmp_path / "b").exists()


# --- a rank 0 that sends the payload through our own transport (Dist.broadcast) ---------------------------

# Rank 0 of a hand-made launch (RANK/WORLD_SIZE), our real code from start to end, except that the `nth` thing
# it shares with the other ranks (`Dist.broadcast`'s bytes) is replaced by the payload.
ROGUE_RANK0 = """
import sys
from mnist_ddp import cli
from mnist_ddp.core import distributed
payload, nth = open(sys.argv[1], "rb").read(), int(sys.argv[2])
honest, shared = distributed.Dist.broadcast, []
def rogue(self, data):
    shared.append(data)
    return honest(self, payload if len(shared) == nth else data)
distributed.Dist.broadcast = rogue
sys.exit(cli.main(sys.argv[3:]))
"""
ROGUE = {  # case -> (which share, the payload, what rank 1 says of it)
    "rank 0's look at --out (JSON), a pickle": (1, lambda m: b"R" + _pickle(m), "not JSON: '\\x80"),
    "the checkpoint, a torch file that runs code": (
        2, lambda m: b"R" + _torch_file(m),
        "the checkpoint rank 0 sent: refused, loading it would import posix.system and could run code"),
}


def test_a_rogue_rank_0_runs_no_code_on_rank_1(tmp_path: Path) -> None:
    """Rank 1, a real `mnist-ddp train`, gets the payload where it expects rank 0's result (its look at --out, or
    the checkpoint of `--resume`): it refuses it with one line, exit 1, and no marker appears."""
    env, mark = marked_env({"WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1"})
    jobs = {}
    with reaped(mark):
        for n, (case, (nth, payload, _)) in enumerate(ROGUE.items()):
            (tmp_path / f"payload{n}").write_bytes(payload(tmp_path / f"marker{n}"))
            train = ["train", *tiny(400, 100), "--out", str(tmp_path / f"out{n}"), "--resume", "--timeout", "30"]
            port = {"MASTER_PORT": str(free_port())}
            rank0 = start([sys.executable, "-c", ROGUE_RANK0, str(tmp_path / f"payload{n}"), str(nth), *train],
                          env | port | {"RANK": "0"}, tmp_path, tmp_path / f"{n}-0.log", module=False)
            rank1 = start(["mnist_ddp", *train], env | port | {"RANK": "1"}, tmp_path, tmp_path / f"{n}-1.log")
            jobs[case] = (rank0, rank1)
        for n, (case, (rank0, rank1)) in enumerate(jobs.items()):
            rc, log = finish(rank1, tmp_path / f"{n}-1.log", HANG)
            finish(rank0, tmp_path / f"{n}-0.log", HANG)  # it lost its peer: whatever it says, it ends
            errors = [line for line in log.splitlines() if line.startswith("mnist-ddp: error: ")]
            assert rc == 1 and "Traceback" not in log and len(errors) == 1, f"{case}: {log}"
            assert errors[0].startswith(f"mnist-ddp: error: rank 1 refused what rank 0 sent ({ROGUE[case][2]}"), \
                f"{case}: {errors[0]}"
            assert not (tmp_path / f"marker{n}").exists(), f"{case}: the payload ran"


# --- the pipe from spawned workers to their launcher ----------------------------------------------------------

def _send(writer: "mp.connection.Connection", raw: bytes) -> None:
    writer.send_bytes(raw)


def _report(reports: launch.ErrorPipe, errors: list[Exception]) -> None:
    for e in errors:
        reports.put(e)


def _child(target: object, *args: object) -> None:
    """`target(*args)` in a child process (forked: a worker's pipe end is inherited the same way)."""
    child = mp.get_context("fork").Process(target=target, args=args)
    child.start()
    child.join(HANG)
    assert child.exitcode == 0


def test_the_launcher_reads_its_workers_errors_as_json_not_pickles(tmp_path: Path) -> None:
    """A child process writes the payload into the launcher's error pipe: the launcher reports an unreadable
    error and no marker appears. What our workers send still reads as before: of a PeerFailure (an echo) and a
    full disk, the launcher names the full disk, with its message and exit code."""
    reports = launch.ErrorPipe()
    _child(_send, reports.writer, _pickle(tmp_path / "marker"))
    cause = reports.cause()
    assert isinstance(cause, PeerFailure) and cause.exit_code == 1, cause
    assert str(cause).startswith("a worker sent the launcher an unreadable error (not JSON: '\\x80"), cause
    assert not (tmp_path / "marker").exists()

    _child(_report, reports, [PeerFailure("rank 1 lost contact"), WriteFailed("no space left on device writing x")])
    cause = reports.cause()
    assert (str(cause), cause.exit_code) == ("no space left on device writing x", 1), cause
    _report(reports, [PeerFailure("rank 0 lost contact"), PeerFailure("rank 1 lost contact")])  # from here, as well
    cause = reports.cause()
    assert (str(cause), cause.exit_code) == ("rank 0 lost contact", 1), cause  # the first echo, as before
    assert reports.cause() is None


# --- poisoned store values -------------------------------------------------------------------------------------

def test_a_poisoned_world_size_is_passed_over_and_never_printed(monkeypatch: pytest.MonkeyPatch) -> None:
    """A store at the master's port whose world-size key holds garbage with an escape sequence: node 1's rank,
    joining as `-n 2 -g 1 -nr 1` does, does not die of it (the check-in compares the world size again) but goes
    on to check in; with no rank 0 there, it gives up in one line saying so, without the garbage. The control:
    a readable world size that disagrees is refused at once, naming both numbers."""
    for var in rendezvous.SOCKET_IFNAMES:  # joining sets the unset ones in this process: unset again afterwards
        if var not in os.environ:
            monkeypatch.setenv(var, "")  # recorded as unset, so undone whatever joining writes
            monkeypatch.delenv(var)
    store = dist.TCPStore("127.0.0.1", 0, None, True, timedelta(seconds=30), wait_for_workers=False)
    joining = identity.spawned(1, 0, 1, 2, "127.0.0.1", store.port)
    store.set("mnist_ddp/world_size", b"\x1b[2J\x1b[31m2")
    with pytest.raises(UserError) as refused:
        distributed.join(joining, torch.device("cpu"), "gloo", 3)
    said = str(refused.value)
    assert "rank 0 never opened the check-in" in said and "\x1b" not in said and "\n" not in said, said
    store.set("mnist_ddp/world_size", b"3")
    with pytest.raises(UserError) as refused:
        distributed.join(joining, torch.device("cpu"), "gloo", 3)
    assert refused.value.exit_code == 2 and "node 0 started a job of 3 processes" in str(refused.value)


def _beats(client: dist.TCPStore, world: int) -> dict[int, dict]:
    """The ranks' own beats in the store now (those under a key that holds garbage at the moment are left out)."""
    found = {}
    for rank in range(world):
        key = f"mnist_ddp/heartbeat/{rank}"
        with suppress(ValueError):
            beat = json.loads(client.get(key)) if client.check([key]) else None
            if isinstance(beat, dict) and isinstance(beat.get("seq"), int) and isinstance(beat.get("pid"), int):
                found[rank] = beat
    return found


POISON = [b"\x80\x04garbage", b"[1, 2]", b"42", b'{"host": "h"}', b'{"pid": "x"}', b"{" * (8 << 20)]


def test_poisoned_beats_leave_the_heartbeat_alive_and_the_diagnosis_right(tmp_path: Path) -> None:
    """A `-g 3` job beating every 0.2 s. A stranger's client writes garbage under every rank's beat (non-JSON,
    a list, a number, records without our fields or with fields of the wrong type, 8 MiB): every rank still
    beats afterwards. Then ranks 1 and 2 are frozen (SIGSTOP) and the stranger leaves garbage with escape
    sequences under rank 1's key and, under rank 2's, a record of our shape whose host and `doing` hold escape
    sequences. Rank 0 times out (--timeout 10) and the launcher's line names both, rank 1's beat as
    unreadable, what /proc says of each, and no escape reaches the output."""
    env, mark = marked_env()
    port, out = free_port(), tmp_path / "out"
    with reaped(mark):
        job = start(["mnist_ddp", "train", *tiny(3000, 100, epochs=50), "--out", str(out), "-g", "3",
                     "--master-port", str(port), "--heartbeat", "0.2", "--timeout", "10", "--checkpoint-every", "2"],
                    env, tmp_path, tmp_path / "log")
        wait_for("training", lambda: progress(out), HANG, running=job)
        client = dist.TCPStore("127.0.0.1", port, None, False, timedelta(seconds=30))
        before = wait_for("every rank's beat", lambda: (b := _beats(client, 3)) and len(b) == 3 and b, HANG)
        for value in POISON:
            for rank in range(3):
                client.set(f"mnist_ddp/heartbeat/{rank}", value)
            time.sleep(0.3)
        wait_for("every rank beating again", lambda: all(
            beat["seq"] > before[r]["seq"] for r, beat in _beats(client, 3).items()) and len(_beats(client, 3)) == 3,
            HANG, running=job)
        pids = {r: beat["pid"] for r, beat in _beats(client, 3).items()}
        for rank in (1, 2):
            os.kill(pids[rank], signal.SIGSTOP)
        wait_for("ranks 1 and 2 stopped", lambda: all(
            Path(f"/proc/{pids[r]}/stat").read_text().rsplit(")", 1)[1].split()[0] == "T" for r in (1, 2)), HANG)
        forged = {**_beats(client, 3)[2], "host": "\x1b]0;owned\x07node9", "doing": "\x1b[2J\x1b[31mnothing"}
        for _ in range(2):  # and once more, after a beat that was on its way when they stopped
            client.set("mnist_ddp/heartbeat/1", b"\x1b[2J\x1b[31mnot a beat")
            client.set("mnist_ddp/heartbeat/2", json.dumps(forged))
            time.sleep(0.5)
        rc, log = finish(job, tmp_path / "log", HANG)
        for rank in (1, 2):
            with suppress(ProcessLookupError):  # the launcher killed its frozen workers already
                os.kill(pids[rank], signal.SIGKILL)
    line = next(line for line in reversed(log.splitlines()) if line.startswith("mnist-ddp: error: "))
    assert rc == 1 and "Traceback" not in log and "Exception in thread" not in log, log
    assert "\x1b" not in log and "does not answer" not in log, log
    host = socket.gethostname()
    assert (f"rank 2 (\\x1b]0;owned\\x07node9, pid {pids[2]}) stopped answering: stopped (SIGSTOP, or a debugger); "
            f"its last beat said it was \\x1b[2J\\x1b[31mnothing") in line, line
    assert (f"unreadable beat from rank 1 (not JSON: '\\x1b[2J\\x1b[31mnot a beat'); rank 1 ({host}, pid {pids[1]}) "
            f"is stopped (SIGSTOP, or a debugger)") in line, line


# --- a torch whose weights-only loader can be made to run code reads no file ----------------------------------

@pytest.mark.parametrize("command", ["evaluate", "predict", "train --resume"])
def test_a_torch_older_than_2_10_loads_no_file(command: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                               capsys: pytest.CaptureFixture[str]) -> None:
    """Under torch 2.9 (its version string: we cannot install one here), `evaluate`, `predict` and `--resume`
    refuse to load a checkpoint, in one line that says why, exit 2. The control: this torch loads it."""
    path = tmp_path / "checkpoint.pt"
    checkpoint.save(path, {"model": ConvNet().state_dict()})
    assert checkpoint.load(path)["model"].keys() == ConvNet().state_dict().keys()
    args = {"evaluate": ["evaluate", str(path)], "predict": ["predict", str(path), str(path)],
            "train --resume": ["train", *tiny(400, 100), "--out", str(tmp_path), "--resume"]}[command]
    monkeypatch.chdir(tmp_path)  # where training caches its synthetic data
    monkeypatch.setattr(torch, "__version__", "2.9.1+cu128")
    assert cli.main(args) == 2
    said = capsys.readouterr().err
    assert said == (f"mnist-ddp: error: {path}: not loaded: PyTorch 2.9.1+cu128 is older than 2.10, and a crafted "
                    f"file can make its weights-only loader run code (CVE-2025-32434, CVE-2026-24747); upgrade it: "
                    f"pip install 'torch>=2.10'.\n"), said
