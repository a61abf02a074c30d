"""--bitwise: the same run saves the same bytes at any world size, through resumes at other worlds, on two machines.

Real runs of the command line, compared by the SHA-256 of every tensor of the saved model's state_dict,
BatchNorm's buffers (num_batches_tracked included) too: no tolerance. The run is chaotic on purpose (fp32 SGD,
lr 0.05, momentum 0.9: any deviation grows to ~1e-3 within 30 steps) and uses the CPU's default layout
(channels_last). Its global batch is 4 micro-batches of 8, 30 steps over 2 epochs, trained
- in one process (--accumulate 4), on 2 processes (--accumulate 2, profiled), on 4;
- by 1 process stopped after its first checkpoint and resumed on 3 (sharing 4 micro-batches unevenly), and by
  4 processes killed (SIGKILL, all of them) mid-epoch 1, resumed on 3, stopped mid-epoch 2 and resumed on 2;
- on two machines (network namespaces), 2 processes each;
and all must save the same bytes. Controls that must differ: the same run with DDP's mean reduction, and a run
of another global batch (2 micro-batches), whose own copy resumed on 4 processes — more processes than
micro-batches, two of them idle — saves its bytes again.
"""

import os
import shutil
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Callable, Iterator
from contextlib import suppress
from pathlib import Path

import pytest

from conftest import cli_env, metrics, progress, run_cli, tiny
from datafiles import ONE_THREAD
from mnist_ddp import cli
from mnist_ddp.outputs import checkpoint
from netns import netns_pair
from procfs import finish, marked_env, reaped, start

ARGS = [*tiny(480, 100, epochs=2), "--batch-size", "8", "--optimizer", "sgd", "--lr", "0.05", "--momentum", "0.9",
        "--scheduler", "none", "--amp", "off", "--seed", "3"]  # 480 images, 4 micro-batches of 8: 15 steps an epoch
BITWISE = [*ARGS, "--bitwise"]
RUN_TIMEOUT = 240  # seconds: a hang detector on a shared box, not a timing assertion


def model_hash(out: Path) -> str:
    """SHA-256 of the saved model: every tensor's dtype, shape and bytes, every key (checkpoint.digest)."""
    return checkpoint.digest(checkpoint.load(out / "checkpoint.pt")["model"])


def _train(out: Path, *extra: str, args: list[str] = BITWISE) -> str:
    r = run_cli("train", *args, *extra, "--out", str(out), cwd=out.parent, env=ONE_THREAD, timeout=RUN_TIMEOUT)
    assert r.returncode == 0, r.stdout + r.stderr
    return r.stdout


def _stopped(out: Path, until: Callable[[dict], bool], *extra: str, kill: bool = False) -> str:
    """A run with a checkpoint after every step, stopped once a checkpoint satisfies `until` — by SIGTERM, as
    Ctrl-C or scancel do, or killed (`kill`: SIGKILL to every process of it, wherever they are, a save
    included) — returns what it said about resuming. Where exactly it stops does not matter: any checkpoint
    continues the same run."""
    log = out.parent / f"{out.name}.log"
    with open(log, "w") as f:  # a session of its own: its process group is the launcher, fork server and ranks
        run = subprocess.Popen([sys.executable, "-m", "mnist_ddp", "train", *BITWISE, "--checkpoint-every", "1",
                                *extra, "--out", str(out)], cwd=out.parent, env=cli_env(ONE_THREAD), stdout=f,
                               stderr=subprocess.STDOUT, start_new_session=True)
    try:
        deadline = time.monotonic() + RUN_TIMEOUT
        while not ((seen := progress(out)) and until(seen)):
            assert run.poll() is None, f"the run ended before it could be stopped: {log.read_text()}"
            assert time.monotonic() < deadline, "no such checkpoint in time"
            time.sleep(0.005)
        if kill:
            os.killpg(run.pid, signal.SIGKILL)
        else:
            run.send_signal(signal.SIGTERM)
        run.wait(RUN_TIMEOUT)
    finally:
        with suppress(ProcessLookupError):
            os.killpg(run.pid, signal.SIGKILL)
        run.wait()
    assert run.returncode == (-signal.SIGKILL if kill else 130), log.read_text()  # stopped, not finished
    return _resume_lines(log.read_text())


def _resume_lines(stdout: str) -> str:
    return "\n".join(line for line in stdout.splitlines() if line.startswith("resume: "))


def _resumed(out: Path, world: int, until: Callable[[dict], bool] | None = None) -> str:
    """--resume at `world` processes, to the end or stopped again (`until`); returns what it said about the resume,
    which must be where it continued from and the change of world."""
    again = ["-g", str(world), "--checkpoint-every", "1", "--resume"]
    said = _stopped(out, until, *again) if until else _resume_lines(_train(out, *again))
    lines = said.splitlines()
    assert len(lines) == 2 and "samples done" in lines[0] and f"→ {world};" in lines[1], said
    return said


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[Path, str]]:
    """Every run of this module, trained once: name → (its folder, what it said)."""
    root = tmp_path_factory.mktemp("bitwise")
    found = {}

    def one(name: str, train: Callable[[Path], str]) -> None:
        out = root / name.replace(" ", "_")
        found[name] = (out, train(out))

    one("1", lambda out: _train(out, "--accumulate", "4"))
    one("2 profiled", lambda out: _train(out, "-g", "2", "--accumulate", "2", "--profile", "3"))
    one("4", lambda out: _train(out, "-g", "4"))
    one("1 → 3", lambda out: _stopped(out, lambda p: True, "--accumulate", "4") + _resumed(out, 3))
    one("4 → 3 → 2", lambda out: "\n".join((
        _stopped(out, lambda p: p["epoch"] == 0 and p["consumed"] >= 3 * 32, "-g", "4", kill=True),  # in epoch 1
        _resumed(out, 3, until=lambda p: p["epoch"] == 1 and p["consumed"] > 0),  # inside epoch 2
        _resumed(out, 2))))
    one("control: DDP's mean", lambda out: _train(out, "-g", "2", "--accumulate", "2", args=ARGS))
    one("control: 2 micro-batches", lambda out: _train(out, "-g", "2"))
    one("2 micro-batches, 1 → 4", lambda out: _stopped(out, lambda p: True, "--accumulate", "2") + _resumed(out, 4))
    return found


SAME_RUN = ("1", "2 profiled", "4", "1 → 3", "4 → 3 → 2")


def test_the_same_run_saves_the_same_bytes_at_every_world(runs: dict[str, tuple[Path, str]]) -> None:
    hashes = {name: model_hash(runs[name][0]) for name in SAME_RUN}
    print("\n".join(f"{name:>10s}: {h}" for name, h in hashes.items()))
    assert len(set(hashes.values())) == 1, hashes
    reference = runs["1"][0]
    for name in SAME_RUN:
        out = runs[name][0]
        assert [m["test_correct"] for m in metrics(out)] == [m["test_correct"] for m in metrics(reference)], name
        assert checkpoint.load(out / "checkpoint.pt")["progress"]["epoch"] == 2, name
    assert "1 thread(s) per process (pinned by --bitwise" in runs["4"][1]
    assert (runs["2 profiled"][0] / "profile" / "timeline.png").is_file()  # profiled, and still the same bytes
    assert "3 processes share 4 micro-batches of 8 unevenly" in runs["1 → 3"][1]
    assert [line.split("world size ")[1].split(";")[0] for line in runs["4 → 3 → 2"][1].splitlines()
            if "world size" in line] == ["4 → 3", "3 → 2"]
    assert [m["world_size"] for m in metrics(runs["4 → 3 → 2"][0])] == [3, 2]  # epoch 1 ended at 3, epoch 2 at 2


def test_controls_differ(runs: dict[str, tuple[Path, str]]) -> None:
    """The hash is not blind: DDP's mean reduction of the same run, and a run of another global batch, differ."""
    same = model_hash(runs["1"][0])
    controls = {name: model_hash(runs[name][0]) for name in ("control: DDP's mean", "control: 2 micro-batches")}
    print("\n".join(f"{name}: {h}" for name, h in controls.items()))
    assert same not in controls.values()


def test_more_processes_than_micro_batches_leave_the_run_as_it_is(runs: dict[str, tuple[Path, str]]) -> None:
    """Resumed on 4 processes, a run of 2 micro-batches keeps them whole (cut, BatchNorm would normalise other
    groups): ranks 2-3 train nothing, and the run saves the bytes of its uninterrupted copy on 2 processes."""
    out, said = runs["2 micro-batches, 1 → 4"]
    assert "ranks 2-3 train none of its 2 micro-batches of 8" in said, said
    print(f"2 micro-batches, 1 -> 4: {model_hash(out)}")
    assert model_hash(out) == model_hash(runs["control: 2 micro-batches"][0])


ADDRS = ("10.79.0.1", "10.79.0.2")


@pytest.fixture
def machines() -> Iterator[tuple[str, str]]:
    with netns_pair(f"mbit-{uuid.uuid4().hex[:6]}", ADDRS) as names:
        yield names


def test_two_machines_save_the_same_bytes(runs: dict[str, tuple[Path, str]], machines: tuple[str, str],
                                          tmp_path: Path) -> None:
    """-n 2 -g 2 on two network namespaces (world 4 over a veth cable) saves the bytes of the one-process run."""
    env, mark = marked_env()
    outs = [tmp_path / f"node{n}-disk" for n in range(2)]
    with reaped(mark):
        nodes = [start(["mnist_ddp", "train", *BITWISE, "-n", "2", "-g", "2", "-nr", str(n), "--master-addr", ADDRS[0],
                        "--master-port", "29410", "--out", str(outs[n])], env, tmp_path, tmp_path / f"node{n}.log",
                       prefix=["ip", "netns", "exec", machines[n]]) for n in range(2)]
        results = [finish(p, tmp_path / f"node{n}.log", RUN_TIMEOUT) for n, p in enumerate(nodes)]
    for rc, log in results:
        assert rc == 0, log
    assert "world size 4" in results[0][1]
    print(f"two machines, 2 x 2: {model_hash(outs[0])}")
    assert model_hash(outs[0]) == model_hash(runs["1"][0])


def test_a_bitwise_run_resumes_only_as_one(runs: dict[str, tuple[Path, str]], tmp_path: Path,
                                          capsys: pytest.CaptureFixture[str]) -> None:
    """Without --bitwise, or with other kernels (--amp), the resumed run would not be the same bits: refused."""
    out = tmp_path / "copy"
    shutil.copytree(runs["4 → 3 → 2"][0], out)
    for changed, flags in (("bitwise", ARGS), ("amp", [*BITWISE, "--amp", "bf16"])):
        assert cli.main(["train", *flags, "--out", str(out), "--resume"]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and f"different settings ({changed})" in err[0], err


def test_bitwise_with_sync_bn_is_refused(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["train", "--bitwise", "--sync-bn"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--bitwise and --sync-bn exclude each other" in err[0], err
