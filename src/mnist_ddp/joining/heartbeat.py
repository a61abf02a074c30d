"""Which rank hangs: every rank's thread beats to the store (host, pid, what it does), so that a failed collective
can name the rank that stopped answering, dead or frozen (docs/design/heartbeat.md)."""

import json
import os
import socket
import threading
import time
from collections.abc import Callable
from contextlib import suppress
from pathlib import Path
from typing import TypeVar

import torch.distributed as dist

from ..common import untrusted
from . import rendezvous

T = TypeVar("T")
BEATS_PREFIX = "mnist_ddp/heartbeat"  # where in the job's store the beats are kept
BEAT_WAIT_S = 2.0  # how long a reading waits for the store (answers take milliseconds): a frozen host is told soon
LOST_CONTACT = "lost contact"  # the last words of a survivor
VERDICT = "verdict"  # where a rank that hosts the store leaves its diagnosis, before it leaves and takes the store


def beats_prefix(generation: int) -> str:
    """Where the beats of a world re-formed by --recover (generation ≥ 1) are kept."""
    return BEATS_PREFIX if generation == 0 else f"{BEATS_PREFIX}/generation{generation}"


# What a beat holds (`Heartbeat._beat`); a record without these, of these types, is no beat of ours.
BEAT: dict[str, type | tuple[type, ...]] = {
    "host": str, "pid": int, "node": str, "start": str, "seq": int, "doing": str, "left": (str, type(None)),
    "culprit": bool}


def _node() -> str:
    """This kernel and pid namespace: where /proc tells about a pid of a peer that published the same."""
    with suppress(OSError):
        boot = Path("/proc/sys/kernel/random/boot_id").read_text().strip()
        return f"{boot}:{os.readlink('/proc/self/ns/pid')}"
    return f"{socket.gethostname()}:{os.getpid()}"  # no /proc: never the same as a peer's


def _started(pid: int) -> str | None:
    """The state letter and start time (clock ticks since boot) of `pid`, or None when there is no such process.
    The start time tells a reused pid from the original."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    fields = stat[stat.rindex(")") + 2:].split()  # the command name may hold spaces and parentheses
    return f"{fields[0]} {fields[19]}"


def stopped(pid: int) -> bool:
    """Whether /proc says `pid` is stopped: SIGSTOP, or a debugger (False where there is no /proc)."""
    now = _started(pid)
    return now is not None and now.split()[0] in ("T", "t")


def _fate(beat: dict) -> str:
    """What /proc says about the process that published `beat` (it ran on this machine)."""
    now = _started(beat["pid"])
    if now is None or now.split()[1] != beat["start"]:
        return "gone (its process no longer exists)"
    state = now.split()[0]
    return {"Z": "gone (exited, not yet reaped)", "T": "stopped (SIGSTOP, or a debugger)",
            "t": "stopped by a debugger", "D": "alive, stuck in the kernel (waiting on a disk or a network file "
            "system)"}.get(state, "alive but silent (hung with its heartbeat thread: stuck holding Python's lock?)")


def gone(beat: dict, stopped: bool = False) -> bool:
    """Whether the process that published `beat` is known to have ended (or, `stopped`, to be stopped: SIGSTOP, a
    debugger): it ran on this machine and /proc says so."""
    return beat["node"] == _node() and _fate(beat).startswith(("gone", "stopped") if stopped else "gone")


def bounded(fn: Callable[[], T], seconds: float) -> T | None:
    """`fn()`, or None if it raised a store error or did not return within `seconds`: a TCPStore call may wait
    for a frozen host without end (docs/design/heartbeat.md)."""
    found: list[T] = []

    def call() -> None:
        with suppress(RuntimeError, OSError):  # DistStoreError is a RuntimeError: the store's host is gone
            found.append(fn())
    caller = threading.Thread(target=call, name="mnist-ddp heartbeat reader", daemon=True)
    caller.start()
    caller.join(seconds)
    return found[0] if found else None


class Heartbeat:
    """This rank's beat, and the reading of everyone's when something failed."""

    DIAGNOSIS_BEATS = 2.5  # a counter that did not move over this many beats is silent

    def __init__(self, store: dist.Store, rank: int, world: int, interval: float, store_host: int | None) -> None:
        """`store_host`: the rank whose process hosts the store (it dies with it), or None for a launcher's."""
        self.store, self.rank, self.world, self.interval, self.store_host = store, rank, world, interval, store_host
        me = _started(os.getpid())
        self.me = {"host": socket.gethostname(), "pid": os.getpid(), "node": _node(),
                   "start": me.split()[1] if me else ""}
        self.roster: dict[int, dict] = {}  # every rank's first record: who is where, even if the store dies later
        self.phase = self.doing = "joining the process group"
        self.seq = 0
        self.stopped = self.store_silent = False
        self.verdict = ""  # the store host's diagnosis, read while the store answered
        self.wake = threading.Event()
        self.thread = threading.Thread(target=self._run, name="mnist-ddp heartbeat", daemon=True)
        self.thread.start()

    @classmethod
    def reader(cls, store: dist.Store, world: int, interval: float) -> "Heartbeat":
        """The job's beats as a launcher reads them (launch.spawn): no rank of its own, no beating; `diagnose`
        and `mark_left` only."""
        reader = cls.__new__(cls)
        reader.store, reader.rank, reader.world, reader.interval, reader.store_host = store, -1, world, interval, None
        reader.me, reader.roster, reader.store_silent = {"node": _node()}, {}, False
        return reader

    def mark_left(self, rank: int, left: str) -> None:
        """Write `rank`'s last record for it, as a departure that is not its own failure: for a rank that could
        not (killed by a signal) and is known to be no culprit, so that no diagnosis names it as silent."""
        read = bounded(self._read, BEAT_WAIT_S)  # (readable beats, unreadable ones), or None: no answer
        beat = read[0].get(rank) if read else None
        if beat:
            bounded(lambda: self.store.set(str(rank), json.dumps({**beat, "left": left, "culprit": False})),
                     BEAT_WAIT_S)

    def set_phase(self, phase: str, epoch: int = 0, step: int = 0) -> None:
        """What this rank does now: a new phase is published at once (by the thread), a new step with the next
        beat, so the loop never waits for the store and its steps cost no I/O."""
        self.doing = f"{phase} (epoch {epoch}, step {step})" if epoch else phase
        if phase != self.phase:
            self.phase = phase
            self.wake.set()

    def _beat(self, left: str | None = None, culprit: bool = False) -> None:
        self.seq += 1
        self.store.set(str(self.rank), json.dumps({**self.me, "seq": self.seq, "doing": self.doing, "left": left,
                                                   "culprit": culprit}))

    def _run(self) -> None:
        while not self.stopped:
            try:
                self._beat()
                if len(self.roster) < self.world:
                    self.roster = {**self._read()[0], **self.roster}
                if self.store_host not in (None, self.rank) and self.store.check([VERDICT]):
                    self.verdict = untrusted.text(self.store.get(VERDICT), limit=2000)
            except (RuntimeError, OSError):  # the store's host is gone or frozen: keep trying, diagnose() says so
                if self._store_gone():  # its port refuses: no beat reaches it again (and each try logs a C++ trace)
                    self.store_silent = True
                    return
            self.wake.wait(self.interval)
            self.wake.clear()

    def _store_gone(self) -> bool:
        """Whether the store's port refuses connections: the process that held it is gone."""
        store = self.store
        while hasattr(store, "underlying_store"):  # PrefixStores, down to the TCPStore
            store = store.underlying_store
        return isinstance(store, dist.TCPStore) and rendezvous.reached(store.host, store.port, 0) is False

    def stop(self, left: str, culprit: bool) -> None:
        """Stop beating, leaving a last record that says why this rank left, and whether that is a failure of
        its own (`culprit`) rather than an echo of another's (LOST_CONTACT), a success or an interrupt."""
        self.stopped = True
        self.wake.set()
        self.thread.join(timeout=BEAT_WAIT_S)
        if not self.store_silent:
            bounded(lambda: self._beat(left, culprit), BEAT_WAIT_S)
        if self.store_host == self.rank and (culprit or left == LOST_CONTACT):  # others may be reading the beats
            time.sleep(self.DIAGNOSIS_BEATS * self.interval + 0.5)

    def beats(self) -> dict[int, dict]:
        """Every rank's last readable record (recovery.py tells the silent ranks by it)."""
        return self._read()[0]

    def _read(self) -> tuple[dict[int, dict], dict[int, str]]:
        """Every rank's last record (ranks that never beat are missing), and why those that are not a beat of
        ours cannot be read."""
        present = [r for r in range(self.world) if self.store.check([str(r)])]
        values = self.store.multi_get([str(r) for r in present]) if present else []
        beats, unreadable = {}, {}
        for rank, value in zip(present, values):
            try:
                beats[rank] = untrusted.record(value, BEAT)
            except ValueError as e:
                unreadable[rank] = str(e)
        return beats, unreadable

    def _who(self, rank: int, beat: dict) -> str:
        return f"rank {rank} ({beat['host']}, pid {beat['pid']})"

    def diagnose(self) -> str:
        """Name the ranks that stopped answering: host, pid, dead or frozen, what they were last doing; '' when
        nothing points at anyone. Takes about three beats (the records are read twice), and never hangs: a
        frozen store host leaves reads unanswered past their timeout (`bounded`)."""
        first = bounded(self._read, BEAT_WAIT_S)
        found = first and bounded(lambda: self._diagnose(first[0]),
                                   self.DIAGNOSIS_BEATS * self.interval + BEAT_WAIT_S)
        if found is not None:
            if found and self.store_host == self.rank:  # for ranks that hear of the failure only as this one leaves
                bounded(lambda: self.store.set(VERDICT, found), BEAT_WAIT_S)
            return found
        self.store_silent = True
        if self.store_host is None:
            return ("the rendezvous store does not answer either, so the launcher that hosts it (torchrun's agent, "
                    "or node 0's mnist-ddp process) is gone or frozen")
        host = self.roster.get(self.store_host)
        who = f"{self._who(self.store_host, host) if host else f'rank {self.store_host}'}, which hosts the " \
              f"rendezvous store,"
        if self.verdict:
            return f"{who} left after it found: {self.verdict}"
        fate = _fate(host) if host and host["node"] == self.me["node"] else "gone or frozen"
        return f"{who} stopped answering: {fate} (the store does not answer either)"

    def _diagnose(self, first: dict[int, dict]) -> str:
        """`diagnose`'s reading of the store, after the `first` one."""
        for rank, beat in first.items():  # what this machine can see, for survivors elsewhere to read
            if rank != self.rank and beat["node"] == self.me["node"]:
                self.store.set(f"fate/{rank}", _fate(beat))
        time.sleep(self.DIAGNOSIS_BEATS * self.interval)
        second, unreadable = self._read()
        fates = {r: untrusted.text(self.store.get(f"fate/{r}")) for r in second if self.store.check([f"fate/{r}"])}
        silent, failed = [], []
        never = [r for r in range(self.world) if r not in second and r not in unreadable]
        for rank, beat in sorted(second.items()):
            if beat["culprit"]:
                failed.append(f"{self._who(rank, beat)} failed: {beat['left']}")
            elif beat["left"] is None and first.get(rank, {}).get("seq") == beat["seq"]:
                fate = _fate(beat) if beat["node"] == self.me["node"] else fates.get(
                    rank, "dead or frozen, on a machine where no survivor could look")
                silent.append(f"{self._who(rank, beat)} stopped answering: {fate}; its last beat said it was "
                              f"{beat['doing']}")
        garbled = [self._unreadable(rank, why) for rank, why in sorted(unreadable.items()) if rank != self.rank]
        named = failed + silent + garbled + [f"rank{'s' if len(never) > 1 else ''} {', '.join(map(str, never))} "
                                             f"never reached the rendezvous store"] * bool(never)
        return "; ".join(named) or self._odd_one_out(second)

    def _unreadable(self, rank: int, why: str) -> str:
        """A rank whose record is no beat of ours (someone else wrote its key), with what the roster and /proc
        still tell about its process."""
        said = f"unreadable beat from rank {rank} ({why})"
        known = self.roster.get(rank)
        if known is None:
            return said
        where = _fate(known) if known["node"] == self.me["node"] else "on another machine"
        return f"{said}; {self._who(rank, known)} is {where}"

    def _odd_one_out(self, beats: dict[int, dict]) -> str:
        """Everyone still beats: name the ranks that were doing something else than the most of them."""
        groups: dict[str, list[int]] = {}
        for rank, beat in beats.items():
            groups.setdefault(beat["doing"], []).append(rank)
        if len(groups) < 2:
            return ""
        common = max(groups, key=lambda doing: len(groups[doing]))
        odd = [f"rank {r} ({beats[r]['host']}, pid {beats[r]['pid']}) was still {doing}"
               for doing, ranks in groups.items() if doing != common for r in ranks]
        return f"every rank still answers, but {'; '.join(odd)} while the others were {common}"
