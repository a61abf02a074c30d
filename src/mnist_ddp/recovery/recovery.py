"""--recover: when a rank is lost, the survivors re-form a process group in their own processes and the run goes
on from the step that failed (docs/design/recovery.md). Entered only on a failure.

`Recovery.reform` leaves the broken group, agrees through the store on who is left (a rank that neither checks in
nor beats is lost) and on the position every survivor can go back to, and joins the survivors' group of the next
generation: a store prefix of its own, ranks numbered anew in the old order. While the world is smaller than the
first, `take_in` lets a replacement of a lost rank join at a step boundary (`grow`): the world grows back.
"""

import json
import os
import sys
import time
from dataclasses import dataclass, replace
from datetime import timedelta
from pathlib import Path
from typing import Protocol

import torch
import torch.distributed as dist

from ..common import untrusted
from ..common.config import TrainConfig, run_settings
from ..common.errors import UserError
from ..core import distributed
from ..core.batches import Batches, Share
from ..core.bnstats import PartStats
from ..core.distributed import Dist, PeerFailure
from ..core.reduction import Reduction
from ..core.state import Progress, Stretch, Training
from ..joining import membership, rendezvous
from ..joining.heartbeat import BEAT_WAIT_S, Heartbeat, beats_prefix, gone
from ..joining.identity import Identity
from ..outputs import checkpoint
from ..outputs.report import Reporter
from . import regroup, successor
from .lossplan import LossPlan
from .snapshot import Snapshots

# Tests only: "S": where step S + 1 first begins, a smaller world waits (up to --timeout) for a replacement.
JOIN_VAR = "MNIST_DDP_TEST_JOIN"
JOIN_EVERY = 10  # steps: how often a world smaller than the first looks for a replacement (rank 0, in the store)
POLL_S = 0.02


class Grow(Exception):
    """Replacements were admitted at this step boundary: (first-world rank, check-in token) of each."""

    def __init__(self, joiners: list[tuple[int, str]]) -> None:
        super().__init__(joiners)
        self.joiners = joiners


class PresumedLost(PeerFailure):
    """This rank was taken for lost (silent too long) and the others went on without it."""


@dataclass(frozen=True)
class Reformed:
    """The survivors' new world, and where it goes on from."""

    d: Dist
    position: int  # the position (Snapshots) every survivor goes back to
    lost: list[str]  # who was lost, in words (ranks as the first world numbered them)
    moved: str = ""  # the store's host was lost too: where the survivors met instead, in words (successor.py)


class Loop(Protocol):
    """What a recovery reads and changes of the training loop (extended.ExtendedTrainer)."""

    cfg: TrainConfig
    d: Dist
    t: Training
    share: Share
    train_batches: Batches
    stats: PartStats
    stretch: Stretch
    rank0: Reporter
    reduction: Reduction

    @property
    def samples_done(self) -> int: ...

    @property
    def step_in_epoch(self) -> int: ...

    @property
    def steps_done(self) -> int: ...

    def _deal(self, share: Share, saved_stats: torch.Tensor | None = None) -> None: ...


def for_run(ident: Identity, cfg: TrainConfig, d: Dist | None = None) -> "Recovery | None":
    """The run's recovery, or None without --recover; refused where the store dies with a rank or a launcher
    restarts the ranks itself."""
    if not cfg.recover or ident.world_size == 1:
        return None
    if ident.store_host != "parent":
        raise UserError(f"--recover needs mnist-ddp's own launcher (-g, or -n/-g/-nr), whose launching process "
                        f"holds the store a lost rank's peers meet at again; under {ident.launcher} use its own "
                        f"restarts with --resume (docs/faults.md).")
    recovery = Recovery(ident, cfg, d)
    if recovery.succession and d and not recovery.joining:  # a replacement learns it as it joins (handover)
        recovery.succession.learn(d)
    return recovery


def world_change(recovery: "Recovery | None", e: BaseException) -> str | list[tuple[int, str]]:
    """What `e` changes under --recover: a lost rank (its failure in words) or replacements joining (a `Grow`'s);
    anything else is raised again."""
    if isinstance(e, Grow):
        return e.joiners
    if recovery is None or not distributed.is_peer_failure(e):
        raise e
    return rendezvous.error_summary(e)


class Recovery:
    """One rank's side of in-place recovery: `recover` after a failure, and the heartbeat of its last generation."""

    def __init__(self, ident: Identity, cfg: TrainConfig, d: Dist | None = None) -> None:
        self.ident, self.timeout, self.interval, self.bitwise = ident, cfg.timeout, cfg.heartbeat, cfg.bitwise
        self.entry = d.entry if d else None  # its admission: the nonce a replacement answers
        placed = self.entry.placed if self.entry else None  # this process replaces a lost rank
        self.creds = membership.Credentials(cfg.secret or b"", run_settings(cfg, ident.world_size))
        self.generation, self.joining = (placed.generation, True) if placed else (0, False)
        # each rank's rank in the first world, what the lines name
        self.first = list(placed.members) if placed else list(range(ident.world_size))
        self.plan = LossPlan(os.environ, ident.rank)  # tests only: where this rank is lost on purpose
        self.await_at = int(os.environ.get(JOIN_VAR) or -1)
        self.store: dist.Store | None = None
        self.snapshots: Snapshots | None = None  # `follow`: the loop's state at each position
        self.heartbeat: Heartbeat | None = None  # this generation's, once re-formed (the launcher stops the first's)
        self.roster: dict[int, dict] = {}  # first-world rank -> its beat, as last read (the lost's host and pid)
        # On several nodes: the standby stores to meet at should the store's host be lost (successor.py).
        self.succession = None if ident.one_node else successor.Succession(
            ident, self.creds, cfg.timeout, Heartbeat.DIAGNOSIS_BEATS * cfg.heartbeat + BEAT_WAIT_S)

    def change(self, loop: Loop, change: str | list[tuple[int, str]]) -> None:
        """Re-form the world after `world_change`'s verdict: without a lost rank, or with the replacements."""
        if isinstance(change, str):
            self.recover(loop, change)
        else:
            self.grow(loop, change)

    def recover(self, loop: Loop, failure: str) -> None:
        """A rank was lost: re-form with the survivors, go back to where the failed position began, and deal the
        run's slots over the new world (docs/design/recovery.md)."""
        assert self.snapshots is not None
        began, rank_was, share_was = time.perf_counter(), self.first[loop.d.rank], loop.share
        new = self.reform(loop.d, self.snapshots.position)
        loop.d = new.d
        snap = self.snapshots.restore(new.position)
        loop.stats.sets, loop.stretch = snap.sets, snap.stretch
        parts = regroup.batchnorm_sets(loop.stats, share_was, loop.d, snap.known)
        loop._deal(Share(slots=share_was.slots, world=loop.d.world_size, whole=loop.cfg.bitwise), parts)
        loop.stretch = regroup.carried(loop.stretch, loop.d)
        if loop.d.is_main and not loop.rank0.enabled:  # rank 0 was lost: this process reports from now on
            loop.rank0 = loop.rank0.taken_over(loop.samples_done)
        loop.rank0.keep_epochs_before(loop.t.progress.epoch)
        loop.rank0.forget_steps_after(loop.stretch.logged[0][0] - 1 if loop.stretch.logged else loop.samples_done)
        moved = f"; {new.moved}" if new.moved else ""
        loop.rank0.say(f"recover: {', '.join(new.lost) or 'no rank'} lost at {_where(loop)} (rank {rank_was} saw: "
                        f"{failure}){moved}; {self._went_on(loop, began)}")

    def _went_on(self, loop: Loop, began: float) -> str:
        """The end of a `recover: ` line: the new world, its generation, the seconds since `began`, its share."""
        many, how = loop.d.world_size > 1, loop.share.describe(loop.cfg.recipe.batch_size)
        return (f"{loop.d.world_size} process{'es' if many else ''} re-formed as generation {self.generation} in "
                f"{time.perf_counter() - began:.2f} s and go{'' if many else 'es'} on from there"
                f"{': ' + how if how else ''}")

    def follow(self, t: Training) -> None:
        """Keep snapshots of `t`, the loop's state, from now on (the loop calls it once, when built)."""
        self.snapshots = Snapshots(t)

    def step_begins(self, loop: Loop) -> None:
        """At every step boundary: replacements may join here (`take_in`), and the state the step starts from is
        kept, where survivors go back to if a rank is lost inside it."""
        assert self.snapshots is not None
        self.take_in(loop)
        self.plan.reached("step", loop.steps_done)
        self.snapshots.take(loop.stats, loop.stretch, loop.reduction.sets)

    def fold_begins(self, loop: Loop) -> None:
        """Before every fold: the state it starts from, kept like a step's."""
        assert self.snapshots is not None
        self.plan.reached("fold", loop.steps_done)
        self.snapshots.take(loop.stats, loop.stretch, loop.reduction.sets)

    def saved(self, loop: Loop) -> None:
        """After an epoch's saves: one small all-reduce, so that a rank lost after the epoch's last collective (rank 0
        while it saves) is lost inside the loop, which goes back and redoes the epoch's end, its saves included,
        rather than after the run's last step, where nothing could (docs/design/recovery.md)."""
        self.plan.reached("saved", loop.steps_done)
        loop.d.all_sum(torch.zeros((), device=loop.d.device))

    def stop(self, left: str, culprit: bool, finished: bool) -> None:
        """Stop the heartbeat of the last generation, if the run re-formed (`Heartbeat.stop`); once the run
        `finished`, rank 0 tells every node's standby store so first (`Succession.finish`)."""
        if finished and self.succession and self.first[0] == self.ident.rank:
            self.succession.finish()
        if self.heartbeat is not None:
            self.heartbeat.stop(left, culprit)

    def reform(self, d: Dist, position: int) -> Reformed:
        """Leave the broken group, agree with the other survivors, join the next generation's group."""
        backend = dist.get_backend()
        # Closes this rank's connections, so a survivor waiting on it hears now; a new group needs the old one gone.
        if not distributed.teardown(together=False, leave_s=self.timeout):
            raise PeerFailure(f"rank {d.rank} could not leave the broken process group within --timeout "
                              f"{self.timeout:g} s; run again with --resume.")
        if d.heartbeat is not None:
            self.roster.update({self.first[r]: beat for r, beat in d.heartbeat.roster.items() if r < len(self.first)})
        try:
            store = self._store()
            beats = Heartbeat.reader(dist.PrefixStore(beats_prefix(self.generation), store), d.world_size,
                                     self.interval)
            members, back_to, lost = self._agree(store, beats, d, position)
            self.roster.update({self.first[r]: beat for r, beat in beats.beats().items()})
            said = [self._who(self.first[r]) for r in lost]
            return Reformed(self._enter(d, backend, [self.first[r] for r in members], members.index(d.rank),
                                        "re-formed without the lost"), back_to, said)
        except RuntimeError:  # a store call failed: if its host is gone, the survivors meet at its successor
            if self.succession is None or not self.succession.gone(self._where()):
                raise
        return self._take_over(d, backend, position)

    def _take_over(self, d: Dist, backend: str, position: int) -> Reformed:
        """The store's host is gone: meet at the next standby store in line, agree there on who is left, and form
        the next generation's group there (successor.py); again if that store's host is lost meanwhile."""
        assert self.succession is not None
        deadline, moved, me = time.monotonic() + self.timeout, [], self.ident.rank
        if d.heartbeat is not None:
            d.heartbeat.store_silent = True  # no last beat into a store that is gone
        while True:
            self.store, where, said = self.succession.take_over(deadline)
            self.ident = replace(self.ident, master_addr=where[0], master_port=where[1])
            self.entry = None  # replacements look for the job at the old address: none is taken in any more
            moved.append(said)
            try:
                generation, members, back_to, lost = self.succession.agree(self.store, self.generation, self.first,
                                                                           position, self.roster, deadline)
                if me not in members:
                    raise self._presumed_lost(me, generation)
                self.generation = generation
                new = self._enter(d, backend, members, members.index(me), "re-formed at the successor store")
                return Reformed(new, back_to, [self._who(r) for r in lost], "; ".join(moved))
            except RuntimeError:
                if not self.succession.gone(where):
                    raise

    def _who(self, rank: int) -> str:
        """First-world rank `rank` in words: its host and pid where a beat said."""
        beat = self.roster.get(rank)
        return f"rank {rank}" + (f" ({untrusted.printable(beat['host'])}, pid {beat['pid']})" if beat else "")

    def _presumed_lost(self, rank: int, generation: int) -> PresumedLost:
        """Said here: the job goes on, and this process's launcher reports no failure."""
        said = (f"rank {rank} was presumed lost by the other processes, which went on without it (generation "
                f"{generation + 1}); this process stops.")
        print(f"mnist-ddp: {said}", file=sys.stderr, flush=True)
        return PresumedLost(said)

    def _where(self) -> tuple[str, int]:
        return self.ident.master_addr, self.ident.master_port

    def _store(self) -> dist.Store:
        if self.store is None:
            if self.succession is not None and self.succession.gone(self._where()):  # else a client waits --timeout
                raise successor.StoreGone(f"the rendezvous store at {self._where()} is gone")
            self.store = rendezvous.connect(self.ident, timedelta(seconds=self.timeout), joining=False)
        return self.store

    def _enter(self, d: Dist, backend: str, members: list[int], rank: int, why: str) -> Dist:
        """Join the next generation's group as `rank` of `members` (first-world ranks), and beat there."""
        if d.heartbeat is not None:
            d.heartbeat.stop(why, culprit=False)
        self.generation += 1
        self.first = members  # the decision is this rank's from here: a successor store hears of it (successor.py)
        # The textbook call again (distributed.join), on this generation's part of the store.
        dist.init_process_group(backend, store=dist.PrefixStore(f"mnist_ddp/generation{self.generation}",
                                                                self._store()),
                                rank=rank, world_size=len(members), timeout=timedelta(seconds=self.timeout),
                                device_id=d.device if backend == "nccl" else None)
        client = rendezvous.connect(self.ident, timedelta(seconds=BEAT_WAIT_S), joining=False)
        beat = self.heartbeat = Heartbeat(dist.PrefixStore(beats_prefix(self.generation), client), rank,
                                          len(members), self.interval, store_host=None)
        return replace(d, rank=rank, world_size=len(members), heartbeat=beat)

    def take_in(self, loop: Loop) -> None:
        """At a step boundary of a world smaller than the first, every JOIN_EVERY steps: rank 0 admits the
        replacements that checked in, and every rank raises Grow when there are some (one small broadcast)."""
        steps = loop.steps_done
        if len(self.first) == self.ident.world_size or self.entry is None or (steps % JOIN_EVERY and
                                                                               steps != self.await_at):
            return
        wait = steps == self.await_at
        if wait:
            self.await_at = -1  # JOIN_VAR holds the run once, not again where a recovery goes back to that step
        found = loop.d.from_main(lambda: self._admitted(wait=wait))
        if found:
            raise Grow([(int(r), str(token)) for r, token in found])

    def _admitted(self, wait: bool) -> list[tuple[int, str]]:
        assert self.entry is not None
        deadline = time.monotonic() + self.timeout
        while True:
            try:
                found = membership.admit_late(self._store(), self.ident.world_size, self.creds, self.entry.nonce,
                                              self.first)
            except RuntimeError:  # its host is gone: nobody can check in until the next failure moves the store
                if self.succession is None or not self.succession.gone(self._where()):
                    raise
                self.store = None  # each look probes again, without a TCPStore client's warnings
                return []
            if found or not wait or time.monotonic() > deadline:
                return sorted(found.items())
            time.sleep(10 * POLL_S)

    def grow(self, loop: Loop, joiners: list[tuple[int, str]]) -> None:
        """Take the admitted replacements in: the next generation is this world and them, rank 0 hands them the
        run's state, and the run's slots are dealt over the grown world (docs/design/recovery.md)."""
        assert self.entry is not None
        began, d, backend = time.perf_counter(), loop.d, dist.get_backend()
        parts = regroup.batchnorm_sets(loop.stats, loop.share, d, {})
        loop.stretch = regroup.carried(loop.stretch, d)  # rank 0 holds what the stretch added up
        members = self.first + [r for r, _ in joiners]
        if d.is_main:
            for r, token in joiners:
                membership.place(self._store(), self.creds, self.entry, r, token,
                                 membership.Placement(self.generation + 1, members.index(r), members))
        distributed.teardown(together=True)
        loop.d = self._enter(d, backend, members, d.rank, "re-formed with a replacement")
        self.handover(loop, parts)
        joined = ", ".join(f"rank {r}" for r, _ in joiners)
        loop.rank0.say(f"recover: {joined} joined at {_where(loop)}; {self._went_on(loop, began)}")

    def handover(self, loop: Loop, parts: torch.Tensor | None = None) -> None:
        """Rank 0's state, as a weights-only checkpoint in bytes with its digest (no pickle), on every rank of the
        grown world; a replacement (`joining`) takes it on, and all deal the run's slots over the world."""
        t, s, snapshots = loop.t, loop.stretch, self.snapshots
        assert snapshots is not None
        if self.succession:  # the grown world's standby stores: the replacement's node has a new launcher
            self.succession.learn(loop.d)

        def state() -> tuple[Path, dict]:
            return Path("rank 0's state"), {
                "model": t.model.state_dict(), "optimizer": t.opt.state_dict(), "progress": vars(t.progress).copy(),
                "rng": torch.get_rng_state(), "slots": loop.share.slots, "batchnorm_parts": parts,
                "position": snapshots.position,
                "samples": s.samples, "logged": [[done, lr, n] for done, lr, _, n in s.logged],
                **({"scaler": t.scaler.state_dict()} if t.scaler is not None else {})}
        found = loop.d.from_main(state, checkpoint.pack, checkpoint.unpack)
        assert found is not None
        where, got = found
        if self.joining:
            checkpoint.restore_model(t.model, got["model"], where)
            t.opt.load_state_dict(got["optimizer"])
            if t.scaler is not None and "scaler" in got:
                t.scaler.load_state_dict(got["scaler"])
            torch.set_rng_state(got["rng"])
            t.progress = Progress(**got["progress"])
            snapshots.position = got["position"]
            zero = torch.zeros((), device=loop.d.device)
            loop.stretch = Stretch(zero.clone(), 0, got["samples"], [(done, lr, zero.clone(), n)
                                                                      for done, lr, n in got["logged"]])
            self.joining = False
        loop._deal(Share(slots=got["slots"], world=loop.d.world_size, whole=self.bitwise), got["batchnorm_parts"])

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
                if d.rank not in decided[0]:
                    raise self._presumed_lost(self.first[d.rank], self.generation)
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


def _where(loop: Loop) -> str:
    """Where the world goes on from, in words: a step, or an epoch's end (its fold, evaluation and saves)."""
    epoch = loop.t.progress.epoch + 1
    if loop.step_in_epoch == loop.train_batches.steps_per_epoch:
        return f"the end of epoch {epoch}"
    return f"epoch {epoch}, step {loop.step_in_epoch + 1}"


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
