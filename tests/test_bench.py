"""`mnist-ddp bench` runs end to end and writes the JSON it promises; its arithmetic is right.

No assertion here is about speed: timings on a shared machine mean nothing in a test.
"""

import importlib.util
import json
from pathlib import Path

import pytest
import torch

from mnist_ddp import tutorial
from mnist_ddp.bench import Run, _time_ratio
from mnist_ddp.data.datasets import Split

TINY_BENCH = ["bench", "--dataset", "synthetic", "--train-samples", "400", "--test-samples", "100",
              "--epochs", "1", "--tutorial-epochs", "1"]


def test_bench_runs_all_four_and_writes_the_json(cli, tmp_path: Path) -> None:
    r = cli(*TINY_BENCH, "--out", "b", "--json", "results/bench.json", timeout=300)
    assert r.returncode == 0, r.stderr
    result = json.loads((tmp_path / "results" / "bench.json").read_text())
    assert result["dataset"] == "synthetic"
    assert (result["train_images"], result["test_images"]) == (400, 100)
    assert set(result["runs"]) == {"tutorial_1", "ours_1", "tutorial_ddp_2", "ours_2"}
    for key, run in result["runs"].items():
        assert len(run["epochs"]) == 1 and run["images_per_second"] == run["epochs"][0]["images_per_second"], key
        assert run["processes"] == (2 if key.endswith("_2") else 1)
    for key in ("tutorial_1", "ours_1", "ours_2"):  # the runs that test, and so can reach the target
        run = result["runs"][key]
        correct = run["final_test_accuracy"] * 100  # of the 100 test images: a count, not any number in [0, 1]
        assert 0 <= correct <= 100 and correct == pytest.approx(round(correct)), run
        assert run["reached_target"] == (run["seconds_to_target"] is not None)
    assert "world size 2" in result["runs"]["ours_2"]["settings"]
    pipeline = "pil" if importlib.util.find_spec("torchvision") else "tensor"  # this machine's case
    assert result["tutorial_pipeline"] == {"name": pipeline, "what": tutorial.PIPELINES[pipeline]}
    for key in ("tutorial_1", "tutorial_ddp_2"):
        assert result["runs"][key]["settings"].startswith(tutorial.PIPELINES[pipeline]), result["runs"][key]
    said = "PIL" if pipeline == "pil" else "tensor"
    assert f"tutorial ({said}), 1 process" in r.stdout and f"tutorial DDP ({said}), 2 processes" in r.stdout
    ratios = result["ratios"]
    assert {"images_per_second_ours_1_vs_tutorial_1", "images_per_second_ours_2_vs_tutorial_ddp_2",
            "images_per_second_ours_2_vs_ours_1"} <= set(ratios)
    ours, tut = result["runs"]["ours_1"], result["runs"]["tutorial_1"]
    assert ratios["images_per_second_ours_1_vs_tutorial_1"]["value"] == pytest.approx(
        ours["images_per_second"] / tut["images_per_second"])
    for label in ("(a) images/s, 1 process", "(b) images/s, 2 processes", "(c) seconds to 89%"):
        assert label in r.stdout
    assert (tmp_path / "b" / "ours-1" / "metrics.jsonl").exists() and (tmp_path / "b" / "ours-2.log").exists()


def test_bench_refuses_a_folder_with_a_bench_in_it(cli, tmp_path: Path) -> None:
    (tmp_path / "b").mkdir()
    (tmp_path / "b" / "bench.json").write_text("keep me")
    r = cli(*TINY_BENCH, "--out", "b")
    assert r.returncode == 2 and "already holds a bench run" in r.stderr and "Traceback" not in r.stderr
    assert (tmp_path / "b" / "bench.json").read_text() == "keep me"


@pytest.mark.parametrize("flag", [["--target", "1.5"], ["-g", "0"], ["--tutorial-epochs", "0"], ["--device", "mps"]])
def test_bench_bad_flags_are_one_line(cli, flag: list[str]) -> None:
    r = cli(*TINY_BENCH, *flag)
    assert r.returncode == 2 and "Traceback" not in r.stderr and len(r.stderr.strip().splitlines()) == 1


def _run(*epochs: tuple[float, float | None]) -> Run:
    return Run("x", 1, [{"images_per_second": 1.0, "seconds": s, "test_accuracy": a} for s, a in epochs])


def test_seconds_to_target_counts_up_to_the_first_epoch_that_reaches_it() -> None:
    assert _run((10, 0.5), (10, 0.9), (10, 0.95)).seconds_to(0.9) == (20, True)
    assert _run((10, 0.5), (10, 0.8)).seconds_to(0.9) == (20, False)


def test_time_ratio_is_a_lower_bound_when_the_slow_run_never_got_there() -> None:
    slow_reached, slow_not, fast = _run((30, 0.9)), _run((30, 0.8)), _run((5, 0.7), (5, 0.91))
    assert (_time_ratio(slow_reached, fast, 0.9).value, _time_ratio(slow_reached, fast, 0.9).lower_bound) == (3, False)
    assert (_time_ratio(slow_not, fast, 0.9).value, _time_ratio(slow_not, fast, 0.9).lower_bound) == (3, True)
    assert _time_ratio(slow_reached, _run((5, 0.5)), 0.9).value is None  # ours never got there: no ratio
    assert str(_time_ratio(slow_not, fast, 0.9)) == ">3.00x"


def test_the_pil_pipeline_computes_totensors_arithmetic() -> None:
    """The tutorial's per-sample path through a PIL image gives ToTensor's numbers (uint8 H×W -> 1×H×W float32,
    divided by 255), here written out as arithmetic on the image tensor: every byte value, in an image that is not
    symmetric, so that a transposed or flipped image would be caught (the control)."""
    g = torch.Generator().manual_seed(0)
    images = torch.randint(0, 256, (3, 28, 28), dtype=torch.uint8, generator=g)
    images[0] = torch.arange(28 * 28).remainder(256).view(28, 28).to(torch.uint8)  # every value, no symmetry
    split = Split(images, torch.tensor([3, 1, 4]))
    pil, plain = tutorial.PerSampleDataset(split, pil=True), tutorial.PerSampleDataset(split)
    for i in range(3):
        x, label = pil[i]
        expected = images[i].view(28, 28, 1).permute(2, 0, 1).contiguous().to(torch.float32).div(255)
        assert x.dtype == torch.float32 and x.shape == (1, 28, 28) and x.is_contiguous()
        assert torch.equal(x, expected) and torch.equal(x, plain[i][0]) and label == plain[i][1] == [3, 1, 4][i]
    assert not torch.equal(pil[0][0], images[0].T.unsqueeze(0).float().div(255))
