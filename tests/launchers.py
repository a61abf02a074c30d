"""Real launchers for the tests that use them: a SLURM cluster of our own, and Open MPI's and MPICH's mpirun.

The cluster is made for one test module in a temp folder: a munge key, socket and pid file of its own, a
generated slurm.conf, slurmctld and one slurmd per node, each started in the foreground (so the pid we hold
is the daemon's) and stopped by that pid. A node is either this machine (single-node clusters) or a network
namespace with its own address, host name and /etc/hosts (`nsenter --net` into the namespace, `unshare
--mount --uts` for the rest: `ip netns exec` would remount /sys, where slurmd then fails to start).
"""

import os
import random
import re
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager, suppress
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from netns import netns_pair

SLURM_TOOLS = ("slurmctld", "slurmd", "srun", "sbatch", "scancel", "scontrol", "sinfo", "munged")
OPEN_MPI_ROOT = {"OMPI_ALLOW_RUN_AS_ROOT": "1", "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM": "1"}  # it refuses root otherwise
# Open MPI over loopback only: its own wire-up would otherwise try every interface of the machine.
OPEN_MPI_LOOPBACK = ["--mca", "oob_tcp_if_include", "lo", "--mca", "btl_tcp_if_include", "lo"]
START_S = 60  # how long daemons get to come up: a hang detector on a shared machine, not a timing assertion


def need(*tools: str) -> None:
    """Skip, with the reason, where a launcher is not installed (`.ci/run` installs them with apt-get)."""
    missing = [t for t in tools if shutil.which(t) is None]
    if missing:
        pytest.skip(f"needs {', '.join(missing)} (Debian: openmpi-bin, mpich, slurmctld, slurmd, slurm-client, munge)")


def need_root() -> None:
    if os.geteuid() != 0:
        pytest.skip("runs SLURM's daemons and network namespaces, which needs root")


def free_ports(n: int) -> list[int]:
    """`n` distinct ports nobody listens on right now."""
    socks = [socket.socket() for _ in range(n)]
    try:
        for s in socks:
            s.bind(("127.0.0.1", 0))
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


@dataclass(frozen=True)
class Node:
    """One SLURM node: its name, its address, and the network namespace it lives in (None: this machine)."""

    name: str
    addr: str
    netns: str | None = None

    def prefix(self, folder: Path) -> list[str]:
        """The command prefix that runs a program on this node, as its own machine would."""
        if self.netns is None:
            return []
        hosts = folder / f"hosts-{self.name}"
        return ["nsenter", f"--net=/run/netns/{self.netns}", "unshare", "--mount", "--uts", "sh", "-c",
                f'mount --bind "{hosts}" /etc/hosts && hostname {self.name} && exec "$@"', "sh"]


@dataclass
class Cluster:
    """A running SLURM cluster; `env` is what its client commands (srun, sbatch, …) need."""

    folder: Path
    nodes: tuple[Node, ...]
    env: dict[str, str]
    daemons: list[subprocess.Popen] = field(default_factory=list)

    def run(self, *cmd: str, node: int = 0, timeout: float = 60, env: dict[str, str] | None = None,
            cwd: Path | None = None) -> subprocess.CompletedProcess:
        """A client command, run on `node`, to its end."""
        return subprocess.run([*self.nodes[node].prefix(self.folder), *cmd], env=self.env | (env or {}),
                              cwd=cwd, capture_output=True, text=True, timeout=timeout)

    def start(self, cmd: list[str], log: Path, node: int = 0, env: dict[str, str] | None = None,
              cwd: Path | None = None) -> subprocess.Popen:
        """A client command (srun …) started on `node` in its own process group, output to `log`."""
        with open(log, "wb") as out:
            return subprocess.Popen([*self.nodes[node].prefix(self.folder), *cmd], env=self.env | (env or {}),
                                    cwd=cwd, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)

    def submit(self, script: Path, log: Path, env: dict[str, str], cwd: Path) -> str:
        """`sbatch` without --wait (which polls at 2, 10, 42 s…: a 12 s job takes 42 s); the job's id."""
        r = self.run("sbatch", "--parsable", "-o", str(log), str(script), env=env, cwd=cwd)
        assert r.returncode == 0, r.stderr
        return r.stdout.strip().split(";")[0]

    def job(self, job: str) -> tuple[str, str]:
        """The job's state (PENDING, RUNNING, COMPLETED, FAILED …) and exit code ('0:0': code:signal)."""
        fields = dict(re.findall(r"\b(JobState|ExitCode)=(\S+)", self.run("scontrol", "show", "job", job).stdout))
        return fields.get("JobState", ""), fields.get("ExitCode", "")

    def finished(self, job: str, timeout: float) -> tuple[str, str]:
        """Wait for the job to end; its final state and exit code."""
        deadline = time.monotonic() + timeout
        while (found := self.job(job))[0] not in ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL"):
            if time.monotonic() > deadline:
                pytest.fail(f"job {job} still {found[0]} after {timeout:.0f} s\n{self.logs()}")
            time.sleep(0.2)
        return found

    def _daemon(self, cmd: list[str], name: str, node: Node | None = None) -> None:
        log = open(self.folder / f"{name}.out", "wb")  # noqa: SIM115 - closed here once the daemon holds its copy
        prefix = node.prefix(self.folder) if node else []
        self.daemons.append(subprocess.Popen([*prefix, *cmd], env=self.env, stdout=log, stderr=subprocess.STDOUT,
                                             start_new_session=True))
        log.close()

    def logs(self) -> str:
        """Every daemon's log, for a failure message."""
        return "\n".join(f"--- {p.name}\n{p.read_text(errors='replace')[-2000:]}"
                         for p in sorted(self.folder.glob("*.log")) + sorted(self.folder.glob("*.out")))

    def wait_idle(self) -> None:
        """Wait until slurmctld sees every node up and idle."""
        deadline = time.monotonic() + START_S
        while time.monotonic() < deadline:
            for p in self.daemons:
                if p.poll() is not None:
                    pytest.fail(f"{p.args} exited with {p.returncode}\n{self.logs()}")
            r = self.run("sinfo", "-h", "-N", "-o", "%N %t")
            states = dict(line.split() for line in r.stdout.splitlines() if line.strip())
            if r.returncode == 0 and all(states.get(n.name) == "idle" for n in self.nodes):
                return
            time.sleep(0.3)
        pytest.fail(f"the SLURM nodes did not come up within {START_S} s\n{self.logs()}")

    def stop(self) -> None:
        """Stop the daemons by their pids (slurmd first, munged last), and kill what does not stop."""
        for p in reversed(self.daemons):
            with suppress(ProcessLookupError):
                p.send_signal(signal.SIGTERM)
            try:
                p.wait(15)
            except subprocess.TimeoutExpired:
                with suppress(ProcessLookupError):
                    os.killpg(p.pid, signal.SIGKILL)
                p.wait()


def quiet_job_id(count: int = 20) -> int:
    """A job id whose port (`20000 + id % 10000`, as the tasks derive it) and the next `count - 1` ids' ports
    are free right now (other test runs on this machine may be using some)."""
    rng = random.Random()
    while True:
        port = rng.randrange(20000, 30000 - count)
        try:
            for p in range(port, port + count):
                with socket.socket() as s:
                    s.bind(("127.0.0.1", p))
        except OSError:
            continue
        return port - 20000


def _slurm_conf(folder: Path, spool: Path, nodes: tuple[Node, ...], control: Node, ports: list[int]) -> str:
    """slurmctld on `control`; no cgroups, no accounting, no systemd: what runs in any container as root. `spool`
    holds each step's Unix socket, whose path may be 108 bytes at most: a short folder, not one under `folder`."""
    cpus = os.cpu_count() or 1
    lines = [
        "ClusterName=mnistddp", f"FirstJobId={quiet_job_id()}",
        f"SlurmctldHost={control.name}({control.addr})",
        "SlurmUser=root", "SlurmdUser=root",
        f"SlurmctldPort={ports[0]}", f"SlurmdPort={ports[1]}",
        "AuthType=auth/munge", "CredType=cred/munge", f"AuthInfo=socket={folder / 'munge.socket'}",
        f"StateSaveLocation={folder / 'state'}", f"SlurmdSpoolDir={spool / '%n'}",
        f"SlurmctldPidFile={folder / 'slurmctld.pid'}", f"SlurmdPidFile={folder / 'slurmd-%n.pid'}",
        f"SlurmctldLogFile={folder / 'slurmctld.log'}", f"SlurmdLogFile={folder / 'slurmd-%n.log'}",
        "ProctrackType=proctrack/pgid", "TaskPlugin=task/none", "MpiDefault=none",
        "SelectType=select/cons_tres", "SelectTypeParameters=CR_CPU",
        "SchedulerType=sched/backfill", "ReturnToService=2", "JobRequeue=1",
        "AccountingStorageType=accounting_storage/none", "JobCompType=jobcomp/none",
        "JobAcctGatherType=jobacct_gather/none", "SwitchType=switch/none",
        "KillWait=10", "MinJobAge=300", "SlurmctldTimeout=30", "SlurmdTimeout=30", "InactiveLimit=0",
    ]
    lines += [f"NodeName={n.name} NodeAddr={n.addr} CPUs={cpus} State=UNKNOWN" for n in nodes]
    lines.append(f"PartitionName=test Nodes={','.join(n.name for n in nodes)} Default=YES MaxTime=INFINITE State=UP "
                 f"OverSubscribe=YES")
    return "\n".join(line for line in lines if line) + "\n"


@contextmanager
def machines(subnet: str = "10.78.0") -> Iterator[tuple[Node, ...]]:
    """Two SLURM nodes on two "machines" (netns.py): addresses `subnet`.1 and .2, host names node1, node2."""
    need("nsenter", "unshare")
    with netns_pair(f"mpi{os.getpid()}", (f"{subnet}.1", f"{subnet}.2")) as names:
        yield tuple(Node(f"node{i + 1}", f"{subnet}.{i + 1}", name) for i, name in enumerate(names))


@contextmanager
def local_cluster(folder: Path) -> Iterator[Cluster]:
    """SLURM on this machine alone: the node has its short host name, which slurmctld compares with
    SlurmctldHost and which resolves here."""
    need(*SLURM_TOOLS)
    need_root()
    with slurm_cluster(folder, (Node(socket.gethostname().split(".")[0], "127.0.0.1"),)) as c:
        yield c


@contextmanager
def slurm_cluster(folder: Path, nodes: tuple[Node, ...]) -> Iterator[Cluster]:
    """munged, slurmctld (on the first node) and one slurmd per node, running until the block ends."""
    folder.mkdir(parents=True, exist_ok=True)
    folder.chmod(0o700)  # munged refuses a key, socket or log in a folder others could write to
    (folder / "state").mkdir()
    key = folder / "munge.key"
    key.write_bytes(os.urandom(1024))
    key.chmod(0o400)
    ports = free_ports(2)
    spool = Path(tempfile.mkdtemp(prefix="slurmd-"))
    conf = folder / "slurm.conf"
    conf.write_text(_slurm_conf(folder, spool, nodes, nodes[0], ports))
    hosts = "127.0.0.1 localhost\n" + "".join(f"{n.addr} {n.name}\n" for n in nodes)
    for n in nodes:
        (folder / f"hosts-{n.name}").write_text(hosts)
    env = {k: v for k, v in os.environ.items() if not k.startswith("SLURM_")} | {"SLURM_CONF": str(conf)}
    cluster = Cluster(folder, nodes, env)
    try:
        cluster._daemon(["munged", "-F", "--force", f"--socket={folder / 'munge.socket'}", f"--key-file={key}",
                         f"--pid-file={folder / 'munged.pid'}", f"--log-file={folder / 'munged.log'}",
                         f"--seed-file={folder / 'munged.seed'}"], "munged")
        deadline = time.monotonic() + START_S
        while not (folder / "munge.socket").exists():
            if cluster.daemons[0].poll() is not None or time.monotonic() > deadline:
                pytest.fail(f"munged did not start\n{cluster.logs()}")
            time.sleep(0.05)
        cluster._daemon(["slurmctld", "-D", "-i", "-f", str(conf)], "slurmctld", nodes[0])
        for n in nodes:
            cluster._daemon(["slurmd", "-D", "-f", str(conf), "-N", n.name], f"slurmd-{n.name}", n)
        cluster.wait_idle()
        yield cluster
    finally:
        cluster.stop()
        shutil.rmtree(spool, ignore_errors=True)
