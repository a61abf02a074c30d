"""The process group: join it, use it, leave it.

`setup` turns an `Identity` (who am I: identity.py) into a `Dist` — the running process's
rank, world size and device, with the few collectives the training loop needs — after
joining the process group (`init_process_group`). Every launcher ends in the same `Dist`,
so the training loop has a single code path; with one process there is no process group
at all and the collectives are no-ops. `teardown` leaves the group, always.

What ranks share crosses the network as bytes in uint8 tensors, never as pickles: torch's object
collectives (broadcast_object_list, gather_object) unpickle whatever arrives with the full unpickler, so
whoever could pose as rank 0 would run code on every rank (and they need numpy, which a base install
lacks). Rank 0's result travels as JSON, or as a checkpoint the weights-only loader reads and its digest
checks (checkpoint.pack); what cannot be read is refused in one line.
"""

import gc
import json
import os
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, TypeVar

import torch
import torch.distributed as dist

from . import errors, membership, rendezvous, untrusted
from .errors import UserError
from .heartbeat import BEAT_WAIT_S, LOST_CONTACT, Heartbeat
from .identity import Identity
from .membership import Credentials

T = TypeVar("T")
MAX_SHARED = 64 * 2**20  # bytes: what one rank may send the others (a checkpoint is ~0.4 MB)


class PeerFailure(UserError):
    """Another process of the job died or stopped answering; not bad input, so exit code 1."""

    exit_code = 1


def pick_device(name: str, local_rank: int) -> torch.device:
    """`auto` is cuda, else mps, else cpu; each local process gets its own GPU.

    A process that sees a single GPU uses it whatever its local rank: SLURM's --gpus-per-task and
    per-rank CUDA_VISIBLE_DEVICES give every process "its" GPU as device 0.
    """
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "mps" if torch.backends.mps.is_available() else "cpu"
    if name == "cuda":
        if not torch.cuda.is_available():
            raise UserError("--device cuda was asked for, but PyTorch sees no CUDA GPU here.")
        visible = torch.cuda.device_count()
        if visible > 1 and local_rank >= visible:
            raise UserError(f"local rank {local_rank} needs a GPU of its own, but this process sees only {visible}; "
                            f"start at most {visible} processes per node.")
        return torch.device("cuda", local_rank if visible > 1 else 0)
    if name == "mps" and not torch.backends.mps.is_available():
        raise UserError("--device mps was asked for, but this PyTorch has no MPS support here.")
    return torch.device(name)


@dataclass(frozen=True)
class Dist:
    """The running process's view of the job; the collectives are no-ops in one process."""

    rank: int
    local_rank: int
    world_size: int
    local_world_size: int
    device: torch.device
    run_id: str = ""  # torchrun's job id (TORCHELASTIC_RUN_ID), recorded in checkpoints
    heartbeat: Heartbeat | None = None  # None: one process, or --heartbeat 0

    def at(self, phase: str, epoch: int = 0, step: int = 0) -> None:
        """Say what this rank is doing, for a peer's timeout message to name (heartbeat.py); no I/O."""
        if self.heartbeat is not None:
            self.heartbeat.at(phase, epoch, step)

    @property
    def is_main(self) -> bool:
        """Rank 0 alone prints, writes metrics and saves checkpoints."""
        return self.rank == 0

    def all_sum(self, tensor: torch.Tensor) -> torch.Tensor:
        """Sum `tensor` over all ranks, in place, and return it."""
        if self.world_size > 1:
            dist.all_reduce(tensor, op=dist.ReduceOp.SUM)
        return tensor

    def from_main(self, fn: Callable[[], T], encode: Callable[[T], bytes] = lambda v: json.dumps(v).encode(),
                  decode: Callable[[bytes], T] = untrusted.parse) -> T:
        """`fn()`, run on rank 0 alone, and its result on every rank: `encode`d there (JSON unless told), sent
        as bytes, `decode`d on the others (checkpoint.pack and unpack for a checkpoint). A UserError there is
        raised on every rank, so bad input only rank 0 can see (an unreadable checkpoint, an unusable --out)
        stops the whole job at once, instead of leaving the other ranks waiting for rank 0 until --timeout."""
        if self.world_size == 1:
            return fn()
        if self.is_main:
            try:
                result = fn()
            except UserError as e:
                self.broadcast(b"E" + errors.relay(e))
                raise
            self.broadcast(b"R" + encode(result))
            return result
        sent = self.broadcast(b"")
        kind, body = sent[:1], sent[1:]
        try:
            if kind == b"R":
                return decode(body)
            if kind != b"E":
                raise ValueError("neither a result nor an error")
            error, _ = errors.relayed(body)
        except (ValueError, UserError) as e:  # untrusted.parse raises ValueError, checkpoint.unpack UserError
            raise self._refused(0, str(e)) from None
        raise error

    def broadcast(self, data: bytes) -> bytes:
        """Rank 0's `data` on every rank (what the others pass is ignored): its length, then its bytes."""
        if self.world_size == 1:
            return data
        size = torch.tensor([len(data)], dtype=torch.int64, device=self._wire)
        dist.broadcast(size, src=0)
        n = int(size)
        if not self.is_main and not 0 < n <= MAX_SHARED:
            raise self._refused(0, f"it announced {n:,} bytes")
        box = _tensor(data, self._wire) if self.is_main else torch.empty(n, dtype=torch.uint8, device=self._wire)
        dist.broadcast(box, src=0)
        return data if self.is_main else _bytes(box)

    def gather(self, obj: Any) -> list[Any] | None:
        """Every rank's `obj` (plain values: JSON), in rank order, on rank 0; None on the other ranks."""
        if self.world_size == 1:
            return [obj]
        data = json.dumps(obj).encode()
        sizes = [torch.zeros(1, dtype=torch.int64, device=self._wire) for _ in range(self.world_size)]
        dist.all_gather(sizes, torch.tensor([len(data)], dtype=torch.int64, device=self._wire))
        lengths = [int(s) for s in sizes]
        for rank, n in enumerate(lengths):
            if rank != self.rank and not 0 < n <= MAX_SHARED:
                raise self._refused(rank, f"it announced {n:,} bytes")
        longest = max(lengths)
        boxes = [torch.empty(longest, dtype=torch.uint8, device=self._wire) for _ in lengths] if self.is_main else None
        dist.gather(_tensor(data.ljust(longest), self._wire), boxes, dst=0)
        if boxes is None:
            return None
        found = []
        for rank, (box, n) in enumerate(zip(boxes, lengths)):
            try:
                found.append(untrusted.parse(_bytes(box[:n])))
            except ValueError as e:
                raise self._refused(rank, str(e)) from None
        return found

    @property
    def _wire(self) -> torch.device:
        """Where a collective's tensors live: nccl moves CUDA tensors only."""
        return self.device if self.device.type == "cuda" else torch.device("cpu")

    def _refused(self, sender: int, why: str) -> PeerFailure:
        """What a rank says of bytes no rank of ours sends: not bad input of the user's, so exit code 1."""
        why = untrusted.printable(why).rstrip(".")
        return PeerFailure(f"rank {self.rank} refused what rank {sender} sent ({why}): no rank of this job sends "
                           f"that, so another process may have reached it; the job stops.")


def _tensor(data: bytes, device: torch.device) -> torch.Tensor:
    """`data` as a uint8 tensor on `device` (torch.frombuffer shares a bytearray's memory: no numpy)."""
    return torch.frombuffer(bytearray(data), dtype=torch.uint8).to(device)


def _bytes(t: torch.Tensor) -> bytes:
    """A uint8 tensor's bytes: copied into a bytearray that a CPU tensor shares (torch.frombuffer), no numpy."""
    out = bytearray(t.numel())
    torch.frombuffer(out, dtype=torch.uint8).copy_(t)
    return bytes(out)


def setup(ident: Identity, device: torch.device, backend: str | None, timeout_s: float,
          heartbeat_s: float = 0, creds: Credentials | None = None) -> Dist:
    """Join the process group on `device` (one process needs none): nccl for CUDA, gloo otherwise, once every
    rank has proven with `creds` that it belongs to the job (membership.py; None: no secret, no run settings, as
    for processes a test starts itself); with `heartbeat_s`, this rank beats to the store every so many seconds
    (heartbeat.py)."""
    if device.type == "cuda":
        torch.cuda.set_device(device)
    beat = None
    if ident.world_size > 1:
        if device.type == "mps":
            raise UserError("MPS has no collective backend; run several processes on --device cpu instead.")
        beat = _join(ident, backend or ("nccl" if device.type == "cuda" else "gloo"), timedelta(seconds=timeout_s),
                     heartbeat_s, creds or Credentials())
    return Dist(ident.rank, ident.local_rank, ident.world_size, ident.local_world_size, device, ident.run_id, beat)


def _join(ident: Identity, backend: str, timeout: timedelta, heartbeat_s: float,
          creds: Credentials) -> Heartbeat | None:
    os.environ.update(rendezvous.socket_interfaces(ident, os.environ))  # gloo and NCCL where the ranks are
    beat = None

    def start_beating() -> None:  # once this rank is in, so that a timeout later can name who hangs
        nonlocal beat
        if heartbeat_s:
            beats = rendezvous.connect(ident, timedelta(seconds=BEAT_WAIT_S), joining=False)
            beat = Heartbeat(dist.PrefixStore("mnist_ddp/heartbeat", beats), ident.rank, ident.world_size, heartbeat_s,
                             store_host=0 if ident.store_host == "rank0" else None)
    try:
        store = rendezvous.joined_store(ident, timeout)
        membership.meet(store, ident, creds, timeout, start_beating)  # every rank proven, or the missing named
        dist.init_process_group(backend, store=store, rank=ident.rank, world_size=ident.world_size, timeout=timeout)
        if beat:
            beat.at("setting up (data, model, checkpoint)")
        return beat
    except (RuntimeError, ValueError, OSError) as e:  # DistStoreError and DistNetworkError are RuntimeErrors
        others = ident.world_size - 1
        who = beat.diagnose() if beat else ""
        if beat:
            beat.stop(LOST_CONTACT, culprit=False)
        raise UserError(
            f"rank {ident.rank} could not join the {others} other process{'es' if others > 1 else ''} at "
            f"{ident.master_addr}:{ident.master_port} within {timeout.total_seconds():g} s "
            f"({rendezvous.gist(e)}{f': {who}' if who else ''}); check that every node was started with the same "
            f"--master-addr/--master-port and world size, and that they can reach each other (GLOO_SOCKET_IFNAME "
            f"names the network interface gloo should use)."
        ) from e
    except BaseException:  # interrupted: leave no thread talking to the store while the interpreter exits
        if beat:
            beat.stop("interrupted", culprit=False)
        raise


# What gloo and NCCL say when the other end of a collective died, or did not answer within --timeout.
_PEER_GONE = ("gloo/transport", "Connection closed by peer", "Connection reset by peer", "ncclRemoteError",
              "remote process exited", "NCCL communicator was aborted", "Watchdog caught collective operation timeout")


def is_peer_failure(e: BaseException) -> bool:
    """Whether `e` is a collective failing because a peer died or stopped answering — not a bug, and not a
    configuration error (a bad NCCL setting must not be reported as a dead peer)."""
    return isinstance(e, dist.DistNetworkError | dist.DistStoreError) or any(m in str(e) for m in _PEER_GONE)


def teardown(together: bool) -> None:
    """Leave the process group; called once, from a `finally`, so also after an error.

    `together` (after success only): first wait for every rank, so that none closes its connections while
    another is still finishing (rank 0 writes the last checkpoint); a rank that left early made its
    peers' gloo threads abort now and then ("terminate called without an active exception").
    """
    if dist.is_available() and dist.is_initialized():
        if together:
            dist.barrier()
        # The DDP wrapper sits in reference cycles and holds the process group; collect it now, so the
        # group's gloo threads are stopped here rather than by destructors while the interpreter exits
        # (where a still-running thread aborts the process: "terminate called without an active exception").
        gc.collect()
        dist.destroy_process_group()
