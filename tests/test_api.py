"""The Python API (`mnist_ddp.train`, `evaluate`, `predict`) is the command line's twin: every flag a keyword,
the same checks and sentences, the same launchers, and the run's results as data equal to its files."""

import argparse
import inspect
import json
import os
import re
import signal
import subprocess
import sys
import threading
import traceback
from pathlib import Path
from typing import Any

import pytest
import torch
from PIL import Image

import mnist_ddp
from conftest import cli_env, tiny
from mnist_ddp import UserError, api, cli
from mnist_ddp.outputs import checkpoint

COMMANDS = {"train": mnist_ddp.train, "evaluate": mnist_ddp.evaluate, "predict": mnist_ddp.predict}
SMALL = {"dataset": "synthetic", "train_samples": 400, "test_samples": 100, "epochs": 1}  # a run of seconds


@pytest.fixture(autouse=True)
def _fresh_shell(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """No launcher variables, one thread (these runs share a few cores), an empty working directory."""
    for name in ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE", "LOCAL_RANK", "SLURM_PROCID", "SLURM_NTASKS"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    monkeypatch.chdir(tmp_path)


def _options(command: str) -> list[argparse.Action]:
    return [a for a in cli.command_parser(command)._actions if a.option_strings and a.dest != "help"]


def _samples(a: argparse.Action) -> list[tuple[Any, list[str]]]:
    """Values for option `a`, each with the flags a person would type for it (its first, shortest spelling)."""
    flag = a.option_strings[0]
    if isinstance(a, argparse.BooleanOptionalAction):
        return [(True, [a.option_strings[0]]), (False, [a.option_strings[1]])]
    if a.nargs == 0:
        return [(not a.default, [flag])]
    if a.nargs == "?":
        return [(True, [flag]), (3, [flag, "3"])]
    if a.choices:
        choice = next(c for c in reversed(a.choices) if c != a.default)
        return [(choice, [flag, choice])]
    if isinstance(a.default, list):
        return [(["http://a", "http://b"], [flag, "http://a", flag, "http://b"])]
    value = {int: 3, float: 0.25}.get(a.type, "-odd name")
    return [(value, [flag, str(value)] if value != "-odd name" else [f"{flag}=-odd name"])]


@pytest.mark.parametrize("command", COMMANDS)
def test_every_flag_is_a_keyword_and_back(command: str) -> None:
    """A walk of the parser: each option of `mnist-ddp COMMAND` has its keyword (its dest; -g is processes=), and
    every value of it parses as the flag typed by hand does; the function's signature has exactly these."""
    keywords = api.keywords(command)
    options = _options(command)
    flags = sorted(a.option_strings for a in keywords.values())
    assert flags == sorted(a.option_strings for a in options) and flags  # each option once, nothing else
    parser = cli.command_parser(command)
    positionals = [a for a in parser._actions if not a.option_strings]
    given = ["model.pt", "a.png"][:len(positionals)]
    for keyword, action in keywords.items():
        assert keyword == api.RENAMED.get(action.dest, action.dest)
        for value, flags in _samples(action):
            ours = api.command_line(command, {keyword: value}, tuple(given))[1:]
            assert parser.parse_args(ours) == parser.parse_args([*flags, *given]), (keyword, value, ours)
            assert parser.parse_args(ours) != parser.parse_args(given), (keyword, value)  # the control: it says so
    signature = inspect.signature(COMMANDS[command]).parameters
    assert [n for n, p in signature.items() if p.kind is p.KEYWORD_ONLY] == list(keywords)
    assert "processes" in api.keywords("train") and "gpus" not in api.keywords("train")


# (keywords, the same as the command line's flags): each refused with the command's own sentence
BAD = [
    ({"epochs": 0}, ["--epochs", "0"]),
    ({"epochs": "two"}, ["--epochs", "two"]),
    ({"epochs": 1.5}, ["--epochs", "1.5"]),
    ({"lr": -1}, ["--lr", "-1"]),
    ({"processes": 0}, ["-g", "0"]),
    ({"dataset": "foo"}, ["--dataset", "foo"]),
    ({"nodes": 2}, ["-n", "2"]),
    ({"master_port": 70000}, ["--master-port", "70000"]),
    ({"target_accuracy": 99}, ["--target-accuracy", "99"]),
    ({"heartbeat": -1}, ["--heartbeat", "-1"]),
    ({"device": "cpu", "amp": "fp16"}, ["--device", "cpu", "--amp", "fp16"]),  # checked in launch, torch loaded
    ({"out": "a-file"}, ["--out", "a-file"]),  # an --out that is a file: refused, and left as it was
]


@pytest.mark.parametrize(("keywords", "flags"), BAD, ids=[" ".join(f) for _, f in BAD])
def test_a_bad_value_raises_the_commands_sentence(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                                  keywords: dict[str, Any], flags: list[str]) -> None:
    Path("a-file").write_text("precious")
    assert cli.main(["train", *tiny(100, 100), "--out", "run", *flags]) == 2
    said = capsys.readouterr().err.strip().removeprefix("mnist-ddp: error: ")
    with pytest.raises(UserError) as e:
        mnist_ddp.train(**{**SMALL, "progress": False, "plots": False, "out": "run", **keywords})
    assert str(e.value) == said
    # One exception, its traceback cut at the call: no frame below api.py's, no chained cause.
    assert {Path(f.filename).name for f in traceback.extract_tb(e.value.__traceback__)} <= {"test_api.py", "api.py"}
    assert e.value.__cause__ is None and e.value.__context__ is None
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a-file"] and Path("a-file").read_text() == "precious"


def test_the_launchers_environment_is_honoured(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str],
                                               tmp_path: Path) -> None:
    """Inside a launcher's environment the API reads it as the command does: torchrun's variables with -n 2,
    refused alike (-n/-g/-nr are not for a launched rank; -n, not -g, so that no fork server starts for it);
    and a bad MASTER_PORT, named alike."""
    for env, flags in (({"RANK": "0", "WORLD_SIZE": "2", "LOCAL_RANK": "0", "MASTER_ADDR": "127.0.0.1",
                         "MASTER_PORT": "29511"}, {"nodes": 2}), ({"MASTER_PORT": "http"}, {})):
        with monkeypatch.context() as m:
            for k, v in env.items():
                m.setenv(k, v)
            assert cli.main(["train", *tiny(), *(["-n", "2"] if flags else []), "--out", "run"]) == 2
            said = capsys.readouterr().err.strip().removeprefix("mnist-ddp: error: ")
            with pytest.raises(UserError) as e:
                mnist_ddp.train(**SMALL, out="run", **flags)
            assert str(e.value) == said and ("already started 2 processes" in said or "MASTER_PORT='http'" in said)
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize(("call", "said"), [
    (lambda: mnist_ddp.train(gpus=2), "train() has no keyword gpus=; did you mean processes=?"),
    (lambda: mnist_ddp.train(epoch=2), "train() has no keyword epoch=; did you mean epochs=?"),
    (lambda: mnist_ddp.train(compile="yes"), "compile= is True or False (the switch --compile), not 'yes'."),
    (lambda: mnist_ddp.evaluate("m.pt", top=3), "evaluate() has no keyword top="),
    (lambda: mnist_ddp.predict("m.pt", 3.5), "predict's input 0 is a float;"),
    (lambda: mnist_ddp.predict("missing.pt", "a.png"), "missing.pt: no such file (a checkpoint was expected)"),
])
def test_what_only_python_can_get_wrong(call: Any, said: str) -> None:
    with pytest.raises(UserError) as e:
        call()
    assert str(e.value).startswith(said), str(e.value)


def test_the_run_as_data_is_its_files(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                      capsys: pytest.CaptureFixture[str]) -> None:
    """One process, in this one: the Run's metrics and steps are metrics.jsonl's and steps.jsonl's lines, its paths
    the files there; Run.load reads the same back; pandas gives the same rows, and without pandas one sentence."""
    run = mnist_ddp.train(**{**SMALL, "epochs": 2}, log_every=1, progress=False, out="run")
    out = tmp_path / "run"
    lines = [[json.loads(line) for line in (out / name).read_text().splitlines()] for name in ("metrics.jsonl",
                                                                                            "steps.jsonl")]
    assert [run.metrics, run.steps] == lines and len(lines[0]) == 2 and len(lines[1]) == 8  # 4 steps an epoch
    assert run.accuracy == lines[0][-1]["test_accuracy"] != lines[0][0]["test_accuracy"]  # the last epoch's
    assert (run.checkpoint, run.best) == (Path("run/checkpoint.pt"), Path("run/best.pt"))
    assert {k: p.is_file() for k, p in run.plots.items()} == {"curves": True, "confusion": True}
    assert run.config is not None and run.config.recipe.epochs == 2
    assert mnist_ddp.Run.load("run", run.config) == run
    assert run.dataframe().to_dict("records") == lines[0] and len(run.steps_dataframe()) == 8
    monkeypatch.setitem(sys.modules, "pandas", None)  # as if not installed
    with pytest.raises(ImportError, match=r"^Run.dataframe\(\) needs pandas, .*: pip install pandas, or "
                       r"'mnist-ddp\[notebook\]'"):
        run.dataframe()

    capsys.readouterr()
    evaluation = mnist_ddp.evaluate(run.checkpoint, dataset="synthetic", test_samples=100)
    assert evaluation.accuracy == run.accuracy and sum(map(sum, evaluation.confusion)) == evaluation.count == 100
    assert cli.main(["evaluate", "run/checkpoint.pt", "--dataset", "synthetic", "--test-samples", "100"]) == 0
    assert capsys.readouterr().out.strip() == str(evaluation)

    torch.manual_seed(0)
    digits = torch.randint(0, 256, (3, 28, 28), dtype=torch.uint8)
    Image.frombytes("L", (28, 28), bytes(digits[0].flatten().tolist())).save("one.png")
    by_tensor = mnist_ddp.predict(run.best, digits, top=2)
    mixed = mnist_ddp.predict(run.best, [digits[:, None].float() / 255, Image.open("one.png"), "one.png"], top=2)
    assert [p.source for p in by_tensor] == ["input 0[0]", "input 0[1]", "input 0[2]"]
    assert [p.source for p in mixed] == ["input 0[0]", "input 0[1]", "input 0[2]", "input 1", "one.png"]
    # floats in [0, 1] are the same pixels; a PIL image is read as its file is
    assert [(p.classes, p.probabilities) for p in mixed[:3]] == [(p.classes, p.probabilities) for p in by_tensor]
    assert (mixed[3].classes, mixed[3].probabilities) == (mixed[4].classes, mixed[4].probabilities)
    assert cli.main(["predict", "run/best.pt", "one.png", "--top", "2"]) == 0
    (top, p), (second, q) = zip(mixed[4].classes, mixed[4].probabilities)
    printed = capsys.readouterr().out.strip()
    assert printed == str(mixed[4]) == f"one.png: {top} ({100 * p:.1f}%), {second} ({100 * q:.1f}%)"
    assert (mixed[4].label, mixed[4].probability) == (top, p)
    for bad, said in ((torch.zeros(32, 32), "a tensor of shape (32, 32)"),
                      (torch.full((28, 28), 2.0), "pixel values from 2 to 2"),
                      (torch.zeros(28, 28, dtype=torch.int64), "a torch.int64 tensor")):
        with pytest.raises(UserError, match="^" + re.escape(f"input 0: {said}")):
            mnist_ddp.predict(run.best, bad)


def test_an_interrupt_gives_back_the_callers_handler(tmp_path: Path) -> None:
    """After Ctrl-C stopped a run, the caller's own SIGINT handler is back (the launcher ignores repeats for good,
    right for a command, which exits next, not for a kernel, which goes on), and the checkpoint stays."""
    def mine(signum: int, frame: Any) -> None:
        raise AssertionError("not ours to be called during training")

    def interrupt_once_training() -> None:
        while not (tmp_path / "run" / "checkpoint.pt").is_file():
            if stop.wait(0.05):
                return
        os.kill(os.getpid(), signal.SIGINT)

    previous = signal.signal(signal.SIGINT, mine)
    stop = threading.Event()
    thread = threading.Thread(target=interrupt_once_training)
    try:
        thread.start()
        with pytest.raises(KeyboardInterrupt, match=r"run/checkpoint\.pt keeps the last checkpoint"):
            mnist_ddp.train(**{**SMALL, "epochs": 500}, progress=False, plots=False, out="run")
        assert signal.getsignal(signal.SIGINT) is mine
    finally:
        stop.set()
        thread.join()
        signal.signal(signal.SIGINT, previous)
    # the checkpoint kept is whole, a run's, and as far on as the one the interrupt waited for (or further)
    kept = checkpoint.load(tmp_path / "run" / "checkpoint.pt")
    assert mnist_ddp.Run.load("run").checkpoint is not None
    assert kept["progress"]["epoch"] + kept["progress"]["consumed"] > 0


def test_inside_torchrun(tmp_path: Path) -> None:
    """`torchrun --standalone --nproc-per-node 2 script.py`, the script calling train(): the ranks are torchrun's
    (nodes=2 is refused there, as -n is), and every rank gets the run, rank 0's files, back."""
    script = tmp_path / "script.py"
    script.write_text(
        "import json, os\nimport mnist_ddp\n"
        f"small = {SMALL!r}\n"
        "try:\n    mnist_ddp.train(**small, nodes=2, out='run')\nexcept mnist_ddp.UserError as e:\n"
        "    refused = str(e)\n"
        "run = mnist_ddp.train(**small, progress=False, out='run')\n"
        "print(json.dumps({'rank': os.environ['RANK'], 'refused': refused, 'metrics': run.metrics}))\n")
    r = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                        str(script)], cwd=tmp_path, env=cli_env({"OMP_NUM_THREADS": "1"}), capture_output=True,
                       text=True, timeout=180)
    assert r.returncode == 0, r.stderr
    said = {}
    for line in r.stdout.splitlines():
        if line.startswith("{"):
            rank = json.loads(line)
            said[rank.pop("rank")] = rank
    written = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert said["0"] == said["1"] and said["0"]["metrics"] == written and written[-1]["world_size"] == 2
    assert said["0"]["refused"].startswith("torchrun already started 2 processes; -n/-g/-nr are for mnist-ddp's")


def test_import_mnist_ddp_imports_no_torch() -> None:
    """`import mnist_ddp` (the API with it) and a bad keyword answer at once: no torch loaded (seconds)."""
    probe = ("import sys, mnist_ddp\ntry:\n    mnist_ddp.train(epochs=0)\nexcept mnist_ddp.UserError as e:\n"
             "    print(e, 'torch' in sys.modules)")
    r = subprocess.run([sys.executable, "-c", probe], env=cli_env(), capture_output=True, text=True, timeout=60)
    assert r.stdout.strip() == "--epochs must be at least 1, not 0. False", r.stdout + r.stderr
