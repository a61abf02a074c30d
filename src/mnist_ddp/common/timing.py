"""Where a run's wall time went: each moment from the start of the command to the `time:` line belongs to exactly one
part, so the parts add up to the wall time by construction. One clock per process, kept by every rank and reported
by rank 0; on a GPU the device is synchronised at each change of part, so queued work is charged to the part that
queued it. No torch here. What each part holds, and where its clock starts: docs/speed.md#where-the-time-went."""

import functools
import os
import time
from collections.abc import Callable
from typing import Any, TypeVar

F = TypeVar("F", bound=Callable[..., Any])

PARTS = ("start", "join", "data", "warm-up", "training", "evaluation", "outputs")


def process_start() -> float:
    """When this process started, in `time.time()` seconds: Linux's /proc/self/stat gives its start in clock ticks
    since boot, read against CLOCK_BOOTTIME; where there is neither, now."""
    try:
        with open("/proc/self/stat") as f:
            return started(f.read(), time.clock_gettime(time.CLOCK_BOOTTIME), time.time(), os.sysconf("SC_CLK_TCK"))
    except (OSError, AttributeError, IndexError, ValueError):
        return time.time()


def started(stat: str, boottime: float, now: float, ticks_per_s: float) -> float:
    """The start, on the clock `now` is read from, of the process whose /proc/PID/stat is `stat`, read when the
    boot clock said `boottime`; never after `now`."""
    ticks = int(stat.rsplit(")", 1)[1].split()[19])  # field 22, starttime: after the name's ")", the 20th
    return now - max(0.0, boottime - ticks / ticks_per_s)


class Split:
    """A wall time cut into PARTS: `enter` charges the time since the last change to the part it leaves."""

    def __init__(self, origin: float, sync: Callable[[], None]) -> None:
        self.sync = sync
        now = time.perf_counter()
        self.began = now - max(0.0, time.time() - origin)  # `origin` on this process's perf_counter
        self.seconds = dict.fromkeys(PARTS, 0.0)
        self.part, self.since = "start", self.began
        self.warm = False  # whether the first training step has ended

    def enter(self, part: str) -> str:
        """Charge the time until now to the current part and begin `part`; returns the part it left."""
        self.sync()
        now = time.perf_counter()
        left = self.part
        self.seconds[left] += now - self.since
        self.part, self.since = part, now
        return left


_split: Split | None = None  # this process's, while it trains


def begin(origin: float, sync: Callable[[], None] = lambda: None) -> None:
    """Start this process's clock at `origin` (`time.time()` seconds: the command's start), in its start part;
    `sync` waits for the device."""
    global _split
    _split = Split(origin, sync)


def enter(part: str) -> None:
    """From now on, time goes to `part` (nothing happens outside a run)."""
    if _split is not None:
        _split.enter(part)


def charged(part: str) -> Callable[[F], F]:
    """A decorator: the call's time goes to `part`, and then the time goes back to the part it came from."""
    def wrap(fn: F) -> F:
        @functools.wraps(fn)
        def call(*args: Any, **kwargs: Any) -> Any:
            if _split is None:
                return fn(*args, **kwargs)
            left = _split.enter(part)
            try:
                return fn(*args, **kwargs)
            finally:
                _split.enter(left)
        return call  # type: ignore[return-value]
    return wrap


def stepped() -> None:
    """After each training step: the first one ends the warm-up (later calls cost an attribute test)."""
    if _split is not None and not _split.warm:
        _split.warm = True
        _split.enter("training")


def finish() -> dict[str, float] | None:
    """The seconds of each part until now, and their sum `total`; the clock stops. None outside a run."""
    global _split
    if _split is None:
        return None
    _split.enter("outputs")
    seconds, _split = _split.seconds, None
    return {**seconds, "total": sum(seconds.values())}


def line(seconds: dict[str, float]) -> str:
    """The run's last line: `time: 12.1 s = start 1.1 + join 0.0 + … + outputs 0.7`."""
    return f"time: {seconds['total']:.1f} s = " + " + ".join(f"{part} {seconds[part]:.1f}" for part in PARTS)
