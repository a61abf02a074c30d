"""What the Python API returns (api.py): a run, an evaluation, predictions, as plain data.

A `Run` is read back from the files rank 0 wrote, so its numbers are metrics.jsonl's and steps.jsonl's by
construction, whichever process trained. pandas and IPython are used when they are there (neither is a
dependency). Plain Python, no torch: `import mnist_ddp` stays instant.
"""

import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from . import inputfile
from .config import TrainConfig
from .errors import UserError

PLOTS = {"curves": "curves.png", "confusion": "confusion.png", "timeline": "profile/timeline.png"}


MOST_RECORDS = 64 << 20  # bytes of one .jsonl file of a run: an epoch's line is ~500, a logged step's ~100
FIELDS = {"metrics.jsonl": ("epoch",), "steps.jsonl": ("samples", "train_loss", "lr")}  # what a reader needs


def read_jsonl(path: Path) -> list[dict[str, Any]]:
    """The objects of one of a run's .jsonl files (metrics.jsonl, steps.jsonl, timing.jsonl), one per line, each
    with the number fields its readers need (`FIELDS`); none when the file is not there. Anything else is one
    sentence naming the file and the line (`inputfile`'s rules for the file itself)."""
    if not os.path.lexists(path):
        return []
    raw = inputfile.read(path, MOST_RECORDS, "file of a run's records")
    records = []
    for n, line in enumerate(raw.splitlines(), 1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except (ValueError, RecursionError):
            record = None
        if not (isinstance(record, dict) and all(isinstance(record.get(k), int | float) and not
                                                 isinstance(record.get(k), bool) for k in FIELDS.get(path.name, ()))):
            raise UserError(f"{inputfile.shown(path)}: line {n} is not one of mnist-ddp's records; move the file "
                            f"aside (nothing else needs it) and run again.")
        records.append(record)
    return records


def _dataframe(rows: list[dict[str, Any]], name: str) -> Any:
    try:
        import pandas
    except ImportError:
        raise ImportError(f"Run.{name}() needs pandas, which mnist-ddp does not install: pip install pandas, or "
                          f"'mnist-ddp[notebook]' (the same rows are in Run.metrics and Run.steps as plain "
                          f"dicts).") from None
    return pandas.DataFrame(rows)


@dataclass(frozen=True)
class Run:
    """A run's results, as its folder holds them: `metrics` (metrics.jsonl, one dict per epoch), `steps`
    (steps.jsonl, one per --log-every-th step), the checkpoints, model.safetensors and plots there. Under
    torchrun, srun or mpirun every rank returns one; rank 0 wrote the files, so on another node without a
    shared file system it is empty."""

    out: Path
    metrics: list[dict[str, Any]] = field(default_factory=list)
    steps: list[dict[str, Any]] = field(default_factory=list)
    checkpoint: Path | None = None  # the latest: --resume continues from it
    best: Path | None = None  # the epoch with the best test accuracy
    plots: dict[str, Path] = field(default_factory=dict)  # of "curves", "confusion", "timeline": those drawn
    config: TrainConfig | None = None  # what ran, when this process ran it
    model: Path | None = None  # model.safetensors: best.pt's weights, to share (model_file.py)

    @classmethod
    def load(cls, out: str | Path, config: TrainConfig | None = None) -> "Run":
        """The run in folder `out` (also one trained earlier, or by the command line)."""
        out = Path(out)

        def found(name: str) -> Path | None:
            return out / name if (out / name).is_file() else None

        metrics, steps = (read_jsonl(out / name) for name in ("metrics.jsonl", "steps.jsonl"))
        plots = {key: p for key, name in PLOTS.items() if (p := found(name))}
        return cls(out, metrics, steps, found("checkpoint.pt"), found("best.pt"), plots, config,
                   found("model.safetensors"))

    @property
    def accuracy(self) -> float | None:
        """The final test accuracy (the last epoch's), or None before any epoch ended."""
        return self.metrics[-1]["test_accuracy"] if self.metrics else None

    def dataframe(self) -> Any:
        """`metrics` as a pandas DataFrame, one row per epoch."""
        return _dataframe(self.metrics, "dataframe")

    def steps_dataframe(self) -> Any:
        """`steps` as a pandas DataFrame, one row per logged step."""
        return _dataframe(self.steps, "steps_dataframe")

    def show(self) -> None:
        """Show the plots (curves, confusion matrix, the profile's timeline) in the notebook; elsewhere, say
        where they are."""
        if not self.plots:
            print(f"{self.out} has no plots (they need matplotlib, and not plots=False)")
            return
        try:
            from IPython import get_ipython
            from IPython.display import Image, display
        except ImportError:
            get_ipython = None
        if get_ipython is None or get_ipython() is None:
            for name, path in self.plots.items():
                print(f"{name}: {path}")
            return
        for path in self.plots.values():
            display(Image(filename=str(path)))

    def __repr__(self) -> str:
        done = f"{len(self.metrics)} epoch(s), test accuracy {self.accuracy:.2%}" if self.metrics else "no epoch done"
        return f"Run({str(self.out)!r}: {done})"


@dataclass(frozen=True)
class Evaluation:
    """A checkpoint's test metrics, as `mnist-ddp evaluate` prints them."""

    accuracy: float
    correct: int
    count: int
    loss: float
    dataset: str
    where: str  # the data's origin: a folder, a download, generated
    confusion: list[list[int]] = field(repr=False)  # rows: the true class, columns: the predicted one

    def __str__(self) -> str:
        return (f"test accuracy {100 * self.accuracy:.2f}% ({self.correct}/{self.count}) on {self.dataset} "
                f"({self.where}), test loss {self.loss:.4f}")


@dataclass(frozen=True)
class Prediction:
    """One image's most likely classes, as `mnist-ddp predict` prints them."""

    source: str  # the file (`name[i]`: image i of an IDX file or a batch), or the API's input it came from
    classes: list[str]  # the --top most likely, most likely first
    probabilities: list[float]

    @property
    def label(self) -> str:
        return self.classes[0]

    @property
    def probability(self) -> float:
        return self.probabilities[0]

    def __str__(self) -> str:
        return f"{self.source}: " + ", ".join(f"{c} ({100 * p:.1f}%)" for c, p in zip(self.classes, self.probabilities))
