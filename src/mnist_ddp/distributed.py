"""Who this process is in the job, and the process group that joins it to the others.

The whole DDP set-up lives here. A process learns its place from one of three
launchers — our own `torch.multiprocessing.spawn` (the tutorial's -n/-g/-nr), torchrun
(RANK/LOCAL_RANK/WORLD_SIZE…), or SLURM's srun (SLURM_PROCID/SLURM_NTASKS…) — and
every one of them ends in the same `Dist`, so the training loop has a single code
path. With one process there is no process group at all and the collectives below
are no-ops.
"""

import re
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, Literal

import torch
import torch.distributed as dist

from . import compute
from .errors import UserError

Rendezvous = Literal["none", "env", "tcp", "store"]


@dataclass(frozen=True)
class Identity:
    """A process's place in the job, and how it meets the others.

    `rendezvous`: "none" (one process), "env" (torchrun set MASTER_ADDR/PORT and
    runs the store), "tcp" (rank 0 opens the store at addr:port — SLURM), or
    "store" (the spawning parent already holds the store at addr:port).
    """

    rank: int = 0
    local_rank: int = 0
    world_size: int = 1
    local_world_size: int = 1
    rendezvous: Rendezvous = "none"
    master_addr: str = "127.0.0.1"
    master_port: int = 0
    launcher: str = "single process"


def _int(env: Mapping[str, str], key: str) -> int:
    try:
        return int(env[key])
    except ValueError:
        raise UserError(f"environment variable {key}={env[key]!r} is not an integer.") from None


def first_host(nodelist: str) -> str:
    """The first host of a SLURM node list: 'gpu[03-05,9],cpu1' -> 'gpu03'."""
    m = re.match(r"([^,\[]+)(?:\[([^\]]+)\])?", nodelist.strip())
    if not m:
        raise UserError(f"SLURM_NODELIST={nodelist!r} is not a node list this program understands.")
    prefix, ranges = m.groups()
    return prefix + ranges.split(",")[0].split("-")[0] if ranges else prefix


def identity_from_env(env: Mapping[str, str]) -> Identity | None:
    """The identity torchrun or SLURM gave this process, or None if neither launched it."""
    if "RANK" in env and "WORLD_SIZE" in env:  # torchrun (also a hand-made env:// launch)
        world = _int(env, "WORLD_SIZE")
        return Identity(
            rank=_int(env, "RANK"),
            local_rank=_int(env, "LOCAL_RANK") if "LOCAL_RANK" in env else 0,
            world_size=world,
            local_world_size=_int(env, "LOCAL_WORLD_SIZE") if "LOCAL_WORLD_SIZE" in env else 1,
            rendezvous="env" if world > 1 else "none",
            master_addr=env.get("MASTER_ADDR", "127.0.0.1"),
            master_port=_int(env, "MASTER_PORT") if "MASTER_PORT" in env else 0,
            launcher="torchrun",
        )
    if "SLURM_PROCID" in env and "SLURM_NTASKS" in env:
        world = _int(env, "SLURM_NTASKS")
        tasks_per_node = re.match(r"\d+", env.get("SLURM_TASKS_PER_NODE", "1"))
        if "MASTER_PORT" in env:
            port = _int(env, "MASTER_PORT")
        else:  # the same on every node of the job, and unlikely to collide with a neighbour job
            port = 20000 + _int(env, "SLURM_JOB_ID") % 20000 if "SLURM_JOB_ID" in env else 29500
        return Identity(
            rank=_int(env, "SLURM_PROCID"),
            local_rank=_int(env, "SLURM_LOCALID") if "SLURM_LOCALID" in env else 0,
            world_size=world,
            local_world_size=int(tasks_per_node.group()) if tasks_per_node else 1,
            rendezvous="tcp" if world > 1 else "none",
            master_addr=env.get("MASTER_ADDR") or first_host(env.get("SLURM_NODELIST", "127.0.0.1")),
            master_port=port,
            launcher="SLURM",
        )
    return None


def pick_device(name: str, local_rank: int) -> torch.device:
    """`auto` is cuda, else mps, else cpu; each local process gets its own GPU."""
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "mps" if torch.backends.mps.is_available() else "cpu"
    if name == "cuda":
        if not torch.cuda.is_available():
            raise UserError("--device cuda was asked for, but PyTorch sees no CUDA GPU here.")
        return torch.device("cuda", local_rank)
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

    @property
    def is_main(self) -> bool:
        """Rank 0 alone prints, writes metrics and saves checkpoints."""
        return self.rank == 0

    def all_sum(self, tensor: torch.Tensor) -> torch.Tensor:
        """Sum `tensor` over all ranks, in place, and return it."""
        if self.world_size > 1:
            dist.all_reduce(tensor, op=dist.ReduceOp.SUM)
        return tensor

    def broadcast(self, obj: Any) -> Any:
        """Rank 0's `obj` on every rank (used for small things: a checkpoint, an error)."""
        if self.world_size == 1:
            return obj
        box = [obj]
        dist.broadcast_object_list(box, src=0, device=self.device if self.device.type == "cuda" else None)
        return box[0]


def setup(ident: Identity, device: str, backend: str | None, timeout_s: float) -> Dist:
    """Pick this process's device and join the process group (not needed for one process)."""
    dev = pick_device(device, ident.local_rank)
    if dev.type == "cpu":  # local processes share the cores rather than oversubscribe them
        compute.share_cores(ident.local_rank, ident.local_world_size)
    if dev.type == "cuda":
        torch.cuda.set_device(dev)
    if ident.world_size > 1:
        if dev.type == "mps":
            raise UserError("MPS has no collective backend; run several processes on --device cpu instead.")
        _join(ident, backend or ("nccl" if dev.type == "cuda" else "gloo"), timedelta(seconds=timeout_s))
    return Dist(ident.rank, ident.local_rank, ident.world_size, ident.local_world_size, dev)


def _join(ident: Identity, backend: str, timeout: timedelta) -> None:
    kwargs: dict[str, Any] = {"backend": backend, "rank": ident.rank, "world_size": ident.world_size,
                              "timeout": timeout}
    where = f"{ident.master_addr}:{ident.master_port}"
    try:
        if ident.rendezvous == "store":
            kwargs["store"] = dist.TCPStore(ident.master_addr, ident.master_port, ident.world_size,
                                            is_master=False, timeout=timeout)
        elif ident.rendezvous == "tcp":
            host = f"[{ident.master_addr}]" if ":" in ident.master_addr else ident.master_addr
            kwargs["init_method"] = f"tcp://{host}:{ident.master_port}"
        dist.init_process_group(**kwargs)
    except (RuntimeError, ValueError, OSError) as e:  # DistStoreError and DistNetworkError are RuntimeErrors
        raise UserError(
            f"rank {ident.rank} could not join the other {ident.world_size - 1} processes at {where} "
            f"within {timeout.total_seconds():.0f} s ({str(e).splitlines()[0]}); check that every node "
            f"was started with the same --master-addr/--master-port and world size."
        ) from e


def teardown() -> None:
    """Leave the process group; called from a `finally`, so also after an error."""
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()
