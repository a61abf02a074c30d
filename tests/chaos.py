"""Faults at random, by the hundred: `make chaos SEED=s TRIALS=n BUDGET=seconds [ONLY=k]` (not part of CI).

Each trial draws, from the seed and its index, a world (`-g N`, or `-n 2 -g G` on two network namespaces),
`--recover` or not, `--bitwise` or not, and one or two faults at a random moment: a signal to a worker, to a
launcher or to the process that hosts the store; the cable between the namespaces cut; the run folder's file
system (a small tmpfs) filled up; a checkpoint or data file damaged before a resume. It runs the job, applies the
faults, and checks the contract docs/faults.md gives for that case (`contract`): the run finished with the
undisturbed run's steps (and its SHA-256 under --bitwise), or it stopped with the documented exit code and one line
naming the cause, leaving a checkpoint from which `--resume` finishes the same run. A run that outlives its limit is
a hang. One line per trial, a table by fault at the end; the output of every trial that broke a contract is kept,
and `ONLY=k` replays trial k of the seed. Every process a trial started carries a marker in its environment and is
killed by pid when the trial ends; its namespaces and tmpfs are removed. docs/testing.md says more.
"""

import argparse
import hashlib
import json
import os
import random
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import uuid
from collections import Counter
from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager, suppress
from dataclasses import dataclass, field, replace
from pathlib import Path

import pytest

from conftest import REPO
from mnist_ddp.outputs import checkpoint
from netns import netns_pair
from procfs import MARK, describe, marked_env, marked_pids, spawned_workers, start

TIMEOUT = 10  # --timeout: what a frozen peer costs
# A tiny chaotic run: 1600 synthetic images in micro-batches of 8 (200 steps at world 2, 100 at world 4), two
# epochs, a checkpoint every 5 steps.
RUN = ["train", "--dataset", "synthetic", "--train-samples", "1600", "--test-samples", "100", "--epochs", "2",
       "--batch-size", "8", "--optimizer", "sgd", "--lr", "0.05", "--momentum", "0.9", "--scheduler", "none",
       "--amp", "off", "--seed", "3", "--no-progress", "--no-plots", "--timeout", str(TIMEOUT),
       "--checkpoint-every", "5", "--log-every", "1"]
SAME = ("epoch", "train_samples", "global_batch", "lr", "batch_size")  # what metrics.jsonl must repeat
ADDRS = ("10.81.0.1", "10.81.0.2")  # the two namespaces' addresses (each pair is a world of its own)
PORT = "29500"
SIGNALS = ("SIGKILL", "SIGSTOP", "SIGTERM", "SIGINT")
SETTLE_S = 10  # after a job ended, how long its processes get to go before they count as left behind
DISK = "8m"  # the run folder's tmpfs: room for its checkpoints, and quickly filled
BROKEN, HUNG, LOST = "broke a contract", "hung", "lost a checkpoint"
ALL = "all trials"


# --- what a trial is: drawn from (seed, index) ------------------------------------------------------------------

@dataclass(frozen=True)
class World:
    """Where the job runs: `-g gpus` on this machine (nodes 1), or `-n 2 -g gpus` on two namespaces."""

    nodes: int
    gpus: int
    recover: bool
    bitwise: bool

    @property
    def size(self) -> int:
        return self.nodes * self.gpus

    def flags(self, node: int) -> list[str]:
        f = ["-g", str(self.gpus)]
        if self.nodes > 1:
            f = ["-n", str(self.nodes), *f, "-nr", str(node), "--master-addr", ADDRS[0], "--master-port", PORT]
        return f + ["--recover"] * self.recover + ["--bitwise"] * self.bitwise

    def __str__(self) -> str:
        where = f"-n {self.nodes} -g {self.gpus}" if self.nodes > 1 else f"-g {self.gpus}"
        return " ".join([where] + ["--recover"] * self.recover + ["--bitwise"] * self.bitwise)


@dataclass(frozen=True)
class Fault:
    """One fault. `target`: worker, launcher (node 1's), store host (node 0's launcher), link, disk, or a damaged
    file (checkpoint.pt, checkpoint.prev.pt, both checkpoints, data file). `how`: a signal, or how a file is
    damaged. `at`: when, as a fraction of the undisturbed run's training (start-up: of its start-up); `lasts`:
    how long a SIGSTOP or a cut lasts, in --timeouts (None: to the end); `which`: which worker (an index)."""

    target: str
    how: str = ""
    at: float = 0.0
    start_up: bool = False
    lasts: float | None = None
    which: int = 0

    @property
    def kind(self) -> str:
        """The row of the summary table."""
        if self.target in ("worker", "launcher", "store host"):
            return f"{self.target} {self.how}"
        return {"link": "link cut", "disk": "disk full"}.get(self.target, f"damaged {self.target}")

    @property
    def damage(self) -> bool:
        return self.target in DAMAGE

    def __str__(self) -> str:
        when = f"at {self.at:.2f} of {'start-up' if self.start_up else 'training'}"
        if self.damage:
            return f"Ctrl-C {when}, {self.target} {self.how} before the resume"
        lasts = "" if self.how not in ("SIGSTOP", "") or self.target == "disk" else \
            f" for {self.lasts:g}x--timeout" if self.lasts is not None else " for good"
        who = f" {self.which}" if self.target == "worker" else ""
        return f"{self.kind}{who} {when}{lasts}"


@dataclass(frozen=True)
class Trial:
    seed: int
    index: int
    world: World
    faults: tuple[Fault, ...]

    def __str__(self) -> str:
        return f"{self.world}: {'; '.join(map(str, self.faults))}"


DAMAGE = {"checkpoint.pt": ("flipped", "truncated", "deleted"), "checkpoint.prev.pt": ("flipped", "truncated"),
          "both checkpoints": ("flipped", "truncated"), "data file": ("flipped",)}


def draw(seed: int, index: int, netns: bool, root: bool) -> Trial:
    """Trial `index` of campaign `seed` (the same on every machine that can make the same kinds of world)."""
    rng = random.Random(f"mnist-ddp chaos {seed}/{index}")
    two = netns and rng.random() < 0.35
    world = World(2, rng.choice((1, 2)), rng.random() < 0.5, rng.random() < 0.5) if two else \
        World(1, rng.choice((2, 3, 4)), rng.random() < 0.5, rng.random() < 0.5)
    kinds = {"worker": 8, "store host": 3, "damage": 3} | ({"disk": 2} if root else {}) | \
        ({"launcher": 2, "link": 2} if two else {})
    faults: list[Fault] = []
    for _ in range(1 if rng.random() < 0.7 else 2):
        kind = rng.choices(list(kinds), list(kinds.values()))[0]
        if kind == "damage":
            kinds.pop("damage")  # one damaged file before the resume is enough
            target = rng.choices(list(DAMAGE), (35, 15, 15, 35))[0]
            faults.append(Fault(target, rng.choice(DAMAGE[target]), rng.random()))  # Ctrl-C then, to resume
            continue
        start_up, at = rng.random() < 0.15, rng.random()
        how = rng.choice(SIGNALS) if kind in ("worker", "launcher", "store host") else ""
        lasts = None
        if how == "SIGSTOP" or kind == "link":
            # a worker or the cable may stay frozen to the end; a launcher is always thawed (frozen for good, it
            # would never exit: a hang by definition, whatever the job does)
            lasts = rng.choice((0.3, 2.0) if kind in ("launcher", "store host") else (0.3, 2.0, None))
        faults.append(Fault(kind, how, at, start_up, lasts, rng.randrange(world.size)))
    return Trial(seed, index, world, tuple(faults))


# --- what the docs promise: the contract of each case -----------------------------------------------------------

@dataclass(frozen=True)
class Stop:
    """A fault the job does not survive: the exit codes its launchers may end with, and what the one line of the
    launcher that reports it must say (regex; '' for none: the process that could say it was SIGKILLed)."""

    codes: frozenset[int]
    says: str


LOST_CONTACT = r"lost contact with the other processes"
# A peer that never arrives: every process gives up within --timeout, exit 2, saying whom it waited for.
NEVER_ARRIVED = Stop(frozenset({2}), r"could not join the \d+ other process|found nobody listening")
# What losing the process that hosts the rendezvous store (node 0's launcher) does where no successor takes the
# store over: under -g (the launcher is the job) and without --recover. `None`: nothing the job notices (a launcher
# frozen for a while: the workers train on without it). Under -n/-nr with --recover the launcher of node 1 holds a
# standby store, and the survivors go on there without node 0's ranks (docs/design/recovery.md, "The store's host").
STORE_HOST: dict[tuple[str, bool], Stop | None] = {
    ("SIGKILL", False): Stop(frozenset({-9, 1}), LOST_CONTACT),  # said by the other node's ranks, if any
    ("SIGKILL", True): Stop(frozenset({-9, 1}), LOST_CONTACT),
    ("SIGTERM", False): Stop(frozenset({130, 1}), r"interrupted|" + LOST_CONTACT),
    ("SIGTERM", True): Stop(frozenset({130, 1}), r"interrupted|" + LOST_CONTACT),
    ("SIGINT", False): Stop(frozenset({130, 1}), r"interrupted|" + LOST_CONTACT),
    ("SIGINT", True): Stop(frozenset({130, 1}), r"interrupted|" + LOST_CONTACT),
    ("SIGSTOP", False): None,
    ("SIGSTOP", True): None,
}


@dataclass
class Landed:
    """A fault as it was applied: the pids it hit (the ranks they held, as workers), whether the job still ran then
    (a fault after the end changes nothing), and whether a checkpoint was there."""

    fault: Fault
    pids: list[int] = field(default_factory=list)
    ranks: set[int] = field(default_factory=set)
    missed: bool = False
    checkpoint_before: bool = False
    when: int = field(default_factory=time.time_ns)  # wall clock, as file times are
    late: bool = False  # after the run's last save (its training had ended): set once the job has ended


@dataclass(frozen=True)
class Expect:
    """What the first run must do: finish as undisturbed (under --recover without the `lost` ranks, saying so), or,
    where there are `stops`, end in one of those ways (finishing as undisturbed is never wrong)."""

    lost: frozenset[int] = frozenset()
    stops: tuple[Stop, ...] = ()
    either: bool = False  # a fault before the first step or after the last save: it may stop the job, or not


def contract(trial: Trial, landed: list[Landed]) -> Expect:
    """The case's contract (docs/faults.md), from the faults that landed while the job ran."""
    lost: set[int] = set()
    stops: list[Stop] = []
    either = False
    for hit in landed:
        if hit.missed:
            continue
        # Before the first step (start-up) and after the last save, --recover has no step to redo: the job may go on
        # or stop, and if it stops, it stops as it would without --recover.
        outside = hit.fault.start_up or hit.late
        either |= outside
        ranks, stop = effect(hit, trial.world, trial.world.recover and not outside)
        lost |= set() if outside else ranks
        stops += [stop] if stop else []
        f = hit.fault
        if f.start_up and f.target != "disk" and (f.lasts is None or f.lasts > 1):
            stops.append(NEVER_ARRIVED)  # a rank lost (or frozen) before it joined is one that never arrived
    if trial.world.recover and lost and len(lost) == trial.world.size:  # nobody left to go on
        # each launcher that was sent SIGINT or SIGTERM says it was interrupted
        told = any(hit.fault.how in ("SIGINT", "SIGTERM") for hit in landed if not hit.missed)
        stops.append(Stop(frozenset({1, 130, -9}), r"was killed by|stopped answering|" + LOST_CONTACT +
                          ("|interrupted" if told else "")))
    return Expect(frozenset(lost), tuple(stops), either)


def effect(hit: Landed, w: World, recover: bool) -> tuple[set[int], Stop | None]:
    """What one fault does to the job: the ranks it loses (under --recover the others go on without them) and,
    where the job cannot go on, how it stops."""
    f = hit.fault
    frozen_long = f.lasts is None or f.lasts > 1  # in --timeouts: a rank thawed within one was only slow
    if f.damage:  # the job was stopped with Ctrl-C, to damage a file before the resume
        return set(), Stop(frozenset({130, 1}), "interrupted|" + LOST_CONTACT)
    if f.target == "store host":
        if recover and w.nodes > 1 and f.how != "SIGSTOP":  # node 0's ranks end with it; node 1's go on
            return set(range(w.gpus)), None
        return set(), STORE_HOST[f.how, recover]
    if f.target in ("worker", "launcher"):
        if f.how == "SIGSTOP" and (f.target == "launcher" or not frozen_long):
            return set(), None  # a launcher trains nothing: its workers go on
        return hit.ranks, None if recover else _lost_without_recover(f, hit)
    if f.target == "link":
        if not frozen_long:
            return set(), None
        # node 1's ranks: node 0 holds the store, where the survivors meet again
        return set(range(w.gpus, w.size)), None if recover else Stop(frozenset({1}), LOST_CONTACT)
    assert f.target == "disk"
    if f.start_up:  # --out cannot be made or written: refused before anything starts
        return set(), Stop(frozenset({1, 2}), r"(?i)no space left on device")
    return set(), Stop(frozenset({1}), r"no space left on device writing .*; the previous checkpoint is intact")


def _lost_without_recover(f: Fault, hit: Landed) -> Stop:
    """A rank lost, nobody to go on without it: the job stops, and a line names it (docs/faults.md)."""
    pid = hit.pids[0] if hit.pids else 0
    if f.target == "launcher":
        return Stop(frozenset({1, 130, -9}), LOST_CONTACT + "|interrupted")
    if f.how in ("SIGTERM", "SIGINT"):
        return Stop(frozenset({1, 130}), rf"interrupted|pid {pid}\)|" + LOST_CONTACT)
    return Stop(frozenset({1}), rf"pid {pid}\b")


# --- running a job ------------------------------------------------------------------------------------------------

@dataclass
class Job:
    """One start of the job: a launcher per node, each in its own session, output to `<folder>/<name>-<n>.log`."""

    trial: Trial
    folder: Path
    out: Path
    env: dict[str, str]
    names: tuple[str, ...]
    name: str = "run"
    extra: tuple[str, ...] = ()
    procs: list[subprocess.Popen] = field(default_factory=list)
    codes: list[int | None] = field(default_factory=list)

    def start(self) -> "Job":
        w = self.trial.world
        for n in range(w.nodes):
            prefix = ["ip", "netns", "exec", self.names[n]] if w.nodes > 1 else []
            self.procs.append(start(["mnist_ddp", *RUN, *w.flags(n), "--out", str(self.out), *self.extra],
                                    self.env, self.folder, self.log(n), prefix=prefix))
        return self

    def log(self, node: int) -> Path:
        return self.folder / f"{self.name}-{node}.log"

    def running(self) -> bool:
        return any(p.poll() is None for p in self.procs)

    def workers(self) -> list[int]:
        """The workers of every node (node by node, in pid order), once each node has all of its own; else []."""
        found = []
        for p in self.procs:
            mine = sorted(spawned_workers(p.pid))
            if len(mine) != self.trial.world.gpus:
                return []
            found += mine
        return found

    def wait(self, limit: float) -> bool:
        """Wait for every launcher; False if one still runs after `limit` seconds."""
        deadline = time.monotonic() + limit
        for p in self.procs:
            try:
                p.wait(max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                return False
        # killed by SIGINT (a second Ctrl-C while the interpreter exits, when Python has put the default handler
        # back): what a shell shows as 130, the code of an interrupted run
        self.codes = [130 if p.returncode == -signal.SIGINT else p.returncode for p in self.procs]
        return True

    def said(self) -> list[str]:
        return [self.log(n).read_text(errors="replace") for n in range(len(self.procs))]


def _send(pid: int, how: str) -> bool:
    try:
        os.kill(pid, getattr(signal, how))
        return True
    except ProcessLookupError:
        return False


def _alive(pid: int) -> bool:
    with suppress(OSError):
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    return False


def _ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True, timeout=30)


def _fill(folder: Path) -> None:
    """Write a filler file until the file system has not one byte left."""
    with suppress(OSError), open(folder / ".filler", "ab") as f:
        while True:
            f.write(b"\0" * 65536)
            f.flush()


@dataclass
class Ref:
    """The undisturbed run of some settings: its final progress, its metrics record, its steps (steps.jsonl's
    samples done, one a step), the SHA-256 of its weights (--bitwise), and how long its start-up (to the first
    checkpoint) and its training took."""

    progress: dict
    record: list[dict]
    steps: list[int]
    digest: str | None
    start_up: float
    training: float


def _result(out: Path, bitwise: bool) -> tuple[dict, list[dict], list[int], str | None]:
    """What a finished run left: (progress, metrics record, steps, weights' digest); UserError if it left no
    checkpoint."""
    ckpt = checkpoint.load(out / "checkpoint.pt")
    record = [{k: m[k] for k in SAME} for m in map(json.loads, (out / "metrics.jsonl").read_text().splitlines())]
    steps = [json.loads(line)["samples"] for line in (out / "steps.jsonl").read_text().splitlines()]
    progress = {k: ckpt["progress"][k] for k in ("epoch", "consumed")}
    return progress, record, steps, checkpoint.digest(ckpt["model"]) if bitwise else None


@dataclass(frozen=True)
class Result:
    """How a trial ended: ok or one of BROKEN, HUNG, LOST; what happened, in words; whether its first run finished;
    the kinds of the faults that came after the run had ended."""

    outcome: str
    story: str
    finished: bool = False
    missed: tuple[str, ...] = ()


class Campaign:
    """Runs trials in `keep` (one folder each, removed when the trial kept its contract)."""

    def __init__(self, keep: Path, refs: Path, keep_all: bool = False) -> None:
        self.keep, self.refs_file, self.keep_all = keep, refs, keep_all
        self.refs: dict[str, dict] = json.loads(refs.read_text()) if refs.is_file() else {}

    # -- the undisturbed runs, once per settings, cached across campaigns (keyed by the source's digest) --

    def ref(self, world: World) -> Ref:
        key = self._key(world)
        if key not in self.refs:
            calm = replace(world, nodes=1, gpus=world.size)
            with self._place(Trial(0, -1, calm, ()), "reference") as (folder, out, env, names):
                job = Job(Trial(0, -1, calm, ()), folder, out, env, names, "reference").start()
                began = time.monotonic()
                while job.running() and not (out / "checkpoint.pt").exists():
                    time.sleep(0.01)
                first = time.monotonic()
                if not job.wait(600) or job.codes != [0]:
                    sys.exit(f"chaos: the undisturbed run ({key}) failed:\n{job.said()[0][-3000:]}")
                # training ends with the last save: its file time, on the monotonic clock
                ended = time.monotonic() - (time.time_ns() - (out / "checkpoint.pt").stat().st_mtime_ns) / 1e9
                progress, record, steps, digest = _result(out, world.bitwise)
            self.refs[key] = vars(Ref(progress, record, steps, digest, first - began, ended - first))
            self.refs_file.write_text(json.dumps(self.refs, indent=1))
        return Ref(**self.refs[key])

    def retime(self, world: World) -> None:
        """Forget `world`'s undisturbed run, so that the next trial runs it again: its times, taken while the machine
        was busier or quieter than now, place each fault in a trial's training."""
        self.refs.pop(self._key(world), None)

    @staticmethod
    def _key(world: World) -> str:
        return f"{world.size} recover={world.recover} bitwise={world.bitwise}"

    @contextmanager
    def _place(self, trial: Trial, name: str) -> Iterator[tuple[Path, Path, dict[str, str], tuple[str, ...]]]:
        """A trial's folder, its run folder (a small tmpfs where the disk is to fill up), its environment (with the
        marker every process it starts carries) and its two namespaces (-n 2): the namespaces and the tmpfs removed
        (its files copied out), and every marked process killed, at the end."""
        folder = self.keep / name
        shutil.rmtree(folder, ignore_errors=True)
        (folder / "run").mkdir(parents=True)
        env, mark = marked_env({"MNIST_DDP_SECRET": uuid.uuid4().hex})
        with ExitStack() as stack:
            stack.callback(_kill_marked, mark)
            if any(f.target == "disk" for f in trial.faults):
                _mount(folder / "run")
                stack.callback(subprocess.run, ["umount", "--lazy", str(folder / "run")], capture_output=True)
                stack.callback(shutil.copytree, folder / "run", folder / "run-disk", dirs_exist_ok=True,
                               ignore=shutil.ignore_patterns(".filler"))
            names: tuple[str, ...] = ()
            if trial.world.nodes > 1:
                names = stack.enter_context(netns_pair(f"chs{os.getpid() % 100000}-{trial.index % 1000}", ADDRS))
            yield folder, folder / "run" / "out", env, names


    # -- one trial --

    def run(self, trial: Trial) -> Result:
        """Run `trial`, and say how it ended."""
        ref = self.ref(trial.world)
        self.seen = Result("", "")  # what the first run did, once known
        with self._place(trial, f"trial-{trial.index}") as (folder, out, env, names):
            outcome, story = self._run(trial, ref, folder, out, env, names)
        if outcome == "ok" and not self.keep_all:
            shutil.rmtree(self.keep / f"trial-{trial.index}", ignore_errors=True)
        return replace(self.seen, outcome=outcome, story=story)

    def _run(self, trial: Trial, ref: Ref, folder: Path, out: Path, env: dict[str, str],
             names: tuple[str, ...]) -> tuple[str, str]:
        limit = 6 * TIMEOUT + 3 * (ref.start_up + ref.training) + 30
        job = Job(trial, folder, out, env, names).start()
        landed, ended = self._drive(job, ref, names, limit)
        if not ended or not job.wait(5):
            return HUNG, f"still running {limit:.0f} s after it started"
        if left := _left_behind(env):
            return BROKEN, f"ended ({_codes(job)}) but left processes behind: {describe(left)}"
        finished = not _same_run(trial, job, out, ref)
        last_save = _last_save(out, ref)
        for hit in landed:
            hit.late = last_save is not None and hit.when >= last_save
        missed = [hit.fault.kind for hit in landed if hit.missed or hit.late]
        story = f"{'finished' if finished else 'stopped'} ({_codes(job)}" + \
            (f"; missed, the run had ended: {', '.join(missed)})" if missed else ")")
        self.seen = Result("", "", finished, tuple(missed))
        wrong = self._judge(trial, job, contract(trial, landed), landed, ref)
        if wrong:
            return wrong[0], f"{story}: {wrong[1]}"
        damage = next((f for f in trial.faults if f.damage), None)
        if finished and damage is None:
            return "ok", f"{story}, as undisturbed"
        if damage is not None and not _damage(damage, folder, out):
            story += f"; no {damage.target} to damage"
        resumed = Job(trial, folder, out, env, names, "resume", ("--resume",))
        if checkpoint.newest_intact(out / "checkpoint.pt")[0] is None and _checkpoints(out):
            return self._refused(resumed, limit, story)
        if not resumed.start().wait(limit):
            return HUNG, f"{story}; the resume still ran {limit:.0f} s after it started"
        if left := _left_behind(env):
            return BROKEN, f"{story}; the resume left processes behind: {describe(left)}"
        wrong_resume = _same_run(trial, resumed, out, ref)
        if wrong_resume:
            return BROKEN, f"{story}; the resume {wrong_resume}"
        return "ok", f"{story}; resumed to the undisturbed run"

    def _judge(self, trial: Trial, job: Job, expect: Expect, landed: list[Landed],
               ref: Ref) -> tuple[str, str] | None:
        """What broke the contract in the first run, (outcome, words); None if nothing did."""
        said = job.said()
        if any("Traceback" in s for s in said):
            return BROKEN, "a traceback: " + _tail(said)
        for node, (code, log) in enumerate(zip(job.codes, said)):
            if code not in (0, -9) and len(_lines(log)) != 1:  # a SIGKILLed launcher cannot say anything
                return BROKEN, f"node {node}'s launcher ended with {code} and {len(_lines(log))} lines: " + _tail(said)
        wrong = _same_run(trial, job, job.out, ref)
        if not wrong:  # finished as undisturbed: a rank the run went on without must have been said so
            if expect.lost and trial.world.recover and not expect.either and not any("recover: " in s for s in said) \
                    and _shrank(job.out, trial.world.size):
                return BROKEN, "no recover: line for the lost rank"
            return None
        if 0 in job.codes:
            return BROKEN, wrong
        had = any(hit.checkpoint_before for hit in landed if not hit.missed)
        if had and checkpoint.newest_intact(job.out / "checkpoint.pt")[0] is None:
            return LOST, "no checkpoint loads: " + _tail(said)
        if not expect.stops and not expect.either:
            return BROKEN, "it should have gone on: " + _tail(said)
        stops = expect.stops or (Stop(frozenset({1, 2, 130, -9}), ""),)
        codes = frozenset().union(*(s.codes for s in stops))
        if not set(job.codes) <= codes:
            return BROKEN, f"not one of the exit codes {sorted(codes)}: " + _tail(said)
        says = "|".join(s.says for s in stops if s.says)
        spoken = [line for log in said for line in _lines(log)]
        if says and spoken and not any(re.search(says, line) for line in spoken):
            return BROKEN, f"no line says /{says}/: {spoken}"
        return None

    def _refused(self, resumed: Job, limit: float, story: str) -> tuple[str, str]:
        """No checkpoint left intact: the resume must refuse in one line, exit 2, and change no file."""
        before = {p: p.read_bytes() for p in _checkpoints(resumed.out)}
        if not resumed.start().wait(limit):
            return HUNG, f"{story}; the resume of damaged checkpoints still ran after {limit:.0f} s"
        lines = _lines(resumed.said()[0])
        if resumed.codes[0] != 2 or len(lines) != 1:
            return BROKEN, f"{story}; the resume of damaged checkpoints ended {_codes(resumed)}: {lines}"
        if {p: p.read_bytes() for p in _checkpoints(resumed.out)} != before:
            return BROKEN, f"{story}; the refused checkpoints were changed"
        return "ok", f"{story}; the damaged checkpoints refused (exit 2) and left as they were"

    def _drive(self, job: Job, ref: Ref, names: tuple[str, ...], limit: float) -> tuple[list[Landed], bool]:
        """Apply the trial's faults at their moments while the job runs, and undo what lasts (a SIGSTOP, a cut)
        when it should; once the job has ended, or outlived `limit` seconds, undo the rest. A worker frozen for good
        is thawed once every other node's launcher has ended: a launcher whose every worker is frozen cannot tell
        that from a debugger's pause, and waits (docs/faults.md). A process frozen twice is thawed by the later thaw.
        What each fault hit, and whether the job ended in time."""
        began, trained = time.monotonic(), None
        landed: list[Landed] = []
        # (when, how, the frozen worker's node, the frozen pid)
        undo: list[tuple[float, Callable[[], object], int | None, int | None]] = []
        pending = list(job.trial.faults)
        while job.running() and time.monotonic() < began + limit:
            now = time.monotonic()
            if trained is None and (job.out / "checkpoint.pt").exists():
                trained = now
            for f in list(pending):
                due = began + f.at * ref.start_up if f.start_up else \
                    (trained + f.at * ref.training if trained is not None else None)
                if due is not None and now >= due:
                    hit, undone = self._apply(f, job, names)
                    if hit is None:  # the workers are not all there yet
                        continue
                    pending.remove(f)
                    landed.append(hit)
                    if undone is not None:
                        node = f.which // job.trial.world.gpus if f.target == "worker" else None
                        undo.append((now + f.lasts * TIMEOUT if f.lasts is not None else float("inf"), undone, node,
                                     hit.pids[0] if hit.pids else None))
            for item in list(undo):
                due, undone, node, pid = item
                others = [p for n, p in enumerate(job.procs) if n != node]
                if now >= due or (node is not None and others and all(p.poll() is not None for p in others)):
                    undo.remove(item)
                    if not any(pid is not None and u[3] == pid and u[0] > due for u in undo):
                        undone()
            time.sleep(0.01)
        ended = not job.running()
        for _, undone, _, _ in undo:
            undone()
        landed += [Landed(f, missed=True) for f in pending]
        return landed, ended

    def _apply(self, f: Fault, job: Job, names: tuple[str, ...]) -> tuple[Landed | None,
                                                                         Callable[[], object] | None]:
        """Apply `f` now: what it hit (None: not yet, the workers are not all there), and how to undo it."""
        had = (job.out / "checkpoint.pt").exists()
        w = job.trial.world
        if f.target == "worker":
            workers = job.workers()
            if not workers:
                return None, None
            pid = workers[f.which]
            hit = Landed(f, [pid], {f.which}, not _alive(pid) or not _send(pid, f.how), had)
            return hit, (lambda: _send(pid, "SIGCONT")) if f.how == "SIGSTOP" else None
        if f.target in ("launcher", "store host"):
            node = 1 if f.target == "launcher" else 0
            pid = job.procs[node].pid
            ranks = set(range(node * w.gpus, (node + 1) * w.gpus))
            hit = Landed(f, [pid], ranks, not _alive(pid) or not _send(pid, f.how), had)
            return hit, (lambda: _send(pid, "SIGCONT")) if f.how == "SIGSTOP" else None
        if f.target == "link":
            link = f"{names[0].rsplit('-', 1)[0]}a"
            _ip("-n", names[0], "link", "set", link, "down")
            return Landed(f, [], set(), False, had), lambda: _ip("-n", names[0], "link", "set", link, "up")
        if f.target == "disk":
            _fill(job.out.parent)  # freed once the job has ended, before the resume
            return Landed(f, [], set(), False, had), lambda: (job.out.parent / ".filler").unlink(missing_ok=True)
        # a damaged file: first the job is stopped, as Ctrl-C in each node's terminal stops it
        pids = [p.pid for p in job.procs]
        missed = True
        for pid in pids:
            with suppress(ProcessLookupError):
                os.killpg(pid, signal.SIGINT)
                missed = False
        return Landed(f, pids, set(), missed, had), None


def _left_behind(env: dict[str, str]) -> list[int]:
    """The processes of a job that has ended (its marker in their environment) still there SETTLE_S later."""
    deadline = time.monotonic() + SETTLE_S
    while (left := marked_pids(env[MARK])) and time.monotonic() < deadline:
        time.sleep(0.1)
    return left


def _kill_marked(mark: str) -> None:
    """SIGKILL every process that carries `mark` (stopped ones too), and wait until none is left."""
    for _ in range(100):
        pids = marked_pids(mark)
        if not pids:
            return
        for pid in pids:
            with suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        time.sleep(0.1)


def _mount(where: Path) -> None:
    subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={DISK}", "tmpfs", str(where)], check=True,
                   capture_output=True)


def _damage(f: Fault, folder: Path, out: Path) -> bool:
    """Damage what `f` names before the resume; False if there was nothing to damage."""
    if f.target == "data file":
        targets = sorted(folder.glob("data/synthetic/v*/train-*-images"))[:1]
    else:
        path = out / "checkpoint.pt"
        targets = [p for p in {"checkpoint.pt": [path], "checkpoint.prev.pt": [checkpoint.previous(path)],
                               "both checkpoints": [path, checkpoint.previous(path)]}[f.target] if p.exists()]
    for path in targets:
        raw = path.read_bytes()
        if f.how == "deleted":
            path.unlink()
        elif f.how == "truncated":
            path.write_bytes(raw[:len(raw) // 2])
        elif f.target == "data file":  # a pixel of every image flipped: whatever the resume trains on, it meets one
            data = bytearray(raw)
            for at in range(16 + 400, len(data), 28 * 28):
                data[at] ^= 0xFF
            path.write_bytes(bytes(data))
        else:  # sixteen bytes flipped in the middle: past any header
            middle = len(raw) // 2
            path.write_bytes(raw[:middle] + bytes(b ^ 0xFF for b in raw[middle:middle + 16]) + raw[middle + 16:])
    return bool(targets)


def _last_save(out: Path, ref: Ref) -> int | None:
    """When (wall clock, ns) `out`'s final checkpoint was saved; None if the run did not get that far."""
    try:
        when = (out / "checkpoint.pt").stat().st_mtime_ns
        done = checkpoint.load(out / "checkpoint.pt")["progress"]
    except (OSError, checkpoint.UserError):
        return None
    return when if {k: done[k] for k in ref.progress} == ref.progress else None


def _checkpoints(out: Path) -> list[Path]:
    return [p for p in (out / "checkpoint.pt", checkpoint.previous(out / "checkpoint.pt")) if p.exists()]


def _same_run(trial: Trial, job: Job, out: Path, ref: Ref) -> str:
    """'' if `job` finished (one launcher exit 0) with the undisturbed run's steps and record (and bytes, under
    --bitwise); else what differs."""
    if 0 not in job.codes:
        return f"ended {_codes(job)}: {_tail(job.said())}"
    return differs(out, trial.world.bitwise, ref)


def differs(out: Path, bitwise: bool, ref: Ref) -> str:
    """'' if the run in `out` ended with the undisturbed run's steps and record (and bytes, under --bitwise);
    else everything that differs, not only the first."""
    try:
        progress, record, steps, digest = _result(out, bitwise)
    except (OSError, ValueError, checkpoint.UserError) as e:
        return f"left no final checkpoint ({e})"
    found = []
    if progress != ref.progress:
        found.append(f"ended at {progress}, not {ref.progress}")
    if record != ref.record:
        wrong = [f"epoch {i + 1}: {ours} against {theirs}" for i, (ours, theirs) in enumerate(zip(record, ref.record))
                 if ours != theirs] + ([f"{len(record)} epochs against {len(ref.record)}"]
                                       if len(record) != len(ref.record) else [])
        found.append(f"wrote another metrics record ({'; '.join(wrong)})")
    if steps != ref.steps:
        at = next((i for i, (ours, theirs) in enumerate(zip(steps, ref.steps)) if ours != theirs), None)
        where = f"; step {at + 1} ends at {steps[at]} samples, not {ref.steps[at]}" if at is not None else ""
        found.append(f"trained other steps ({len(steps)} against {len(ref.steps)}{where})")
    if digest != ref.digest:
        found.append(f"saved other weights (SHA-256 {digest[:12]}…, undisturbed {ref.digest[:12]}…)")
    return "; and ".join(found)


def _shrank(out: Path, size: int) -> bool:
    """Whether the run's record shows an epoch trained by fewer processes than the job started: a rank it went on
    without. A rank whose launcher was lost as the run ended may have finished its part (its last collectives
    returned) before it noticed: then nothing was lost, and no `recover:` line is owed."""
    return any(json.loads(line)["world_size"] < size for line in (out / "metrics.jsonl").read_text().splitlines())


def _lines(log: str) -> list[str]:
    """The lines a launcher ends with when it stops: mnist-ddp's errors and its 'interrupted.'."""
    return [line for line in log.splitlines() if line.startswith(("mnist-ddp: error:", "mnist-ddp: interrupted"))]


def _codes(job: Job) -> str:
    return "exit " + "/".join(str(c) for c in job.codes)


def _tail(said: list[str]) -> str:
    return " | ".join(s.strip().splitlines()[-1] if s.strip() else "(nothing)" for s in said)[-600:]


# --- the campaign -------------------------------------------------------------------------------------------------

def _source_digest() -> str:
    h = hashlib.sha256()
    for path in [*sorted((REPO / "src" / "mnist_ddp").rglob("*.py")), Path(__file__)]:
        h.update(path.read_bytes())
    return h.hexdigest()[:16]


def can_make_namespaces() -> bool:
    if os.geteuid() != 0 or shutil.which("ip") is None:
        return False
    try:
        with netns_pair(f"chsprobe{os.getpid() % 100000}", ADDRS):
            return True
    except pytest.skip.Exception:
        return False


def table(rows: dict[str, Counter]) -> str:
    """The summary: trials, how they ended and what went wrong, by fault kind (a trial counts in each of its rows),
    then over all trials."""
    heads = ("fault", "trials", "missed", "finished", "stopped", "hangs", "lost ckpts", "broken")
    keys = ("trials", "missed", "finished", "stopped", HUNG, LOST, BROKEN)
    width = max([len(heads[0]), *map(len, rows)])
    lines = [f"{heads[0]:<{width}}  " + "  ".join(f"{h:>10}" for h in heads[1:])]
    for kind in sorted(rows, key=lambda k: (k == ALL, k)):
        lines.append(f"{kind:<{width}}  " + "  ".join(f"{rows[kind][k]:>10}" for k in keys))
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    """Run the campaign; exit 0 when every trial kept its contract, 1 otherwise."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--trials", type=int, default=200)
    p.add_argument("--budget", type=float, default=3600, help="seconds: no trial starts after them (default 3600)")
    p.add_argument("--only", type=int, help="replay trial ONLY of the seed, alone")
    p.add_argument("--first", type=int, default=0, help="start at trial FIRST (to go on with a campaign whose budget "
                   "ran out; default 0)")
    p.add_argument("--keep", type=Path, help="where trials that broke a contract leave their output (default: a "
                   "new temp folder)")
    p.add_argument("--keep-all", action="store_true", help="keep every trial's output, not only the failed ones'")
    args = p.parse_args(argv)
    signal.signal(signal.SIGTERM, signal.default_int_handler)  # a trial's clean-up runs when the campaign is stopped
    root = os.geteuid() == 0
    netns = can_make_namespaces()
    keep = args.keep or Path(tempfile.mkdtemp(prefix="mnist-ddp-chaos-"))
    keep.mkdir(parents=True, exist_ok=True)
    refs = Path(tempfile.gettempdir()) / f"mnist-ddp-chaos-refs-{_source_digest()}.json"
    campaign = Campaign(keep, refs, args.keep_all)
    if not netns or not root:
        print(f"chaos: {'no network namespaces (needs root and iproute2): one machine only; ' if not netns else ''}"
              f"{'' if root else 'not root: no tmpfs, so no full disk; '}", flush=True)
    indices = [args.only] if args.only is not None else list(range(args.first, args.trials))
    rows: dict[str, Counter] = {}
    outcomes: Counter = Counter()
    began = time.monotonic()
    for i in indices:
        if time.monotonic() - began > args.budget:
            print(f"chaos: the budget of {args.budget:g} s is spent after {sum(outcomes.values())} trials", flush=True)
            break
        trial = draw(args.seed, i, netns, root)
        started = time.monotonic()
        result = campaign.run(trial)
        outcome = result.outcome
        outcomes[outcome] += 1
        for kind in {f.kind for f in trial.faults} | {ALL}:
            row = rows.setdefault(kind, Counter())
            row["trials"] += 1
            row["missed"] += kind in result.missed or (kind == ALL and bool(result.missed))
            row[outcome if outcome != "ok" else "finished" if result.finished else "stopped"] += 1
        mark = "ok" if outcome == "ok" else f"{outcome.upper()} (replay: make chaos SEED={args.seed} ONLY={i}; " \
                                             f"output in {keep / f'trial-{i}'})"
        print(f"chaos: {i:3d} {trial} -> {result.story} [{time.monotonic() - started:.0f} s]: {mark}", flush=True)
    print(table(rows))
    bad = sum(n for k, n in outcomes.items() if k != "ok")
    print(f"chaos: seed {args.seed}: {sum(outcomes.values())} trials, {outcomes[HUNG]} hung, {outcomes[LOST]} lost a "
          f"checkpoint, {outcomes[BROKEN]} broke a contract, in {time.monotonic() - began:.0f} s; kept: {keep}")
    return 0 if bad == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
