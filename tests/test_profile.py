"""--profile: real runs leave a Chrome trace per rank that parses, timeline.png and a split of every step
into phases that adds up to the step; profiling leaves the weights bit for bit as they are without it (it
only puts a clock on the comm hook every run reduces with; with --bitwise: test_bitwise.py); the split itself
is checked on marks whose answer is known.

Nothing here compares clocks or durations: a paused process would break such a check without anything being
wrong. What is checked is structure — each step cut into ordered, non-overlapping phases that sum to it, the
all-reduce where the comm hook saw the bucket, one optimizer step per traced step, and a picture whose coloured
runs sit where phases.json's numbers put them.
"""

import gzip
import itertools
import json
from pathlib import Path
from typing import Any

import pytest
import torch
from PIL import Image

from conftest import run_cli, tiny
from datafiles import ONE_THREAD
from mnist_ddp import cli
from mnist_ddp.outputs import checkpoint, timeline
from mnist_ddp.outputs.timeline import COLOURS, PHASES, split_steps


def _train(out: Path, tmp_path: Path, *extra: str, samples: int = 800) -> str:
    """A tiny run (batch 50: 8 steps per rank at -g 2 of 800 images); returns its stdout."""
    r = run_cli("train", *tiny(train=samples, test=200), "--batch-size", "50", "--out", str(out), *extra,
                cwd=tmp_path, env=ONE_THREAD)
    assert r.returncode == 0, r.stderr
    return r.stdout


def _weights(out: Path) -> dict[str, torch.Tensor]:
    return checkpoint.load(out / "checkpoint.pt")["model"]


def _traced_steps(path: Path) -> list[dict[str, int]]:
    """Per ProfilerStep#n span of the trace, in order: how many optimizer steps, convolutions and convolution
    backward passes ran inside it (by the trace's own clock, which is the only one compared with itself)."""
    events = [e for e in json.loads(gzip.decompress(path.read_bytes()))["traceEvents"] if e.get("ph") == "X"]
    spans = sorted((e["ts"], e["ts"] + e["dur"]) for e in events if str(e["name"]).startswith("ProfilerStep#"))
    counts = []
    for a, b in spans:
        inside = [e["name"] for e in events if a <= e["ts"] and e["ts"] + e["dur"] <= b]
        counts.append({"optimizer": sum(n.startswith("Optimizer.step#") for n in inside),
                       "conv": inside.count("aten::conv2d"),
                       "conv backward": inside.count("aten::convolution_backward")})
    return counts


def _assert_same_weights(a: Path, b: Path) -> None:
    wa, wb = _weights(a), _weights(b)
    assert wa.keys() == wb.keys()
    for key in wa:
        assert torch.equal(wa[key], wb[key]), key


def _assert_steps_are_split(rank: dict[str, Any], world: int) -> None:
    """Every step of `rank` is cut into phases, in order, without overlap, inside the step, that add up to it;
    `other` is exactly the gaps; with a bucket, waiting and all-reduce lie where the comm hook saw it."""
    steps = rank["steps"]
    for before, after in itertools.pairwise(steps):
        assert before["end"] <= after["start"], (before, after)  # steps in order, one after the other
    for s in steps:
        segments = s["segments"]
        assert s["start"] <= segments[0][1] and segments[-1][2] <= s["end"], s
        for (_, a, b), (_, c, _) in itertools.pairwise(segments):
            assert a < b <= c, segments
        names = [name for name, _, _ in segments]
        exchange = ["waiting", "all-reduce", "backward"] if world > 1 else []  # backward: DDP finishing
        assert _in_order(names, ["data", "forward", "backward", *exchange, "optimizer"]), names
        assert {"forward", "backward", "optimizer"} <= set(names), names
        for phase in PHASES[:-1]:
            assert s["split"][phase] == pytest.approx(sum(b - a for name, a, b in segments if name == phase), abs=1e-12)
        gaps = (s["end"] - s["start"]) - sum(b - a for _, a, b in segments)
        assert s["split"]["other"] == pytest.approx(gaps, abs=1e-12) and gaps >= 0
        assert sum(s["split"].values()) == pytest.approx(s["end"] - s["start"], abs=1e-12)
        if world == 1:
            assert not s["buckets"] and s["split"]["waiting"] == s["split"]["all-reduce"] == 0
            continue
        (handed_over, back), = s["buckets"]  # 116 kB of gradients: one bucket, all-reduced once per step
        exchanged = [(a, b) for name, a, b in segments if name in ("waiting", "all-reduce")]
        assert exchanged and exchanged[0][0] == pytest.approx(handed_over) and exchanged[-1][1] == pytest.approx(back)
        assert s["split"]["waiting"] + s["split"]["all-reduce"] == pytest.approx(back - handed_over)


def _in_order(names: list[str], order: list[str]) -> bool:
    """Whether `names` is `order` with some of its phases left out (a phase of no time draws no segment)."""
    it = iter(order)
    return all(any(n == o for o in it) for n in names)


def _runs(row: list[tuple[int, int, int]], colour: tuple[int, int, int]) -> list[tuple[int, int]]:
    """[x0, x1) of each horizontal run of pixels of exactly `colour` in `row`."""
    runs, start = [], None
    for x, px in enumerate([*row, None]):
        if px == colour and start is None:
            start = x
        elif px != colour and start is not None:
            runs.append((start, x))
            start = None
    return runs


def _rgb(hex_colour: str) -> tuple[int, int, int]:
    return int(hex_colour[1:3], 16), int(hex_colour[3:5], 16), int(hex_colour[5:7], 16)


def _assert_timeline_shows(split: dict[str, Any], png: Path) -> None:
    """timeline.png shows phases.json: a lane per rank (rank 0 on top) holding one forward run per step, and
    in every lane each phase's coloured runs where that rank's segments put them, and each bucket's bar under
    its lane — positions on one linear time axis, fitted to the forward passes (no clock read here)."""
    image = Image.open(png).convert("RGB")
    width, height = image.size
    data = image.tobytes()  # RGB, row by row
    rows = [[tuple(data[i:i + 3]) for i in range(3 * width * y, 3 * width * (y + 1), 3)] for y in range(height)]
    colour = {phase: _rgb(COLOURS[phase]) for phase in PHASES}
    # A lane's rows hold the forward colour in more than one run (the legend's patch is one run).
    lanes: list[list[int]] = []
    for y in (y for y in range(height) if len(_runs(rows[y], colour["forward"])) > 1):
        if lanes and y == lanes[-1][-1] + 1:
            lanes[-1].append(y)
        else:
            lanes.append([y])
    ranks = split["ranks"]
    assert len(lanes) == len(ranks), [(lane[0], lane[-1]) for lane in lanes]
    middles = [rows[lane[len(lane) // 2]] for lane in lanes]
    # One time axis for every lane, x = origin + scale·t, fitted to where each forward run ends (its start may lie
    # under the step's start tick).
    pairs = []
    for row, r in zip(middles, ranks):
        forward = [(a, b) for s in r["steps"] for name, a, b in s["segments"] if name == "forward"]
        runs = _runs(row, colour["forward"])
        assert len(runs) == len(forward) == len(r["steps"]), (runs, forward)  # one forward per step
        pairs += [(t1, x1) for (_, t1), (_, x1) in zip(forward, runs)]
    n, st, sx = len(pairs), sum(t for t, _ in pairs), sum(x for _, x in pairs)
    scale = (n * sum(t * x for t, x in pairs) - st * sx) / (n * sum(t * t for t, _ in pairs) - st * st)
    origin = (sx - scale * st) / n

    def at(t0: float, t1: float) -> tuple[float, float]:
        return origin + scale * t0, origin + scale * t1
    assert max(abs(origin + scale * t - x) for t, x in pairs) <= 2, pairs  # they sit where their times say
    for lane, row, r in zip(lanes, middles, ranks):
        bars = next((rows[y] for y in range(lane[-1] + 1, height) if _runs(rows[y], colour["all-reduce"])
                     and not _runs(rows[y], colour["forward"])), [])
        shown = {phase: _runs(row, colour[phase]) for phase in PHASES[:-1]}
        drawn = {phase: [at(t0, t1) for s in r["steps"] for name, t0, t1 in s["segments"] if name == phase]
                 for phase in PHASES[:-1]}
        shown["bucket"] = _runs(bars, colour["all-reduce"])
        drawn["bucket"] = [at(t0, t1) for s in r["steps"] for t0, t1 in s["buckets"]]
        # Every run of a colour begins and ends at edges of that phase's spans, and every span a few pixels wide
        # shows. (Edge pixels are blended with the neighbour's colour; a step's start tick hides a few more.)
        for phase, spans in drawn.items():
            for x0, x1 in shown[phase]:
                assert any(abs(x0 - s0) <= 4 for s0, _ in spans) and any(abs(x1 - s1) <= 3 for _, s1 in spans), \
                    (r["rank"], phase, (x0, x1), spans)
            for s0, s1 in spans:
                assert s1 - s0 < 6 or any(x0 < s1 - 1 and s0 + 1 < x1 for x0, x1 in shown[phase]), \
                    (r["rank"], phase, (s0, s1), shown[phase])


def test_two_ranks_trace_draw_and_split_each_step_without_changing_the_training(tmp_path: Path) -> None:
    """A bare --profile: 5 steps after a warm-up of 5 (12 steps per rank in the epoch: steps 6-10)."""
    profiled, plain = tmp_path / "profiled", tmp_path / "plain"
    stdout = _train(profiled, tmp_path, "--profile", "-g", "2", samples=1200)
    _train(plain, tmp_path, "-g", "2", samples=1200)
    _assert_same_weights(profiled, plain)

    folder = profiled / "profile"
    split = json.loads((folder / "phases.json").read_text())
    assert [r["rank"] for r in split["ranks"]] == [0, 1]
    for r in split["ranks"]:
        assert len(r["steps"]) == cli.PROFILE_STEPS
        _assert_steps_are_split(r, world=2)
        traced = _traced_steps(folder / f"rank{r['rank']}.json.gz")
        # One ProfilerStep per profiled step, each holding that step's convolutions, forward and backward, and its
        # one optimizer step; torch.profiler may open one more as it stops, which holds no step.
        assert len(traced) in (cli.PROFILE_STEPS, cli.PROFILE_STEPS + 1), traced
        for counted in traced[:cli.PROFILE_STEPS]:
            assert counted["optimizer"] == 1 and counted["conv"] >= 2 and counted["conv backward"] >= 2, traced
        assert all(counted["optimizer"] == 0 for counted in traced[cli.PROFILE_STEPS:]), traced
    _assert_timeline_shows(split, folder / "timeline.png")
    # One table: a header, the phase names, a row per rank.
    lines = stdout.splitlines()
    header = next(i for i, line in enumerate(lines) if line.startswith("profile: steps"))
    assert lines[header].startswith("profile: steps 6-10 of this run, 5 per rank"), lines[header]
    assert lines[header + 1].split() == ["rank", *PHASES, "step"]
    assert [line.split()[0] for line in lines[header + 2:header + 4]] == ["0", "1"]


def test_an_odd_world_trains_the_same_with_the_comm_hook(tmp_path: Path) -> None:
    """At an odd world too (where a reduction that divided by 3 instead of multiplying by 1/3, as DDP does,
    would differ in the last bit now and then, which training amplifies: test_accumulate checks ours is DDP's
    own), the clock leaves every bit alone."""
    profiled, plain = tmp_path / "profiled", tmp_path / "plain"
    _train(profiled, tmp_path, "-g", "3", "--profile", "1")
    _train(plain, tmp_path, "-g", "3")
    _assert_same_weights(profiled, plain)
    split = json.loads((profiled / "profile" / "phases.json").read_text())  # and the clock ran, on every rank
    assert [r["rank"] for r in split["ranks"]] == [0, 1, 2] and all(len(r["steps"]) == 1 for r in split["ranks"])
    for r in split["ranks"]:
        _assert_steps_are_split(r, world=3)


def test_one_process_profiles_the_steps_left_in_a_short_epoch(tmp_path: Path) -> None:
    out = tmp_path / "run"
    stdout = _train(out, tmp_path, "--batch-size", "200", "--profile", "10")  # 4 steps: 1 warm-up, 3 profiled
    assert "3 are profiled instead of 10" in stdout
    split = json.loads((out / "profile" / "phases.json").read_text())
    (rank,) = split["ranks"]
    assert len(rank["steps"]) == 3
    _assert_steps_are_split(rank, world=1)
    assert sum(counted["optimizer"] for counted in _traced_steps(out / "profile" / "rank0.json.gz")) == 3
    _assert_timeline_shows(split, out / "profile" / "timeline.png")


def _marks(start: float, ready: float, back: float) -> dict:
    """A step from `start`: 1 ms data, forward until +3, backward until `back` + 0.5 (its last bucket handed
    over at `ready`), optimizer for 1 ms, ending 0.5 ms later."""
    return {"start": start, "end": back + 2.0,
            "phases": [("forward", start + 1, start + 3), ("backward", start + 3, back + 0.5),
                       ("optimizer", back + 0.5, back + 1.5)],
            "buckets": [(ready, back)]}


def test_the_split_charges_the_wait_for_a_slower_rank_to_the_faster_one() -> None:
    # Rank 1 hands its bucket over 4 ms after rank 0; both have the reduced gradients back at 16.
    ranks = [{"rank": r, "host": "h", "steps": [_marks(0.0, ready, 16.0)]} for r, ready in ((1, 14.0), (0, 10.0))]
    fast, slow = (r["steps"][0]["split"] for r in split_steps(ranks)["ranks"])
    assert fast == pytest.approx({"data": 1, "forward": 2, "backward": 7.5, "waiting": 4, "all-reduce": 2,
                                  "optimizer": 1, "other": 0.5})
    assert slow == pytest.approx({"data": 1, "forward": 2, "backward": 11.5, "waiting": 0, "all-reduce": 2,
                                  "optimizer": 1, "other": 0.5})


def test_a_rank_on_another_machine_is_put_on_rank_0s_clock_by_the_all_reduce() -> None:
    """Its perf_counter counts from another boot: 1000 s ahead here. The reduced gradients come back at the
    same moment everywhere, which is what aligns it."""
    ranks = [{"rank": 0, "host": "a", "steps": [_marks(0.0, 10.0, 16.0), _marks(20.0, 30.0, 36.0)]},
             {"rank": 1, "host": "b", "steps": [_marks(1000.0, 1014.0, 1016.0), _marks(1020.0, 1034.0, 1036.0)]}]
    other = split_steps(ranks)["ranks"][1]
    assert other["clock_offset"] == pytest.approx(1000.0)
    assert [s["start"] for s in other["steps"]] == pytest.approx([0.0, 20.0])


def test_profile_needs_at_least_one_step(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["train", "--profile", "0"]) == 2
    assert capsys.readouterr().err.strip() == ("mnist-ddp: error: --profile takes a number of steps of at least 1, "
                                               "not 0.")


class _Event:
    """A stand-in for torch.cuda.Event: completes at a moment the test sets (ms), as the device would."""

    def __init__(self, ms: float) -> None:
        self.ms = ms

    def elapsed_time(self, later: "_Event") -> float:
        return later.ms - self.ms


def test_on_a_gpu_the_clock_reads_the_events_from_the_steps_anchor(monkeypatch: pytest.MonkeyPatch) -> None:
    """BucketClock's GPU path (no GPU here, so events stand in): a bucket's moments are the events recorded when
    the observer was told, read as the anchor's perf_counter plus their time after the anchor's event, not the
    moments the observer was told (under NCCL the callback runs when the all-reduce is queued); outside an
    anchored step nothing is kept."""
    completes = iter([1000.0, 1002.5, 1009.0, 1500.0, 1501.0])  # ms: anchor, handed over, back, then unanchored
    seen: list[tuple[float, float]] = []
    clock = timeline.BucketClock(lambda a, b: seen.append((a, b)), torch.device("cuda", 0),
                                 event=lambda: _Event(next(completes)))
    clock.start(50.0)  # the step began at perf_counter 50 s, the anchor's event at 1000 ms of the device
    clock.handed_over(0)
    clock.back(0)
    assert seen == []  # nothing is read before the device has caught up
    clock.settle()
    assert seen == [(pytest.approx(50.0025), pytest.approx(50.009))]
    clock.handed_over(0)
    clock.back(0)  # after settle, no anchor: dropped
    clock.settle()
    assert len(seen) == 1 and clock.pending == []
    readings = iter([7.0, 7.5])
    monkeypatch.setattr(timeline.time, "perf_counter", lambda: next(readings))
    cpu = timeline.BucketClock(lambda a, b: seen.append((a, b)), torch.device("cpu"))
    cpu.handed_over(3)
    cpu.back(3)  # on the CPU: perf_counter, recorded at once, no anchor needed
    assert seen[1:] == [(7.0, 7.5)]
