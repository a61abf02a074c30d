"""Which rank hangs: every rank says where it is, so that a timeout can name the one that stopped answering.

A collective that times out only knows that *some* peer did not answer; at 64 ranks on 8 hosts that is
useless. So each rank runs a small thread that, every `interval` seconds, writes one short record to the
job's rendezvous store (the one the process group met at, under its own prefix, over a connection of its
own): host, pid, a counter that grows with every beat, and what the rank was last doing, as the training
loop reports it with `at` (a tuple assignment: no I/O in the loop). The thread beats while the main thread
waits inside a collective, so a healthy rank keeps beating; a frozen (SIGSTOP) or dead process does not.

When a collective or the rendezvous fails, `diagnose` reads every rank's record twice, a few beats apart:
those whose counter did not move are the silent ones. A silent rank on this machine (the same kernel and
pid namespace) is looked up in /proc: gone, stopped (SIGSTOP, a debugger) or alive but silent; for one on
another machine, a survivor there writes what it saw under `fate/<rank>` while it diagnoses. A rank that
left on purpose writes a last record saying why (`stop`), so a survivor that already gave up is not taken
for the culprit, and a rank that failed for a reason of its own is named with it.
"""

import json
import os
import socket
import threading
import time
from contextlib import suppress
from pathlib import Path

import torch.distributed as dist

BEAT_WAIT_S = 5.0  # how long a beat or a reading waits for the store: short, so a frozen store host is told soon
LOST_CONTACT = "lost contact"  # the last words of a survivor


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


def _fate(beat: dict) -> str:
    """What /proc says about the process that published `beat` (it ran on this machine)."""
    now = _started(beat["pid"])
    if now is None or now.split()[1] != beat["start"]:
        return "gone (its process no longer exists)"
    state = now.split()[0]
    return {"Z": "gone (exited, not yet reaped)", "T": "stopped (SIGSTOP, or a debugger)",
            "t": "stopped by a debugger", "D": "alive, stuck in the kernel (waiting on a disk or a network file "
            "system)"}.get(state, "alive but silent (hung with its heartbeat thread: stuck holding Python's lock?)")


class Heartbeat:
    """This rank's beat, and the reading of everyone's when something failed."""

    DIAGNOSIS_BEATS = 2.5  # a counter that did not move over this many beats is silent

    def __init__(self, store: dist.Store, rank: int, world: int, interval: float, hosts_store: bool) -> None:
        self.store, self.rank, self.world, self.interval = store, rank, world, interval
        self.hosts_store = hosts_store  # the store lives in this process: it dies with it
        me = _started(os.getpid())
        self.me = {"host": socket.gethostname(), "pid": os.getpid(), "node": _node(),
                   "start": me.split()[1] if me else ""}
        self.phase = self.doing = "joining the process group"
        self.seq = 0
        self.stopped = False
        self.wake = threading.Event()
        self.thread = threading.Thread(target=self._run, name="mnist-ddp heartbeat", daemon=True)
        self.thread.start()

    def at(self, phase: str, epoch: int = 0, step: int = 0) -> None:
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
            with suppress(RuntimeError, OSError):  # the store's host is gone or frozen: keep trying, diagnose() says so
                self._beat()
            self.wake.wait(self.interval)
            self.wake.clear()

    def stop(self, left: str, culprit: bool) -> None:
        """Stop beating, leaving a last record that says why this rank left, and whether that is a failure of
        its own (`culprit`) rather than an echo of another's (LOST_CONTACT), a success or an interrupt."""
        self.stopped = True
        self.wake.set()
        self.thread.join(timeout=self.interval + 2 * BEAT_WAIT_S)
        with suppress(RuntimeError, OSError):
            self._beat(left, culprit)
        if self.hosts_store and (culprit or left == LOST_CONTACT):  # the others may be reading the beats now
            time.sleep(self.DIAGNOSIS_BEATS * self.interval + 0.5)

    def _read(self) -> dict[int, dict]:
        """Every rank's last record (ranks that never beat are missing)."""
        present = [r for r in range(self.world) if self.store.check([str(r)])]
        values = self.store.multi_get([str(r) for r in present]) if present else []
        return {r: json.loads(v) for r, v in zip(present, values)}

    def diagnose(self) -> str:
        """Name the ranks that stopped answering: host, pid, what they were last doing, dead or frozen.
        Takes about three beats (the records are read twice); '' when nothing points at anyone."""
        try:
            first = self._read()
            for rank, beat in first.items():  # what this machine can see, for survivors elsewhere to read
                if rank != self.rank and beat["node"] == self.me["node"]:
                    self.store.set(f"fate/{rank}", _fate(beat))
            time.sleep(self.DIAGNOSIS_BEATS * self.interval)
            second = self._read()
        except (RuntimeError, OSError) as e:  # DistStoreError is a RuntimeError: timed out, or the host is gone
            return (f"the rendezvous store does not answer either ({type(e).__name__}), so whoever hosts it (rank "
                    f"0, a launcher's agent, or node 0's spawning process) is gone or frozen")
        silent, failed, never = [], [], [r for r in range(self.world) if r not in second]
        for rank, beat in sorted(second.items()):
            if beat["culprit"]:
                failed.append(f"rank {rank} ({beat['host']}, pid {beat['pid']}) failed: {beat['left']}")
            elif beat["left"] is None and first.get(rank, {}).get("seq") == beat["seq"]:
                fate = (_fate(beat) if beat["node"] == self.me["node"] else
                        self.store.get(f"fate/{rank}").decode() if self.store.check([f"fate/{rank}"]) else
                        "silent: dead or frozen, on a machine where no survivor could look")
                silent.append(f"rank {rank} ({beat['host']}, pid {beat['pid']}) stopped answering: {fate}; its "
                              f"last beat said it was {beat['doing']}")
        named = failed + silent + [f"rank{'s' if len(never) > 1 else ''} {', '.join(map(str, never))} never "
                                   f"reached the rendezvous store"] * bool(never)
        return "; ".join(named) or self._odd_one_out(second)

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
