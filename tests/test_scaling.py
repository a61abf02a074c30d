"""benchmarks/scaling.py: its alpha-beta fit recovers known numbers, and its smoke run writes what it promises.

No assertion is about speed: the measured times on a shared machine mean nothing in a test.
"""

import importlib.util
import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import REPO, cli_env
from datafiles import ONE_THREAD

SCRIPT = REPO / "benchmarks" / "scaling.py"
_spec = importlib.util.spec_from_file_location("scaling", SCRIPT)
scaling = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(scaling)


def _ring(n: int, p: int, alpha: float, beta: float) -> float:
    """The textbook ring all-reduce time, written out here independently of the script."""
    return 2 * (p - 1) * alpha + 2 * (p - 1) / p * n * beta


def test_ring_time_is_the_textbook_formula() -> None:
    assert scaling.ring_time(1000, 4, 1e-5, 1e-9) == pytest.approx(6 * 1e-5 + 1.5 * 1000 * 1e-9)
    assert scaling.ring_time(1000, 1, 1e-5, 1e-9) == 0.0  # one rank sends nothing


@pytest.mark.parametrize("worlds", [(2,), (2, 4, 8)])
@pytest.mark.parametrize("alpha, beta", [(25e-6, 1 / 1.25e9), (300e-6, 1 / 12.5e6), (2e-6, 1 / 300e9)])
def test_fit_recovers_known_alpha_and_beta(worlds: tuple[int, ...], alpha: float, beta: float) -> None:
    points = [(n, p, _ring(n, p, alpha, beta)) for p in worlds for n in (4 ** k for k in range(1, 13))]
    got_alpha, got_beta = scaling.fit(points)
    assert got_alpha == pytest.approx(alpha, rel=1e-6)
    assert got_beta == pytest.approx(beta, rel=1e-6)


def test_fit_never_returns_a_negative_term() -> None:
    """Pure bandwidth (no latency) data with a little noise that would pull an unconstrained alpha below 0."""
    points = [(n, 2, n * 1e-9 * (1.1 if n < 100 else 1.0)) for n in (16, 64, 4096, 1 << 20)]
    alpha, beta = scaling.fit(points)
    assert alpha >= 0 and beta > 0


def test_times_that_do_not_grow_with_size_fit_as_latency_alone_and_print() -> None:
    """What a loaded CI box measured once: every size took about as long, so beta is 0 (its summary divided by it)."""
    points = [(n, 2, 1e-3 * (1.2 if n == 4 else 1.0)) for n in (4, 1024, 65536, 1 << 20)]
    alpha, beta = scaling.fit(points)
    assert alpha > 0 and beta == 0
    line = scaling.fit_line("loopback", {"alpha_seconds": alpha, "beta_seconds_per_byte": beta,
                                         "rms_relative_error_fitted": 0.1})
    assert "beta   0.000 ns/B (= none measurable: latency alone fits)" in line, line
    assert "MB/s" in scaling.fit_line("loopback", {"alpha_seconds": 1e-5, "beta_seconds_per_byte": 1e-9,
                                                   "rms_relative_error_fitted": 0.1})


def test_prediction_is_perfect_without_communication_cost() -> None:
    compute = scaling.Compute({b: {"forward": b * 1e-5, "backward": b * 2e-5, "optimizer": 1e-4}
                               for b in scaling.BATCHES}, "stated")
    free = scaling.predict(compute, 0.0, 0.0)["100"]["serial"]
    assert free["efficiency"] == pytest.approx([1.0] * len(scaling.RANKS))
    slow = scaling.predict(compute, 1e-3, 1e-9)["100"]
    assert slow["serial"]["efficiency"][-1] < slow["overlap"]["efficiency"][-1] <= 1.0
    assert slow["serial"]["last_ranks_at_half_efficiency"] < 1024


def test_quick_run_writes_the_fit_predictions_and_plot(tmp_path: Path) -> None:
    r = subprocess.run([sys.executable, str(SCRIPT), "--quick", "--out", "tmp"], cwd=tmp_path, text=True,
                       capture_output=True, env=cli_env(ONE_THREAD), timeout=300)
    assert r.returncode == 0, r.stderr
    result = json.loads((tmp_path / "tmp" / "scaling.json").read_text())
    fitted = result["fits"]["loopback"]
    # Non-negative and not both zero: which term the noise of a loaded box leaves is not the script's to promise.
    for key in ("alpha_seconds", "beta_seconds_per_byte"):
        assert math.isfinite(fitted[key]) and fitted[key] >= 0, (key, fitted)
    assert fitted["alpha_seconds"] + fitted["beta_seconds_per_byte"] > 0, fitted
    assert result["ranks"] == [2 ** k for k in range(11)]
    assert {"loopback", "10GbE (alpha 20 us)", "NVLink-class 300 GB/s (alpha 3 us)"} <= set(result["predictions"])
    for link, pr in result["predictions"].items():
        for batch in ("100", "1000"):
            for mode in ("serial", "overlap"):
                eff = pr[batch][mode]["efficiency"]
                assert len(eff) == 11 and eff[0] == pytest.approx(1.0) and all(0 < e <= 1 + 1e-9 for e in eff), link
    held_out = [h for h in result["holdout"] if h["bytes"] == scaling.GRADIENT_BYTES]
    assert held_out and all(h["predicted_seconds"] > 0 for h in held_out)
    assert {(s["world"], s["batch"]) for s in result["measured_steps"]} == {(1, 100), (1, 1000), (2, 100)}
    assert "fitted ring all-reduce model" in r.stdout
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        return
    assert (tmp_path / "tmp" / "scaling.png").stat().st_size > 0


@pytest.mark.parametrize("args", [["--compute-per-image", "-1"], ["--compute-per-image", "fast"], ["--nodes"]])
def test_bad_flags_are_one_line_and_exit_2(args: list[str], tmp_path: Path) -> None:
    r = subprocess.run([sys.executable, str(SCRIPT), *args], cwd=tmp_path, text=True, capture_output=True,
                       env=cli_env(ONE_THREAD), timeout=60)
    assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr
    assert not (tmp_path / "runs").exists()


def test_unwritable_out_is_one_sentence_and_exit_2(tmp_path: Path) -> None:
    (tmp_path / "file").write_text("")
    r = subprocess.run([sys.executable, str(SCRIPT), "--out", "file/sub"], cwd=tmp_path, text=True,
                       capture_output=True, env=cli_env(ONE_THREAD), timeout=60)
    assert r.returncode == 2 and r.stderr.startswith("scaling.py: cannot write to --out"), r.stderr
