"""Who may join a job: a rank is counted only after it proves at check-in that it knows the job's secret (an HMAC
of rank 0's nonce) and runs the same run; rank 0 admits one per rank (docs/design/membership.md)."""

import hashlib
import hmac
import json
import os
import re
import secrets
import socket
import sys
import time
from collections import Counter
from collections.abc import Callable, Collection, Mapping
from dataclasses import asdict, dataclass, field, replace
from typing import Any, TypeVar

import torch.distributed as dist

from ..common import untrusted
from ..common.errors import UserError
from .identity import Identity

T = TypeVar("T")
NONCE = "mnist_ddp/nonce"  # rank 0's challenge, 32 hex digits
CHECKINS = "mnist_ddp/checkins"  # the tokens of the check-ins so far, one per line, appended by each candidate
ADMITTED = "mnist_ddp/admitted"  # the ranks admitted so far, for a waiting rank's timeout message only
CHECKIN, VERDICT, WELCOME = "mnist_ddp/checkin/", "mnist_ddp/verdict/", "mnist_ddp/welcome/"  # + a token
PLACE = "mnist_ddp/place/"  # + a replacement's token: the re-formed world it joins (recovery.py)
_HEX32 = re.compile(rb"[0-9a-f]{32}")
MAX_CHECKIN = 16384  # bytes: a real check-in is a few hundred
RELIST_S = 2.0  # a candidate without an answer lists its token again (a stray write may have erased the list)
UNKNOWN_ADDRESS = "unknown address"  # what `address_towards` says where no route leads to the master
SHOWN = 20  # refusal lines printed, the last saying so: a flood of check-ins is not echoed line by line


class Refused(UserError):
    """This process was refused by the job it tried to join: the user's to fix (exit code 2)."""


@dataclass(frozen=True)
class Credentials:
    """What a rank proves at check-in: that it knows the job's secret (b"": none was given), and which run it is
    part of (config.run_settings)."""

    secret: bytes = field(default=b"", repr=False)
    run: Mapping[str, str] = field(default_factory=dict)


@dataclass(frozen=True)
class CheckIn:
    """One candidate's check-in, as written to the store."""

    rank: int
    addr: str
    host: str
    pid: int
    nonce: str
    run: dict[str, str]
    mac: str

    def who(self) -> str:
        return f"{untrusted.printable(self.addr)} ({untrusted.printable(self.host)}, pid {self.pid})"

    @classmethod
    def parse(cls, raw: bytes) -> "CheckIn | None":
        """A check-in from the store's bytes, or None for anything that is not one (of any size or shape)."""
        try:
            d = untrusted.record(raw, _FIELDS, limit=MAX_CHECKIN, most=MAX_CHECKIN)
            c = cls(**{k: d[k] for k in _FIELDS}) if set(d) == set(_FIELDS) else None
        except ValueError:
            return None
        return c if c is not None and all(isinstance(k, str) and isinstance(v, str) for k, v in c.run.items()) else None


_FIELDS = {"rank": int, "addr": str, "host": str, "pid": int, "nonce": str, "run": dict, "mac": str}


def _digest(run: Mapping[str, str]) -> str:
    return hashlib.sha256(json.dumps(dict(run), sort_keys=True).encode()).hexdigest()


def _mac(secret: bytes, *fields: Any) -> str:
    """HMAC-SHA256 over `fields` (JSON: no two lists of fields read the same)."""
    return hmac.new(secret, json.dumps(fields).encode(), hashlib.sha256).hexdigest()


def vouch(creds: Credentials, *fields: Any) -> str:
    """HMAC-SHA256 over `fields` and the run's digest, keyed with the job's secret: what only this job's processes
    can write (successor.py)."""
    return _mac(creds.secret, *fields, _digest(creds.run))


def _sign(c: CheckIn, secret: bytes) -> str:
    return _mac(secret, "check-in", c.nonce, c.rank, _digest(c.run), c.addr, c.host, c.pid)


@dataclass(frozen=True)
class Placement:
    """Where a replacement joins a running job (recovery.py): the generation, its rank there, and the members
    (as the first world numbered them) in their new order."""

    generation: int
    rank: int
    members: list[int]


@dataclass(frozen=True)
class Entry:
    """This rank's admission: the nonce it answered and, for ranks above 0, its check-in's token."""

    nonce: str
    token: str | None  # None: this process is the job's rank 0, which admits the others
    placed: Placement | None = None  # a replacement admitted into a running job


def admit_late(store: dist.Store, world: int, creds: Credentials, nonce: str, present: list[int]) -> dict[int, str]:
    """Rank 0 of a running job: answer the check-ins listed since it began, admitting one per rank not `present`
    (a replacement of a lost rank); rank -> token of those admitted. Welcome them with `place`."""
    admission = _Admission(store, world, creds, nonce, present)
    for raw in dict.fromkeys(_HEX32.findall(_read(store, CHECKINS))):
        token = raw.decode()
        if not store.check([VERDICT + token]) and (answer := admission._answer(token)):
            store.set(VERDICT + token, answer)  # type: ignore[arg-type]  # a store takes bytes (not in the stubs)
    return {rank: token for rank, (token, _) in admission.admitted.items()}


def place(store: dist.Store, creds: Credentials, entry: Entry, rank: int, token: str, where: Placement) -> None:
    """Tell the admitted replacement `rank` (its check-in `token`) where it joins, then welcome it."""
    store.set(PLACE + token, json.dumps({**asdict(where), "mac": _mac(creds.secret, "place", entry.nonce, token,
                                                                      asdict(where))}))
    store.set(WELCOME + token, _mac(creds.secret, "welcome", entry.nonce, token, rank))


def placement(store: dist.Store, creds: Credentials, entry: Entry) -> Placement | None:
    """Where this welcomed rank joins: None in the job's first world, else the running job's word for it (its MAC
    checked: anyone can write the store)."""
    if entry.token is None or not store.check([PLACE + entry.token]):
        return None
    try:
        d = untrusted.record(store.get(PLACE + entry.token), {"generation": int, "rank": int, "members": list,
                                                              "mac": str})
        where = Placement(d["generation"], d["rank"], d["members"])
        if not all(isinstance(r, int) for r in where.members) or not 0 <= where.rank < len(where.members):
            raise ValueError("not ranks")
    except (ValueError, KeyError) as e:
        raise Refused(f"the running job's word on where this process joins is unreadable ({e}).") from None
    if not hmac.compare_digest(d["mac"], _mac(creds.secret, "place", entry.nonce, entry.token, asdict(where))):
        raise Refused("the word on where this process joins was not written by the job (its MAC does not match).")
    return where


def check_in(store: dist.Store, ident: Identity, creds: Credentials, deadline: float) -> Entry:
    """Return once this rank is in: rank 0 once it opened the check-in, any other once rank 0 admitted it;
    raise Refused if this process is refused."""
    if ident.rank == 0:
        nonce = secrets.token_hex(16)
        current = store.compare_set(NONCE, "", nonce)
        if current == nonce.encode() or not _HEX32.fullmatch(current):  # ours, or garbage written before it
            return Entry(nonce, None)
        # Another rank 0 is admitting here already: a second job on this port, or -nr 0 given twice. This one
        # must prove itself to it like any other rank (and is refused, with its line there).
    token, nonce = _check_in(store, ident, creds, deadline)
    return Entry(nonce, token)


def wait_for_all(store: dist.Store, ident: Identity, creds: Credentials, entry: Entry, deadline: float) -> None:
    """Return once every rank of the job is in (rank 0 admits them here); TimeoutError names the ranks missing."""
    if entry.token is None:
        _Admission(store, ident.world_size, creds, entry.nonce).run(deadline)
        return
    token = entry.token
    welcome = _mac(creds.secret, "welcome", entry.nonce, token, ident.rank)
    _wait(lambda: _read(store, WELCOME + token) == welcome.encode() or None, deadline,
          lambda: _stalled(store, ident.world_size))


def _check_in(store: dist.Store, ident: Identity, creds: Credentials, deadline: float) -> tuple[str, str]:
    """Check in as `ident.rank` and wait for rank 0's verdict; the token and nonce of the admitted check-in."""
    nonce = _wait(lambda: _nonce(store), deadline, lambda: "rank 0 never opened the check-in")
    token = secrets.token_hex(16)
    c = CheckIn(ident.rank, address_towards(ident.master_addr), socket.gethostname(), os.getpid(), nonce,
                dict(creds.run), "")
    store.set(CHECKIN + token, json.dumps(asdict(replace(c, mac=_sign(c, creds.secret)))))
    admitted = f"admitted {_mac(creds.secret, 'admitted', nonce, token, ident.rank)}".encode()
    listed = 0.0

    def verdict() -> bool | None:
        nonlocal listed
        if time.monotonic() - listed > RELIST_S:  # first, and again while there is no answer
            store.append(CHECKINS, token + "\n")  # type: ignore[attr-defined]  # every store has it; the stubs not
            listed = time.monotonic()
        answer = _read(store, VERDICT + token)
        if answer.startswith(b"refused "):
            raise Refused(f"the job at {ident.master_addr}:{ident.master_port} refused this process (rank "
                          f"{ident.rank}): {untrusted.printable(answer[8:].decode(errors='replace'))}.")
        return answer == admitted or None  # anything else is not rank 0's: wait on for its answer
    _wait(verdict, deadline, lambda: "rank 0 did not answer its check-in")
    return token, nonce


class _Admission:
    """Rank 0's side: admit one valid check-in per rank, refuse the rest, then welcome the admitted."""

    def __init__(self, store: dist.Store, world: int, creds: Credentials, nonce: str,
                 present: Collection[int] = ()) -> None:
        self.store, self.world, self.creds, self.nonce, self.present = store, world, creds, nonce, present
        self.admitted: dict[int, tuple[str, CheckIn]] = {}  # rank -> (token, check-in)
        self.answers: dict[str, bytes] = {}  # token -> verdict (b"": listed without a check-in, nobody to answer)
        self.refusals = 0

    def run(self, deadline: float) -> None:
        listed: Counter[bytes] = Counter()  # token -> how often it was listed when last answered
        pause = 0.01
        while len(self.admitted) < self.world - 1:
            if self.store.compare_set(NONCE, self.nonce, self.nonce) != self.nonce.encode():
                self.store.set(NONCE, self.nonce)  # someone wrote over it: every candidate must see ours
            for raw, times in Counter(_HEX32.findall(_read(self.store, CHECKINS))).items():
                if times <= listed[raw]:
                    continue  # answered, and not asked again
                listed[raw], token, pause = times, raw.decode(), 0.01
                if token not in self.answers:
                    self.answers[token] = self._answer(token)
                if self.answers[token]:  # the first answer, or the same again (a stray write may have erased it)
                    self.store.set(VERDICT + token, self.answers[token])  # type: ignore[arg-type]  # as above
            if time.monotonic() >= deadline:
                raise TimeoutError(f"{_missing_from(self.admitted, self.world)} never checked in")
            time.sleep(pause)
            pause = min(0.5, pause * 1.5)  # a thousand ranks checking in stay a light load for the store
        for rank, (token, _) in self.admitted.items():
            self.store.set(WELCOME + token, _mac(self.creds.secret, "welcome", self.nonce, token, rank))

    def _answer(self, token: str) -> bytes:
        """The verdict on check-in `token`, admitting its rank if it is valid."""
        if not self.store.check([CHECKIN + token]):  # candidates write it before they list it: not one of ours
            return b""
        c = CheckIn.parse(self.store.get(CHECKIN + token))
        reason = _reason(c, self.nonce, self.creds, self.world, self.admitted)
        if c is not None and reason is None and c.rank in self.present:  # a running job: admit_late
            reason = f"rank {c.rank} is still in the job"
        if c is not None and reason is None:
            self.admitted[c.rank] = (token, c)
            self.store.set(ADMITTED, ",".join(map(str, sorted([0, *self.admitted]))))
            return f"admitted {_mac(self.creds.secret, 'admitted', self.nonce, token, c.rank)}".encode()
        self.refusals += 1
        if self.refusals <= SHOWN:  # one line each; a flood of them is not echoed
            who = f"{c.who()}, which checked in as rank {c.rank}" if c else "a process"
            more = "; further refusals are not shown" if self.refusals == SHOWN else ""
            print(f"mnist-ddp: refused {who}: {reason}; still waiting for "
                  f"{_missing_from(self.admitted, self.world)}{more}.", file=sys.stderr, flush=True)
        return f"refused {reason}".encode()


def _reason(c: CheckIn | None, nonce: str, creds: Credentials, world: int,
            admitted: dict[int, tuple[str, CheckIn]]) -> str | None:
    """Why check-in `c` is refused; None when it is admitted."""
    if c is None:
        return "its check-in is unreadable (not one of mnist-ddp's)"
    if c.nonce != nonce:
        return "it answered another job's challenge (an old or copied check-in)"
    if not hmac.compare_digest(c.mac, _sign(c, creds.secret)):
        return "its secret is not the job's (MNIST_DDP_SECRET or --secret-file must be the same on every node)"
    shown = lambda v: untrusted.printable(v, 40)  # noqa: E731
    differ = [f"{shown(k)} {shown(c.run.get(k, '(unset)'))} (the job: {creds.run.get(k, '(unset)')})"
              for k in sorted(set(c.run) | set(creds.run)) if c.run.get(k) != creds.run.get(k)]
    if differ:
        return f"it belongs to another run: {', '.join(differ[:3])}{' …' if len(differ) > 3 else ''}"
    if c.rank == 0:
        return "the job has its rank 0 already (is -nr 0 given to two nodes, or is this another job's node 0?)"
    if not 0 < c.rank < world:
        return f"the job has ranks 0 to {world - 1} only"
    if c.rank in admitted:
        return f"rank {c.rank} is in the job already, from {admitted[c.rank][1].who()}"
    return None


def _missing_from(admitted: Mapping[int, Any] | set[int], world: int) -> str:
    """'rank 3' or 'ranks 1, 2, …': those of 1 … world-1 not in `admitted`."""
    missing = [r for r in range(1, world) if r not in admitted]
    shown = ", ".join(map(str, missing[:8])) + (" …" if len(missing) > 8 else "")
    return f"rank{'s' if len(missing) > 1 else ''} {shown}"


def _stalled(store: dist.Store, world: int) -> str:
    """Why an admitted rank still waits: the ranks not admitted yet, as rank 0 last published them."""
    admitted = {int(r) for r in _read(store, ADMITTED).split(b",") if r.isdigit()}
    if all(r in admitted for r in range(1, world)):
        return "rank 0 let every rank in but never said so (it stopped, or its store did)"
    return f"{_missing_from(admitted, world)} never checked in"


def _read(store: dist.Store, key: str) -> bytes:
    """`key`'s value, b"" while it is not there (a get would wait for it)."""
    return store.get(key) if store.check([key]) else b""


def _nonce(store: dist.Store) -> str | None:
    """Rank 0's nonce, once it is there (and not garbage someone wrote over it)."""
    value = _read(store, NONCE)
    return value.decode() if _HEX32.fullmatch(value) else None


def _wait(ready: Callable[[], T | None], deadline: float, what: Callable[[], str]) -> T:
    """Poll `ready()` until it gives a value, backing off from 10 ms to 0.5 s; TimeoutError(`what()`) at the
    deadline. Polling in Python, not waiting inside the store's C++, keeps Ctrl-C and SIGTERM heard."""
    pause = 0.01
    while (value := ready()) is None:
        if time.monotonic() >= deadline:
            raise TimeoutError(what())
        time.sleep(pause)
        pause = min(0.5, pause * 1.5)
    return value


def address_towards(addr: str) -> str:
    """This machine's address on the way to `addr` (what the job's refusal line names)."""
    try:
        family, _, _, _, target = socket.getaddrinfo(addr, 9, type=socket.SOCK_DGRAM)[0]
        with socket.socket(family, socket.SOCK_DGRAM) as s:
            s.connect(target)  # a UDP connect sends nothing: the kernel only picks the route
            return s.getsockname()[0]
    except OSError:
        return UNKNOWN_ADDRESS
