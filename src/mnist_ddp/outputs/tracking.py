"""MLflow (`--mlflow [URI]`): rank 0's Reporter logs the run's settings, each epoch's metrics, the logged steps'
losses and, at the end, its files, to one MLflow run named after the run folder.

The x-axis ("step") is the run's training samples so far, as TensorBoard's (tb.py). The run's id is kept in
`<out>/mlflow-run.json`, so a resumed run (or a --recover rank 0 taking over) logs to the same MLflow run. A bare
`--mlflow` logs to $MLFLOW_TRACKING_URI, else to `mlflow.db` in the current folder, MLflow's own default
(`mlflow ui` there shows every run); nothing goes over the network unless the URI says so: MLflow's usage
telemetry is off unless you turned it on. `mlflow` is imported only here, when rank 0 opens the run.
"""

import contextlib
import json
import logging
import os
import socket
import time
import urllib.parse
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..common import atomic, extras, inputfile, untrusted
from ..common.config import TrainConfig
from ..common.errors import UserError

RUN_FILE = "mlflow-run.json"  # the MLflow run this folder's run logs to
ARTIFACTS = ("curves.png", "confusion.png", "model.safetensors", "metrics.jsonl", "steps.jsonl")


def default_uri(env: Mapping[str, str]) -> str:
    """What a bare --mlflow logs to: $MLFLOW_TRACKING_URI, else ./mlflow.db (as an absolute path)."""
    return env.get("MLFLOW_TRACKING_URI") or f"sqlite:///{Path.cwd() / 'mlflow.db'}"


def check_installed(uri: str) -> None:
    """Refuse --mlflow at once, before any process starts, without the packages its store needs."""
    extras.require("--mlflow", ("mlflow", "sqlalchemy") if uri.startswith("sqlite:") else ("mlflow",), "mlflow")


REACH_S = 10.0  # how long a tracking server may take to accept a connection


def check_reachable(uri: str) -> None:
    """Refuse an http(s) --mlflow URI at once, before any process starts, where nothing accepts a connection at its
    host and port: MLflow itself would retry for minutes before it said so."""
    if not uri.startswith(("http://", "https://")):
        return
    try:
        parts = urllib.parse.urlsplit(uri)
        host, port = parts.hostname, parts.port or (443 if parts.scheme == "https" else 80)
    except ValueError as e:  # a port that is not a number 0-65535, an unclosed [IPv6 address]
        raise UserError(f"--mlflow {untrusted.printable(uri)}: not a URI ({untrusted.printable(str(e))}).") from None
    if not host:
        raise UserError(f"--mlflow {untrusted.printable(uri)}: names no host.")
    try:
        socket.create_connection((host, port), timeout=REACH_S).close()
    except (OSError, UnicodeError) as e:  # UnicodeError: a host name IDNA cannot encode (a label over 63 letters)
        why = f"no answer within {REACH_S:g} s" if isinstance(e, TimeoutError) else \
            (e.strerror if isinstance(e, OSError) and e.strerror else str(e))
        raise UserError(f"--mlflow {untrusted.printable(uri)}: nothing accepts a connection at "
                        f"{untrusted.printable(f'{host}:{port}')} ({untrusted.printable(why)}); "
                        f"start the tracking server, or leave --mlflow out, and run again.") from None


@dataclass(frozen=True)
class Tracking:
    """What rank 0 needs to open the run: where, and the settings to log as its parameters."""

    uri: str
    params: dict[str, str]


def for_run(cfg: TrainConfig, world_size: int) -> Tracking | None:
    """The MLflow logging of run `cfg` at `world_size`, or None without --mlflow."""
    if cfg.mlflow is None:
        return None

    def flat(d: dict[str, Any], prefix: str = "") -> Iterator[tuple[str, str]]:
        for key, value in d.items():
            yield from flat(value, f"{prefix}{key}.") if isinstance(value, dict) else [(f"{prefix}{key}", str(value))]
    return Tracking(cfg.mlflow, dict(flat(cfg.to_dict() | {"world_size": world_size})))


class TrackingFailed(UserError):
    """MLflow refused or failed while the run went on; the run's own files are whole (exit code 1)."""

    exit_code = 1


class MLflowRun:
    """Rank 0's MLflow run: created, or continued from `<out>/mlflow-run.json`."""

    def __init__(self, out: Path, tracking: Tracking, say: Any) -> None:
        self.out, self.uri = out, tracking.uri
        with self._failing(None):
            self.client = _client(tracking.uri)
            self.run_id = self._continued(say)
            if self.run_id is None:
                experiment = _experiment(self.client, os.environ.get("MLFLOW_EXPERIMENT_NAME") or "mnist-ddp")
                run = self.client.create_run(experiment, run_name=out.name, tags={"mnist_ddp.out": str(out.resolve())})
                self.run_id = run.info.run_id
                self._log(params=[_param(k, v) for k, v in tracking.params.items()])
                record = {"tracking_uri": self.uri, "experiment_id": experiment, "run_id": self.run_id}
                atomic.write(out / RUN_FILE, lambda f: f.write(json.dumps(record).encode()))
                say(f"mlflow: run {out.name!r} ({self.run_id}) in {self.uri}")

    def _continued(self, say: Any) -> str | None:
        """The run id `<out>/mlflow-run.json` names, when it is of this store and the store still has it."""
        try:
            if not os.path.lexists(self.out / RUN_FILE):
                return None
            record = untrusted.record(inputfile.read(self.out / RUN_FILE, 1 << 16, "record of an MLflow run"),
                                      {"run_id": str, "tracking_uri": str}, limit=1000)
            run_id, uri = record["run_id"], record["tracking_uri"]
        except (UserError, ValueError):
            say(f"mlflow: {self.out / RUN_FILE} is unreadable; starting a new MLflow run")
            return None
        if uri != self.uri:
            say(f"mlflow: {RUN_FILE} names a run in {uri}; starting a new one in {self.uri}")
            return None
        self.client.update_run(run_id, status="RUNNING")
        say(f"mlflow: continuing run {self.out.name!r} ({run_id}) in {self.uri}")
        return run_id

    @contextlib.contextmanager
    def _failing(self, what: str | None) -> Iterator[None]:
        """MLflow's exceptions (any type: its store's, the network's) as one sentence: opening the run (`what`
        None), where --mlflow's URI is the likely cause, or `what` later."""
        try:
            yield
        except Exception as e:
            if isinstance(e, UserError):
                raise
            reason = (str(e).strip().splitlines() or [type(e).__name__])[0].split(". ")[0][:200]
            if what is None:
                raise UserError(f"--mlflow {self.uri}: the MLflow run could not be opened ({reason}); fix that, or "
                                f"leave --mlflow out, and run again.") from e
            raise TrackingFailed(f"--mlflow {self.uri}: {what} failed ({reason}); the run's own files are whole: fix "
                                 f"that, then run again with --resume to continue it and its MLflow run.") from e

    def _log(self, metrics: list[Any] | None = None, params: list[Any] | None = None) -> None:
        """In batches of MLflow's limits (1000 metrics, 100 parameters)."""
        for items, size, kind in ((metrics or [], 1000, "metrics"), (params or [], 100, "params")):
            for i in range(0, len(items), size):
                self.client.log_batch(self.run_id, **{kind: items[i:i + size]})

    def scalars(self, points: list[tuple[int, dict[str, float]]]) -> None:
        """Metrics, each at x = its point's training samples."""
        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        with self._failing("logging metrics"):
            self._log(metrics=[Metric(key, float(value), now, step) for step, values in points
                               for key, value in values.items()])

    def epoch(self, step: int, metrics: dict[str, Any]) -> None:
        """Every number of the epoch's metrics.jsonl line, as "epoch/<key>"."""
        self.scalars([(step, {f"epoch/{key}": value for key, value in metrics.items()
                              if isinstance(value, int | float) and not isinstance(value, bool)})])

    def close(self, stopped: str | None = None) -> None:
        """The run's files, then the run marked finished; `stopped` ("FAILED", "KILLED"): only marked so, never
        raising (the run's own error is the one to report)."""
        if stopped is not None:
            with contextlib.suppress(Exception):
                self.client.set_terminated(self.run_id, stopped)
            return
        with self._failing("logging the run's files"):
            for name in ARTIFACTS:
                if (self.out / name).is_file():
                    self.client.log_artifact(self.run_id, str(self.out / name))
            self.client.set_terminated(self.run_id, "FINISHED")


def _client(uri: str) -> Any:
    os.environ.setdefault("MLFLOW_DISABLE_TELEMETRY", "true")  # its usage reports go over the network
    from mlflow.tracking import MlflowClient

    for name in ("mlflow", "alembic"):  # the store's set-up lines ("Creating initial MLflow database tables")
        logging.getLogger(name).setLevel(logging.WARNING)
    return MlflowClient(tracking_uri=uri)


def _experiment(client: Any, name: str) -> str:
    """The id of experiment `name`, created if it is new (by whichever of two runs gets there first)."""
    found = client.get_experiment_by_name(name)
    if found is None:
        try:
            return client.create_experiment(name)
        except Exception:  # another run created it meanwhile
            found = client.get_experiment_by_name(name)
            if found is None:
                raise
    return found.experiment_id


def _param(key: str, value: str) -> Any:
    from mlflow.entities import Param

    return Param(key, value)
