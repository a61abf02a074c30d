"""Real MPI launchers start the processes: Open MPI's `mpirun` and MPICH's `mpiexec.mpich`, alone and inside a
SLURM allocation. No mpi4py: MPI only starts the processes; they read their rank from the launcher's variables
and meet at rank 0's store as under any other launcher."""

import re
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from conftest import metrics, tiny
from launchers import (
    OPEN_MPI_LOOPBACK,
    OPEN_MPI_ROOT,
    SLURM_TOOLS,
    Cluster,
    local_cluster,
    machines,
    need,
    slurm_cluster,
)
from procfs import finish, marked_env, reaped, start

pytestmark = [pytest.mark.skipif(sys.platform != "linux", reason="the MPI launchers are tested on Linux"),
              pytest.mark.timeout(600)]  # a SLURM cluster to start for some, and HANG-guarded phases
TRAIN = [sys.executable, "-m", "mnist_ddp", "train", *tiny(600, 100)]
HANG = 240  # seconds: a hang detector on a shared machine, not a timing assertion


def _open_mpi(np: int) -> list[str]:
    """Open MPI's mpirun, over loopback (as root it must be told that is fine: OPEN_MPI_ROOT)."""
    return ["mpirun", "-np", str(np), *OPEN_MPI_LOOPBACK]


LAUNCHERS = {  # name -> (tool, command prefix)
    "open-mpi": ("mpirun", _open_mpi(2)),
    "mpich": ("mpiexec.mpich", ["mpiexec.mpich", "-n", "2"]),
}


def _check_world_of_two(log: str, out: Path) -> None:
    assert "world size 2" in log and log.count("final: test accuracy") == 1, log  # one world, rank 0 speaks
    assert [row["world_size"] for row in metrics(out)] == [2], log


@pytest.mark.parametrize("wrapped", [False, True], ids=["direct", "through-a-script"])
@pytest.mark.parametrize("launcher", LAUNCHERS)
def test_mpi_launcher_starts_one_world_of_two(launcher: str, wrapped: bool, tmp_path: Path) -> None:
    """`mpirun -np 2 mnist-ddp train` (also through a wrapper script, as sites often do): one world of 2, on
    127.0.0.1 and a port both processes derive from their job, with no variable set by hand."""
    tool, prefix = LAUNCHERS[launcher]
    need(tool)
    out = tmp_path / "o"
    command = [*TRAIN, "--out", str(out)]
    if wrapped:  # a shell that outlives python (no exec): the ranks' parent is no longer the launcher
        command = ["sh", "-c", 'echo "rank $0 starting"; "$@"; exit $?', "x", *command]
    env, mark = marked_env(OPEN_MPI_ROOT)
    began = time.monotonic()
    with reaped(mark):
        proc = start([*prefix, *command], env, tmp_path, tmp_path / "log", module=False)
        rc, log = finish(proc, tmp_path / "log", HANG)
    print(f"{launcher} {'wrapped' if wrapped else 'direct'}: {time.monotonic() - began:.1f} s")
    assert rc == 0, log
    _check_world_of_two(log, out)


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    with local_cluster(tmp_path_factory.mktemp("slurm")) as c:
        yield c


@pytest.mark.parametrize("launcher", LAUNCHERS)
def test_mpi_launcher_inside_an_sbatch_allocation_slurm(launcher: str, cluster: Cluster, tmp_path: Path) -> None:
    """`mpirun` in a batch script: every process inherits the batch step's SLURM_PROCID=0 and SLURM_NTASKS=2,
    which describe no rank; MPI's variables win, so the ranks are right and they train one world of 2."""
    tool, prefix = LAUNCHERS[launcher]
    need(tool)
    out = tmp_path / "o"
    script = tmp_path / "job.sh"
    script.write_text(f"#!/bin/bash\n#SBATCH --ntasks=2\n{' '.join(prefix)} {' '.join(TRAIN)} --out {out}\n")
    env, mark = marked_env(OPEN_MPI_ROOT)
    began = time.monotonic()
    with reaped(mark):
        state, code = cluster.finished(cluster.submit(script, tmp_path / "job.log", env, tmp_path), HANG)
    print(f"{launcher} in sbatch: {time.monotonic() - began:.1f} s")
    log = (tmp_path / "job.log").read_text()
    assert (state, code) == ("COMPLETED", "0:0"), log + cluster.logs()
    _check_world_of_two(log, out)


def test_open_mpi_across_two_machines_needs_master_addr_mpi(tmp_path: Path) -> None:
    """`mpirun -np 2` in a two-node allocation (Open MPI starts its daemon on the second node through srun),
    one rank per network namespace. Without MASTER_ADDR every rank says so and exits 2 (mpirun is told not to
    stop the others on the first failure, so that each can be seen); with `-x MASTER_ADDR=node1`, one world."""
    need("mpirun", *SLURM_TOOLS)
    subnet = "10.78.0.0/24"  # Open MPI's own wire-up between the nodes, over the namespaces' cable
    mpirun = ["mpirun", "-np", "2", "--mca", "orte_abort_on_non_zero_status", "0",
              "--mca", "oob_tcp_if_include", subnet, "--mca", "btl_tcp_if_include", subnet]
    each = 'sh -c \'"$@"; echo "rank $OMPI_COMM_WORLD_RANK exit $?"\' x'
    env, mark = marked_env(OPEN_MPI_ROOT)
    with machines() as nodes, slurm_cluster(tmp_path / "slurm", nodes) as two, reaped(mark):
        for case, extra in {"alone": [], "told": ["-x", "MASTER_ADDR=node1"]}.items():
            script = tmp_path / f"{case}.sh"
            script.write_text(f"#!/bin/bash\n#SBATCH --nodes=2 --ntasks=2\n"
                              f"{' '.join(mpirun + extra)} {each} {' '.join(TRAIN)} --out {tmp_path / case}\n"
                              f"echo mpirun exit $?\n")
            began = time.monotonic()
            state, _ = two.finished(two.submit(script, tmp_path / f"{case}.log", env, tmp_path), HANG)
            print(f"open-mpi across two machines, {case}: {time.monotonic() - began:.1f} s", end=" ")
            print(re.findall(r"mpirun exit \d+", (tmp_path / f"{case}.log").read_text()))
            log = (tmp_path / f"{case}.log").read_text()
            assert state == "COMPLETED", log + two.logs()
            if case == "alone":
                assert sorted(re.findall(r"rank (\d) exit (\d+)", log)) == [("0", "2"), ("1", "2")], log
                assert log.count("mnist-ddp: error: Open MPI started 2 processes on several nodes (1 on this one) "
                                 "and does not say where rank 0 runs") == 2, log
            else:
                assert sorted(re.findall(r"rank (\d) exit (\d+)", log)) == [("0", "0"), ("1", "0")], log
                _check_world_of_two(log, tmp_path / case)
