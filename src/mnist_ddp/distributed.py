"""Who this process is in the job, and the process group that joins it to the others.

The whole DDP set-up lives here. A process learns its place from one of three
launchers — our own `torch.multiprocessing.spawn` (the tutorial's -n/-g/-nr), torchrun
(RANK/LOCAL_RANK/WORLD_SIZE…), or SLURM's srun (SLURM_PROCID/SLURM_NTASKS…) — and
every one of them ends in the same `Dist`, so the training loop has a single code
path. With one process there is no process group at all and the collectives below
are no-ops.
"""

import gc
import os
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, Literal, TypeVar

import torch
import torch.distributed as dist

from . import compute, rendezvous
from .errors import UserError

Rendezvous = Literal["none", "env", "agent", "tcp", "store"]
T = TypeVar("T")


class PeerFailure(UserError):
    """Another process of the job died or stopped answering; not bad input, so exit code 1."""

    exit_code = 1


@dataclass(frozen=True)
class Identity:
    """A process's place in the job, and how it meets the others.

    `rendezvous`: "none" (one process), "env" (MASTER_ADDR/PORT: rank 0 opens the store
    there — a hand-made launch, or torchrun without a shared store), "agent" (torchrun's
    agent holds the store there, across restarts; `attempt` counts them), "tcp" (rank 0
    opens the store at addr:port — SLURM), or "store" (the spawning parent holds it).
    """

    rank: int = 0
    local_rank: int = 0
    world_size: int = 1
    local_world_size: int = 1
    rendezvous: Rendezvous = "none"
    master_addr: str = "127.0.0.1"
    master_port: int = 0
    launcher: str = "single process"
    attempt: int = 0


def _int(env: Mapping[str, str], key: str) -> int:
    try:
        return int(env[key])
    except ValueError:
        raise UserError(f"environment variable {key}={env[key]!r} is not an integer.") from None


def first_host(nodelist: str) -> str:
    """The first host of a SLURM node list: 'gpu[03-05,9],cpu1' -> 'gpu03', 'r[1-2]-n[07-09]' -> 'r1-n07'."""
    entry = re.match(r"(?:[^,\[\]]|\[[^\[\]]+\])+(?=,|$)", nodelist.strip())  # up to a comma outside brackets
    if not entry:
        raise UserError(f"SLURM_NODELIST={nodelist!r} is not a node list this program understands.")
    return re.sub(r"\[([^\],-]*)[^\]]*\]", r"\1", entry.group())


def tasks_on_node(tasks_per_node: str, node: int) -> int | None:
    """Entry `node` of SLURM_TASKS_PER_NODE ('4(x2),3' -> 4, 4, 3), or None if it has no such entry."""
    counts = []
    for count, repeat in re.findall(r"(\d+)(?:\(x(\d+)\))?", tasks_per_node):
        counts += [int(count)] * int(repeat or 1)
    return counts[node] if 0 <= node < len(counts) else None


def _place(rank: int, world: int, local_rank: int, local_world: int | None, names: tuple[str, str, str]) -> int:
    """Check that a launcher's numbers describe a real seat in the job (else every process would wait for
    one that cannot exist); returns the number of processes on this node (1 if the launcher did not say)."""
    rank_key, world_key, local_key = names
    if world < 1:
        raise UserError(f"{world_key}={world}: a job needs at least one process.")
    if not 0 <= rank < world:
        raise UserError(f"{rank_key}={rank} does not fit {world_key}={world}: ranks run from 0 to {world - 1}.")
    if local_rank < 0 or (local_world is not None and local_rank >= local_world):
        raise UserError(f"{local_key}={local_rank} does not fit the {local_world} process(es) on this node.")
    return local_world or 1


def identity_from_env(env: Mapping[str, str]) -> Identity | None:
    """The identity torchrun or SLURM gave this process, or None if neither launched it.

    torchrun's variables win: under `srun torchrun …` both sets are present, and torchrun's describe the
    processes it started.
    """
    if "RANK" in env and "WORLD_SIZE" in env:  # torchrun (also a hand-made env:// launch)
        rank, world = _int(env, "RANK"), _int(env, "WORLD_SIZE")
        local_rank = _int(env, "LOCAL_RANK") if "LOCAL_RANK" in env else 0
        local_world = _place(rank, world, local_rank,
                             _int(env, "LOCAL_WORLD_SIZE") if "LOCAL_WORLD_SIZE" in env else None,
                             ("RANK", "WORLD_SIZE", "LOCAL_RANK"))
        agent = env.get("TORCHELASTIC_USE_AGENT_STORE") == "True"
        return Identity(rank, local_rank, world, local_world,
                        rendezvous="none" if world == 1 else "agent" if agent else "env",
                        master_addr=env.get("MASTER_ADDR", "127.0.0.1"),
                        master_port=_int(env, "MASTER_PORT") if "MASTER_PORT" in env else 0, launcher="torchrun",
                        attempt=_int(env, "TORCHELASTIC_RESTART_COUNT") if "TORCHELASTIC_RESTART_COUNT" in env else 0)
    if "SLURM_PROCID" in env and "SLURM_NTASKS" in env:
        rank, world = _int(env, "SLURM_PROCID"), _int(env, "SLURM_NTASKS")
        local_rank = _int(env, "SLURM_LOCALID") if "SLURM_LOCALID" in env else 0
        node = _int(env, "SLURM_NODEID") if "SLURM_NODEID" in env else 0
        local_world = _place(rank, world, local_rank, tasks_on_node(env.get("SLURM_TASKS_PER_NODE", ""), node),
                             ("SLURM_PROCID", "SLURM_NTASKS", "SLURM_LOCALID"))
        if "MASTER_PORT" in env:
            port = _int(env, "MASTER_PORT")
        else:  # the same on every node of the job, and unlikely to collide with a neighbour job
            port = 20000 + _int(env, "SLURM_JOB_ID") % 20000 if "SLURM_JOB_ID" in env else 29500
        nodes = env.get("SLURM_STEP_NODELIST") or env.get("SLURM_NODELIST") or env.get("SLURM_JOB_NODELIST")
        return Identity(rank, local_rank, world, local_world, rendezvous="tcp" if world > 1 else "none",
                        master_addr=env.get("MASTER_ADDR") or (first_host(nodes) if nodes else "127.0.0.1"),
                        master_port=port, launcher="SLURM")
    return None


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

    def from_main(self, fn: Callable[[], T]) -> T:
        """`fn()`, run on rank 0 alone, and its result on every rank. A UserError there is raised on every
        rank, so bad input only rank 0 can see (an unreadable checkpoint, an unusable --out) stops the whole
        job at once, instead of leaving the other ranks waiting for rank 0 until --timeout."""
        if self.world_size == 1:
            return fn()
        result, error = None, None
        if self.is_main:
            try:
                result = fn()
            except UserError as e:
                error = str(e)
        result, error = self.broadcast((result, error))
        if error is not None:
            raise UserError(error)
        return result


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
    if backend == "gloo" and "GLOO_SOCKET_IFNAME" not in os.environ:
        interface = rendezvous.gloo_interface(ident.master_addr)
        if interface:
            os.environ["GLOO_SOCKET_IFNAME"] = interface
    try:
        if ident.rendezvous != "env":
            kwargs["store"] = rendezvous.joined_store(ident, timeout)
        elif ident.rank > 0:  # env:// makes rank 0 the store's host; the others connect to it
            rendezvous.wait_for_listener(ident, timeout)
        dist.init_process_group(**kwargs)
    except (RuntimeError, ValueError, OSError) as e:  # DistStoreError and DistNetworkError are RuntimeErrors
        others = ident.world_size - 1
        raise UserError(
            f"rank {ident.rank} could not join the {others} other process{'es' if others > 1 else ''} at "
            f"{ident.master_addr}:{ident.master_port} within {timeout.total_seconds():g} s "
            f"({rendezvous.gist(e)}); check that every node was started with the same --master-addr/--master-port "
            f"and world size, and that they can reach each other (GLOO_SOCKET_IFNAME names the network interface "
            f"gloo should use)."
        ) from e


def is_peer_failure(e: BaseException) -> bool:
    """Whether `e` is a collective failing because a peer died or stopped answering, rather than a bug."""
    text = str(e)
    return isinstance(e, dist.DistError) or any(
        mark in text for mark in ("gloo/transport", "Connection closed by peer", "Connection reset by peer", "NCCL"))


def teardown(together: bool = False) -> None:
    """Leave the process group; called from a `finally`, so also after an error.

    `together` (the normal end): first wait for every rank, so that none closes its connections while
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
