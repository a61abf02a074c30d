"""A job lets in only its own processes: where it listens, whom it admits, and that stray traffic changes nothing.

Real jobs, real strangers. Two network namespaces joined by a veth pair play two machines (netns.py): a job on
one machine must not be reachable from the other at all; a job across both admits only the ranks that prove
its secret and its run, whether a stranger comes from the other machine or from the job's own; and under a
stream of stray traffic (tests/stray.py) from both machines a job ends with the same weights, bit for bit, as
without it. Every comparison has a control that must come out the other way.
"""

import hashlib
import ipaddress
import json
import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from conftest import REPO, metrics, progress, run_cli, tiny
from mnist_ddp.joining.membership import MAX_CHECKIN, CheckIn
from netns import netns_pair
from procfs import finish, free_port, marked_env, marked_pids, reaped, socket_inodes, start, wait_for

ADDRS = ("10.81.0.1", "10.81.0.2")
TAG = f"tr{os.getpid() % 100000}"  # namespaces tr<pid>-0/-1, veth tr<pid>a (in -0) and tr<pid>b (in -1)
HANG = 180  # seconds: a hang detector on a shared machine, not a timing assertion
TRAIN = ["mnist_ddp", "train", *tiny(800, 200, epochs=2), "--seed", "3", "--timeout", "300"]
LONG = ["mnist_ddp", "train", *tiny(800, 200, epochs=500), "--timeout", "300"]  # stopped once looked at
SOFT_LIMIT_1024 = ["sh", "-c", 'ulimit -Sn 1024 && exec "$@"', "sh"]  # a common default soft limit of open files
GOOD = {"rank": 1, "addr": "10.0.0.2", "host": "node2", "pid": 7, "nonce": "0" * 32, "run": {"seed": "3"},
        "mac": "0" * 64}  # a check-in's shape


@pytest.fixture(scope="module")
def machines() -> Iterator[tuple[str, str]]:
    with netns_pair(TAG, ADDRS) as names:
        yield names


def on(machine: str) -> list[str]:
    return ["ip", "netns", "exec", machine]


def _ip(field: str) -> str:
    """An address of /proc/net/tcp{,6} ("0100007F" is 127.0.0.1: the kernel's words, in host byte order)."""
    raw = bytes.fromhex(field)
    return str(ipaddress.ip_address(b"".join(raw[i:i + 4][::-1] for i in range(0, len(raw), 4))))


def listening(mark: str) -> set[tuple[str, int]]:
    """(address, port) of every TCP socket in LISTEN that a process carrying `mark` holds, in its namespace."""
    found = set()
    for pid in marked_pids(mark):
        held = socket_inodes(pid)
        for table in ("tcp", "tcp6"):
            try:
                rows = Path(f"/proc/{pid}/net/{table}").read_text().splitlines()[1:]
            except OSError:
                continue
            for f in map(str.split, rows):
                if f[3] == "0A" and int(f[9]) in held:
                    addr, port = f[1].rsplit(":", 1)
                    found.add((_ip(addr), int(port, 16)))
    return found


def reachable(machine: str, host: str, ports: list[int]) -> dict[int, bool]:
    """Whether a connection from `machine` to each of `host`'s `ports` is accepted."""
    probe = ("import json, socket, sys\nout = {}\nfor p in map(int, sys.argv[2:]):\n    try:\n"
             "        socket.create_connection((sys.argv[1], p), timeout=3).close(); out[p] = True\n"
             "    except OSError:\n        out[p] = False\nprint(json.dumps(out))")
    r = subprocess.run([*on(machine), sys.executable, "-c", probe, host, *map(str, ports)], capture_output=True,
                       text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    return {int(k): v for k, v in json.loads(r.stdout).items()}


def weights_sha256(out: Path) -> str:
    """SHA-256 of the saved model's state_dict: every tensor's bytes, in key order."""
    model, h = torch.load(out / "checkpoint.pt", weights_only=True)["model"], hashlib.sha256()
    for key in sorted(model):
        h.update(key.encode())
        h.update(bytes(model[key].detach().contiguous().clone().untyped_storage()))
    return h.hexdigest()


def ours(log: str) -> list[str]:
    """The lines the process printed (c10d's C++ warnings, such as the one its client gives inside these
    namespaces, with no DNS server to name its own socket's host, are not shown: mnist_ddp/__init__.py)."""
    return log.strip().splitlines()


def refusals(log: str) -> list[str]:
    return [line for line in log.splitlines() if line.startswith("mnist-ddp: refused ")]


def test_a_job_on_one_machine_cannot_be_reached_from_another(machines: tuple[str, str], tmp_path: Path) -> None:
    """`-g 2` on machine 0: its store and its gloo sockets listen on loopback only, so a connection from machine
    1 to machine 0's address on those ports is refused, while on machine 0 itself they answer. The control: the
    same job told to listen on machine 0's address (--master-addr, GLOO_SOCKET_IFNAME) is reachable."""
    jobs = {"loopback": ([], {}), "control": (["--master-addr", ADDRS[0]], {"GLOO_SOCKET_IFNAME": f"{TAG}a"})}
    seen: dict[str, set[tuple[str, int]]] = {}
    procs = {}
    marks = []
    for name, (flags, extra) in jobs.items():
        env, mark = marked_env(extra)
        marks.append(mark)
        procs[name] = (mark, start([*LONG, "-g", "2", *flags, "--out", str(tmp_path / name)], env, tmp_path,
                                   tmp_path / f"{name}.log", prefix=on(machines[0])))
    try:
        for name, (mark, proc) in procs.items():
            wait_for(f"{name}: training", lambda name=name: progress(tmp_path / name), HANG, running=proc)
            seen[name] = wait_for(f"{name}: its 3 listening sockets", lambda mark=mark: len(listening(mark)) >= 3 and
                                  listening(mark), HANG, running=proc)
        print(subprocess.run([*on(machines[0]), "ss", "-ltnp"], capture_output=True, text=True).stdout)
        ports = sorted(port for _, port in seen["loopback"])
        assert {addr for addr, _ in seen["loopback"]} == {"127.0.0.1"}, seen
        assert reachable(machines[1], ADDRS[0], ports) == dict.fromkeys(ports, False)
        assert reachable(machines[0], "127.0.0.1", ports) == dict.fromkeys(ports, True)  # they are there
        ports = sorted(port for _, port in seen["control"])
        assert {addr for addr, _ in seen["control"]} == {ADDRS[0]}, seen
        assert reachable(machines[1], ADDRS[0], ports) == dict.fromkeys(ports, True)
    finally:
        for name, (mark, proc) in procs.items():
            with reaped(mark):
                os.killpg(proc.pid, signal.SIGTERM)  # stops like Ctrl-C
                rc, log = finish(proc, tmp_path / f"{name}.log", HANG)
            assert rc == 130, log


def _hand_made(rank: int, port: int, extra: dict[str, str] | None = None) -> dict[str, str]:
    """The environment a static launcher gives rank `rank` of a world of 2 that meets at 127.0.0.1:`port`."""
    return {"RANK": str(rank), "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port),
            **(extra or {})}


def test_strangers_on_the_same_machine_are_refused_and_the_job_finishes(tmp_path: Path) -> None:
    """Rank 0 of a world of 2 (started by hand, as a launcher would) waits with its secret from --secret-file.
    Three strangers check in as rank 1 first — one with another secret, one with the secret but another --seed,
    one with none — and each is refused with one line, there and at the job; then the real rank 1 (the secret
    from MNIST_DDP_SECRET, the same value) is admitted, and the job finishes."""
    secret = tmp_path / "secret"
    secret.write_text("correct horse battery staple\n")
    secret.chmod(0o600)
    port = free_port()
    env, mark = marked_env()
    strangers = {"another secret": ({"MNIST_DDP_SECRET": "wrong"}, []),
                 "another run": ({"MNIST_DDP_SECRET": "correct horse battery staple"}, ["--seed", "4"]),
                 "no secret": ({}, [])}
    with reaped(mark):
        rank0 = start([*TRAIN, "--secret-file", str(secret), "--out", str(tmp_path / "out")],
                      env | _hand_made(0, port), tmp_path, tmp_path / "0.log")
        procs = {case: start([*TRAIN, *flags, "--out", str(tmp_path / f"s{n}")], env | _hand_made(1, port, extra),
                             tmp_path, tmp_path / f"s{n}.log")
                 for n, (case, (extra, flags)) in enumerate(strangers.items())}
        said = {case: finish(p, tmp_path / f"s{n}.log", HANG) for n, (case, p) in enumerate(procs.items())}
        rank1 = start([*TRAIN, "--out", str(tmp_path / "r1")],
                      env | _hand_made(1, port, {"MNIST_DDP_SECRET": "correct horse battery staple"}), tmp_path,
                      tmp_path / "1.log")
        (rc0, log0), (rc1, log1) = finish(rank0, tmp_path / "0.log", HANG), finish(rank1, tmp_path / "1.log", HANG)
    why = {"another secret": "its secret is not the job's (MNIST_DDP_SECRET or --secret-file must be the same on "
                             "every node)",
           "another run": "it belongs to another run: seed 4 (the job: 3)",
           "no secret": "its secret is not the job's (MNIST_DDP_SECRET or --secret-file must be the same on every "
                        "node)"}
    pids = {case: procs[case].pid for case in strangers}
    for case, (rc, log) in said.items():
        assert rc == 2, f"{case}: {log}"
        assert log.strip().splitlines() == [f"mnist-ddp: error: the job at 127.0.0.1:{port} refused this process "
                                            f"(rank 1): {why[case]}."], f"{case}: {log}"
    assert rc0 == 0 and rc1 == 0, log0 + log1
    lines = refusals(log0)
    assert len(lines) == 3, log0
    for case in strangers:  # the job names each: address, host, pid, and why
        assert any(f"refused 127.0.0.1 ({os.uname().nodename}, pid {pids[case]}), which checked in as rank 1: "
                   f"{why[case]}; still waiting for rank 1." in line for line in lines), (case, log0)
    assert [m["world_size"] for m in metrics(tmp_path / "out")] == [2, 2]
    for n in range(3):
        assert not (tmp_path / f"s{n}").exists()  # a refused rank wrote nothing
    for path in (tmp_path / "out").rglob("*"):  # the secret is in no output, the checkpoint's config included
        assert not path.is_file() or b"battery staple" not in path.read_bytes(), path


def test_a_rank_of_another_run_is_refused_from_another_machine(machines: tuple[str, str], tmp_path: Path) -> None:
    """The tutorial's flags, typed as they are (no secret): node 0 on machine 0 waits for its node 1. From
    machine 1, a node 1 of another run (--seed 4) and one that brings a secret this job does not have, started
    with node 0, check in first, and then a second node 0 (-nr 0 typed twice): each is refused with its line and
    exits 2, while node 0 keeps waiting; then the real node 1 comes, and the job finishes. Node 0's store
    listens on machine 0's address alone, not on every interface."""
    port = free_port()
    flags = ["-n", "2", "-g", "1", "--master-addr", ADDRS[0], "--master-port", str(port)]
    env, mark = marked_env()
    with reaped(mark):
        node0 = start([*TRAIN, *flags, "-nr", "0", "--out", str(tmp_path / "out")], env, tmp_path,
                      tmp_path / "0.log", prefix=on(machines[0]))
        other = start([*TRAIN, *flags, "-nr", "1", "--seed", "4", "--out", str(tmp_path / "x")], env, tmp_path,
                      tmp_path / "other.log", prefix=on(machines[1]))
        keyed = start([*TRAIN, *flags, "-nr", "1", "--out", str(tmp_path / "y")], env | {"MNIST_DDP_SECRET": "k"},
                      tmp_path, tmp_path / "keyed.log", prefix=on(machines[1]))
        (rc_other, log_other) = finish(other, tmp_path / "other.log", HANG)
        (rc_keyed, log_keyed) = finish(keyed, tmp_path / "keyed.log", HANG)
        stores = {addr for addr, p in listening(mark) if p == port}
        # Once node 0's rank 0 admits (the two above were answered), a second node 0 (-nr 0 typed on both
        # machines) may only check in to it, as a rank 0 it already has.
        (rc_twice, log_twice) = finish(start([*TRAIN, *flags, "-nr", "0", "--out", str(tmp_path / "z")], env,
                                             tmp_path, tmp_path / "twice.log", prefix=on(machines[1])),
                                       tmp_path / "twice.log", HANG)
        node1 = start([*TRAIN, *flags, "-nr", "1", "--out", str(tmp_path / "out1")], env, tmp_path,
                      tmp_path / "1.log", prefix=on(machines[1]))
        (rc0, log0), (rc1, log1) = finish(node0, tmp_path / "0.log", HANG), finish(node1, tmp_path / "1.log", HANG)
    assert stores == {ADDRS[0]}, stores
    head = f"mnist-ddp: error: the job at {ADDRS[0]}:{port} refused this process (rank 1): "
    assert rc_other == 2 and ours(log_other) == [
        f"{head}it belongs to another run: seed 4 (the job: 3)."], log_other
    assert rc_keyed == 2 and ours(log_keyed) == [
        f"{head}its secret is not the job's (MNIST_DDP_SECRET or --secret-file must be the same on every node)."], \
        log_keyed
    assert rc_twice == 2 and ours(log_twice) == [
        f"mnist-ddp: error: the job at {ADDRS[0]}:{port} refused this process (rank 0): the job has its rank 0 "
        f"already (is -nr 0 given to two nodes, or is this another job's node 0?)."], log_twice
    assert rc0 == 0 and rc1 == 0, log0 + log1
    lines = refusals(log0)
    assert len(lines) == 3 and all(f"refused {ADDRS[1]} (" in line for line in lines), log0
    for log in (log0, log1):  # open to its network, and says so: one line on each node
        assert sum(line.startswith("mnist-ddp: warning: this job has no secret") for line in log.splitlines()) == 1, log
    assert [m["world_size"] for m in metrics(tmp_path / "out")] == [2, 2]


def test_two_jobs_given_one_address_never_mix(tmp_path: Path) -> None:
    """Jobs A and B, each `-n 2 -g 1` with a secret of its own and otherwise the same settings, are given the same
    master address and port. Their nodes 0 start together: one gets the port, the other is told it is in use.
    The losing job's node 1, which can only reach the winner's store, is refused there (it does not know that
    job's secret), and then the winner's node 1 is admitted and the winning job finishes."""
    port = free_port()
    flags = ["-n", "2", "-g", "1", "--master-addr", "127.0.0.1", "--master-port", str(port)]
    env, mark = marked_env()

    def node(job: str, n: int) -> subprocess.Popen:
        return start([*TRAIN, *flags, "-nr", str(n), "--out", str(tmp_path / f"{job}{n}")],
                     env | {"MNIST_DDP_SECRET": f"secret of {job}"}, tmp_path, tmp_path / f"{job}{n}.log")
    with reaped(mark):
        nodes0 = {job: node(job, 0) for job in "AB"}
        lost = wait_for("one node 0 to lose the port", lambda: next(
            (job for job, p in nodes0.items() if p.poll() is not None), None), HANG)
        won = "B" if lost == "A" else "A"
        done = {(lost, 0): finish(nodes0[lost], tmp_path / f"{lost}0.log", HANG)}
        done[lost, 1] = finish(node(lost, 1), tmp_path / f"{lost}1.log", HANG)
        done[won, 1] = finish(node(won, 1), tmp_path / f"{won}1.log", HANG)
        done[won, 0] = finish(nodes0[won], tmp_path / f"{won}0.log", HANG)
    assert done[lost, 0][0] == 2 and ours(done[lost, 0][1]) == [
        f"mnist-ddp: error: port {port} is already in use on this machine (another job or program listens there); "
        f"choose another --master-port (or MASTER_PORT)."], done[lost, 0]
    assert done[lost, 1][0] == 2 and ours(done[lost, 1][1]) == [
        f"mnist-ddp: error: the job at 127.0.0.1:{port} refused this process (rank 1): its secret is not the job's "
        f"(MNIST_DDP_SECRET or --secret-file must be the same on every node)."], done[lost, 1]
    assert done[won, 0][0] == 0 and done[won, 1][0] == 0, done
    assert len(refusals(done[won, 0][1])) == 1, done[won, 0]
    assert [m["world_size"] for m in metrics(tmp_path / f"{won}0")] == [2, 2]
    assert not (tmp_path / f"{lost}1").exists()  # the refused rank wrote nothing


def test_stray_traffic_leaves_the_weights_as_they_were(machines: tuple[str, str], tmp_path: Path) -> None:
    """The same run (world 2, seed 3) three times: undisturbed (`-g 2`); on this machine (ranks 0 and 1 started
    by hand, rank 0 hosting the store) with a stranger here; and across the two machines (`-n 2 -g 1`) with a
    stranger on machine 1. Each stranger (tests/stray.py) holds 1,000 idle connections and a request sent
    halfway open at the job's store, writes 8 MiB values into the job's keys again and again, and knocks on and
    sends random bytes to every port the job listens on (on machine 1, it also sweeps every port of machine 0);
    rank 1 comes only once that has begun, so the check-in happens under it all. The store hosts start with a
    soft limit of 1,024 open files. Both disturbed runs end with the undisturbed run's weights, bit for bit; the
    control, the same run with --seed 4, ends with other weights."""
    (quiet, quiet_mark), (env_here, mark_here), (env_there, mark_there) = (marked_env() for _ in range(3))
    plain = quiet | {"MNIST_DDP_TEST_MARK": "none"}  # the strangers are not part of any job
    here, there = free_port(), free_port()
    two = ["-n", "2", "-g", "1", "--master-addr", ADDRS[0], "--master-port", str(there)]
    env_here |= {"WORLD_SIZE": "2", "LOCAL_WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(here)}
    stray = [sys.executable, str(REPO / "tests" / "stray.py")]
    logs = [tmp_path / "stray-here", tmp_path / "stray-there"]
    with reaped(quiet_mark), reaped(mark_here), reaped(mark_there):  # each job's mark: a stranger finds only its own
        runs = {
            "undisturbed": start([*TRAIN, "-g", "2", "--out", str(tmp_path / "undisturbed")], quiet, tmp_path,
                                 tmp_path / "undisturbed.log"),
            "control": start([*TRAIN, "-g", "2", "--seed", "4", "--out", str(tmp_path / "control")], quiet,
                             tmp_path, tmp_path / "control.log"),
            "here": start([*TRAIN, "--out", str(tmp_path / "here")], env_here | {"RANK": "0", "LOCAL_RANK": "0"},
                          tmp_path, tmp_path / "here.log", prefix=SOFT_LIMIT_1024),
            "there": start([*TRAIN, *two, "-nr", "0", "--out", str(tmp_path / "there")], env_there, tmp_path,
                           tmp_path / "there.log", prefix=[*on(machines[0]), *SOFT_LIMIT_1024]),
        }
        strangers = [start([*stray, "127.0.0.1", str(here), mark_here], plain, tmp_path, logs[0], module=False),
                     start([*stray, ADDRS[0], str(there), mark_there, "--sweep"], plain, tmp_path, logs[1],
                           module=False, prefix=on(machines[1]))]
        for log, p in zip(logs, strangers):
            wait_for("the stranger's first 8 MiB values", lambda log=log: "8 MiB values" in log.read_text(), HANG,
                     running=p)
        ranks1 = {"here": start([*TRAIN, "--out", str(tmp_path / "here1")], env_here | {"RANK": "1", "LOCAL_RANK": "1"},
                                tmp_path, tmp_path / "here1.log"),
                  "there": start([*TRAIN, *two, "-nr", "1", "--out", str(tmp_path / "there1")], env_there, tmp_path,
                                 tmp_path / "there1.log", prefix=on(machines[1]))}
        done = {name: finish(p, tmp_path / f"{name}.log", HANG) for name, p in runs.items()}
        done |= {f"{name} rank 1": finish(p, tmp_path / f"{name}1.log", HANG) for name, p in ranks1.items()}
        for p in strangers:
            os.killpg(p.pid, signal.SIGKILL)
            p.wait()
    said = [log.read_text() for log in logs]
    for log in said:  # the strangers did what they are for
        assert "1000 idle connections and a request sent halfway, held open" in log, log
        assert "knocking, and sending random bytes" in log, log
    assert "swept every port of" in said[1], said[1]
    for name, (rc, log) in done.items():
        assert rc == 0, f"{name}: {log[-3000:]}"
    hashes = {name: weights_sha256(tmp_path / name) for name in runs}
    print(hashes)
    assert hashes["here"] == hashes["undisturbed"]
    assert hashes["there"] == hashes["undisturbed"]
    assert hashes["control"] != hashes["undisturbed"]


@pytest.mark.parametrize("raw", [b"[" * 10000, b"\xff\xfe", b"null", b'{"rank": 1}',
                                 json.dumps(GOOD).encode() + b" " * MAX_CHECKIN,
                                 *(json.dumps({**GOOD, **odd}).encode()
                                   for odd in ({"rank": "1"}, {"run": {"a": 1}}, {"spare": 1}))],
                         ids=["nested deep", "not UTF-8", "null", "a part", "too long", "rank a string",
                              "a setting a number", "a field more"])
def test_a_check_in_that_is_none_is_read_as_none(raw: bytes) -> None:
    """Anyone can write a check-in: every shape that is not one is read as none (and refused), nothing raises."""
    assert CheckIn.parse(json.dumps(GOOD).encode()) == CheckIn(**GOOD)  # the control: a real one is read
    assert CheckIn.parse(raw) is None


# (world size, ranks on this machine, master address, what the user set) -> what the rank sets
INTERFACES = [
    ((2, 2, ADDRS[0], {}), {"GLOO_SOCKET_IFNAME": "lo", "NCCL_SOCKET_IFNAME": "=lo"}),  # one machine: loopback
    ((4, 2, ADDRS[1], {}), {"GLOO_SOCKET_IFNAME": f"{TAG}a", "NCCL_SOCKET_IFNAME": f"={TAG}a"}),  # towards the master
    ((4, 2, ADDRS[1], {"NCCL_SOCKET_IFNAME": "eth"}), {"GLOO_SOCKET_IFNAME": f"{TAG}a"}),  # the user's choice stays
]
SNIPPET = ("import json, sys\nfrom mnist_ddp.joining.identity import Identity\n"
           "from mnist_ddp.joining.rendezvous import socket_interfaces\n"
           "print(json.dumps([socket_interfaces(Identity(world_size=w, local_world_size=lw, master_addr=addr), env) "
           "for w, lw, addr, env in json.loads(sys.argv[1])]))")


def test_gloo_and_nccl_use_the_interface_towards_the_master(machines: tuple[str, str]) -> None:
    """On machine 0: loopback for a job on one machine, else the veth that leads to the master on machine 1;
    NCCL's name with "=" (exactly this interface, not every one it prefixes); what the user set is left alone."""
    r = subprocess.run([*on(machines[0]), sys.executable, "-c", SNIPPET, json.dumps([c for c, _ in INTERFACES])],
                       capture_output=True, text=True, timeout=120, env={**os.environ, "PYTHONPATH": str(REPO / "src")})
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout) == [expected for _, expected in INTERFACES]


@pytest.mark.parametrize("case", ["missing", "empty", "readable by others", "empty MNIST_DDP_SECRET"])
def test_an_unusable_secret_is_one_sentence(case: str, tmp_path: Path) -> None:
    path, env = tmp_path / "secret", {}
    if case != "missing":
        path.write_text("" if case == "empty" else "s3cret\n")
        path.chmod(0o644 if case == "readable by others" else 0o600)
    args = ["train", *tiny(), "--out", str(tmp_path / "o")]
    if case == "empty MNIST_DDP_SECRET":
        env = {"MNIST_DDP_SECRET": " "}
    else:
        args += ["--secret-file", str(path)]
    r = run_cli(*args, cwd=tmp_path, env=env, timeout=60)
    said = {"missing": f"{path}: no such file (a secret was expected).",
            "empty": f"--secret-file {path} is empty; put the job's secret in it (e.g. `openssl rand -hex 32`).",
            "readable by others": f"--secret-file {path} can be read by other users (mode 0644); make it yours "
                                  f"alone: chmod 600 {path}.",
            "empty MNIST_DDP_SECRET": "MNIST_DDP_SECRET is set but empty; give it the job's secret (e.g. `openssl "
                                      "rand -hex 32`) or unset it."}
    assert r.returncode == 2 and r.stderr.strip().splitlines() == [f"mnist-ddp: error: {said[case]}"], r.stderr
    assert not (tmp_path / "o").exists()
