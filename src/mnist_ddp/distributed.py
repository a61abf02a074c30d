"""Who this process is in the job, and the process group that joins it to the others.

The whole DDP set-up lives here. A process learns its place from one of three
launchers — our own `torch.multiprocessing.spawn` (the tutorial's -n/-g/-nr), torchrun
(RANK/LOCAL_RANK/WORLD_SIZE…), or SLURM's srun (SLURM_PROCID/SLURM_NTASKS…) — and
every one of them ends in the same `Dist`, so the training loop has a single code
path. With one process there is no process group at all and the collectives below
are no-ops.
"""

import ipaddress
import os
import re
import socket
import struct
import sys
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, Literal, TypeVar

import torch
import torch.distributed as dist

from . import compute
from .errors import UserError

Rendezvous = Literal["none", "env", "agent", "tcp", "store"]
T = TypeVar("T")
WORLD_KEY = "mnist_ddp/world_size"  # the store's host writes the world size here; every joiner compares


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


def host_store(addr: str, port: int, world_size: int, timeout: timedelta) -> dist.TCPStore:
    """Open the job's rendezvous store on node 0 (port 0: any free port). Listening fails at once when the
    port is taken, the clearest moment to say so; the world size is left in it for every joiner to check."""
    try:
        store = dist.TCPStore(addr, port, world_size, is_master=True, timeout=timeout, wait_for_workers=False)
    except (RuntimeError, OSError) as e:
        if "EADDRINUSE" in str(e):
            raise UserError(f"port {port} is already in use on this machine (another job or program listens "
                            f"there); choose another --master-port (or MASTER_PORT).") from e
        raise UserError(f"cannot listen on port {port} of {addr} for the other processes ({gist(e)}); "
                        f"choose another --master-port (or MASTER_PORT).") from e
    store.set(WORLD_KEY, str(world_size))
    return store


def _wait_for_listener(ident: Identity, timeout: timedelta) -> None:
    """Wait until node 0's store accepts connections. Polling here, not inside TCPStore (whose client
    retries past its own timeout, logging C++ traces), keeps the wait within --timeout and names the cause."""
    addr, port, deadline = ident.master_addr, ident.master_port, time.monotonic() + timeout.total_seconds()
    while True:
        try:
            with socket.create_connection((addr, port), timeout=max(0.1, min(2.0, deadline - time.monotonic()))):
                return
        except socket.gaierror as e:
            raise UserError(f"the master address {addr!r} is not a host name this machine can resolve ({e}).") \
                from None
        except OSError:
            if time.monotonic() >= deadline:
                raise UserError(
                    f"rank {ident.rank} found nobody listening at {addr}:{port} within {timeout.total_seconds():g} s "
                    f"(--timeout); start node 0 (the one with rank 0) as well, and give every node the same "
                    f"--master-addr and --master-port."
                ) from None
            time.sleep(0.2)


def _joined_store(ident: Identity, timeout: timedelta) -> dist.Store:
    """The rendezvous store, as its host (rank 0 under SLURM) or as a client of node 0's (or torchrun's)."""
    if ident.rendezvous == "agent":
        # torchrun's agent keeps one store for all restarts, so a restarted worker would read the
        # addresses its dead predecessors left there and fail to connect (pytorch/pytorch#135712):
        # each attempt gets a namespace of its own.
        store = dist.TCPStore(ident.master_addr, ident.master_port, ident.world_size, is_master=False, timeout=timeout)
        return dist.PrefixStore(f"mnist_ddp/attempt_{ident.attempt}", store)
    if ident.rendezvous == "tcp" and ident.rank == 0:
        return host_store(ident.master_addr, ident.master_port, ident.world_size, timeout)
    _wait_for_listener(ident, timeout)
    store = dist.TCPStore(ident.master_addr, ident.master_port, ident.world_size, is_master=False, timeout=timeout)
    expected = int(store.get(WORLD_KEY))
    if expected != ident.world_size:
        raise UserError(f"node 0 started a job of {expected} processes, but this one was told the job has "
                        f"{ident.world_size}; give every node the same -n and -g (or the same number of tasks).")
    return store


def gloo_interface(addr: str) -> str | None:
    """The network interface (e.g. 'eth0') this machine reaches `addr` through; None for loopback or unknown.

    Left alone, gloo listens on the address the hostname resolves to, and on many machines (Debian's
    127.0.1.1, containers, network namespaces) that is a loopback address that other nodes cannot reach.
    """
    if sys.platform != "linux":
        return None
    import fcntl  # POSIX only

    siocgifaddr = 0x8915  # Linux ioctl: the IPv4 address of an interface
    try:
        ip = socket.getaddrinfo(addr, None, socket.AF_INET)[0][4][0]
        if ipaddress.ip_address(ip).is_loopback:
            return None
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            s.connect((ip, 9))  # a UDP connect sends nothing: the kernel only picks the route and our address
            local = s.getsockname()[0]
            for _, name in socket.if_nameindex():
                try:
                    answer = fcntl.ioctl(s.fileno(), siocgifaddr, struct.pack("256s", name.encode()[:15]))
                except OSError:  # an interface without an IPv4 address
                    continue
                if socket.inet_ntoa(answer[20:24]) == local:
                    return name
    except OSError:
        pass
    return None


def _join(ident: Identity, backend: str, timeout: timedelta) -> None:
    kwargs: dict[str, Any] = {"backend": backend, "rank": ident.rank, "world_size": ident.world_size,
                              "timeout": timeout}
    if backend == "gloo" and "GLOO_SOCKET_IFNAME" not in os.environ:
        interface = gloo_interface(ident.master_addr)
        if interface:
            os.environ["GLOO_SOCKET_IFNAME"] = interface
    try:
        if ident.rendezvous != "env":
            kwargs["store"] = _joined_store(ident, timeout)
        elif ident.rank > 0:  # env:// makes rank 0 the store's host; the others connect to it
            _wait_for_listener(ident, timeout)
        dist.init_process_group(**kwargs)
    except (RuntimeError, ValueError, OSError) as e:  # DistStoreError and DistNetworkError are RuntimeErrors
        others = ident.world_size - 1
        raise UserError(
            f"rank {ident.rank} could not join the {others} other process{'es' if others > 1 else ''} at "
            f"{ident.master_addr}:{ident.master_port} within {timeout.total_seconds():g} s ({gist(e)}); check that "
            f"every node was started with the same --master-addr/--master-port and world size, and that they can "
            f"reach each other (GLOO_SOCKET_IFNAME names the network interface gloo should use)."
        ) from e


def is_peer_failure(e: BaseException) -> bool:
    """Whether `e` is a collective failing because a peer died or stopped answering, rather than a bug."""
    text = str(e)
    return isinstance(e, dist.DistError) or any(
        mark in text for mark in ("gloo/transport", "Connection closed by peer", "Connection reset by peer", "NCCL"))


def gist(e: BaseException) -> str:
    """The gist of a c10d/gloo error: its first sentence, without the C++ source location."""
    lines = [line for line in str(e).splitlines() if line.strip()]
    first = re.sub(r"^\[[^\]]*\]\s*", "", lines[0].strip()).split(". ")[0] if lines else type(e).__name__
    return first if len(first) <= 200 else first[:197] + "..."


def teardown(together: bool = False) -> None:
    """Leave the process group; called from a `finally`, so also after an error.

    `together` (the normal end): first wait for every rank, so that none closes its connections while
    another is still finishing (rank 0 writes the last checkpoint); a rank that left early made its
    peers' gloo threads abort now and then ("terminate called without an active exception").
    """
    if dist.is_available() and dist.is_initialized():
        if together:
            dist.barrier()
        dist.destroy_process_group()
