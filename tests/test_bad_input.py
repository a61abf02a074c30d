"""Hostile and mistaken input: one clear sentence, exit code 2, and nothing on disk overwritten or lost.

CASES is the table: each row builds its situation in a fresh folder and names the words the one error
line must contain. Every row runs the real `mnist-ddp` entry point (`cli.main`) in this process, and
the folder is fingerprinted before and after: no file may change, vanish, or appear (new empty folders
are allowed). A few cases that need more than one process run as real processes further down.
"""

import hashlib
import os
import pickle
import socket
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from torch import nn

from conftest import run_cli, tiny
from mnist_ddp import cli
from mnist_ddp.common.config import TrainConfig
from mnist_ddp.common.errors import UserError
from mnist_ddp.joining.identity import without_launcher_vars
from mnist_ddp.launchers import launch
from mnist_ddp.model import ConvNet
from mnist_ddp.outputs import checkpoint
from procfs import finish, free_port, marked_env, reaped, start

TRAIN = ["train", *tiny(200, 50, epochs=None)]
MARKER = "code-ran"  # the file the hostile pickle tries to create


class Evil:
    """Unpickling this runs a shell command: what a booby-trapped checkpoint would do."""

    def __init__(self, folder: Path) -> None:
        self.command = f"touch {folder / MARKER}"

    def __reduce__(self) -> tuple:
        return os.system, (self.command,)


def _ours(model: nn.Module) -> dict:
    """A complete, resumable checkpoint of ours around `model`'s weights."""
    return {"model": model.state_dict(), "optimizer": {"state": {}, "param_groups": []}, "scheduler": None,
            "progress": {"epoch": 1, "consumed": 0, "loss_sum": 0.0, "seen": 0, "best_accuracy": 0.5},
            "rng": torch.get_rng_state(), "config": {}}


def _real_checkpoint_bytes(tmp: Path) -> bytes:
    checkpoint.save(tmp / "c.pt", _ours(ConvNet()))
    data = (tmp / "c.pt").read_bytes()
    (tmp / "c.pt").unlink()
    return data


def _nested_deep(folder: Path) -> bytes:
    """A torch file whose pickle builds lists nested 100,000 deep (no Python pickler can write it: it recurses;
    the weights-only loader reads it, as it does not): one sentence too, not a RecursionError's traceback."""
    n = 100_000
    pkl = (b"\x80\x02}(X\x05\x00\x00\x00model}X\x06\x00\x00\x00digestX\x01\x00\x00\x00dX\x04\x00\x00\x00deep"
           + b"]" * n + b"a" * (n - 1) + b"u.")
    writer = torch._C.PyTorchFileWriter(str(folder / "checkpoint.pt"))
    for name, data in (("data.pkl", pkl), ("byteorder", b"little"), ("version", b"3\n")):
        writer.write_record(name, data, len(data))
    writer.write_end_of_file()
    return (folder / "checkpoint.pt").read_bytes()


# What can sit where a checkpoint is expected; each must be refused in one sentence, by name.
BAD_CHECKPOINTS: dict[str, tuple[Callable[[Path], bytes | None], str]] = {
    "a checkpoint of a different model": (
        lambda d: checkpoint.save(d / "checkpoint.pt", _ours(nn.Sequential(nn.Linear(4, 2)))),
        "not a checkpoint of this ConvNet"),
    "weights only (a bare state_dict) for --resume": (
        lambda d: torch.save(ConvNet().state_dict(), d / "checkpoint.pt"), "no training state"),
    "a text file": (lambda d: b"hello, I am not a checkpoint\n", "not a PyTorch checkpoint"),
    "an empty file": (lambda d: b"", "not a PyTorch checkpoint"),
    "random bytes": (lambda d: bytes(range(256)) * 40, "not a PyTorch checkpoint"),
    "a truncated checkpoint": (lambda d: _real_checkpoint_bytes(d)[:5000], "not a PyTorch checkpoint"),
    "a plain pickle that runs a command": (lambda d: pickle.dumps(Evil(d)), "not a PyTorch checkpoint"),
    "a torch.save'd object that runs a command": (lambda d: torch.save(Evil(d), d / "checkpoint.pt"),
                                                  "refused, loading it would import"),
    "values nested 100,000 deep": (_nested_deep, "nests values deeper than any checkpoint does"),
}


def _place_checkpoint(folder: Path, kind: str) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    data = BAD_CHECKPOINTS[kind][0](folder)
    if data is not None:
        (folder / "checkpoint.pt").write_bytes(data)
    return folder / "checkpoint.pt"


@dataclass(frozen=True)
class Case:
    prepare: Callable[[Path, pytest.MonkeyPatch], list[str]]  # builds the situation, returns the argv
    said: str  # words the error line must contain


def _listening(port_box: list[socket.socket]) -> int:
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    s.listen()
    port_box.append(s)
    return s.getsockname()[1]


HELD: list[socket.socket] = []  # sockets the port-in-use case keeps open while it runs

CASES: dict[str, Case] = {
    "port already in use": Case(
        lambda d, mp: [*TRAIN, "-n", "1", "-g", "2", "--master-port", str(_listening(HELD)), "--out", str(d / "o")],
        "is already in use on this machine"),
    "torchrun env with RANK >= WORLD_SIZE": Case(
        lambda d, mp: (mp.setenv("RANK", "4"), mp.setenv("WORLD_SIZE", "4"), [*TRAIN, "--out", str(d / "o")])[-1],
        "RANK=4 does not fit WORLD_SIZE=4"),
    "srun env with SLURM_PROCID >= SLURM_NTASKS": Case(
        lambda d, mp: (mp.setenv("SLURM_PROCID", "2"), mp.setenv("SLURM_NTASKS", "2"),
                       [*TRAIN, "--out", str(d / "o")])[-1],
        "SLURM_PROCID=2 does not fit SLURM_NTASKS=2"),
    "-n/-g under torchrun": Case(
        lambda d, mp: (mp.setenv("RANK", "0"), mp.setenv("WORLD_SIZE", "2"),
                       [*TRAIN, "-g", "2", "--out", str(d / "o")])[-1],
        "leave them out"),
    "-nr >= -n": Case(
        lambda d, mp: [*TRAIN, "-n", "2", "-nr", "2", "--master-addr", "127.0.0.1", "--master-port", "1",
                       "--out", str(d / "o")],
        "-nr/--nr is this node's index"),
    "-g larger than the visible GPUs (CUDA)": Case(
        lambda d, mp: (mp.setattr(torch.cuda, "is_available", lambda: True),
                       mp.setattr(torch.cuda, "device_count", lambda: 1),
                       [*TRAIN, "-g", "2", "--out", str(d / "o")])[-1],
        "-g/--gpus 2 asks for more GPUs than the 1 visible"),
    "--sync-bn on the CPU": Case(lambda d, mp: [*TRAIN, "--device", "cpu", "--sync-bn", "--out", str(d / "o")],
                                 "--sync-bn needs CUDA"),
    "--out under a regular file": Case(
        lambda d, mp: ((d / "notes.txt").write_text("precious"), [*TRAIN, "--out", str(d / "notes.txt" / "run")])[-1],
        "is not a writable folder"),
    "--out holds a run, no --resume": Case(
        lambda d, mp: (_place_checkpoint(d / "o", "a checkpoint of a different model"),
                       [*TRAIN, "--out", str(d / "o")])[-1],
        "already holds a run"),
    **{f"--out holds only another run's {', '.join(names)}{', --resume' if resume else ''}": Case(
        lambda d, mp, names=names, resume=resume: (
            (d / "o").mkdir(), *((d / "o" / n).write_bytes(b"another run's " + n.encode()) for n in names),
            [*TRAIN, *(["--resume"] if resume else []), "--out", str(d / "o")])[-1],
        "but no checkpoint.pt to continue from" if resume else "already holds a run")
       for names in (("best.pt", "model.safetensors"), ("model.safetensors",)) for resume in (False, True)},
    "--out holds only another run's steps.jsonl": Case(
        lambda d, mp: ((d / "o").mkdir(), (d / "o" / "steps.jsonl").write_text("{}\n"),
                       [*TRAIN, "--out", str(d / "o")])[-1], "choose another --out (it holds steps.jsonl)"),
    "a 300-character file name": Case(lambda d, mp: ["predict", "x" * 300 + ".pt", "a.png"], "file name too long"),
    "-g 1000 CPU processes": Case(lambda d, mp: [*TRAIN, "-g", "1000", "--device", "cpu", "--out", str(d / "o")],
                                  "asks for more worker processes than this machine's"),
    "--accumulate 1,000,000,000": Case(lambda d, mp: [*TRAIN, "--accumulate", "1000000000", "--out", str(d / "o")],
                                       "micro-batches a step, more than the 65,536"),
    **{f"--{flag} {value!r}": Case(lambda d, mp, flag=flag, value=value: [
        *TRAIN, *(["--out", str(d / "o")] if flag != "out" else []), f"--{flag}", value], said)
       for flag, value, said in (
        ("lr", "inf", "--lr must be a finite number, not inf"), ("timeout", "inf", "--timeout must be a finite"),
        ("heartbeat", "inf", "--heartbeat must be a finite"), ("heartbeat", "1e9", "is longer than --timeout"),
        ("out", "", "--out is empty"), ("out", " ", "--out is empty"), ("seed", "-1", "--seed must be from 0"))},
    "WORLD_SIZE=99999999999999999999": Case(
        lambda d, mp: (mp.setenv("RANK", "0"), mp.setenv("WORLD_SIZE", "9" * 20), [*TRAIN, "--out", str(d / "o")])[-1],
        "WORLD_SIZE='99999999999999999999' is not a whole number from 0 to 1,048,576"),
    **{f"--resume from {kind}": Case(
        lambda d, mp, kind=kind: (_place_checkpoint(d / "o", kind), [*TRAIN, "--resume", "--out", str(d / "o")])[-1],
        said) for kind, (_, said) in BAD_CHECKPOINTS.items()},
    **{f"evaluate {kind}": Case(
        lambda d, mp, kind=kind: ["evaluate", str(_place_checkpoint(d / "o", kind)), "--dataset", "synthetic",
                                  "--test-samples", "50"],
        said) for kind, (_, said) in BAD_CHECKPOINTS.items() if "resume" not in kind},
}


def _fingerprint(folder: Path) -> dict[str, str]:
    """Every file under `folder` but the synthetic data's cache, which a run may fill before it finds the error."""
    cache = folder / "data" / "synthetic"
    return {str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(folder.rglob("*")) if p.is_file() and not p.is_relative_to(cache)}


@pytest.fixture
def clean_env(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Iterator[pytest.MonkeyPatch]:
    """No launcher variables from the outside; the test's folder as working directory."""
    for name in set(os.environ) - set(without_launcher_vars(os.environ)):
        monkeypatch.delenv(name)
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("OMP_NUM_THREADS", "1")  # training in this process: one thread, as the children get
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield monkeypatch
    torch.set_num_threads(threads)
    while HELD:
        HELD.pop().close()


@pytest.mark.parametrize("case", CASES)
def test_bad_input(case: str, tmp_path: Path, clean_env: pytest.MonkeyPatch, capfd: pytest.CaptureFixture[str]) -> None:
    argv = CASES[case].prepare(tmp_path, clean_env)
    before = _fingerprint(tmp_path)
    code = cli.main(argv)
    _, err = capfd.readouterr()
    lines = err.strip().splitlines()
    assert code == 2, err
    assert len(lines) == 1 and lines[0].startswith("mnist-ddp: error: ") and "Traceback" not in err, err
    print(f"{case} -> {lines[0]}")
    assert CASES[case].said in lines[0], lines[0]
    assert _fingerprint(tmp_path) == before  # nothing overwritten, removed or added: the hostile pickle never ran


def test_preflight_counts_gpus_only_when_on_cuda(monkeypatch: pytest.MonkeyPatch) -> None:
    """-g above the GPU count is an error on CUDA (NCCL: a GPU each) unless --backend gloo lets processes share them;
    on the CPU -g means worker processes and any number is fine."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    launch.preflight(TrainConfig(gpus=2))
    with pytest.raises(UserError, match="-g/--gpus 3 asks for more GPUs than the 2 visible"):
        launch.preflight(TrainConfig(gpus=3))
    launch.preflight(TrainConfig(gpus=3, device="cpu"))  # CPU worker processes: not limited by GPUs
    launch.preflight(TrainConfig(gpus=3, backend="gloo"))  # gloo: processes may share a GPU


def test_hostile_checkpoint_as_a_real_process(tmp_path: Path) -> None:
    """The same refusal from `python -m mnist_ddp evaluate` itself: no traceback, and no code ran."""
    path = _place_checkpoint(tmp_path, "a torch.save'd object that runs a command")
    r = run_cli("evaluate", str(path), "--dataset", "synthetic", "--test-samples", "50", cwd=tmp_path, timeout=120)
    assert r.returncode == 2 and "refused" in r.stderr and "Traceback" not in r.stderr, r.stderr
    assert not (tmp_path / MARKER).exists()


def test_nodes_that_disagree_on_the_world_size(tmp_path: Path) -> None:
    """Node 0 says -n 2 -g 1 (world 2), node 1 says -n 2 -g 2 (world 4): node 1 learns it at once from
    node 0's store and says so; node 0, whose second process never comes, gives up after --timeout."""
    port = str(free_port())
    base = ["mnist_ddp", *TRAIN, "--timeout", "20", "--master-addr", "127.0.0.1", "--master-port", port]
    env, mark = marked_env()
    with reaped(mark):
        node0 = start([*base, "-n", "2", "-g", "1", "-nr", "0", "--out", str(tmp_path / "o")], env, tmp_path,
                      tmp_path / "0.log")
        node1 = start([*base, "-n", "2", "-g", "2", "-nr", "1", "--out", str(tmp_path / "o1")], env, tmp_path,
                      tmp_path / "1.log")
        (rc0, log0), (rc1, log1) = finish(node0, tmp_path / "0.log", 120), finish(node1, tmp_path / "1.log", 120)
    assert rc1 == 2 and "node 0 started a job of 2 processes, but this one was told the job has 4" in log1, log1
    assert rc0 == 2 and "could not join" in log0 and " within 20 s " in log0, log0  # --timeout's wait
    assert "Traceback" not in log0 + log1
    assert not (tmp_path / "o1").exists()

