"""Who am I in the job: rank, world size, and where the others are to be met.

A process learns its place from one of three launchers — our own spawn (the tutorial's
-n/-g/-nr, built in `launch.py`), torchrun (RANK/LOCAL_RANK/WORLD_SIZE…) or SLURM's srun
(SLURM_PROCID/SLURM_NTASKS…) — and every one of them ends in the same `Identity`. Plain
Python, no torch: this only reads numbers and checks that they describe a real seat.
"""

import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Literal

from .errors import UserError

# Who opens the rendezvous store that every process of the job first connects to:
#   "none"   one process alone: no store, no process group;
#   "parent" node 0's spawning parent (our -n/-g/-nr launcher), before it starts its children;
#   "agent"  torchrun's agent, which keeps one store across restarts (`attempt` counts them);
#   "rank0"  rank 0 itself, at MASTER_ADDR:MASTER_PORT (srun, or a hand-made RANK/WORLD_SIZE launch).
StoreHost = Literal["none", "parent", "agent", "rank0"]

# The environment variables through which a launcher hands a process its place. A child we start
# ourselves (bench, tests) must not inherit them, or it would believe it is part of our job.
LAUNCHER_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
LAUNCHER_PREFIXES = ("SLURM_", "TORCHELASTIC_")


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


def _int(env: Mapping[str, str], key: str) -> int | None:
    """`env[key]` as an integer, None when absent; a value that is no number is the user's to fix."""
    if key not in env:
        return None
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


def _from_torchrun(env: Mapping[str, str]) -> Identity:
    """torchrun's variables (also those of a hand-made RANK/WORLD_SIZE launch)."""
    rank, world = _int(env, "RANK") or 0, _int(env, "WORLD_SIZE") or 0
    local_rank = _int(env, "LOCAL_RANK") or 0
    local_world = _place(rank, world, local_rank, _int(env, "LOCAL_WORLD_SIZE"), ("RANK", "WORLD_SIZE", "LOCAL_RANK"))
    if world == 1:
        store_host: StoreHost = "none"
    elif env.get("TORCHELASTIC_USE_AGENT_STORE") == "True":
        store_host = "agent"
    else:
        store_host = "rank0"
    return Identity(rank, local_rank, world, local_world, store_host,
                    master_addr=env.get("MASTER_ADDR", "127.0.0.1"), master_port=_int(env, "MASTER_PORT") or 0,
                    launcher="torchrun", attempt=_int(env, "TORCHELASTIC_RESTART_COUNT") or 0,
                    run_id=env.get("TORCHELASTIC_RUN_ID", ""))


def _from_slurm(env: Mapping[str, str]) -> Identity:
    """srun's variables: the master is the step's first node, the port derived from the job id."""
    rank, world = _int(env, "SLURM_PROCID") or 0, _int(env, "SLURM_NTASKS") or 0
    local_rank = _int(env, "SLURM_LOCALID") or 0
    here = tasks_on_node(env.get("SLURM_TASKS_PER_NODE", ""), _int(env, "SLURM_NODEID") or 0)
    local_world = _place(rank, world, local_rank, here, ("SLURM_PROCID", "SLURM_NTASKS", "SLURM_LOCALID"))
    port = _int(env, "MASTER_PORT")
    if port is None:  # the same on every node of the job, and unlikely to collide with a neighbour job's
        job = _int(env, "SLURM_JOB_ID")
        port = 29500 if job is None else 20000 + job % 20000
    addr = env.get("MASTER_ADDR")
    if not addr:
        nodes = env.get("SLURM_STEP_NODELIST") or env.get("SLURM_NODELIST") or env.get("SLURM_JOB_NODELIST")
        addr = first_host(nodes) if nodes else "127.0.0.1"
    return Identity(rank, local_rank, world, local_world, "rank0" if world > 1 else "none",
                    master_addr=addr, master_port=port, launcher="SLURM")


def from_env(env: Mapping[str, str]) -> Identity | None:
    """The identity torchrun or SLURM gave this process, or None if neither launched it.

    torchrun's variables win: under `srun torchrun …` both sets are present, and torchrun's describe the
    processes it started.
    """
    if "RANK" in env and "WORLD_SIZE" in env:
        return _from_torchrun(env)
    if "SLURM_PROCID" in env and "SLURM_NTASKS" in env:
        return _from_slurm(env)
    return None


def spawned(node_rank: int, local_rank: int, local_world: int, nodes: int, addr: str, port: int) -> Identity:
    """The identity of local process `local_rank` of node `node_rank`, started by our own spawn:
    the tutorial's rank = node_rank × local_world + local_rank, world = nodes × local_world."""
    return Identity(rank=node_rank * local_world + local_rank, local_rank=local_rank,
                    world_size=nodes * local_world, local_world_size=local_world, store_host="parent",
                    master_addr=addr, master_port=port, launcher="mnist-ddp spawn")
