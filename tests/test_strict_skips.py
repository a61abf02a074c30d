"""The CI hook (strict_skips.py) in a real pytest run: under CI a skip fails with its reason, except a
`ci_may_skip` one; without CI every skip stays a skip."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

TESTS = Path(__file__).resolve().parent
CASES = '''
import pytest

def test_skips():
    pytest.skip("needs slurmd")

@pytest.mark.skipif(True, reason="needs root")
def test_skipif():
    pass

@pytest.mark.ci_may_skip
def test_forgiven():
    pytest.skip("no MNIST files beside the checkout")

def test_passes():
    pass
'''


def _pytest(folder: Path, ci: str | None) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "CI"} | ({"CI": ci} if ci is not None else {})
    return subprocess.run([sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-rA", str(folder)],
                          cwd=folder, env=env, text=True, capture_output=True, timeout=120)


@pytest.fixture
def folder(tmp_path: Path) -> Path:
    (tmp_path / "conftest.py").write_text(f"import sys\nsys.path.insert(0, {str(TESTS)!r})\n"
                                          "from strict_skips import *  # noqa\n")
    (tmp_path / "test_cases.py").write_text(CASES)
    return tmp_path


def test_under_ci_a_skip_fails_with_its_reason(folder: Path) -> None:
    r = _pytest(folder, "true")
    assert r.returncode == 1, r.stdout
    # a skip in the call fails it; a skipif (decided in set-up) makes it an error: both are red
    assert "1 failed, 1 passed, 1 skipped, 1 error" in r.stdout, r.stdout
    assert "FAILED test_cases.py::test_skips" in r.stdout and "ERROR test_cases.py::test_skipif" in r.stdout, r.stdout
    assert "needs slurmd" in r.stdout and "needs root" in r.stdout, r.stdout
    assert "SKIPPED" in r.stdout and "no MNIST files beside the checkout" in r.stdout, r.stdout  # the forgiven one
    assert "PASSED test_cases.py::test_passes" in r.stdout, r.stdout


def test_under_ci_a_skipped_module_stops_the_run(folder: Path) -> None:
    (folder / "test_gone.py").write_text("import pytest\npytest.importorskip('no_such_module_here')\n")
    r = _pytest(folder, "true")
    assert r.returncode == 2 and "ERROR test_gone.py" in r.stdout and "no_such_module_here" in r.stdout, r.stdout
    assert _pytest(folder, None).returncode == 0


def test_without_ci_skips_stay_skips(folder: Path) -> None:
    r = _pytest(folder, None)
    assert r.returncode == 0, r.stdout
    assert "failed" not in r.stdout and "error" not in r.stdout.lower(), r.stdout
    assert "1 passed, 3 skipped" in r.stdout, r.stdout
