"""Bad command lines: each is one clear line on stderr and exit code 2, before any work or any file."""

import re
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import cli_env, run_cli, tiny
from mnist_ddp import cli

# (flags added to a good tiny `train` command line, words the one-line error must contain)
BAD_TRAIN = [
    (["--epochs", "0"], "--epochs must be at least 1"),
    (["--epochs", "two"], "invalid int value"),
    (["--lr", "-1"], "--lr must be positive"),
    (["--lr", "0"], "--lr must be positive"),
    (["--batch-size", "0"], "--batch-size must be at least 1"),
    (["--eval-batch-size", "0"], "--eval-batch-size"),
    (["--accumulate", "0"], "--accumulate must be at least 1 micro-batch per step"),
    (["--momentum", "1.5"], "--momentum"),
    (["--weight-decay", "-0.1"], "--weight-decay"),
    (["--label-smoothing", "1"], "--label-smoothing"),
    (["--dataset", "foo"], "invalid choice: 'foo'"),
    (["--train-samples", "0"], "--train-samples must be at least 1"),
    (["--test-samples", "-5"], "--test-samples must be at least 1"),
    (["--download-timeout", "0"], "--download-timeout"),
    (["--checkpoint-every", "-1"], "--checkpoint-every"),
    (["-g", "0"], "-g/--gpus must be at least 1"),
    (["-n", "0"], "-n/--nodes must be at least 1"),
    (["-n", "2", "-nr", "2", "--master-addr", "10.0.0.1", "--master-port", "29400"], "-nr/--nr"),
    (["-nr", "-1"], "-nr/--nr"),
    (["-n", "2"], "--master-addr"),
    (["-n", "2", "--master-addr", "10.0.0.1"], "--master-port"),
    (["--master-port", "70000"], "--master-port 70000"),
    (["--timeout", "0"], "--timeout"),
    (["--heartbeat", "-1"], "--heartbeat is seconds between beats (0: off), not -1.0."),
    (["--device", "tpu"], "invalid choice: 'tpu'"),
    (["--device", "cpu", "--amp", "fp16"], "--amp fp16 needs CUDA"),
    (["--device", "cpu", "--sync-bn"], "--sync-bn needs CUDA"),
    (["--device", "cpu", "--backend", "nccl"], "--backend nccl needs CUDA"),
    (["--optimizer", "lbfgs"], "invalid choice: 'lbfgs'"),
    (["--recipe", "fast"], "invalid choice: 'fast'"),
    (["--no-such-flag"], "unrecognized arguments: --no-such-flag"),
    (["--target-accuracy", "0"], "--target-accuracy is a test accuracy above 0 and at most 1"),
    (["--target-accuracy", "-0.5"], "--target-accuracy is a test accuracy above 0 and at most 1"),
    (["--target-accuracy", "99"], "(0.99: 99%), not 99.0."),
]


@pytest.fixture(autouse=True)
def _no_launcher_env(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """As on a fresh shell: no MASTER_* or torchrun/SLURM variables, and an empty working directory."""
    for name in ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE", "LOCAL_RANK", "SLURM_PROCID", "SLURM_NTASKS"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.chdir(tmp_path)


def _one_error_line(capsys: pytest.CaptureFixture[str], argv: list[str]) -> str:
    code = cli.main(argv)
    out, err = capsys.readouterr()
    lines = err.strip().splitlines()
    assert code == 2 and len(lines) == 1 and lines[0].startswith("mnist-ddp: error: "), (code, err)
    assert "Traceback" not in err and out == ""
    return lines[0]


def _train(tmp_path: Path, *flags: str) -> list[str]:
    return ["train", *tiny(100, 100, epochs=None), "--no-download", "--out", str(tmp_path / "run"), *flags]


@pytest.mark.parametrize(("flags", "said"), BAD_TRAIN, ids=[" ".join(f) for f, _ in BAD_TRAIN])
def test_bad_train_flags(tmp_path: Path, capsys: pytest.CaptureFixture[str], flags: list[str], said: str) -> None:
    assert said in _one_error_line(capsys, _train(tmp_path, *flags))
    assert not (tmp_path / "run").exists()  # refused before anything was created


def test_bad_port_in_the_environment(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                     monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MASTER_PORT", "http")
    assert "MASTER_PORT='http'" in _one_error_line(capsys, _train(tmp_path))


def test_out_that_is_a_file(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    (tmp_path / "run").write_text("precious")
    assert "not a writable folder" in _one_error_line(capsys, _train(tmp_path))
    assert (tmp_path / "run").read_text() == "precious"


@pytest.mark.parametrize(("argv", "said"), [
    ([], "required: command"),
    (["fly"], "invalid choice: 'fly'"),
    (["evaluate"], "required: checkpoint"),
    (["evaluate", "missing.pt"], "missing.pt: no such file (a checkpoint was expected)"),
    (["evaluate", "missing.pt", "--batch-size", "0"], "--batch-size must be at least 1"),
    (["predict", "model.pt"], "required: FILE"),
    (["predict", "model.pt", "x.png", "--top", "11"], "--top must be between 1 and 10"),
])
def test_bad_evaluate_predict_and_commands(capsys: pytest.CaptureFixture[str], argv: list[str], said: str) -> None:
    assert said in _one_error_line(capsys, argv)


def test_the_real_entry_point(tmp_path: Path) -> None:
    """`python -m mnist_ddp` (what the console script and torchrun run): the same line, exit 2, no traceback."""
    r = run_cli(*_train(tmp_path, "--epochs", "0"), cwd=tmp_path, timeout=120)
    assert r.returncode == 2 and r.stdout == ""
    assert r.stderr.strip() == "mnist-ddp: error: --epochs must be at least 1, not 0."
    ok = run_cli("train", "--help", cwd=tmp_path, timeout=120)
    assert ok.returncode == 0 and "--master-addr" in ok.stdout and "(default: 1)" in ok.stdout


def test_arguments_are_checked_before_torch_is_imported() -> None:
    """`--help` and a bad flag answer at once: the CLI and the configs import no torch (seconds to load)."""
    probe = ("import sys; from mnist_ddp import cli; rc = cli.main(['train', '--epochs', '0']); "
             "print(rc, 'torch' in sys.modules)")
    r = subprocess.run([sys.executable, "-c", probe], env=cli_env(), capture_output=True, text=True, timeout=60)
    assert r.stdout.split() == ["2", "False"], r.stdout + r.stderr


def _help_entries(text: str) -> dict[str, str]:
    """`--help`'s options, each flag (its last spelling) -> its help text joined into one line."""
    entries: dict[str, str] = {}
    flag = None
    for line in text.splitlines():
        if line.startswith("  -"):
            head = line.split("  ", 2)[1]
            flag = re.findall(r"(?:^|, )(--?[\w-]+)", head)[-1]
            entries[flag] = line[2 + len(head):].strip()
        elif flag and line.startswith("   "):
            entries[flag] += " " + line.strip()
        else:
            flag = None
    return entries


def test_train_help_states_each_default_once_and_truly(capsys: pytest.CaptureFixture[str],
                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    """`train --help` as a user reads it: every option says its default exactly once, never argparse's bare
    None or [], a switch (--no-download, --resume, …) says it is off unless given, and a recipe knob names the
    value a bare `train` really uses."""
    monkeypatch.setenv("COLUMNS", "100")
    with pytest.raises(SystemExit) as done:
        cli.main(["train", "--help"])
    assert done.value.code == 0
    entries = _help_entries(capsys.readouterr().out)
    parser = cli.command_parser("train")
    flags = {a.option_strings[-1]: a for a in parser._actions if a.option_strings and a.dest != "help"}
    assert set(entries) - {"--help"} == set(flags)
    for flag, said in entries.items():
        if flag == "--help":
            continue
        assert said.count("(default") == 1, f"{flag}: {said}"
        assert "(default: None)" not in said and "(default: [])" not in said, f"{flag}: {said}"
        if flags[flag].nargs == 0 and flags[flag].default is not None:  # a switch: store_true or store_false
            assert "(default: off" in said, f"{flag}: {said}"
    assert entries["--dataset"].endswith("(default: mnist)")
    plain = cli.configure(["train"])
    for knob in ("lr", "momentum", "weight_decay", "batch_size", "epochs", "label_smoothing"):
        flag = "--" + knob.replace("_", "-")
        assert f"(default: the recipe's: {getattr(plain.recipe, knob)}" in entries[flag], entries[flag]
    assert (plain.data.download, plain.progress, plain.plots) == (True, True, True)  # what "off" above means
