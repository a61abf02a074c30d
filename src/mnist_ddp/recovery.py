"""--recover: when a rank is lost, the survivors re-form a process group in their own processes and the run goes
on from the step that failed (docs/design/recovery.md). Entered only on a failure.

`Recovery.reform` leaves the broken group, agrees through the store on who is left (a rank that neither checks in
nor beats is lost) and on the position every survivor can go back to, and joins the survivors' group of the next
generation: a store prefix of its own, ranks numbered anew in the old order.
"""

import json
import os
import sys
import time
from dataclasses import dataclass, replace
from datetime import timedelta
from typing import Protocol

import torch
import torch.distributed as dist

from . import distributed, regroup, rendezvous, untrusted
from .batches import Share
from .config import TrainConfig
from .distributed import Dist, PeerFailure
from .errors import UserError
from .heartbeat import BEAT_WAIT_S, BEATS_PREFIX, Heartbeat, gone
from .identity import Identity
from .report import Reporter
from .snapshot import Snapshots
from .state import Stretch, Training
from .steps import PartStats

# Tests only: "R:S[,R:S…]": the process that was rank R of the first world SIGKILLs itself where step S + 1 begins.
LOSE_VAR = "MNIST_DDP_TEST_LOSE"
POLL_S = 0.02


class PresumedLost(PeerFailure):
    """This rank was taken for lost (silent too long) and the others went on without it."""


@dataclass(frozen=True)
class Reformed:
    """The survivors' new world, and where it goes on from."""

    d: Dist
    position: int  # the position (Snapshots) every survivor goes back to
    lost: list[str]  # who was lost, in words (ranks as the first world numbered them)
    generation: int


class Loop(Protocol):
    """What a recovery reads and changes of the training loop (trainer.Trainer)."""

    cfg: TrainConfig
    d: Dist
    t: Training
    share: Share
    stats: PartStats
    stretch: Stretch
    report: Reporter
    snapshots: Snapshots | None

    @property
    def samples_done(self) -> int: ...

    @property
    def step_in_epoch(self) -> int: ...

    def _deal(self, share: Share, saved_stats: torch.Tensor | None = None) -> None: ...


def beats_prefix(generation: int) -> str:
    return BEATS_PREFIX if generation == 0 else f"{BEATS_PREFIX}/generation{generation}"


def for_run(ident: Identity, cfg: TrainConfig) -> "Recovery | None":
    """The run's recovery, or None without --recover; refused where the store dies with a rank or a launcher
    restarts the ranks itself."""
    if not cfg.recover or ident.world_size == 1:
        return None
    if ident.store_host != "parent":
        raise UserError(f"--recover needs mnist-ddp's own launcher (-g, or -n/-g/-nr), whose launching process "
                        f"holds the store a lost rank's peers meet at again; under {ident.launcher} use its own "
                        f"restarts with --resume (docs/faults.md).")
    return Recovery(ident, cfg)


def doomed_steps(env: dict[str, str] | os._Environ, rank: int) -> set[int]:
    """The steps done after which this rank kills itself (`LOSE_VAR`; tests only: snapshot.Snapshots.take)."""
    pairs = [item.split(":") for item in env.get(LOSE_VAR, "").split(",") if item.strip()]
    return {int(step) for r, step in pairs if int(r) == rank}


class Recovery:
    """One rank's side of in-place recovery: `recover` after a failure, and the heartbeat of its last generation."""

    def __init__(self, ident: Identity, cfg: TrainConfig) -> None:
        self.ident, self.timeout, self.interval = ident, cfg.timeout, cfg.heartbeat
        self.generation = 0
        self.first = list(range(ident.world_size))  # each rank's rank in the first world, what the lines name
        self.doomed = doomed_steps(os.environ, ident.rank)
        self.store: dist.Store | None = None
        self.heartbeat: Heartbeat | None = None  # this generation's, once re-formed (the launcher stops the first's)

    def recover(self, loop: Loop, failure: str) -> None:
        """A rank was lost: re-form with the survivors, go back to where the failed position began, and deal the
        run's slots over the new world (docs/design/recovery.md)."""
        assert loop.snapshots is not None
        began, rank_was, share_was = time.perf_counter(), self.first[loop.d.rank], loop.share
        new = self.reform(loop.d, loop.snapshots.position)
        loop.d = new.d
        snap = loop.snapshots.restore(new.position)
        loop.stats.sets, loop.stretch = snap.sets, snap.stretch
        parts = regroup.batchnorm_sets(loop.stats, share_was, loop.d, snap.known)
        loop._deal(Share(slots=share_was.slots, world=loop.d.world_size, whole=loop.cfg.bitwise), parts)
        loop.stretch = regroup.carried(loop.stretch, loop.d)
        if loop.d.is_main and not loop.report.enabled:  # rank 0 was lost: this process reports from now on
            loop.report = loop.report.taken_over(loop.samples_done)
        loop.report.keep_epochs_before(loop.t.progress.epoch)
        loop.report.forget_steps_after(loop.stretch.logged[0][0] - 1 if loop.stretch.logged else loop.samples_done)
        p, how, many = loop.t.progress, loop.share.describe(loop.cfg.recipe.batch_size), loop.d.world_size > 1
        loop.report.say(f"recover: {', '.join(new.lost)} lost at epoch {p.epoch + 1}, step {loop.step_in_epoch + 1} "
                        f"(rank {rank_was} saw: {failure}); {loop.d.world_size} process{'es' if many else ''} "
                        f"re-formed as generation {new.generation} in {time.perf_counter() - began:.2f} s and "
                        f"go{'' if many else 'es'} on from there{': ' + how if how else ''}")

    def stop(self, left: str, culprit: bool) -> None:
        """Stop the heartbeat of the last generation, if the run re-formed (`Heartbeat.stop`)."""
        if self.heartbeat is not None:
            self.heartbeat.stop(left, culprit)

    def reform(self, d: Dist, position: int) -> Reformed:
        """Leave the broken group, agree with the other survivors, join the next generation's group."""
        backend = dist.get_backend()
        # Closes this rank's connections, so a survivor waiting on it hears now; a new group needs the old one gone.
        if not distributed.teardown(together=False, leave_s=self.timeout):
            raise PeerFailure(f"rank {d.rank} could not leave the broken process group within --timeout "
                              f"{self.timeout:g} s; run again with --resume.")
        if self.store is None:
            self.store = rendezvous.connect(self.ident, timedelta(seconds=self.timeout), joining=False)
        store = self.store
        beats = Heartbeat.reader(dist.PrefixStore(beats_prefix(self.generation), store), d.world_size, self.interval)
        members, back_to, lost = self._agree(store, beats, d, position)
        roster = beats.beats()
        if d.heartbeat is not None:
            d.heartbeat.stop("re-formed without the lost", culprit=False)
        self.generation += 1
        rank, world = members.index(d.rank), len(members)
        distributed.form_group(backend, dist.PrefixStore(f"mnist_ddp/generation{self.generation}", store), rank,
                               world, timedelta(seconds=self.timeout), d.device)
        client = rendezvous.connect(self.ident, timedelta(seconds=BEAT_WAIT_S), joining=False)
        beat = self.heartbeat = Heartbeat(dist.PrefixStore(beats_prefix(self.generation), client), rank, world,
                                          self.interval, store_host=None)
        said = [f"rank {self.first[r]}" + (f" ({untrusted.printable(roster[r]['host'])}, pid {roster[r]['pid']})"
                               if r in roster else "") for r in lost]
        self.first = [self.first[r] for r in members]
        return Reformed(replace(d, rank=rank, world_size=world, heartbeat=beat), back_to, said, self.generation)

    def _agree(self, store: dist.Store, beats: Heartbeat, d: Dist, position: int) -> tuple[list[int], int, list[int]]:
        """Check in at `position`; once every rank of the old world has checked in or is lost (gone, or its beat
        stood still for 2.5 beats), the first to see it writes the decision: the members, and the lowest position
        any of them is at. A rank that finds the decision made without it was presumed lost."""
        key = f"mnist_ddp/recover/{self.generation}/"
        store.set(f"{key}at/{d.rank}", json.dumps({"position": position}))
        still: dict[int, tuple[int, float]] = {}  # rank -> (its beat's counter, when that was first seen)
        deadline = time.monotonic() + self.timeout
        while True:
            if store.check([key + "decided"]):
                decided = _decision(store.get(key + "decided"), d.world_size)
                if d.rank not in decided[0]:  # said here: the job goes on, and its launcher reports no failure
                    said = (f"rank {self.first[d.rank]} was presumed lost by the other processes, which went on "
                            f"without it (generation {self.generation + 1}); this process stops.")
                    print(f"mnist-ddp: {said}", file=sys.stderr, flush=True)
                    raise PresumedLost(said)
                return decided
            at = {r: _position(store.get(f"{key}at/{r}")) for r in range(d.world_size)
                  if store.check([f"{key}at/{r}"])}
            now, lost = time.monotonic(), []
            for r, beat in sorted(beats.beats().items()):
                if r in at:
                    continue
                if beat["left"] is not None or gone(beat):
                    lost.append(r)
                    continue
                seq, since = still.get(r, (None, now))
                still[r] = (beat["seq"], since if seq == beat["seq"] else now)
                if now - still[r][1] > Heartbeat.DIAGNOSIS_BEATS * self.interval:
                    lost.append(r)
            known = set(at) | set(lost)
            lost += [r for r in range(d.world_size) if r not in known and now > deadline - self.timeout / 2]
            if len(at) + len(lost) == d.world_size:
                valid = {r: p for r, p in at.items() if p is not None}
                store.compare_set(key + "decided", "", json.dumps(
                    {"members": sorted(valid), "position": min(valid.values()), "lost": sorted(lost)}))
                continue
            if now > deadline:
                raise PeerFailure(f"rank {d.rank} could not agree with the other processes on how to go on within "
                                  f"--timeout {self.timeout:g} s; run again with --resume.")
            time.sleep(POLL_S)


def _position(raw: bytes) -> int | None:
    try:
        value = untrusted.parse(raw)
        return value["position"] if isinstance(value, dict) and isinstance(value.get("position"), int) else None
    except ValueError:
        return None


def _decision(raw: bytes, world: int) -> tuple[list[int], int, list[int]]:
    """The decision as written to the store (untrusted: one that does not parse is a failure)."""
    try:
        value = untrusted.parse(raw)
        members, position, lost = value["members"], value["position"], value["lost"]
        if not (all(isinstance(r, int) and 0 <= r < world for r in [*members, *lost]) and isinstance(position, int)):
            raise ValueError("not ranks of this job")
    except (ValueError, KeyError, TypeError) as e:
        raise PeerFailure(f"the survivors' decision in the store is unreadable ({e}); the job stops.") from None
    return members, position, lost
