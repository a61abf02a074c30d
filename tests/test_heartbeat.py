"""The heartbeat's reading of a job, on a real TCPStore in this process: ranks here are Heartbeat objects that
beat over connections of their own, and silent ranks are real processes whose beat thread is stopped. (Ranks
killed or frozen while training are in test_faults.py.)

No clock decides anything here. A diagnosis reads every rank's beat twice, 2.5 beats apart: the pause between
the two readings is made to end once every rank meant to be alive has published a newer beat (`readings`),
and the ranks meant to be silent have provably stopped beating, so a loaded box cannot make a live rank look
silent, nor a silent one alive.
"""

import json
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from datetime import timedelta
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch.distributed as dist

from mnist_ddp.joining import heartbeat
from mnist_ddp.joining.heartbeat import LOST_CONTACT, Heartbeat
from procfs import children, marked_env, reaped

BEAT = 60.0  # seconds: no rank here beats on its own during a test, only when told to (and once as it starts)
HANG = 60  # seconds: how long a test waits for a beat or a process before it fails; a hang guard only


@pytest.fixture
def store() -> Iterator[dist.TCPStore]:
    server = dist.TCPStore("127.0.0.1", 0, None, True, timedelta(seconds=10), wait_for_workers=False)
    yield server


def _client(server: dist.TCPStore) -> dist.TCPStore:
    return dist.TCPStore("127.0.0.1", server.port, None, False, timedelta(seconds=10))


def _published(server: dist.TCPStore, rank: int) -> dict:
    """What `rank`'s key holds; {"seq": 0} where no beat of ours is there (none yet, or a stranger's garbage)."""
    try:
        beat = json.loads(server.get(str(rank))) if server.check([str(rank)]) else None
    except (ValueError, RecursionError):
        beat = None
    return beat if isinstance(beat, dict) and isinstance(beat.get("seq"), int) else {"seq": 0}


def _until(what: str, ok: object) -> None:
    deadline = time.monotonic() + HANG
    while not ok():  # type: ignore[operator]
        assert time.monotonic() < deadline, f"no {what} within {HANG} s"
        time.sleep(0.01)


@pytest.fixture
def readings(store: dist.TCPStore, monkeypatch: pytest.MonkeyPatch) -> list[Heartbeat]:
    """The ranks (in this process) that are alive: the pause between a diagnosis's two readings wakes each and
    ends once each has published a beat newer than the first reading's."""
    alive: list[Heartbeat] = []

    def pause(_seconds: float) -> None:
        for beat in alive:
            newer = _published(store, beat.rank)["seq"] + 1
            beat.wake.set()
            _until(f"beat from rank {beat.rank}", lambda beat=beat, newer=newer: _published(store, beat.rank)["seq"]
                   >= newer)
    clock = {name: getattr(time, name) for name in dir(time) if not name.startswith("_")}
    monkeypatch.setattr(heartbeat, "time", SimpleNamespace(**clock | {"sleep": pause}))  # heartbeat's time alone
    return alive


def _ranks(server: dist.TCPStore, world: int, present: int, alive: list[Heartbeat]) -> list[Heartbeat]:
    ranks = [Heartbeat(_client(server), rank, world, BEAT, store_host=None) for rank in range(present)]
    alive += ranks
    for beat in ranks:  # each has published its first beat
        _until(f"first beat from rank {beat.rank}", lambda beat=beat: _published(server, beat.rank)["seq"] >= 1)
    return ranks


def test_rank_doing_something_else_is_named_when_none_is_silent(store: dist.TCPStore,
                                                                readings: list[Heartbeat]) -> None:
    ranks = _ranks(store, 3, 3, readings)
    for beat in ranks:
        beat.set_phase("training", 2, 14)
    ranks[1].set_phase("saving checkpoint.pt")
    said = ranks[0].diagnose()
    assert said.startswith("every rank still answers, but rank 1 (") and "was still saving checkpoint.pt while " \
        "the others were training (epoch 2, step 14)" in said, said
    for beat in ranks:
        beat.stop("finished", culprit=False)


def test_rank_that_failed_on_its_own_is_named_with_why_and_survivors_are_not(store: dist.TCPStore,
                                                                             readings: list[Heartbeat]) -> None:
    ranks = _ranks(store, 3, 3, readings)
    for beat in ranks[1:]:
        readings.remove(beat)
    ranks[2].stop("no space left on device writing checkpoint.pt", culprit=True)
    ranks[1].stop(LOST_CONTACT, culprit=False)  # a survivor that already gave up
    said = ranks[0].diagnose()
    assert said.startswith("rank 2 (") and said.endswith("failed: no space left on device writing checkpoint.pt"), said
    assert "rank 1" not in said
    ranks[0].stop(LOST_CONTACT, culprit=False)


def test_ranks_that_never_came_are_named(store: dist.TCPStore, readings: list[Heartbeat]) -> None:
    ranks = _ranks(store, 4, 2, readings)
    assert ranks[1].diagnose() == "ranks 2, 3 never reached the rendezvous store"
    for beat in ranks:
        beat.stop(LOST_CONTACT, culprit=False)


# --- whoever reaches the store can write the beats: a value that is no beat of ours is said to be one ---------

GARBAGE = {  # what a stranger (or a bug) could leave under a rank's key -> what the diagnosis says of it
    "not JSON": (b"\x80\x04\x95\x1b[2J", "not JSON: '"),
    "a JSON list": (b"[1, 2, 3]", "JSON list, not an object"),
    "a JSON number": (b"42", "JSON int, not an object"),
    "a record without our fields": (b'{"host": "h"}', "no 'pid'"),
    "a field of the wrong type": (json.dumps({"host": "h", "pid": "7", "node": "", "start": "", "seq": 1,
                                              "doing": "", "left": None, "culprit": False}).encode(), "'pid' is a str"),
    "a bool for a number": (json.dumps({"host": "h", "pid": True, "node": "", "start": "", "seq": 1, "doing": "",
                                        "left": None, "culprit": False}).encode(), "'pid' is a bool"),
    "nested 60,000 deep": (b"[" * 60000, "JSON nested deeper than Python can read"),
    "8 MiB": (b"{" * (8 << 20), "8,388,608 bytes, more than any value of ours"),
}


@pytest.mark.parametrize("case", GARBAGE)
def test_unreadable_beat_is_named_and_the_heartbeat_lives_on(store: dist.TCPStore, readings: list[Heartbeat],
                                                             case: str) -> None:
    """Rank 2 never beats, and a stranger's client writes `case` under its key, and under a live rank's (which
    its next beat repairs): the diagnosis names rank 2's beat as unreadable (not "the store does not answer"),
    says nothing of rank 1, and every heartbeat thread still runs."""
    value, said_of_it = GARBAGE[case]
    ranks = _ranks(store, 3, 2, readings)
    stranger = _client(store)
    stranger.set("2", value)
    stranger.set("1", value)
    said = ranks[0].diagnose()
    assert said.startswith(f"unreadable beat from rank 2 ({said_of_it}"), said
    assert "rank 1" not in said and "\x1b" not in said, said
    assert not ranks[0].store_silent
    assert all(beat.thread.is_alive() for beat in ranks)
    for beat in ranks:
        beat.stop("finished", culprit=False)


def test_text_from_the_store_is_printed_escaped(store: dist.TCPStore, readings: list[Heartbeat]) -> None:
    """A record of the right shape whose host and `doing` hold terminal escape sequences (clear the screen, set
    the window title) is quoted with them escaped: no control character of it reaches the message."""
    ranks = _ranks(store, 3, 2, readings)
    forged = {**ranks[0].me, "host": "\x1b]0;owned\x07node9", "seq": 1, "doing": "\x1b[2J\x1b[31mtraining\u202e",
              "left": None, "culprit": False}
    _client(store).set("2", json.dumps(forged))
    said = ranks[0].diagnose()
    assert said.startswith("rank 2 (\\x1b]0;owned\\x07node9, pid "), said
    assert said.endswith("its last beat said it was \\x1b[2J\\x1b[31mtraining\\u202e"), said
    assert not any(ord(c) < 32 or c == "\u202e" for c in said), said
    for beat in ranks:
        beat.stop("finished", culprit=False)


# A rank in a process of its own: it beats, says it trains, then its beat thread stops for good (joined, no last
# record: a rank that hangs) and the process either sleeps (alive) or waits inside the kernel: a vfork()ed child
# that never execs keeps its parent in uninterruptible sleep, state D, as a hung disk or NFS server would.
_SILENT = """
import ctypes, json, sys, time
from datetime import timedelta
import torch.distributed as dist
from mnist_ddp.joining.heartbeat import Heartbeat
port, rank, world, how = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
store = dist.TCPStore("127.0.0.1", port, None, False, timedelta(seconds=10))
beat = Heartbeat(store, rank, world, 3600, store_host=None)
beat.set_phase("training", 1, 3)
said = lambda: json.loads(store.get(str(rank))).get("doing") if store.check([str(rank)]) else None
while said() != "training (epoch 1, step 3)":  # published
    time.sleep(0.01)
beat.stopped = True
beat.wake.set()
beat.thread.join()
print("silent", flush=True)
if how == "kernel":
    libc = ctypes.CDLL(None)
    if libc.vfork() == 0:
        libc.pause()  # the child: its parent stays in the kernel until it execs or exits, which it never does
        libc._exit(0)
time.sleep(3600)
"""


def test_silent_ranks_on_this_machine_are_named_with_what_proc_says(store: dist.TCPStore,
                                                                    readings: list[Heartbeat]) -> None:
    """Rank 1 alive but silent (its process sleeps), rank 2 stuck in the kernel (state D); rank 0 reads both."""
    env, mark = marked_env()
    ranks = _ranks(store, 3, 1, readings)
    with reaped(mark):
        silent = {rank: subprocess.Popen([sys.executable, "-c", _SILENT, str(store.port), str(rank), "3", how],
                                         env=env, stdout=subprocess.PIPE, text=True)
                  for rank, how in ((1, "asleep"), (2, "kernel"))}
        try:
            for proc in silent.values():
                assert proc.stdout is not None and proc.stdout.readline() == "silent\n"
            _until("rank 2 in the kernel", lambda: Path(f"/proc/{silent[2].pid}/stat").read_text()
                   .rsplit(")", 1)[1].split()[0] == "D")
            said = ranks[0].diagnose()
        finally:
            grandchildren = children(silent[2].pid)  # the vfork child, which outlives a SIGKILLed parent
            for pid in [proc.pid for proc in silent.values()] + grandchildren:
                os.kill(pid, signal.SIGKILL)
            for proc in silent.values():
                proc.wait()
    host, last = socket.gethostname(), "its last beat said it was training (epoch 1, step 3)"
    assert said == (f"rank 1 ({host}, pid {silent[1].pid}) stopped answering: alive but silent (hung with its "
                    f"heartbeat thread: stuck holding Python's lock?); {last}; rank 2 ({host}, pid {silent[2].pid}) "
                    f"stopped answering: alive, stuck in the kernel (waiting on a disk or a network file system); "
                    f"{last}"), said
    ranks[0].stop(LOST_CONTACT, culprit=False)


def test_a_survivor_quotes_what_the_store_host_found_once_the_store_is_gone() -> None:
    """Rank 0 hosts the store, finds rank 2 gone and leaves, taking the store with it; rank 1, which heard of the
    failure only as rank 0 left (waiting on it in gloo's ring), can no longer read the beats: it quotes what rank 0
    found, which its beat thread read while the store answered, rather than name rank 0. (Beats every 0.05 s;
    whether a beat looked late decides nothing asserted here.)"""
    server = dist.TCPStore("127.0.0.1", 0, None, True, timedelta(seconds=10), wait_for_workers=False)
    host, survivor = (Heartbeat(_client(server), rank, 3, 0.05, store_host=0) for rank in (0, 1))
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    server.set("2", json.dumps({"host": socket.gethostname(), "pid": int(dead.stdout), "node": heartbeat._node(),
                                "start": "0", "seq": 5, "doing": "training (epoch 1, step 3)", "left": None,
                                "culprit": False}))
    found = host.diagnose()
    gone = f"rank 2 ({socket.gethostname()}, pid {int(dead.stdout)}) stopped answering: gone ("
    assert gone in found, found
    _until("rank 1's thread to read rank 0's finding", lambda: survivor.verdict == found)
    host.stop(LOST_CONTACT, culprit=False)
    del host, server  # rank 0's process ends, and its store with it
    said = survivor.diagnose()
    assert said.startswith("rank 0 (") and f"which hosts the rendezvous store, left after it found: {found}" in said
    survivor.stop(LOST_CONTACT, culprit=False)
