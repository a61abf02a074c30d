"""Where the time went (timing.py): every moment of a run is charged to one part, the parts add up to the wall
time from the command's start, and rank 0 says so in its last line and in timing.jsonl. No test here asserts how
long anything took: only that the clock starts where the command did and that nothing is lost or counted twice."""

import io
import json
import subprocess
import sys
import time
from pathlib import Path

import pytest

from conftest import cli_env, tiny
from mnist_ddp.common import timing


def test_process_start_is_read_from_the_kernels_record() -> None:
    """The start is the stat record's starttime (field 22, after a name that may hold spaces and parentheses), in
    ticks since boot, put on the caller's clock: 1234 ticks of 1/100 s after boot, read at 100 s of boot clock and
    1,000 s of wall clock, is 912.34 s; a start read as later than now is now."""
    stat = "4242 (a (tricky) name) S " + " ".join(["0"] * 18) + " 1234 0 0"
    assert timing.started(stat, boottime=100.0, now=1000.0, ticks_per_s=100) == pytest.approx(912.34)
    assert timing.started(stat, boottime=12.0, now=1000.0, ticks_per_s=100) == 1000.0


def test_process_start_reads_this_processs_record_against_the_boot_clock(monkeypatch: pytest.MonkeyPatch) -> None:
    """process_start reads /proc/self/stat, the boot clock, the wall clock and the tick rate (here stand-ins for
    each, so a wrong file, clock or rate gives another number); with no /proc, now."""
    stat = "4242 (python3) S " + " ".join(["0"] * 18) + " 1234 0 0"
    opened: list[str] = []

    def fake_open(path: str) -> io.StringIO:
        opened.append(path)
        return io.StringIO(stat)
    monkeypatch.setattr(timing, "open", fake_open, raising=False)
    monkeypatch.setattr(timing.time, "clock_gettime", lambda clock: 100.0 if clock == time.CLOCK_BOOTTIME else -1.0)
    monkeypatch.setattr(timing.time, "time", lambda: 1000.0)
    monkeypatch.setattr(timing.os, "sysconf", lambda name: 100 if name == "SC_CLK_TCK" else -1)
    assert timing.process_start() == pytest.approx(912.34) and opened == ["/proc/self/stat"]

    def no_proc(path: str) -> io.StringIO:
        raise FileNotFoundError(path)
    monkeypatch.setattr(timing, "open", no_proc, raising=False)
    assert timing.process_start() == 1000.0


class _Clock:
    """A stand-in for the `time` module: perf_counter moves 1 s a reading, the wall clock stands at 1000 s."""

    def __init__(self) -> None:
        self.now = 0.0

    def perf_counter(self) -> float:
        self.now += 1.0
        return self.now

    def time(self) -> float:
        return 1000.0


def test_parts_take_turns_and_add_up(monkeypatch: pytest.MonkeyPatch) -> None:
    """Each change of part charges the seconds since the last to the part left (the clock reads 1, 2, …, 9 s;
    the command began 10 s before the first reading)."""
    monkeypatch.setattr(timing, "time", _Clock())
    syncs = []
    timing.begin(990.0, lambda: syncs.append(1))
    try:
        timing.enter("join")
        timing.enter("data")
        timing.enter("warm-up")
        evaluate = timing.charged("evaluation")(lambda: timing._split.part)
        assert evaluate() == "evaluation" and timing._split.part == "warm-up"  # back where it came from
        timing.stepped()
        assert timing._split.part == "training"
        timing.enter("warm-up")
        timing.stepped()  # only the run's first step ends the warm-up
        assert timing._split.part == "warm-up"
    finally:
        seconds = timing.finish()
    assert seconds is not None and timing._split is None and timing.finish() is None
    assert list(seconds) == [*timing.PARTS, "total"]
    assert seconds == dict.fromkeys(timing.PARTS, 0.0) | {
        "start": 11.0, "join": 1.0, "data": 1.0, "warm-up": 3.0, "evaluation": 1.0, "training": 1.0, "total": 18.0}
    assert len(syncs) == 8  # each change of part waits for the device
    assert timing.line(seconds).startswith(f"time: {seconds['total']:.1f} s = start {seconds['start']:.1f} + join ")


def test_outside_a_run_nothing_is_timed() -> None:
    assert timing.charged("outputs")(lambda x: x + 1)(1) == 2
    timing.enter("data")
    timing.stepped()
    assert timing._split is None and timing.finish() is None


@pytest.mark.parametrize("launch", [[], ["-g", "2"]], ids=["one process", "-g 2"])
def test_a_run_says_where_its_wall_time_went(tmp_path: Path, launch: list[str]) -> None:
    """The last line is the split, timing.jsonl holds the same numbers, they add up to its total, and every part a
    run must pass through got its share (for -g, the launcher's start too: its imports and the children's start)."""
    out = tmp_path / "run"
    cmd = [sys.executable, "-m", "mnist_ddp", "train", *tiny(), "--out", str(out), *launch]
    p = subprocess.Popen(cmd, cwd=tmp_path, env=cli_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    lines, seen = [], False
    assert p.stdout is not None
    for line in p.stdout:
        lines.append(line.rstrip("\n"))
        if line.startswith("time: "):
            seen = True
    assert p.wait(timeout=180) == 0, p.stderr.read() if p.stderr else ""
    assert seen and lines[-1].startswith("time: ") and lines[-2].startswith("final: "), lines
    [record] = [json.loads(line) for line in (out / "timing.jsonl").read_text().splitlines()]
    assert list(record) == [*timing.PARTS, "total"]
    assert record["total"] == pytest.approx(sum(record[p] for p in timing.PARTS), rel=1e-12)
    assert lines[-1] == timing.line(record)
    # entered: a part the run never entered holds exactly 0 (no bound on how long any took)
    assert all(record[p] != 0 for p in ("start", "data", "warm-up", "training", "evaluation", "outputs")), record
    if not launch:  # a resume (of a finished run: nothing to train) adds its own line
        r = subprocess.run([*cmd, "--resume"], cwd=tmp_path, env=cli_env(), capture_output=True,
                           text=True, timeout=180)
        assert r.returncode == 0, r.stderr
        records = [json.loads(line) for line in (out / "timing.jsonl").read_text().splitlines()]
        assert records[0] == record and len(records) == 2 and list(records[1]) == list(record)



def test_the_command_exits_as_python_would_less_the_teardown() -> None:
    """cli.exit_now skips the modules' teardown, not what an exit must do: threads are waited for, exit handlers
    run, buffered output is written, and the exit code is kept."""
    probe = ("import atexit, sys, threading, time; from mnist_ddp.cli import exit_now; "
             "atexit.register(print, 'handler ran'); "
             "threading.Thread(target=lambda: (time.sleep(0.2), print('thread done'))).start(); "
             "sys.stdout.write('buffered, no newline'); exit_now(3)")
    r = subprocess.run([sys.executable, "-c", probe], env=cli_env(), capture_output=True, text=True, timeout=60)
    assert r.returncode == 3 and r.stdout == "buffered, no newlinethread done\nhandler ran\n", r
