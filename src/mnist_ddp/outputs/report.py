"""What a run tells the world: console lines, metrics.jsonl, progress bar, plots, TensorBoard, MLflow. Only rank 0
reports: the others' `Reporter(enabled=False)` does nothing, so the training loop needs no `if rank == 0` branches."""

import contextlib
import functools
import json
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import Any, TypeVar

import torch

from ..common import atomic, console, timing
from ..common.config import TrainConfig
from ..common.results import read_jsonl
from . import tracking
from .tb import TensorBoard

T = TypeVar("T")
PLOTS_EVERY_S = 10.0  # an epoch's plots are drawn once this long has passed since the last were, and at the run's end


class Reporter:
    """Rank 0's voice. Metrics go to `<out>/metrics.jsonl`, one JSON object per epoch, and the train loss of
    every --log-every-th step to `<out>/steps.jsonl`, one per step."""

    def __init__(self, out: Path, enabled: bool, progress: bool = True, plots: bool = True,
                 tensorboard: bool = False, mlflow: tracking.Tracking | None = None,
                 plots_every_s: float = PLOTS_EVERY_S) -> None:
        self.out, self.enabled, self.progress, self.plots = out, enabled, progress, plots
        self.mlflow, self.plots_every_s = mlflow, plots_every_s
        self.tracker: tracking.MLflowRun | None = None  # the MLflow run opens in `begin` too
        self.metrics_path, self.steps_path = out / "metrics.jsonl", out / "steps.jsonl"
        self.timing_path = out / "timing.jsonl"
        self.logged: list[dict[str, float]] = []  # steps.jsonl's lines
        self.drawing: Drawing | None = None  # the last epoch's plots, drawn while training goes on
        self.undrawn: Callable[[Any], None] | None = None  # an epoch's plots not yet due (`epoch`)
        self.drawn_at = time.monotonic()  # when the last plots began, or training did
        # TensorBoard's x-axis is the run's training samples so far, which mean the same at any world size.
        self.tensorboard = tensorboard
        self.tb: TensorBoard | None = None  # the writer opens in `begin`, once the start is known

    @classmethod
    def for_run(cls, cfg: TrainConfig, *, enabled: bool, world_size: int) -> "Reporter":
        """A training run's Reporter, with what its flags ask for: the bar, plots, TensorBoard, MLflow."""
        reporter = cls(Path(cfg.out), enabled, cfg.progress, cfg.plots, cfg.tensorboard,
                       tracking.for_run(cfg, world_size))
        if enabled:  # a resumed run's records, checked before anything reads the checkpoint or writes
            for path in (reporter.metrics_path, reporter.steps_path, reporter.timing_path):
                read_jsonl(path)
        return reporter

    def begin(self, step: int) -> None:
        """Training starts, or resumes, after `step` training samples of the run: what a lost run logged after
        that is redone, so it is dropped (TensorBoard: its purge_step)."""
        if not self.enabled:
            return
        if self.tensorboard:
            self.tb = TensorBoard(self.out / "tb", step)
        if self.mlflow is not None:
            self.tracker = tracking.MLflowRun(self.out, self.mlflow, self.say)
        self.logged = [point for point in read_jsonl(self.steps_path) if point["samples"] <= step]
        self.drawn_at = time.monotonic()

    @timing.charged("outputs")
    def steps(self, points: list[dict[str, float]]) -> None:
        """Logged steps (samples, epoch, train_loss averaged over the ranks, lr), delivered at each fold: to
        steps.jsonl (for curves.png) and TensorBoard, at x = samples. Every rank keeps them (all have the sums): a
        rank that takes over from a lost rank 0 writes what it could not."""
        self.logged += points
        if not (self.enabled and points):
            return
        _write_lines(self.steps_path, [json.dumps(p) for p in self.logged])
        logged = [(int(p["samples"]), {"train/loss": p["train_loss"], "train/lr": p["lr"]}) for p in points]
        if self.tb is not None:
            for step, values in logged:
                self.tb.scalars(step, values)
        if self.tracker is not None:
            self.tracker.scalars(logged)

    @timing.charged("outputs")
    def close(self, raised: type[BaseException] | None = None) -> None:
        """The run's end, after its final line: the last epoch's plots drawn (the result is said without waiting for
        them), then TensorBoard's files closed and the MLflow run finished, or marked stopped by `raised` (an
        interrupt, an error: the run's own, which a failure to draw does not replace)."""
        if self.undrawn is not None:  # the run ended before its last epoch's plots were due
            self._draw_undrawn()
        if raised is None:
            self.wait_for_plots()
        else:
            with contextlib.suppress(Exception):
                self.wait_for_plots()
        if self.tb is not None:
            self.tb.close()
        if self.tracker is not None:  # last: it sends the run's files, model.safetensors among them
            self.tracker.close(None if raised is None else "KILLED" if issubclass(raised, KeyboardInterrupt)
                               else "FAILED")

    def wall_time(self, seconds: dict[str, float] | None) -> None:
        """The run's wall time and its parts (timing.py): a line of `<out>/timing.jsonl`, one per start of the run
        (a resume adds one), then the `time:` line, the run's last."""
        if not (self.enabled and seconds):
            return
        _append(self.timing_path, seconds)
        self.say(timing.line(seconds))

    def say(self, line: str) -> None:
        if self.enabled:
            print(line, flush=True)

    def bar(self, items: Iterable[T], total: int, desc: str, initial: int = 0) -> Iterator[T]:
        """`items`, with rank 0's progress bar when progress is on (drawn where console.py says)."""
        if not (self.enabled and self.progress):
            return iter(items)
        return console.bar(items, total, desc, initial)

    def taken_over(self, samples: int) -> "Reporter":
        """This Reporter, speaking from now on: the process that reported was lost (recovery.py), its files stay
        (on another node, this one's --out is made)."""
        self.out.mkdir(parents=True, exist_ok=True)
        new = Reporter(self.out, True, self.progress, self.plots, self.tensorboard, self.mlflow, self.plots_every_s)
        new.begin(samples)
        new.add_steps(self.logged, samples)
        return new

    def add_steps(self, held: list[dict[str, float]], samples: int) -> None:
        """The steps up to `samples` that this process kept and the file lacks (its rank 0 was lost before it wrote
        them), in order."""
        written = {point["samples"] for point in self.logged}
        self.logged = sorted([*self.logged, *(point for point in held if point["samples"] <= samples
                                              and point["samples"] not in written)], key=lambda point: point["samples"])

    def forget_steps_after(self, samples: int) -> None:
        """Drop logged steps after `samples` training samples: they are trained again."""
        self.logged = [point for point in self.logged if point["samples"] <= samples]

    def keep_epochs_before(self, epoch: int) -> None:
        """On resume: drop metric lines of epochs the checkpoint does not include (they are redone)."""
        if not (self.enabled and self.metrics_path.exists()):
            return
        _write_lines(self.metrics_path, [json.dumps(m) for m in read_jsonl(self.metrics_path) if m["epoch"] <= epoch])

    @timing.charged("outputs")
    def epoch(self, metrics: dict[str, Any], confusion: torch.Tensor, classes: tuple[str, ...], step: int) -> None:
        """Record one finished epoch (ending at `step` samples of the run): console line, metrics.jsonl, plots,
        TensorBoard, MLflow. The plots are drawn in a thread while the next epoch trains, each epoch's where
        TensorBoard is on (it keeps them all), else the run's last epoch's and any epoch's `plots_every_s` after the
        last drawing began: drawing costs ~0.3 s of a CPU (docs/outputs.md)."""
        if not self.enabled:
            return
        _append(self.metrics_path, metrics)
        self.say(f"epoch {metrics['epoch']}/{metrics['epochs']}  train_loss {metrics['train_loss']:.4f}  "
                 f"test_loss {metrics['test_loss']:.4f}  test_acc {100 * metrics['test_accuracy']:.2f}%  "
                 f"{metrics['images_per_second']:,.0f} img/s  {metrics['epoch_seconds']:.1f} s")
        if self.tracker is not None:
            self.tracker.epoch(step, metrics)
        self.wait_for_plots()  # the epoch before's: a failure to draw them (a full disk) ends the run here
        if not (self.plots or self.tb is not None):
            return
        self.undrawn = functools.partial(self._draw, metrics=metrics, confusion=confusion, classes=classes, step=step,
                                         rows=self.history(), logged=list(self.logged))
        last = metrics["epoch"] == metrics["epochs"]
        if self.tb is not None or last or time.monotonic() - self.drawn_at >= self.plots_every_s:
            self._draw_undrawn()

    def _draw_undrawn(self) -> None:
        """Start drawing the undrawn plots in a thread. matplotlib is imported here, not in the thread: two threads
        importing can deadlock (docs/speed.md)."""
        figure_class = matplotlib_figure()
        draw, self.undrawn = self.undrawn, None
        if draw is not None and (figure_class is not None or self.tb is not None):  # else nothing to draw: no thread
            self.drawn_at = time.monotonic()
            self.drawing = Drawing(functools.partial(draw, figure_class))

    def wait_for_plots(self) -> None:
        """Wait until the last epoch's plots are drawn; raises what drawing them raised."""
        if self.drawing is not None:
            drawing, self.drawing = self.drawing, None
            drawing.wait()

    def _draw(self, figure_class: Any | None, *, metrics: dict[str, Any], confusion: torch.Tensor,
              classes: tuple[str, ...], step: int, rows: list[dict[str, Any]], logged: list[dict[str, float]]) -> None:
        """An epoch's plots and TensorBoard values, from the metrics lines and logged steps so far."""
        figure = _confusion_figure(figure_class, confusion, classes) if figure_class else None  # drawn once, for both
        if self.plots and figure is not None:
            self._plot(figure_class, figure, rows, logged)
        if self.tb is not None:
            self.tb.epoch(step, metrics, figure)

    def history(self) -> list[dict[str, Any]]:
        return read_jsonl(self.metrics_path)

    def _plot(self, figure_class: Any, confusion_figure: Any, rows: list[dict[str, Any]],
              logged: list[dict[str, float]]) -> None:
        """curves.png (the train loss of every `logged` step and each epoch's losses and test accuracy, from `rows`,
        against epochs: samples seen / samples per epoch) and confusion.png."""
        epochs = [r["epoch"] for r in rows]
        from matplotlib.ticker import MaxNLocator

        fig = figure_class(figsize=(11, 4))
        ax1, ax2 = fig.subplots(1, 2)
        ax1.plot([p["epoch"] for p in logged], [p["train_loss"] for p in logged], "-", alpha=0.6,
                 label="train, every logged step")
        ax1.hlines([r["train_loss"] for r in rows], [e - 1 for e in epochs], epochs, colors="C1",
                   label="train, epoch mean")
        ax1.plot(epochs, [r["test_loss"] for r in rows], "o-", color="C2", label="test")
        ax1.set(xlabel="epoch (samples seen / samples per epoch)", ylabel="loss", title="loss")
        ax1.legend()
        ax2.plot(epochs, [100 * r["test_accuracy"] for r in rows], "o-")
        ax2.set(xlabel="epoch", ylabel="accuracy (%)", title="test accuracy")
        for ax in (ax1, ax2):
            ax.set_xlim(0, max(epochs) + 0.05)
            ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        fig.tight_layout()
        save_figure(fig, self.out / "curves.png")

        save_figure(confusion_figure, self.out / "confusion.png")


class Drawing:
    """`draw()` run in a thread of its own, from now on: an epoch's plots, drawn while the next epoch trains."""

    def __init__(self, draw: Callable[[], None]) -> None:
        self.error: BaseException | None = None
        self.thread = threading.Thread(target=self._run, args=(draw,), name="mnist-ddp plots", daemon=True)
        self.thread.start()

    def _run(self, draw: Callable[[], None]) -> None:
        try:
            draw()
        except BaseException as e:  # raised again by `wait`, in the thread that trains
            self.error = e

    def wait(self) -> None:
        """Until the drawing is done; raises what it raised."""
        self.thread.join()
        if self.error is not None:
            raise self.error


def _append(path: Path, record: dict[str, Any]) -> None:
    """`record` as the last line of the .jsonl file `path`, the file rewritten whole (`_write_lines`)."""
    _write_lines(path, [json.dumps(line) for line in [*read_jsonl(path), record]])


def _write_lines(path: Path, lines: list[str]) -> None:
    """Rewrite a .jsonl file whole (they are small), rather than append: a full disk or a kill mid-write
    leaves the previous lines, never half a line."""
    atomic.write(path, lambda f: f.write("".join(line + "\n" for line in lines).encode()))


def matplotlib_figure() -> Any | None:
    """matplotlib's Figure class, None without matplotlib (the `plot` extra is optional). A Figure made from it
    draws off-screen without pyplot, so its global backend stays the user's: a notebook that trained in its
    own process still shows its own plots inline."""
    try:
        from matplotlib.figure import Figure
    except ImportError:
        return None
    return Figure


def _confusion_figure(figure_class: Any, confusion: torch.Tensor, classes: tuple[str, ...]) -> Any:
    """The confusion matrix with its counts: confusion.png, and TensorBoard's image."""
    fig = figure_class(figsize=(7, 6))
    ax = fig.subplots()
    ax.imshow(confusion.numpy(), cmap="Blues")
    ax.set(xticks=range(10), yticks=range(10), xlabel="predicted", ylabel="true",
           title="confusion matrix (test set)")
    ax.set_xticklabels(classes, rotation=45, ha="right")
    ax.set_yticklabels(classes)
    for (i, j), n in zip(((i, j) for i in range(10) for j in range(10)), confusion.flatten().tolist()):
        ax.text(j, i, str(n), ha="center", va="center", fontsize=7,
                color="white" if n > confusion.max().item() / 2 else "black")
    fig.tight_layout()
    return fig


def save_figure(fig: Any, path: Path) -> None:
    """A plot, replaced whole like every output: a disk too full for it ends the run (`atomic.write`) rather than
    leave a broken PNG, since the checkpoint written right after it would not fit either."""
    atomic.write(path, lambda f: fig.savefig(f, format="png", dpi=100))
