"""--mlflow: a real run, stopped after its first epoch and resumed by two processes, is one MLflow run named after its
folder, whose numbers, read back through MLflow's own client, are metrics.jsonl's and steps.jsonl's, with the run's
settings and files; the one process that logged opened no socket off this machine. Without the package the
flag is refused before anything starts; a run that fails is FAILED there. (Three runs in all: importing mlflow
costs each about a second.)"""

import ast
import ipaddress
import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import cli_env, metrics, run_cli, tiny
from datafiles import ONE_THREAD
from mnist_ddp import cli
from mnist_ddp.common.config import TrainConfig
from mnist_ddp.common.errors import UserError
from mnist_ddp.launchers import launch
from mnist_ddp.outputs import tracking
from test_stops import DIVERGING

pytest.importorskip("mlflow")  # the dev extra installs the mlflow extra's packages
from mlflow.tracking import MlflowClient

# What SQLAlchemy says of MLflow's store in this process (a user's run shows no warnings).
pytestmark = pytest.mark.filterwarnings("ignore:The ``noload`` loader strategy:DeprecationWarning")

SAMPLES = 800  # per epoch, tiny()'s: the x-axis ("step") counts training samples, as TensorBoard's
WITH_PLOTS = [arg for arg in tiny(epochs=2) if arg != "--no-plots"]  # curves.png and confusion.png are logged
# The first start runs in this interpreter's child with an audit hook that writes down every address a socket
# of Python's connects to or looks up (requests, urllib, http.client all go through them).
WATCHED = """
import sys
def hook(event, args):
    if event in ("socket.connect", "socket.getaddrinfo"):
        print("SOCKET", event, repr(args[1] if event == "socket.connect" else args[0]), file=sys.stderr, flush=True)
sys.addaudithook(hook)
from mnist_ddp.cli import console
console()
"""


def _off_this_machine(stderr: str) -> list[str]:
    """The watched sockets' addresses that are not loopback (nor a unix socket's path)."""
    found = []
    for line in stderr.splitlines():
        if line.startswith("SOCKET "):
            address = ast.literal_eval(line.split(" ", 2)[2])  # the repr the hook wrote: a str or tuple
            host = address[0] if isinstance(address, tuple) else address
            if isinstance(host, str) and not host.startswith("/") and host != "localhost":
                try:
                    if not ipaddress.ip_address(host).is_loopback:
                        found.append(line)
                except ValueError:  # a host name
                    found.append(line)
    return found


def test_a_resumed_run_is_one_mlflow_run_holding_the_files_numbers(tmp_path: Path) -> None:
    out, uri = tmp_path / "digits-1", f"sqlite:///{tmp_path / 'store' / 'mlflow.db'}"
    (tmp_path / "store").mkdir()
    first = ["train", *WITH_PLOTS, "--log-every", "3", "--target-accuracy", "0.01", "--out", str(out), "--mlflow", uri]
    r = subprocess.run([sys.executable, "-c", WATCHED, *first], cwd=tmp_path, env=cli_env(ONE_THREAD),
                       capture_output=True, text=True, timeout=180)
    assert r.returncode == 0 and "reached the target 1.00% after epoch 1 of 2" in r.stdout, r.stdout + r.stderr
    # The hook's control: it saw the one-process run's store look up 127.0.0.1, and nothing else.
    assert "SOCKET socket.getaddrinfo '127.0.0.1'" in r.stderr and _off_this_machine(r.stderr) == [], r.stderr
    run_id = json.loads((out / "mlflow-run.json").read_text())["run_id"]
    assert f"mlflow: run 'digits-1' ({run_id}) in {uri}" in r.stdout

    # Resumed at another world size, without the target: epoch 2, by two processes, rank 0 alone logging.
    r = run_cli("train", *WITH_PLOTS, "--log-every", "3", "--out", str(out), "--mlflow", uri, "--resume", "-g", "2",
                cwd=tmp_path, env=ONE_THREAD)
    assert r.returncode == 0, r.stderr
    assert f"mlflow: continuing run 'digits-1' ({run_id}) in {uri}" in r.stdout, r.stdout

    client = MlflowClient(uri)
    [run] = client.search_runs([client.get_experiment_by_name("mnist-ddp").experiment_id])
    assert (run.info.run_id, run.info.run_name, run.info.status) == (run_id, "digits-1", "FINISHED")
    rows = metrics(out)
    assert [row["epoch"] for row in rows] == [1, 2] and [row["world_size"] for row in rows] == [1, 2]
    numbers = [key for key, value in rows[0].items() if isinstance(value, int | float)]
    assert {"test_accuracy", "train_loss", "test_loss", "lr", "images_per_second", "epoch_seconds"} <= set(numbers)
    for key in numbers:  # each epoch's value once, at the samples trained by its end
        history = [(m.step, m.value) for m in client.get_metric_history(run_id, f"epoch/{key}")]
        assert history == [(row["epoch"] * SAMPLES, pytest.approx(row[key], rel=1e-12)) for row in rows], key
    steps = [json.loads(line) for line in (out / "steps.jsonl").read_text().splitlines()]
    for key, logged in (("train/loss", "train_loss"), ("train/lr", "lr")):
        history = sorted((m.step, m.value) for m in client.get_metric_history(run_id, key))
        assert history == [(p["samples"], pytest.approx(p[logged], rel=1e-12)) for p in steps], key
    assert [p["samples"] for p in steps] == [300, 600, 900, 1200, 1500]
    params = run.data.params
    assert (params["recipe"], params["lr"], params["seed"], params["data.dataset"], params["world_size"]) \
        == ("default", "0.003", "0", "synthetic", "1")  # the first start's settings
    assert {f.path for f in client.list_artifacts(run_id)} == set(tracking.ARTIFACTS)
    assert os.listdir(client.download_artifacts(run_id, "", str(tmp_path / "down"))) and \
        (tmp_path / "down" / "model.safetensors").read_bytes() == (out / "model.safetensors").read_bytes()


def test_a_store_mlflow_cannot_open_is_one_sentence_exit_2(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """A URI MLflow cannot open (a database inside a plain file, which not even root can make a folder of): rank 0
    says so before it trains, in one sentence."""
    out, blocker = tmp_path / "run", tmp_path / "a-file"
    blocker.write_text("not a folder")
    uri = f"sqlite:///{blocker}/mlflow.db"
    assert cli.main(["train", *tiny(), "--out", str(out), "--mlflow", uri]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith(f"mnist-ddp: error: --mlflow {uri}: the MLflow run could not be "
                                                    f"opened ("), err
    assert not (out / "metrics.jsonl").exists() and blocker.read_text() == "not a folder"


def test_a_tracking_server_that_is_not_there_is_one_sentence_before_anything_starts(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Nothing listens at an http URI's port: refused before any process starts, where rank 0 will run (MLflow's own
    client would retry for minutes first). The controls: a port that accepts passes, another node's launcher does
    not look, and a URI with no host, a bad port or an escape sequence is refused in words."""
    with socket.create_server(("127.0.0.1", 0)) as listening:
        port = listening.getsockname()[1]
        tracking.check_reachable(f"http://127.0.0.1:{port}/")
    uri = f"http://127.0.0.1:{port}"  # closed now
    assert cli.main(["train", *tiny(), "--out", str(tmp_path / "run"), "--mlflow", uri]) == 2
    assert capsys.readouterr().err == (f"mnist-ddp: error: --mlflow {uri}: nothing accepts a connection at "
                                       f"127.0.0.1:{port} (Connection refused); start the tracking server, or leave "
                                       f"--mlflow out, and run again.\n")
    assert not (tmp_path / "run").exists()
    # Only where rank 0 runs: a server on node 0's loopback is not on node 1's, which logs nothing.
    launch.preflight(TrainConfig(mlflow=uri), rank0_here=False)
    with pytest.raises(UserError, match="nothing accepts a connection"):
        launch.preflight(TrainConfig(mlflow=uri), rank0_here=True)
    for bad, says in (("http://127.0.0.1:99999", "not a URI"), ("http://:5000", "names no host"),
                      ("http://127.0.0.1:5\x1b[31m", r"5\\x1b\[31m: not a URI \("),
                      ("http://a\x1bb:5000", r"at a\\x1bb:5000"), (f"http://{'a' * 64}:5000", r"label too long")):
        with pytest.raises(UserError, match=says) as refused:
            tracking.check_reachable(bad)
        assert "\x1b" not in str(refused.value)  # an escape sequence is written out, never sent to the terminal


def test_a_bare_flag_logs_where_mlflow_itself_would(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """$MLFLOW_TRACKING_URI where set (the URI may then reach a server), else mlflow.db in the current folder."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    assert cli.configure(["train", "--mlflow"]).mlflow == f"sqlite:///{tmp_path}/mlflow.db"
    assert cli.configure(["train", "--mlflow", "--epochs", "1"]).mlflow == f"sqlite:///{tmp_path}/mlflow.db"
    assert cli.configure(["train", "--mlflow", "http://127.0.0.1:5000"]).mlflow == "http://127.0.0.1:5000"
    assert cli.configure(["train"]).mlflow is None
    monkeypatch.setenv("MLFLOW_TRACKING_URI", "sqlite:////srv/runs.db")
    assert cli.configure(["train", "--mlflow"]).mlflow == "sqlite:////srv/runs.db"


def test_a_run_that_fails_is_failed_in_mlflow(tmp_path: Path) -> None:
    """A run that diverges (exit 1, its own line) leaves its MLflow run FAILED, not RUNNING for ever; the control, a
    run that finishes, is FINISHED (the first test)."""
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    r = run_cli("train", *DIVERGING, "--batch-size", "200", "--mlflow", uri, "--out", str(tmp_path / "run"),
                cwd=tmp_path, env=ONE_THREAD)
    assert r.returncode == 1 and "diverged" in r.stderr, r.stderr
    run_id = json.loads((tmp_path / "run" / tracking.RUN_FILE).read_text())["run_id"]
    assert MlflowClient(tracking_uri=uri).get_run(run_id).info.status == "FAILED"
