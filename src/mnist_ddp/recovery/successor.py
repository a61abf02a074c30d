"""--recover on several nodes, when the process that holds the rendezvous store is lost (node 0's launcher, and its
ranks with it): the survivors meet again at the standby store of the next node's launcher, which every rank knew from
the start, once its host proved that it holds the job's secret, and agree there on who is left
(docs/design/recovery.md, "The store's host"). A launcher holds its `Standby` meanwhile; the rest is entered only on
a failure."""

import hmac
import json
import re
import secrets
import threading
import time
from contextlib import suppress
from datetime import timedelta
from functools import partial

import torch.distributed as dist

from ..common import untrusted
from ..common.errors import UserError
from ..core.distributed import Dist, PeerFailure
from ..joining import membership, rendezvous
from ..joining.heartbeat import BEAT_WAIT_S, bounded, gone
from ..joining.identity import Identity

CHALLENGES = "mnist_ddp/successor/challenges"  # a queue: each survivor pushes a random token onto it
PROOF = "mnist_ddp/successor/proof/"  # + a token: the standby's answer, an HMAC with the job's secret
AT, DECIDED = "mnist_ddp/successor/at/", "mnist_ddp/successor/decided"  # the survivors' agreement
FINISHED = "mnist_ddp/successor/finished"  # rank 0's word that the run finished, an HMAC with the job's secret
_HEX32 = re.compile(rb"[0-9a-f]{32}")
POLL_S = 0.02
Seat = tuple[int, str, int]  # a node's standby store: the node, its address, its port


class StoreGone(RuntimeError):
    """The store's port refuses connections: the process that held it is gone."""


def proof(creds: membership.Credentials, token: str, where: tuple[str, int]) -> str:
    """What only a holder of the job's secret can answer to `token` for the store at `where`."""
    return membership.vouch(creds, "successor", token, *where)


def finish_mark(creds: membership.Credentials, where: tuple[str, int]) -> str:
    """What rank 0 writes at the standby store at `where` once the run finished: only a holder of the secret can."""
    return membership.vouch(creds, "finished", *where)


class Standby:
    """A launcher's standby store (nodes 1, 2, … under --recover): held from launch, for the survivors to meet at if
    the store's host is lost; its thread, blocked on the challenge queue until then, answers each challenge."""

    def __init__(self, master_addr: str, world: int, creds: membership.Credentials, timeout: timedelta) -> None:
        addr = membership.address_towards(master_addr)  # where gloo listens too: the interface the others reach
        if addr == membership.UNKNOWN_ADDRESS:
            raise UserError(f"this node cannot tell its own address on the way to the master address {master_addr} "
                            f"(no route to it?), where --recover's standby store would listen; check --master-addr.")
        self.store = rendezvous.host_store(addr, 0, world, timeout, one_node=False)  # port 0: the kernel picks
        self.where, self.creds, self.closed = (addr, self.store.port), creds, False
        self.thread = threading.Thread(target=self._answer, name="mnist-ddp standby", daemon=True)
        self.thread.start()

    def _answer(self) -> None:
        with suppress(RuntimeError):  # the store closed
            queue = dist.TCPStore(*self.where, is_master=False, timeout=timedelta(days=365))
            while not self.closed:
                token = queue.queue_pop(CHALLENGES)  # blocks in the store: no cost while nobody knocks
                if _HEX32.fullmatch(token):
                    queue.set(PROOF + token.decode(), proof(self.creds, token.decode(), self.where))

    def close(self) -> None:
        """Stop answering (the store closes with the launcher)."""
        if self.closed:
            return
        self.closed = True
        with suppress(RuntimeError):
            self.store.queue_push(CHALLENGES, "")
        self.thread.join(BEAT_WAIT_S)

    def retire(self) -> None:
        """The run has finished (a rank of this node ended it): close the store's port, so that a rank presumed lost
        that wakes now finds no successor to go on at, and stops, rather than re-form alone and write over the run's
        outputs from where it froze. Once is enough; a second call does nothing."""
        self.close()
        self.__dict__.pop("store", None)  # the TCPStore's server listens for as long as the object lives


class Succession:
    """One rank's line of succession: every node's standby store in node order, and which nodes' launchers are known
    to have ended (the store's host first, once it is lost)."""

    def __init__(self, ident: Identity, creds: membership.Credentials, timeout: float, patience: float) -> None:
        self.ident, self.creds, self.timeout, self.patience = ident, creds, timeout, patience
        self.node = ident.rank // ident.local_world_size  # spawn's numbering: node × G + local rank
        self.host = 0  # the node whose launcher holds the job's store
        self.line: list[Seat] = []
        self.ended: set[int] = set()  # nodes whose launcher (and so whose ranks) are gone

    def learn(self, d: Dist) -> None:
        """Every node's standby, as its ranks know it from their launcher: gathered over the group (admitted ranks
        only), not through the store."""
        mine = [self.node, *self.ident.standby] if self.ident.standby else None
        every = d.gather(mine)
        line = d.from_main(lambda: sorted({tuple(seat) for seat in every or [] if _seat(seat)}))
        self.line = [(n, a, p) for n, a, p in line if _seat([n, a, p]) and n > self.host]

    def finish(self) -> None:
        """The run finished (rank 0, last): every standby in line is told so, with the job's secret, for a rank of
        its node presumed lost that wakes later to stop there, not re-form alone (docs/design/recovery.md, "After
        the run"). A standby that does not take it within BEAT_WAIT_S is passed over."""
        def tell(where: tuple[str, int]) -> None:
            store = dist.TCPStore(*where, is_master=False, timeout=timedelta(seconds=BEAT_WAIT_S))
            store.set(FINISHED, finish_mark(self.creds, where))
        for _, addr, port in self.line:
            bounded(partial(tell, (addr, port)), BEAT_WAIT_S)

    def gone(self, where: tuple[str, int]) -> bool:
        """Whether the store at `where` is known gone (its port refuses); PeerFailure when nothing answers at all."""
        answer = rendezvous.reached(*where, self.patience)
        if answer is None:
            raise PeerFailure(f"rank {self.ident.rank} found the rendezvous store at {where[0]}:{where[1]} silent (its "
                              f"machine is down, frozen or cut off from this one); a cut cable looks the same, and "
                              f"going on at a successor could then split the run in two, so the job stops. Run again "
                              f"with --resume to continue from the last checkpoint.")
        return not answer

    def take_over(self, deadline: float) -> tuple[dist.Store, tuple[str, int], str]:
        """The store's host is gone: the store of the next node in line whose launcher is there and proves it holds
        the job's secret, its address, and what happened in words. PeerFailure when there is none."""
        lost, self.ended = self.host, self.ended | {self.host}
        for node, addr, port in self.line:
            if self.node in self.ended:
                break
            if self.gone((addr, port)):
                self.ended.add(node)  # refused: that launcher has ended too
                continue
            store = self._proven((addr, port), deadline)
            if store is None:
                raise PeerFailure(f"rank {self.ident.rank} refused the store at {addr}:{port} as node {node}'s "
                                  f"successor to the lost rendezvous store: its host did not prove that it holds the "
                                  f"job's secret, so it is not node {node}'s launcher; the job stops. Run again with "
                                  f"--resume to continue from the last checkpoint.")
            if store.check([FINISHED]) and hmac.compare_digest(store.get(FINISHED),
                                                               finish_mark(self.creds, (addr, port)).encode()):
                raise PeerFailure(f"rank {self.ident.rank} was presumed lost, and the run finished without it (rank "
                                  f"0 said so at node {node}'s standby store); this process stops and writes "
                                  f"nothing.")
            self.host, self.line = node, [seat for seat in self.line if seat[0] > node]
            return store, (addr, port), (f"node {lost}'s launcher, which held the rendezvous store, is gone: node "
                                         f"{node}'s ({addr}:{port}) holds it now")
        if self.node in self.ended:  # this rank's own launcher: it is told to stop with it (forkserver.py)
            raise PeerFailure(f"rank {self.ident.rank} lost its own node's launcher; this process stops.")
        raise PeerFailure(f"rank {self.ident.rank} lost the rendezvous store with node {lost}'s launcher, and no other "
                          f"node's launcher is left to take it over; the job stops. Run again with --resume to "
                          f"continue from the last checkpoint.")

    def _proven(self, where: tuple[str, int], deadline: float) -> dist.Store | None:
        """A client of the store at `where` once its host answered a random challenge as only a holder of the job's
        secret can; None if it answers otherwise, or not by the deadline (a TCPStore client waits without end for a
        host that accepts and never answers: `bounded`)."""
        token = secrets.token_hex(16)

        def ask() -> dist.Store | None:
            store = dist.TCPStore(*where, is_master=False, timeout=timedelta(seconds=max(1.0, deadline -
                                                                                           time.monotonic())))
            store.queue_push(CHALLENGES, token)
            while time.monotonic() < deadline:
                if store.check([PROOF + token]):
                    answer = store.get(PROOF + token)
                    return store if hmac.compare_digest(answer, proof(self.creds, token, where).encode()) else None
                time.sleep(POLL_S)
            return None
        return bounded(ask, max(0.0, deadline - time.monotonic()) + BEAT_WAIT_S)

    def agree(self, store: dist.Store, generation: int, members: list[int], position: int,
              roster: dict[int, dict], deadline: float) -> tuple[int, list[int], int, list[int]]:
        """Check in at the successor with this rank's generation, members (first-world ranks) and position; once
        every member of the highest generation any survivor brought has checked in or is lost on evidence (its
        node's launcher ended, or /proc here says it is gone or stopped), the first to see it writes the decision:
        that generation, the members left, the lowest position among them, the lost."""
        me, world, mine = self.ident.rank, self.ident.world_size, json.dumps(
            {"generation": generation, "members": members, "position": position})

        def lost(r: int) -> bool:
            return r // self.ident.local_world_size in self.ended or (r in roster and gone(roster[r], stopped=True))
        while True:
            if store.check([DECIDED]):
                return _decision(store.get(DECIDED), world)
            at = {r: a for r in range(world) if store.check([AT + str(r)]) and (a := _arrival(store.get(AT + str(r)),
                                                                                               world))}
            if me not in at:  # first, or a stray write erased it
                store.set(AT + str(me), mine)
                continue
            top = max(at.values(), key=lambda a: a["generation"])
            kept = [r for r in top["members"] if r in at and not lost(r)]
            if kept and all(r in at or lost(r) for r in top["members"]):
                store.compare_set(DECIDED, "", json.dumps({
                    "generation": top["generation"], "members": kept, "position": min(at[r]["position"] for r in kept),
                    "lost": [r for r in top["members"] if r not in kept]}))
                continue
            if time.monotonic() > deadline:
                raise PeerFailure(f"rank {me} could not agree with the other processes at the successor store on how "
                                  f"to go on within --timeout {self.timeout:g} s; run again with --resume.")
            time.sleep(POLL_S)


def _seat(seat: object) -> bool:
    return (isinstance(seat, list | tuple) and len(seat) == 3 and isinstance(seat[0], int) and isinstance(seat[1], str)
            and isinstance(seat[2], int))


def _ranks(value: object, world: int) -> bool:
    return isinstance(value, list) and all(isinstance(r, int) and 0 <= r < world for r in value)


def _arrival(raw: bytes, world: int) -> dict | None:
    """A survivor's check-in at the successor (untrusted: None for one that is not of ours)."""
    try:
        a = untrusted.record(raw, {"generation": int, "members": list, "position": int})
    except ValueError:
        return None
    return a if _ranks(a["members"], world) else None


def _decision(raw: bytes, world: int) -> tuple[int, list[int], int, list[int]]:
    """The decision as written to the store (untrusted: one that does not parse is a failure)."""
    try:
        d = untrusted.record(raw, {"generation": int, "members": list, "position": int, "lost": list})
        if not (_ranks(d["members"], world) and _ranks(d["lost"], world)):
            raise ValueError("not ranks of this job")
    except ValueError as e:
        raise PeerFailure(f"the survivors' decision in the successor store is unreadable ({e}); the job stops.") \
            from None
    return d["generation"], d["members"], d["position"], d["lost"]
