"""The process group: `join` joins it and turns an `Identity` into the one `Dist` every launcher ends in (rank,
world, device, the loop's few collectives: no-ops in one process); `teardown` leaves it, always. Ranks share
bytes in uint8 tensors, never pickles: JSON, or a digest-checked weights-only checkpoint (docs/faults.md)."""

import gc
import json
import os
import threading
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, TypeVar

import torch
import torch.distributed as dist

from ..common import errors, untrusted
from ..common.errors import UserError
from ..joining import membership, rendezvous
from ..joining.admission import Admission
from ..joining.heartbeat import Heartbeat
from ..joining.identity import Identity
from ..joining.membership import Credentials

T = TypeVar("T")
LEAVE_S = 2.0  # after an error, how long closing the process group may take before the rank leaves it open
MAX_SHARED = 64 * 2**20  # bytes: what one rank may send the others (a checkpoint is ~0.4 MB)


class PeerFailure(UserError):
    """Another process of the job died or stopped answering; not bad input, so exit code 1."""

    exit_code = 1


def join(ident: Identity, device: torch.device, backend: str | None, timeout_s: float, heartbeat_s: float = 0,
         creds: Credentials | None = None) -> "Dist":
    """Join the job's process group, once per rank, and return this process's `Dist` on `device` (one process: no
    group). Where this differs from the textbook's join (`init_method="env://"`, torch's defaults): the backend named
    (nccl for CUDA, gloo otherwise); `timeout_s` (--timeout, 180 s; torch's default is 30 minutes for gloo, 10 for
    nccl); gloo's and NCCL's socket set to the interface that reaches the master, unless the user set it; the store
    opened first (under -g hosted by node 0's launcher, not by rank 0) for the check-in and a heartbeat every
    `heartbeat_s` (--heartbeat, 1 s). Any failure is one sentence that says who or what was missing (`Admission`)."""
    if device.type == "cuda":
        torch.cuda.set_device(device)
    if ident.world_size == 1:
        return Dist(0, ident.local_rank, 1, ident.local_world_size, device, ident.run_id)
    if device.type == "mps":
        raise UserError("MPS has no collective backend; run several processes on --device cpu instead.")
    backend = backend or ("nccl" if device.type == "cuda" else "gloo")
    timeout = timedelta(seconds=timeout_s)
    os.environ.update(rendezvous.socket_interfaces(ident, os.environ))  # gloo and NCCL where the ranks are
    if backend == "nccl":
        os.environ.update(nccl_error_handling(os.environ))  # read when the process group is made
    # Every rank meets at the master's address and port: --master-addr/--master-port, else MASTER_ADDR/MASTER_PORT,
    # else the launcher's rendezvous (identity.py). With init_method="env://" init_process_group would open the
    # TCPStore there itself; here it is opened first, so that each rank proves it is one of the job's
    # (membership.py) and starts its heartbeat before the group forms, then handed over.
    with Admission(ident, device, timeout) as admission:
        # The TCPStore at the master's address and port; under -g its host is the launcher (`launch.spawn`'s
        # `rendezvous.host_store`) and every rank a client; under torchrun its agent's, under srun/mpirun rank 0's.
        store = rendezvous.joined_store(ident, timeout)
        # trust, heartbeat: skippable. Returns ident's rank and world and this store, unchanged but for a --recover
        # replacement, which is given its place in the running job
        rank, world, store = admission.admit(store, creds or Credentials(), heartbeat_s)
        # nccl: device_id makes the communicator now, on this rank's GPU.
        dist.init_process_group(backend, store=store, rank=rank, world_size=world, timeout=timeout,
                                device_id=device if backend == "nccl" else None)
    return Dist(rank, ident.local_rank, world, ident.local_world_size, device, ident.run_id, admission.beat,
                admission.entry)


def teardown(together: bool, leave_s: float = LEAVE_S) -> bool:
    """Leave the process group: `destroy_process_group`, called once from `worker.run_worker`'s `finally` (and by
    recovery.py before it re-forms), so also after an error. `together` (after success): every rank waits for the
    others first. After an error a dead peer may hold the group's threads: closing gets `leave_s`, and False means it
    is still closing, so the caller ends the process with os._exit (docs/design/rendezvous.md, "Leaving")."""
    if not (dist.is_available() and dist.is_initialized()):
        return True
    if together:  # no rank closes its connections while a peer still finishes (rank 0's last save): under gloo
        # that made a peer's threads abort now and then. On nccl the barrier runs on the GPU join bound the group to.
        dist.barrier()
    gc.collect()  # the DDP wrapper, in reference cycles, holds the group: gone now, not while the interpreter exits
    if together:
        dist.destroy_process_group()
        return True
    closing = threading.Thread(target=dist.destroy_process_group, name="leave-group", daemon=True)
    closing.start()
    closing.join(leave_s)
    return not closing.is_alive()


# What gloo and NCCL say when the other end of a collective died, or did not answer within --timeout.
_PEER_GONE = ("gloo/transport", "Connection closed by peer", "Connection reset by peer", "ncclRemoteError",
              "remote process exited", "NCCL communicator was aborted", "Watchdog caught collective operation timeout")


def is_peer_failure(e: BaseException) -> bool:
    """Whether `e` is a collective failing because a peer died or stopped answering — not a bug, and not a
    configuration error (a bad NCCL setting must not be reported as a dead peer)."""
    return isinstance(e, dist.DistNetworkError | dist.DistStoreError) or any(m in str(e) for m in _PEER_GONE)


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
    entry: membership.Entry | None = None  # its admission: rank 0 admits replacements with its nonce (recovery.py)

    def set_phase(self, phase: str, epoch: int = 0, step: int = 0) -> None:
        """Say what this rank is doing, for a peer's timeout message to name (heartbeat.py); no I/O."""
        if self.heartbeat is not None:
            self.heartbeat.set_phase(phase, epoch, step)

    @property
    def is_main(self) -> bool:
        """Rank 0 alone prints, writes metrics and saves checkpoints."""
        return self.rank == 0

    def all_sum(self, tensor: torch.Tensor) -> torch.Tensor:
        """Sum `tensor` over all ranks, in place, and return it."""
        if self.world_size > 1:
            dist.all_reduce(tensor, op=dist.ReduceOp.SUM)
        return tensor

    def all_gather(self, tensor: torch.Tensor) -> list[torch.Tensor]:
        """Every rank's `tensor` (shaped alike on each), in rank order."""
        if self.world_size == 1:
            return [tensor]
        every = [torch.empty_like(tensor) for _ in range(self.world_size)]
        dist.all_gather(every, tensor)
        return every

    def barrier(self) -> None:
        """Wait until every rank is here."""
        if self.world_size > 1:
            dist.barrier()

    def raise_if_aborted(self) -> None:
        """Raise, as the next collective would, when NCCL's watchdog has aborted the communicator; rank 0 asks
        before it saves, so no checkpoint holds numbers from after an abort (docs/design/nccl-errors.md)."""
        if self.world_size == 1 or dist.get_backend() != "nccl":
            return
        assert dist.group.WORLD is not None  # a world of several ranks has its group
        get_error = getattr(dist.group.WORLD._get_backend(self.device), "get_error", None)
        error = get_error() if get_error else None
        if error is not None and error.name != "SUCCESS":
            raise dist.DistBackendError(f"NCCL communicator was aborted ({error.name}): a collective timed out or "
                                        f"lost a peer")

    def from_main(self, fn: Callable[[], T], encode: Callable[[T], bytes] = lambda v: json.dumps(v).encode(),
                  decode: Callable[[bytes], T] = untrusted.parse) -> T:
        """`fn()`, run on rank 0 alone, and its result on every rank (`encode`d, JSON unless told; sent as bytes;
        `decode`d). A UserError there is raised on every rank, so the job stops at once, not at --timeout."""
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


def pick_device(name: str, local_rank: int, local_world_size: int, env: Mapping[str, str] = os.environ, *,
                share: bool = False) -> torch.device:
    """`auto` is cuda, else mps, else cpu; each local process gets its own GPU (`gpu_index`; `share`: processes
    may share one, --backend gloo).

    A CUDA device always carries its index: `torch.cuda.set_device` and NCCL need to know which GPU."""
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "mps" if torch.backends.mps.is_available() else "cpu"
    if name == "cuda":
        if not torch.cuda.is_available():
            raise UserError("--device cuda was asked for, but PyTorch sees no CUDA GPU here.")
        return torch.device("cuda", gpu_index(local_rank, local_world_size, torch.cuda.device_count(), env, share))
    if name == "mps" and not torch.backends.mps.is_available():
        raise UserError("--device mps was asked for, but this PyTorch has no MPS support here.")
    return torch.device(name)


# Set where someone chose which GPUs each process sees: srun --gpus-per-task sets both, a wrapper script that
# gives each rank its own GPU sets CUDA_VISIBLE_DEVICES.
GPU_CHOSEN_BY = ("CUDA_VISIBLE_DEVICES", "SLURM_GPUS_PER_TASK")


def gpu_index(local_rank: int, local_world_size: int, visible: int, env: Mapping[str, str],
              share: bool = False) -> int:
    """Which of the `visible` GPUs local process `local_rank` (of `local_world_size` here) takes: its own by local
    rank; cuda:0 when there are fewer and the launcher chose each process's (`GPU_CHOSEN_BY`, taken at its word:
    `join` names a duplicate); with `share` (gloo, which NCCL's one-process-per-GPU rule does not bind), in turn;
    else refused, as NCCL would stop the job (docs/design/nccl-errors.md)."""
    processes = max(local_world_size, local_rank + 1)
    if processes <= visible:
        return local_rank
    if any(env.get(name) for name in GPU_CHOSEN_BY):
        return 0
    if share:
        return local_rank % visible
    shared = "so they would all use cuda:0, which NCCL refuses" if visible == 1 else "too few for one each"
    raise UserError(f"{processes} processes run on this machine but this one sees {visible} GPU"
                    f"{'s' if visible > 1 else ''} ({shared}); start at most {visible} per machine "
                    f"(torchrun --nproc-per-node {visible}), or give each process its own GPU (srun --gpus-per-task 1, "
                    f"or CUDA_VISIBLE_DEVICES set per process), or let them share over --backend gloo.")


def sharing(device: torch.device, local_world_size: int, env: Mapping[str, str] = os.environ) -> str:
    """The line that says this machine's processes share its GPUs (`gpu_index`'s `share`; '' where each has its own)."""
    visible = torch.cuda.device_count() if device.type == "cuda" else 0
    if local_world_size <= visible or not visible or any(env.get(name) for name in GPU_CHOSEN_BY):
        return ""
    return (f"gpu: {local_world_size} processes share {visible} GPU{'s' if visible > 1 else ''} over gloo, whose "
            f"all-reduce goes through host memory: right to learn DDP on, not to measure its speed")


def nccl_error_handling(env: Mapping[str, str]) -> dict[str, str]:
    """TORCH_NCCL_ASYNC_ERROR_HANDLING=2, so an NCCL failure raises in Python instead of a SIGABRT, unless the
    user chose how NCCL errors are handled (docs/design/nccl-errors.md)."""
    chosen = ("TORCH_NCCL_ASYNC_ERROR_HANDLING", "NCCL_ASYNC_ERROR_HANDLING", "TORCH_NCCL_BLOCKING_WAIT",
              "NCCL_BLOCKING_WAIT")
    return {} if any(name in env for name in chosen) else {"TORCH_NCCL_ASYNC_ERROR_HANDLING": "2"}
