"""Who am I in the job: the same `Identity` (rank, world size, where to meet) from our spawn, torchrun, an MPI
launcher or SLURM, checked to describe a real seat. Plain Python, no torch (docs/design/identity.md)."""

import os
import re
import zlib
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from ..common.errors import UserError

# Who opens the rendezvous store that every process of the job first connects to:
#   "none"   one process alone: no store, no process group;
#   "parent" node 0's spawning parent (our -n/-g/-nr launcher), before it starts its children;
#   "agent"  torchrun's agent, which keeps one store across restarts (`attempt` counts them);
#   "rank0"  rank 0 itself, at MASTER_ADDR:MASTER_PORT (srun, mpirun, or a hand-made RANK/WORLD_SIZE launch).
StoreHost = Literal["none", "parent", "agent", "rank0"]

# The environment variables through which a launcher hands a process its place. A child we start
# ourselves (bench, tests) must not inherit them, or it would believe it is part of our job.
LAUNCHER_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT",
                 "MPI_LOCALRANKID", "MPI_LOCALNRANKS")
LAUNCHER_PREFIXES = ("SLURM_", "TORCHELASTIC_", "OMPI_", "PMIX_", "PMI_", "MV2_")


@dataclass(frozen=True)
class MpiVars:
    """The variables through which one MPI launcher tells each process it starts its place."""

    launcher: str
    rank: str
    world: str
    local_rank: str
    local_world: str


# Tried in this order; a launcher counts when all four of its variables are set. srun sets some of them too
# (PMI_RANK/PMI_SIZE with --mpi=pmi2, PMIX_RANK with --mpi=pmix) but never all four: then SLURM's are read.
MPI_LAUNCHERS = (
    MpiVars("Open MPI", "OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_LOCAL_RANK",
            "OMPI_COMM_WORLD_LOCAL_SIZE"),
    MpiVars("MVAPICH", "MV2_COMM_WORLD_RANK", "MV2_COMM_WORLD_SIZE", "MV2_COMM_WORLD_LOCAL_RANK",
            "MV2_COMM_WORLD_LOCAL_SIZE"),
    MpiVars("MPICH", "PMI_RANK", "PMI_SIZE", "MPI_LOCALRANKID", "MPI_LOCALNRANKS"),  # and Intel MPI: both Hydra
)
# The same on every node of one mpirun: Open MPI's job id (4.x) or PMIx namespace (5.x). Hydra has none.
MPI_JOB_IDS = ("OMPI_MCA_ess_base_jobid", "PMIX_NAMESPACE")
DEFAULT_PORT = 29500  # torch's own default, where nothing better is known


def without_launcher_vars(env: Mapping[str, str]) -> dict[str, str]:
    """`env` less every variable that would make a child process think a launcher started it."""
    return {k: v for k, v in env.items() if k not in LAUNCHER_VARS and not k.startswith(LAUNCHER_PREFIXES)}


@dataclass(frozen=True)
class Identity:
    """A process's place in the job, and where it meets the others."""

    rank: int = 0
    local_rank: int = 0
    world_size: int = 1
    local_world_size: int = 1
    store_host: StoreHost = "none"
    master_addr: str = "127.0.0.1"
    master_port: int = 0
    launcher: str = "single process"
    attempt: int = 0  # torchrun's restart count: each attempt meets in a namespace of its own
    run_id: str = ""  # torchrun's job id: --rdzv-id, or a fresh uuid per torchrun under --standalone
    standby: tuple[str, int] | None = None  # where this node's launcher holds a standby store (successor.py)

    @property
    def one_node(self) -> bool:
        """Whether every rank runs on this machine: then the job listens on loopback only (rendezvous.py)."""
        return self.local_world_size == self.world_size


MOST = 1 << 20  # the largest rank, world size or restart count a launcher may hand us: far past any cluster


def env_number(env: Mapping[str, str], key: str) -> int | None:
    """`env[key]` as an integer from 0 to `MOST` (a port: to 65535), None when absent; any other value is the user's
    to fix."""
    if key not in env:
        return None
    most = 65535 if key.endswith("_PORT") else 2**32 if key.endswith("JOB_ID") else MOST
    value = env[key].strip()
    if not (value.isascii() and value.isdigit() and len(value) <= 12 and int(value) <= most):
        raise UserError(f"environment variable {key}={env[key][:40]!r} is not a whole number from 0 to {most:,}.")
    return int(value)


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
    if local_world is not None and local_rank >= local_world:
        raise UserError(f"{local_key}={local_rank} does not fit the {local_world} process(es) on this node.")
    return local_world or 1


def _from_torchrun(env: Mapping[str, str]) -> Identity:
    """torchrun's variables (also those of a hand-made RANK/WORLD_SIZE launch)."""
    rank, world = env_number(env, "RANK") or 0, env_number(env, "WORLD_SIZE") or 0
    local_rank = env_number(env, "LOCAL_RANK") or 0
    local_world = _place(rank, world, local_rank, env_number(env, "LOCAL_WORLD_SIZE"),
                         ("RANK", "WORLD_SIZE", "LOCAL_RANK"))
    if world == 1:
        store_host: StoreHost = "none"
    elif env.get("TORCHELASTIC_USE_AGENT_STORE") == "True":
        store_host = "agent"
    else:
        store_host = "rank0"
    return Identity(rank, local_rank, world, local_world, store_host,
                    master_addr=env.get("MASTER_ADDR", "127.0.0.1"), master_port=env_number(env, "MASTER_PORT") or 0,
                    launcher="torchrun", attempt=env_number(env, "TORCHELASTIC_RESTART_COUNT") or 0,
                    run_id=env.get("TORCHELASTIC_RUN_ID", ""))


def _from_slurm(env: Mapping[str, str]) -> Identity:
    """srun's variables: the master is the step's first node (127.0.0.1 when the step has one node), the port
    derived from the job id."""
    rank, world = env_number(env, "SLURM_PROCID") or 0, env_number(env, "SLURM_NTASKS") or 0
    local_rank = env_number(env, "SLURM_LOCALID") or 0
    here = tasks_on_node(env.get("SLURM_TASKS_PER_NODE", ""), env_number(env, "SLURM_NODEID") or 0)
    local_world = _place(rank, world, local_rank, here, ("SLURM_PROCID", "SLURM_NTASKS", "SLURM_LOCALID"))
    port = env_number(env, "MASTER_PORT")
    if port is None:
        job = env_number(env, "SLURM_JOB_ID")
        port = DEFAULT_PORT if job is None else job_port(job)
    addr = env.get("MASTER_ADDR")
    if not addr:
        nodes = env.get("SLURM_STEP_NODELIST") or env.get("SLURM_NODELIST") or env.get("SLURM_JOB_NODELIST")
        addr = first_host(nodes) if nodes and local_world < world else "127.0.0.1"
    return Identity(rank, local_rank, world, local_world, "rank0" if world > 1 else "none",
                    master_addr=addr, master_port=port, launcher="SLURM")


def job_port(job: int) -> int:
    """The rendezvous port of job number `job`: the same on every node of the job, unlikely to be a neighbour
    job's, and below Linux's ephemeral ports (32768 on), where a busy node's outgoing connections may hold it."""
    return 20000 + job % 10000


def launcher_pid(rank_var: str) -> int | None:
    """The process that started this one: the nearest ancestor without `rank_var` in its environment (a
    wrapper script in between inherits it), so the same for every rank of one job on one node. None where
    /proc cannot tell (not Linux, or an ancestor that is not ours to read)."""
    pid, needle = os.getppid(), rank_var.encode() + b"="
    while pid > 1:
        try:
            environ = Path(f"/proc/{pid}/environ").read_bytes()
            stat = Path(f"/proc/{pid}/stat").read_text()
        except OSError:
            return None
        if not any(item.startswith(needle) for item in environ.split(b"\0")):
            return pid
        pid = int(stat[stat.rindex(")") + 2:].split()[1])  # the parent; the name may hold spaces and ")"
    return None


def _mpi_port(env: Mapping[str, str], rank_var: str, one_node: bool) -> int:
    """An MPI job's rendezvous port: from its job id, the same on every node; without one (Hydra), from the
    launcher's pid when the job has one node; else torch's default."""
    job = next((env[key] for key in MPI_JOB_IDS if env.get(key)), None)
    if job:
        return job_port(zlib.crc32(job.encode()))
    pid = launcher_pid(rank_var) if one_node else None
    return DEFAULT_PORT if pid is None else job_port(pid)


def _from_mpi(env: Mapping[str, str], names: MpiVars) -> Identity:
    """An MPI launcher's variables. One node: 127.0.0.1, the port derived from the job. Several nodes: the
    launcher does not say where rank 0 runs, so MASTER_ADDR must (`mpirun -x MASTER_ADDR=…`)."""
    rank, world, local_rank, local_world = (env_number(env, key) or 0 for key in
                                            (names.rank, names.world, names.local_rank, names.local_world))
    _place(rank, world, local_rank, local_world, (names.rank, names.world, names.local_rank))
    one_node = local_world == world
    addr = env.get("MASTER_ADDR") or ("127.0.0.1" if one_node else "")
    if not addr:
        raise UserError(f"{names.launcher} started {world} processes on several nodes ({local_world} on this one) "
                        f"and does not say where rank 0 runs; pass its node's address to every process as "
                        f"MASTER_ADDR (`mpirun -x MASTER_ADDR=<host>`, or `-genv MASTER_ADDR <host>` with Hydra).")
    port = env_number(env, "MASTER_PORT")
    return Identity(rank, local_rank, world, local_world, "rank0" if world > 1 else "none",
                    master_addr=addr, master_port=_mpi_port(env, names.rank, one_node) if port is None else port,
                    launcher=names.launcher)


def from_env(env: Mapping[str, str]) -> Identity | None:
    """The identity torchrun, an MPI launcher or SLURM gave this process, or None if none launched it; where
    several left variables, torchrun's win over MPI's, and MPI's over SLURM's (docs/design/identity.md)."""
    if "RANK" in env and "WORLD_SIZE" in env:
        return _from_torchrun(env)
    for names in MPI_LAUNCHERS:
        if all(key in env for key in (names.rank, names.world, names.local_rank, names.local_world)):
            return _from_mpi(env, names)
    if "SLURM_PROCID" in env and "SLURM_NTASKS" in env:
        return _from_slurm(env)
    if "PMIX_RANK" in env:  # Open MPI 5 always sets OMPI_COMM_WORLD_*: some other PMIx launcher, world unknown
        raise UserError(f"PMIX_RANK={env['PMIX_RANK']} says a PMIx launcher started this process, but neither "
                        f"OMPI_COMM_WORLD_SIZE nor SLURM_NTASKS says how many processes the job has; start it "
                        f"with Open MPI's mpirun, srun or torchrun.")
    return None


def spawned(node_rank: int, local_rank: int, local_world: int, nodes: int, addr: str, port: int,
            standby: tuple[str, int] | None = None) -> Identity:
    """The identity of local process `local_rank` of node `node_rank`, started by our own spawn:
    the tutorial's rank = node_rank × local_world + local_rank, world = nodes × local_world."""
    return Identity(rank=node_rank * local_world + local_rank, local_rank=local_rank,
                    world_size=nodes * local_world, local_world_size=local_world, store_host="parent",
                    master_addr=addr, master_port=port, launcher="mnist-ddp spawn", standby=standby)
