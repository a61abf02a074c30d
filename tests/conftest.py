"""Shared test helpers: run the real CLI in a subprocess on tiny synthetic data, read what it left,
and join real gloo process groups the way `mnist-ddp train -g N` does."""

import json
import os
import subprocess
import sys
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.multiprocessing as mp

from mnist_ddp.common.errors import UserError
from mnist_ddp.core import distributed
from mnist_ddp.joining import identity, rendezvous
from mnist_ddp.outputs import checkpoint
from strict_skips import pytest_configure, pytest_make_collect_report, pytest_runtest_makereport  # noqa: F401

# The suite proves the CPU path (gloo, CPU worker processes): on a machine with GPUs it must prove the same, so
# they are hidden from this process and every child before anything asks CUDA (`-g 2` means two CPU workers
# there too, and the runs are the CPU's, bit for bit). benchmarks/gpu_check.py is what runs on GPUs.
os.environ["CUDA_VISIBLE_DEVICES"] = ""

# The slowest test files (by their time in one process), first: pytest-xdist hands whole files to its workers in
# the order they were collected, so these start at once and the short files fill in around them, rather than one
# of them running alone at the end.
SLOWEST_FIRST = ("test_recovery.py", "test_faults.py", "test_multinode.py", "test_chaos.py", "test_fuzz.py",
                 "test_notebook.py", "test_trust.py", "test_resume.py", "test_base_install.py", "test_bitwise.py")


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    rank = {name: i for i, name in enumerate(SLOWEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))  # a stable sort: each file's order is kept


REPO = Path(__file__).resolve().parents[1]
SHARED = REPO.parent / "shared"
MNIST_T10K = SHARED / "data" / "mnist-t10k"
FASHION = Path("/usr/share/datasets/fashion-mnist")
HAS_T10K = (MNIST_T10K / "t10k-images-idx3-ubyte.gz").is_file()


def needs_t10k(test: Callable) -> Callable:
    """Skip `test` where the MNIST test files are not beside the checkout (the one skip CI allows)."""
    skip = pytest.mark.skipif(not HAS_T10K, reason=f"the MNIST test files are not in {MNIST_T10K}")
    return pytest.mark.ci_may_skip(skip(test))


def tiny(train: int = 800, test: int = 200, epochs: int | None = 1) -> list[str]:
    """The data and output flags of a run that takes seconds (`epochs` None: the recipe's)."""
    args = ["--dataset", "synthetic", "--train-samples", str(train), "--test-samples", str(test),
            "--no-progress", "--no-plots"]
    return args + (["--epochs", str(epochs)] if epochs else [])


TINY = tiny()  # 800 synthetic training images, one epoch


def cli_env(extra: dict[str, str] | None = None) -> dict[str, str]:
    """The environment for a child: no inherited launcher variables, src/ importable."""
    env = identity.without_launcher_vars(os.environ)
    env["PYTHONPATH"] = str(REPO / "src") + os.pathsep + env.get("PYTHONPATH", "")
    env["PYTHONUNBUFFERED"] = "1"
    return env | (extra or {})


def run_cli(*args: str, cwd: Path | None = None, timeout: float = 180, env: dict[str, str] | None = None,
            module: str = "mnist_ddp") -> subprocess.CompletedProcess:
    """`python -m mnist_ddp ARGS` as a user would run it; output captured as text."""
    return subprocess.run([sys.executable, "-m", module, *args], cwd=cwd, env=cli_env(env), text=True,
                          capture_output=True, timeout=timeout)


def metrics(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines() if line.strip()]


def progress(out: Path) -> dict[str, Any] | None:
    """The progress saved in `<out>/checkpoint.pt`, or None before the first save."""
    try:
        return checkpoint.load(out / "checkpoint.pt")["progress"]
    except UserError:
        return None


def _gloo_rank(rank: int, fn: Callable[..., None], world: int, port: int, args: tuple) -> None:
    torch.set_num_threads(1)
    ident = identity.spawned(0, rank, world, 1, "127.0.0.1", port)
    d = distributed.join(ident, torch.device("cpu"), "gloo", 60)
    finished = False
    try:
        fn(d, *args)
        finished = True
    finally:
        # together after success, as launch does: a rank that leaves first aborts a peer's gloo thread now and
        # then ("terminate called without an active exception", SIGABRT; seen once in six runs of test_accumulate)
        distributed.teardown(together=finished)


def spawn_gloo(fn: Callable[..., None], world: int, *args: Any) -> None:
    """`fn(d: Dist, *args)` in `world` spawned processes joined into one gloo group, as `-g world` joins them
    (`fn` must be a module-level function, so that the children can import it)."""
    store = rendezvous.host_store("127.0.0.1", 0, world, timedelta(seconds=60))
    mp.spawn(_gloo_rank, args=(fn, world, store.port, args), nprocs=world, join=True)
    del store


TRAINED_TEST_SAMPLES = "200"


@pytest.fixture(scope="session")
def trained_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A run that knows the digits (~95% on synthetic test images; 800 images would leave it at ~40%), so that
    an answer can be checked against the true label, not only against another answer; trained once for the
    modules that only read it (evaluate, predict, model.safetensors, export)."""
    out = tmp_path_factory.mktemp("trained") / "run"
    r = run_cli("train", *tiny(12000, int(TRAINED_TEST_SAMPLES)), "--out", str(out), cwd=out.parent,
                env={"OMP_NUM_THREADS": "1"})
    assert r.returncode == 0, r.stderr
    return out


@pytest.fixture
def cli(tmp_path: Path):
    """Run the CLI with the test's temp folder as the working directory."""
    def run(*args: str, **kw) -> subprocess.CompletedProcess:
        kw.setdefault("cwd", tmp_path)
        return run_cli(*args, **kw)
    return run
