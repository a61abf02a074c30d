"""--profile: real runs leave a Chrome trace per rank that parses, timeline.png and a split of every step
into phases that adds up to the step as torch.profiler timed it; profiling leaves the weights bit for bit
as they are without it (it only puts a clock on the comm hook every run reduces with; with --bitwise:
test_bitwise.py); the split itself is checked on marks whose answer is known."""

import gzip
import json
from pathlib import Path

import pytest
import torch

from conftest import run_cli, tiny
from datafiles import ONE_THREAD
from mnist_ddp import checkpoint, cli
from mnist_ddp.timeline import PHASES, split_steps


def _train(out: Path, tmp_path: Path, *extra: str) -> str:
    """A tiny run (batch 50: 8 steps per rank at -g 2); returns its stdout."""
    r = run_cli("train", *tiny(train=800, test=200), "--batch-size", "50", "--out", str(out), *extra,
                cwd=tmp_path, env=ONE_THREAD)
    assert r.returncode == 0, r.stderr
    return r.stdout


def _weights(out: Path) -> dict[str, torch.Tensor]:
    return checkpoint.load(out / "checkpoint.pt")["model"]


def _trace_steps(path: Path) -> list[float]:
    """The seconds of each step torch.profiler recorded (its ProfilerStep#n spans), in order."""
    events = json.loads(gzip.decompress(path.read_bytes()))["traceEvents"]
    steps = sorted((e["ts"], e["dur"]) for e in events if str(e.get("name", "")).startswith("ProfilerStep#"))
    return [dur / 1e6 for _, dur in steps]


def _assert_same_weights(a: Path, b: Path) -> None:
    wa, wb = _weights(a), _weights(b)
    assert wa.keys() == wb.keys()
    for key in wa:
        assert torch.equal(wa[key], wb[key]), key


def test_two_ranks_trace_draw_and_split_each_step_without_changing_the_training(tmp_path: Path) -> None:
    profiled, plain = tmp_path / "profiled", tmp_path / "plain"
    stdout = _train(profiled, tmp_path, "-g", "2", "--profile", "3")
    _train(plain, tmp_path, "-g", "2")
    _assert_same_weights(profiled, plain)

    folder = profiled / "profile"
    assert (folder / "timeline.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    split = json.loads((folder / "phases.json").read_text())
    assert [r["rank"] for r in split["ranks"]] == [0, 1]
    for r in split["ranks"]:
        steps = r["steps"]
        assert len(steps) == 3
        traced = _trace_steps(folder / f"rank{r['rank']}.json.gz")
        assert len(traced) >= 3  # torch.profiler may open one more step as it stops
        for s, seconds in zip(steps, traced):
            assert sum(s["split"].values()) == pytest.approx(s["end"] - s["start"])
            assert s["end"] - s["start"] == pytest.approx(seconds, rel=0.05, abs=2e-3)  # two clocks, one step
            assert len(s["buckets"]) == 1  # 116 kB of gradients: one bucket, all-reduced once per step
            assert s["split"]["forward"] > 0 and s["split"]["backward"] > 0 and s["split"]["optimizer"] > 0
        # The marked phases, not the loop's bookkeeping, are where a step's time goes.
        named = sum(sum(v for k, v in s["split"].items() if k != "other") for s in steps)
        assert named >= 0.9 * sum(traced[:3])
        exchange = [s["split"]["all-reduce"] + s["split"]["waiting"] for s in steps]
        assert all(x > 0 for x in exchange)
    # One table: a header, the phase names, a row per rank.
    lines = stdout.splitlines()
    header = next(i for i, line in enumerate(lines) if line.startswith("profile: steps"))
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


def test_one_process_profiles_the_steps_left_in_a_short_epoch(tmp_path: Path) -> None:
    out = tmp_path / "run"
    stdout = _train(out, tmp_path, "--batch-size", "200", "--profile", "10")  # 4 steps: 1 warm-up, 3 profiled
    assert "3 are profiled instead of 10" in stdout
    split = json.loads((out / "profile" / "phases.json").read_text())
    (rank,) = split["ranks"]
    assert len(rank["steps"]) == 3
    assert all(s["split"]["all-reduce"] == s["split"]["waiting"] == 0 and not s["buckets"] for s in rank["steps"])
    assert len(_trace_steps(out / "profile" / "rank0.json.gz")) >= 3


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
