"""Who am I under an MPI launcher: Open MPI, MPICH/Intel MPI (Hydra) and MVAPICH, and how they rank against
torchrun and SLURM. The variables are the ones the launchers set (see test_real_mpi.py for the real thing)."""

import os
import subprocess
import sys
import zlib

import pytest

from mnist_ddp.common.errors import UserError
from mnist_ddp.joining.identity import DEFAULT_PORT, job_port, launcher_pid, without_launcher_vars
from mnist_ddp.joining.identity import from_env as identity_from_env

OPEN_MPI = {"OMPI_COMM_WORLD_RANK": "3", "OMPI_COMM_WORLD_SIZE": "4", "OMPI_COMM_WORLD_LOCAL_RANK": "1",
            "OMPI_COMM_WORLD_LOCAL_SIZE": "2", "OMPI_MCA_ess_base_jobid": "2021326849", "PMIX_RANK": "3",
            "PMIX_NAMESPACE": "2021326849"}
HYDRA = {"PMI_RANK": "1", "PMI_SIZE": "2", "MPI_LOCALRANKID": "1", "MPI_LOCALNRANKS": "2", "PMI_FD": "8"}
MVAPICH = {"MV2_COMM_WORLD_RANK": "5", "MV2_COMM_WORLD_SIZE": "8", "MV2_COMM_WORLD_LOCAL_RANK": "1",
           "MV2_COMM_WORLD_LOCAL_SIZE": "4"}
# What a batch step hands everything started in it: task 0 of 2.
SBATCH = {"SLURM_PROCID": "0", "SLURM_NTASKS": "2", "SLURM_LOCALID": "0", "SLURM_NODEID": "0",
          "SLURM_TASKS_PER_NODE": "2", "SLURM_NODELIST": "n1", "SLURM_JOB_ID": "77"}


def _ident(env: dict[str, str]) -> tuple:
    ident = identity_from_env(env)
    assert ident is not None
    return (ident.launcher, ident.rank, ident.world_size, ident.local_rank, ident.local_world_size,
            ident.store_host, ident.master_addr, ident.master_port)


def test_open_mpi_on_several_nodes_meets_at_master_addr_on_a_port_from_its_job_id() -> None:
    port = job_port(zlib.crc32(b"2021326849"))
    assert _ident(OPEN_MPI | {"MASTER_ADDR": "node1"}) == ("Open MPI", 3, 4, 1, 2, "rank0", "node1", port)


def test_every_rank_of_one_mpi_job_derives_the_same_port() -> None:
    """Open MPI: from the job id, which every node shares; another job gets another port."""
    ranks = [OPEN_MPI | {"OMPI_COMM_WORLD_RANK": str(r), "OMPI_COMM_WORLD_LOCAL_RANK": str(r),
                         "OMPI_COMM_WORLD_SIZE": "2", "OMPI_COMM_WORLD_LOCAL_SIZE": "2"} for r in range(2)]
    ports = {_ident(env)[-1] for env in ranks}
    assert len(ports) == 1
    other = ranks[0] | {"OMPI_MCA_ess_base_jobid": "2021392385"}
    assert _ident(other)[-1] not in ports
    assert _ident({k: v for k, v in ranks[0].items() if k != "OMPI_MCA_ess_base_jobid"})[-1] == ports.pop()  # 5.x


def test_hydra_on_one_node_meets_on_loopback_at_a_port_from_its_launchers_pid() -> None:
    """Hydra (MPICH, Intel MPI) gives no job id; on one node the port comes from the process that started the
    ranks: here the test's parent, the nearest ancestor without PMI_RANK."""
    assert _ident(HYDRA) == ("MPICH", 1, 2, 1, 2, "rank0", "127.0.0.1", job_port(os.getppid()))


def test_the_launchers_pid_is_found_through_a_wrapper_script() -> None:
    """A shell between the launcher and python inherits PMI_RANK: the search goes past it, so every rank
    finds the same process (here: this test's)."""
    code = "from mnist_ddp.joining.identity import launcher_pid; print(launcher_pid('PMI_RANK'))"
    env = os.environ | {"PMI_RANK": "0", "PYTHONPATH": os.pathsep.join(sys.path)}
    r = subprocess.run(["sh", "-c", f'{sys.executable} -c "{code}"; exit $?'], env=env, capture_output=True,
                       text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    assert int(r.stdout) == os.getpid()
    assert launcher_pid("PMI_RANK") == os.getppid()


def test_mvapich() -> None:
    assert _ident(MVAPICH | {"MASTER_ADDR": "10.0.0.1", "MASTER_PORT": "4000"}) == \
        ("MVAPICH", 5, 8, 1, 4, "rank0", "10.0.0.1", 4000)


def test_hydra_on_several_nodes_without_a_job_id_uses_torchs_default_port() -> None:
    env = HYDRA | {"PMI_SIZE": "4", "MASTER_ADDR": "n1"}
    assert _ident(env)[-2:] == ("n1", DEFAULT_PORT)


@pytest.mark.parametrize(("env", "launcher"), [(OPEN_MPI, "Open MPI"), (HYDRA | {"PMI_SIZE": "4"}, "MPICH"),
                                               (MVAPICH, "MVAPICH")])
def test_mpi_on_several_nodes_without_master_addr_is_one_clear_sentence(env: dict[str, str], launcher: str) -> None:
    """The launcher does not say where rank 0 runs; every rank (all see the same numbers) says so."""
    with pytest.raises(UserError, match=f"^{launcher} started \\d processes on several nodes .* MASTER_ADDR"):
        identity_from_env(env)


def test_mpi_variables_win_over_the_batch_steps_slurm_variables() -> None:
    """`mpirun` inside `sbatch`: every rank inherits task 0 of 2 from the batch step; MPI's numbers are right."""
    assert _ident(SBATCH | HYDRA)[:5] == ("MPICH", 1, 2, 1, 2)
    assert _ident(SBATCH | OPEN_MPI | {"MASTER_ADDR": "n1"})[:5] == ("Open MPI", 3, 4, 1, 2)


def test_srun_with_an_mpi_plugin_is_still_read_as_slurm() -> None:
    """`srun --mpi=pmi2` sets PMI_RANK/PMI_SIZE, `--mpi=pmix` PMIX_RANK, never the local numbers: srun
    started the tasks, and its variables say all."""
    tasks = SBATCH | {"SLURM_PROCID": "1", "SLURM_LOCALID": "1"}
    assert _ident(tasks | {"PMI_RANK": "1", "PMI_SIZE": "2"})[:3] == ("SLURM", 1, 2)
    assert _ident(tasks | {"PMIX_RANK": "1", "PMIX_NAMESPACE": "slurm.pmix.77.0"})[:3] == ("SLURM", 1, 2)


def test_torchrun_under_mpirun_wins() -> None:
    env = OPEN_MPI | {"RANK": "0", "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29400"}
    assert _ident(env)[:3] == ("torchrun", 0, 2)


def test_a_pmix_rank_without_a_world_size_is_a_clear_error() -> None:
    with pytest.raises(UserError, match="PMIX_RANK=0 says a PMIx launcher started this process"):
        identity_from_env({"PMIX_RANK": "0", "PMIX_NAMESPACE": "x"})


@pytest.mark.parametrize(("env", "message"), [
    (HYDRA | {"PMI_RANK": "2"}, "PMI_RANK=2 does not fit PMI_SIZE=2"),
    (HYDRA | {"MPI_LOCALRANKID": "2"}, "MPI_LOCALRANKID=2 does not fit the 2 process"),
    (OPEN_MPI | {"OMPI_COMM_WORLD_SIZE": "zero"}, "OMPI_COMM_WORLD_SIZE='zero' is not a whole number"),
    (MVAPICH | {"MV2_COMM_WORLD_SIZE": "0"}, "MV2_COMM_WORLD_SIZE=0: a job needs at least one process"),
])
def test_impossible_mpi_numbers_are_clear_errors(env: dict[str, str], message: str) -> None:
    with pytest.raises(UserError, match=message):
        identity_from_env(env)


def test_children_we_start_do_not_inherit_an_mpi_identity() -> None:
    env = OPEN_MPI | HYDRA | MVAPICH | {"PATH": "/bin", "OMP_NUM_THREADS": "1"}
    assert without_launcher_vars(env) == {"PATH": "/bin", "OMP_NUM_THREADS": "1"}
