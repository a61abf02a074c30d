"""`--profile`: what each rank did in each step, as a Chrome trace per rank and one picture of all ranks, split into
phases that add up to the step (docs/speed.md#see-a-step). It never changes the training: the comm hook's clock
only watches the reduction that runs anyway. How it measures: docs/design/timeline.md."""

import json
import math
import socket
import statistics
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager, nullcontext
from pathlib import Path
from typing import Any

import torch

from ..common import atomic
from ..core.distributed import Dist
from ..core.reduction import Reduction
from .report import Reporter, matplotlib_figure, save_figure

WARMUP = 5  # steps before profiling
PHASES = ("data", "forward", "backward", "all-reduce", "waiting", "optimizer", "other")
COLOURS = {"data": "#9e9e9e", "forward": "#1f77b4", "backward": "#ff7f0e", "all-reduce": "#2ca02c",
           "waiting": "#d62728", "optimizer": "#9467bd", "other": "#e0e0e0"}


class StepProfiler:
    """Profiles `steps` steps after the warm-up; with `steps` None every method does nothing."""

    def __init__(self, steps: int | None, d: Dist, report: Reporter, folder: Path) -> None:
        self.steps, self.d, self.report, self.folder = steps, d, report, folder
        self.done = 0  # steps ended so far, in this run
        self.window: range | None = None  # the run's steps that are profiled, once the first step ended
        self.marks: list[dict[str, Any]] = []  # one per profiled step: phases and buckets, perf_counter seconds
        self.profiler: torch.profiler.profile | None = None
        self.clock: BucketClock | None = None  # set by `watch` when there is a reduction to time

    @property
    def active(self) -> bool:
        return self.profiler is not None

    def watch(self, reduction: Reduction) -> None:
        """Time each gradient bucket's reduction (in one process there is none: no DDP, no comm hook)."""
        if self.steps:
            self.clock = reduction.observer = BucketClock(self.bucket, self.d.device)

    def phase(self, name: str) -> Any:
        """A context that marks phase `name` of the current step (nothing outside the profiled steps)."""
        return self._mark(name) if self.active else nullcontext()

    @contextmanager
    def _mark(self, name: str) -> Iterator[None]:
        start = self._now()
        try:
            yield
        finally:
            self.marks[-1]["phases"].append((name, start, self._now()))

    def bucket(self, handed_over: float, back: float) -> None:
        """One bucket's all-reduce (from the comm hook's `BucketClock`)."""
        if self.active:
            self.marks[-1]["buckets"].append((handed_over, back))

    def step(self, step: int, steps: int) -> None:
        """Step `step` of the `steps` of this epoch ended: start, go on or finish profiling."""
        if not self.steps:
            return
        self.done += 1
        if self.window is None:
            self._plan(left=steps - step)
        if self.active:
            assert self.profiler is not None and self.window is not None
            self.marks[-1]["end"] = self._now()
            if self.clock:  # the device has caught up (`_now`): its events can be read
                self.clock.settle()
            self.profiler.step()
            if self.done == self.window[-1]:
                self._finish()
                return
        elif self.window and self.done + 1 == self.window.start:
            self._start()
        if self.active:
            self.marks.append({"start": self._now(), "phases": [], "buckets": []})
            if self.clock:
                self.clock.start(self.marks[-1]["start"])

    def _plan(self, left: int) -> None:
        """Which steps to profile, after the first one, with `left` more in this epoch: all in this epoch."""
        assert self.steps is not None
        warmup = min(WARMUP - 1, max(left - self.steps, 0))  # the step that just ended was the first
        self.window = range(self.done + warmup + 1, self.done + 1 + min(warmup + self.steps, left))
        if len(self.window) < self.steps:
            self.report.say(f"profile: this epoch has {len(self.window)} step(s) left after the warm-up, so "
                            f"{len(self.window)} are profiled instead of {self.steps}")
        if not self.window:
            self.steps = None

    def _now(self) -> float:
        """perf_counter, after the device's queued work: on a GPU, phases end when their kernels do."""
        if self.d.device.type == "cuda":
            torch.cuda.synchronize(self.d.device)
        return time.perf_counter()

    def _start(self) -> None:
        activities = [torch.profiler.ProfilerActivity.CPU]
        if self.d.device.type == "cuda":
            activities.append(torch.profiler.ProfilerActivity.CUDA)
        # A schedule that always records: with one, torch.profiler marks each step (ProfilerStep#n) in the trace.
        self.profiler = torch.profiler.profile(activities=activities,
                                               schedule=lambda _: torch.profiler.ProfilerAction.RECORD)
        self.profiler.start()

    def _finish(self) -> None:
        """Write this rank's trace; rank 0 gathers every rank's marks, prints the split and draws it."""
        assert self.profiler is not None and self.window is not None
        self.profiler.stop()
        self.folder.mkdir(parents=True, exist_ok=True)
        trace = self.folder / f"rank{self.d.rank}.json.gz"
        self.profiler.export_chrome_trace(str(trace))
        self.profiler, self.steps = None, None  # done: from here on every method does nothing
        mine = {"rank": self.d.rank, "host": socket.gethostname(), "steps": self.marks}
        everyone = self.d.gather(mine)
        if everyone is None:
            return
        split = split_steps(everyone)
        self.report.say(table(split, f"steps {self.window.start}-{self.window[-1]} of this run"))
        atomic.write(self.folder / "phases.json", lambda f: f.write(json.dumps(split, indent=1).encode()))
        figure_class = matplotlib_figure()
        self.report.wait_for_plots()  # one thread draws at a time: matplotlib's fonts are shared
        if figure_class is None:
            self.report.say("profile: matplotlib is not installed, so timeline.png was not drawn")
        else:
            draw(figure_class, split, self.folder / "timeline.png")
        self.report.say(f"profile: Chrome traces (Perfetto, chrome://tracing), timeline.png and phases.json in "
                        f"{self.folder}")


class BucketClock:
    """The moments a reduction's observer is told (reduction.BucketObserver): when backward handed a bucket over,
    and when its reduced values were back; `record` gets both, as perf_counter seconds. On a GPU they are CUDA
    events, turned into seconds by `settle` (docs/design/timeline.md says why)."""

    def __init__(self, record: Callable[[float, float], None], device: torch.device,
                 event: Callable[[], Any] | None = None) -> None:
        self.record = record
        self.since: dict[int, Any] = {}  # bucket -> when it was handed over
        self.event = event or (_cuda_event if device.type == "cuda" else None)  # None: perf_counter
        self.anchor: tuple[float, Any] | None = None
        self.pending: list[tuple[Any, Any]] = []

    def _moment(self) -> Any:
        return time.perf_counter() if self.event is None else self.event()

    def handed_over(self, bucket: int) -> None:
        self.since[bucket] = self._moment()

    def back(self, bucket: int) -> None:
        handed_over, back = self.since.pop(bucket), self._moment()
        if self.event is None:
            self.record(handed_over, back)
        elif self.anchor is not None:  # events outside an anchored step are dropped, not kept for ever
            self.pending.append((handed_over, back))

    def start(self, now: float) -> None:
        """A step begins at perf_counter `now`, with the device idle: the anchor for its events."""
        if self.event is not None:
            self.anchor, self.pending = (now, self.event()), []

    def settle(self) -> None:
        """Record the step's events as seconds (the device must have caught up with them), and drop the anchor."""
        if self.anchor is not None:
            now, anchor = self.anchor
            for a, b in self.pending:
                self.record(now + anchor.elapsed_time(a) / 1e3, now + anchor.elapsed_time(b) / 1e3)
        self.anchor, self.pending = None, []


def _cuda_event() -> torch.cuda.Event:
    event = torch.cuda.Event(enable_timing=True)
    event.record()  # on the current stream: the one backward and the comm hook's callback run on
    return event


def split_steps(ranks: list[dict[str, Any]]) -> dict[str, Any]:
    """Every rank's marks on one clock (seconds since rank 0's first profiled step began), each step cut
    into coloured segments, and what each phase took per step (`split`, seconds; they add up to the step)."""
    ranks = sorted(ranks, key=lambda r: r["rank"])
    n = min(len(r["steps"]) for r in ranks)
    offsets = _clock_offsets(ranks, n)
    t0 = ranks[0]["steps"][0]["start"]
    steps = [[_shifted(s, t0 + offset) for s in r["steps"][:n]] for r, offset in zip(ranks, offsets)]
    # Per step, when the last rank handed over its last bucket: no all-reduce can finish before that.
    all_ready = [max((max(b[0] for b in lane[i]["buckets"]) for lane in steps if lane[i]["buckets"]), default=0.0)
                 for i in range(n)]
    out = []
    for r, offset, lane in zip(ranks, offsets, steps):
        for i, s in enumerate(lane):
            s["segments"] = _segments(s, all_ready[i])
            s["split"] = dict.fromkeys(PHASES, 0.0)
            for phase, a, b in s["segments"]:
                s["split"][phase] += b - a
            s["split"]["other"] = s["end"] - s["start"] - sum(s["split"].values())
            del s["phases"]
        out.append({"rank": r["rank"], "host": r["host"], "clock_offset": offset, "steps": lane})
    return {"phases": PHASES, "ranks": out}


def _clock_offsets(ranks: list[dict[str, Any]], n: int) -> list[float]:
    """How far each rank's perf_counter is ahead of rank 0's. On rank 0's machine every process reads the
    same clock; elsewhere, the reduced gradients are back at about the same moment on every rank."""
    def back(r: dict[str, Any]) -> list[float]:
        return [max((b[1] for b in s["buckets"]), default=math.nan) for s in r["steps"][:n]]
    ours = back(ranks[0])
    return [0.0 if r["host"] == ranks[0]["host"] else
            statistics.median(x - y for x, y in zip(back(r), ours) if not math.isnan(x - y)) for r in ranks]


def _shifted(step: dict[str, Any], t0: float) -> dict[str, Any]:
    return {"start": step["start"] - t0, "end": step["end"] - t0,
            "phases": [(name, a - t0, b - t0) for name, a, b in step["phases"]],
            "buckets": [(a - t0, b - t0) for a, b in step["buckets"]]}


def _segments(step: dict[str, Any], all_ready: float) -> list[tuple[str, float, float]]:
    """The step as (phase, start, end), in order, not overlapping; gaps are `other`. Backward is cut where the
    last bucket was handed over: after it, this rank waited for the last rank to hand over its own, then for
    the all-reduce; buckets reduced earlier overlapped the backward pass and cost nothing here."""
    segments: list[tuple[str, float, float]] = []
    cursor = step["start"]
    ready = max((b[0] for b in step["buckets"]), default=math.inf)
    back = max((b[1] for b in step["buckets"]), default=math.inf)
    for name, a, b in sorted(step["phases"], key=lambda p: p[1]):
        if name == "forward" and a > cursor:
            segments.append(("data", cursor, a))
        if name != "backward":
            segments.append((name, a, b))
        else:  # backward | waiting | all-reduce | backward (DDP finishing), each clipped to [a, b]
            cuts = [a, ready, max(ready, min(all_ready, back)), back, b]
            cuts = [min(max(c, a), b) for c in cuts]
            segments += [(p, x, y) for p, x, y in zip(("backward", "waiting", "all-reduce", "backward"), cuts, cuts[1:])
                         if y > x]
        cursor = max(cursor, b)
    return segments


def means(split: dict[str, Any]) -> list[dict[str, float]]:
    """Per rank: the mean seconds per step of each phase, and of the whole step (`step`)."""
    return [{k: statistics.mean(s["split"][k] if k != "step" else s["end"] - s["start"] for s in r["steps"])
             for k in (*PHASES, "step")} for r in split["ranks"]]


def table(split: dict[str, Any], which: str) -> str:
    """The split as one table: per rank, ms per step and % of the step of each phase."""
    lines = [f"profile: {which}, {len(split['ranks'][0]['steps'])} per rank; ms per step (% of the step)",
             f"{'rank':>4s}" + "".join(f"{p:>15s}" for p in (*PHASES, "step"))]
    for r, m in zip(split["ranks"], means(split)):
        cells = [f"{1e3 * m[p]:8.2f} ({100 * m[p] / m['step']:3.0f}%)" for p in PHASES]
        lines.append(f"{r['rank']:4d}" + "".join(f"{c:>15s}" for c in cells) + f"{1e3 * m['step']:12.2f} ms")
    return "\n".join(lines)


def draw(figure_class: Any, split: dict[str, Any], path: Path) -> None:
    """timeline.png: a lane per rank (rank 0 on top), each step's phases in colour, step starts as ticks,
    and under each lane a thin bar for every bucket's all-reduce in flight (the comm hook's view)."""
    ranks = split["ranks"]
    from matplotlib.patches import Rectangle

    fig = figure_class(figsize=(12, 1.6 + 0.8 * len(ranks)))
    ax = fig.subplots()
    for lane, r in enumerate(ranks):
        y = len(ranks) - 1 - lane
        for s in r["steps"]:
            ax.broken_barh([(1e3 * s["start"], 1e3 * (s["end"] - s["start"]))], (y - 0.3, 0.6),
                           color=COLOURS["other"])
            for phase, a, b in s["segments"]:
                ax.broken_barh([(1e3 * a, 1e3 * (b - a))], (y - 0.3, 0.6), color=COLOURS[phase])
            ax.broken_barh([(1e3 * a, 1e3 * (b - a)) for a, b in s["buckets"]], (y - 0.42, 0.08),
                           color=COLOURS["all-reduce"])
            ax.vlines(1e3 * s["start"], y - 0.45, y + 0.45, color="black", linewidth=0.8)
    m = means(split)
    ax.set(yticks=range(len(ranks)), yticklabels=[f"rank {r['rank']}" for r in reversed(ranks)],
           xlabel="ms since rank 0's first profiled step began (ticks: step starts; thin bars: each bucket's "
                  "all-reduce in flight)",
           title=f"{len(ranks)} rank(s), {len(ranks[0]['steps'])} steps; mean step "
                 f"{1e3 * statistics.mean(x['step'] for x in m):.1f} ms, waiting "
                 f"{1e3 * statistics.mean(x['waiting'] for x in m):.2f} ms, all-reduce "
                 f"{1e3 * statistics.mean(x['all-reduce'] for x in m):.2f} ms")
    handles = [Rectangle((0, 0), 1, 1, color=COLOURS[p]) for p in PHASES]
    fig.legend(handles, PHASES, ncol=len(PHASES), loc="lower center", frameon=False)
    fig.tight_layout(rect=(0, 0.5 / fig.get_figheight(), 1, 1))  # room for the legend: half an inch
    save_figure(fig, path)
