"""Under CI a skip is a failure (conftest.py registers these hooks).

`.ci/run` exports CI=true and installs everything the suite needs — root, SLURM and munge, Open MPI and
MPICH, iproute2, Fashion-MNIST, the dev extras — so a test that skips there means a prerequisite broke, and
what the test proves went unproven while CI stayed green. Under CI such a skip fails, saying what was
missing; a skipped module (an import that failed) fails the same way. The only skips CI forgives are tests
marked `ci_may_skip`: what they need cannot be installed by any step of CI (the MNIST test files in
../shared beside the checkout). Locally, without CI set, everything skips as before.
"""

import os
from typing import Any

import pytest

STRICT = os.environ.get("CI", "").lower() in ("1", "true", "yes")
MESSAGE = "CI must not skip this; .ci/run should have provided what it needs: "


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "ci_may_skip: a skip CI forgives (what the test needs, CI cannot install)")


def _reason(longrepr: Any) -> str:
    return longrepr[2] if isinstance(longrepr, tuple) else str(longrepr)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo) -> Any:
    report = yield
    if STRICT and report.skipped and not hasattr(report, "wasxfail") and item.get_closest_marker("ci_may_skip") is None:
        report.outcome = "failed"
        report.longrepr = MESSAGE + _reason(report.longrepr)
    return report


@pytest.hookimpl(wrapper=True)
def pytest_make_collect_report(collector: pytest.Collector) -> Any:
    report = yield
    if STRICT and report.skipped:
        report.outcome = "failed"
        report.longrepr = MESSAGE + _reason(report.longrepr)
    return report
