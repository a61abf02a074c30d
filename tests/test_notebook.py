"""The example notebook, run for real in a Jupyter kernel, and that kernel then used on as a person would.

examples/ddp_in_a_notebook.ipynb runs top to bottom, its data made tiny (an override cell after the one
tagged "parameters", as papermill does): the kernel uses torch and trains in its own process, then launches
`processes=2`, shows the plots, evaluates, predicts and raises a bad value's sentence. It runs twice in one
folder, each time in a new kernel (Restart & Run All): the second run's runs get fresh folders, and the
first's are left as they were. Then, in the same
kernel: "interrupt kernel" (SIGINT to the kernel's process group, what Jupyter sends) during a
`processes=2` run, and again in the same cell after it; SIGKILL to one worker; an environment variable set
now; and one more run. /proc says which processes are left, not our code.
"""

import asyncio
import json
import os
import signal
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import nbformat
import pytest
from nbclient import NotebookClient
from nbformat import NotebookNode

from conftest import REPO, cli_env
from mnist_ddp import cli
from mnist_ddp.outputs import checkpoint
from procfs import marked_env, marked_pids, needs_proc, reaped, spawned_workers
from venvs import fresh_venv

pytestmark = needs_proc

NOTEBOOK = REPO / "examples" / "ddp_in_a_notebook.ipynb"
TINY = 'data = dict(dataset="synthetic", train_samples=400, test_samples=100)'
HANG = 180  # seconds before a cell or a wait counts as hung: a hang guard, not a timing assertion
WIDGET = "application/vnd.jupyter.widget-view+json"
LONG_RUN = 'train(processes=2, epochs=500, out="runs/{name}", **data)'  # runs until it is stopped


def _kernelspec(jupyter: Path, python: Path | str = sys.executable) -> str:
    """A kernel of `python` (by default this interpreter, the one mnist_ddp is installed in), found first through
    JUPYTER_PATH."""
    spec = jupyter / "kernels" / "mnist-ddp-test"
    spec.mkdir(parents=True)
    (spec / "kernel.json").write_text(json.dumps({
        "argv": [str(python), "-m", "ipykernel_launcher", "-f", "{connection_file}"],
        "display_name": "mnist-ddp tests", "language": "python"}))
    return spec.name


def _tiny_notebook() -> NotebookNode:
    """The example notebook, its data made tiny by a cell after the one tagged "parameters" (as papermill does)."""
    nb = nbformat.read(NOTEBOOK, as_version=4)
    parameters = next(i for i, c in enumerate(nb.cells) if "parameters" in c.metadata.get("tags", []))
    nb.cells.insert(parameters + 1, nbformat.v4.new_code_cell(TINY))
    return nb


def _text(cell: NotebookNode, stream: str = "stdout") -> str:
    return "".join(o.text for o in cell.outputs if o.output_type == "stream" and o.name == stream)


def _errors(cell: NotebookNode) -> list[NotebookNode]:
    return [o for o in cell.outputs if o.output_type == "error"]


def _assert_no_error_but_the_tagged_one(nb: NotebookNode) -> None:
    for cell in nb.cells:
        assert cell.cell_type != "code" or _errors(cell) == [] or "raises-exception" in cell.metadata.tags, cell


def _cell(nb: NotebookNode, start: str) -> NotebookNode:
    return next(c for c in nb.cells if c.cell_type == "code" and c.source.startswith(start))


async def _until(what: str, ok: Callable[[], object], timeout: float = HANG) -> None:
    """Poll `ok` while the kernel's messages keep flowing (the cell's outputs grow as they come)."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while not ok():
        if loop.time() > deadline:
            pytest.fail(f"timed out after {timeout:.0f} s waiting for {what}")
        await asyncio.sleep(0.1)


class Kernel:
    """One kernel, running the notebook's cells and more cells appended to it."""

    def __init__(self, client: NotebookClient, nb: NotebookNode) -> None:
        self.client, self.nb = client, nb

    @property
    def pid(self) -> int:
        return self.client.km.provisioner.process.pid

    def start(self, source: str, raises: bool = False) -> tuple[NotebookNode, asyncio.Task]:
        cell = nbformat.v4.new_code_cell(source, metadata={"tags": ["raises-exception"] if raises else []})
        self.nb.cells.append(cell)
        return cell, asyncio.create_task(self.client.async_execute_cell(cell, len(self.nb.cells) - 1))

    async def run(self, source: str, raises: bool = False) -> NotebookNode:
        cell, task = self.start(source, raises)
        await task
        return cell

    async def training(self, out: Path) -> list[int]:
        """Once a long run in this kernel has saved its first checkpoint: its two workers."""
        await _until("the first checkpoint", lambda: (out / "checkpoint.pt").is_file())
        workers = spawned_workers(self.pid)
        assert len(workers) == 2, workers  # the control: the workers are where the checks below look
        # Forked from the fork server, a fresh interpreter, not from the kernel: no copy of it runs the workers.
        for worker in workers:
            assert "multiprocessing.forkserver" in _cmdline(worker) and "ipykernel" not in _cmdline(worker)
        return workers


def _cmdline(pid: int) -> str:
    return Path(f"/proc/{pid}/cmdline").read_text(errors="replace").replace("\0", " ")


def test_the_example_notebook_and_its_kernel_after(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                   capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setenv("JUPYTER_PATH", str(tmp_path / "jupyter"))
    nb = _tiny_notebook()
    work = tmp_path / "work"
    work.mkdir()
    client = NotebookClient(nb, timeout=HANG, kernel_name=_kernelspec(tmp_path / "jupyter"),
                            resources={"metadata": {"path": str(work)}})
    env, mark = marked_env()
    cli.main(["train", "--epochs", "0"])  # the sentence the command prints for the notebook's bad value
    said = capsys.readouterr().err.strip().removeprefix("mnist-ddp: error: ")
    with reaped(mark):  # and when the kernel has shut down, none of its processes is left
        # Restart & Run All, twice: a first kernel runs the notebook in the same folder, then the one below.
        first = _tiny_notebook()
        NotebookClient(first, timeout=HANG, kernel_name=client.kernel_name,
                       resources={"metadata": {"path": str(work)}}).execute(env=env)
        _assert_no_error_but_the_tagged_one(first)
        runs_before = {p: p.read_bytes() for p in (work / "runs").glob("*/metrics.jsonl")}
        assert len(runs_before) == 2, runs_before  # the in-kernel run's folder and the DDP run's

        async def drive() -> None:
            async with client.async_setup_kernel(env=env):
                for index, cell in enumerate(nb.cells):
                    await client.async_execute_cell(cell, index)
                kernel = Kernel(client, nb)
                await _the_notebook(kernel, work, said)
                # The second Run All ran in two fresh folders, and left the first's as they were.
                assert {p: p.read_bytes() for p in runs_before} == runs_before
                assert len(list((work / "runs").glob("*/metrics.jsonl"))) == 4
                await _interrupted(kernel, work, mark)
                await _a_worker_killed(kernel, work)
                await _the_kernels_environment_now(kernel)
        asyncio.run(drive())


@pytest.mark.timeout(900)  # a fresh venv's install first (venvs.INSTALL_S)
def test_the_notebook_extra_runs_the_example_top_to_bottom(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The README's install for notebooks, `pip install "mnist-ddp[notebook]"` (with torch) into a fresh venv and
    nothing else, runs the example notebook top to bottom in a kernel of that venv: the plots, the bar's widget
    and run.dataframe()'s table included; only the cell tagged to raise raises."""
    bin_, env = fresh_venv(tmp_path / "install", "notebook")
    monkeypatch.setenv("JUPYTER_PATH", str(tmp_path / "jupyter"))
    nb, work = _tiny_notebook(), tmp_path / "work"
    work.mkdir()
    NotebookClient(nb, timeout=HANG, kernel_name=_kernelspec(tmp_path / "jupyter", bin_ / "python"),
                   resources={"metadata": {"path": str(work)}}).execute(env=env)
    _assert_no_error_but_the_tagged_one(nb)
    assert "text/html" in _cell(nb, "run.dataframe()").outputs[0].data
    assert any(WIDGET in o.get("data", {}) for o in _cell(nb, "run = train(processes=2").outputs)
    assert all("image/png" in o.data for o in _cell(nb, "run.show()").outputs)


async def _the_notebook(kernel: Kernel, work: Path, said: str) -> None:
    """What the notebook's cells showed: the lines, bars, plots and results; the bad value's one sentence."""
    nb = kernel.nb
    _assert_no_error_but_the_tagged_one(nb)
    in_kernel = _text(_cell(nb, "import torch"))
    assert "world size 1" in in_kernel and "final: test accuracy" in in_kernel, in_kernel
    ddp = _cell(nb, "run = train(processes=2")
    assert "world size 2" in _text(ddp) and "final: test accuracy" in _text(ddp), ddp.outputs  # rank 0's lines ...
    assert any(WIDGET in o.get("data", {}) for o in ddp.outputs), ddp.outputs  # ... and its bar, drawn by the kernel
    shown = _cell(nb, "run.show()").outputs
    assert [o.output_type for o in shown] == ["display_data"] * 2 and all("image/png" in o.data for o in shown)
    assert "text/html" in _cell(nb, "run.dataframe()").outputs[0].data
    assert "Evaluation(accuracy=" in _cell(nb, "evaluate(").outputs[0].data["text/plain"]
    assert _cell(nb, "from PIL").outputs[0].data["text/plain"].count("Prediction(") == 2
    [error] = _errors(_cell(nb, "train(epochs=0"))
    assert (error.ename, error.evalue) == ("UserError", said), error
    assert not any(name in line for line in error.traceback for name in ("cli.py", "config.py")), error.traceback
    # The results as data are the files' (run.metrics: metrics.jsonl), and the kernel's own plots stay inline:
    # training in its process drew its PNGs without switching matplotlib's backend.
    check = await kernel.run("import json, matplotlib; print(json.dumps(run.metrics)); print(matplotlib.get_backend())"
                             "; print(run.out)")
    metrics, backend, out = _text(check).splitlines()
    assert json.loads(metrics) == [json.loads(line) for line in (work / out / "metrics.jsonl").open()]
    assert "inline" in backend, backend


async def _interrupted(kernel: Kernel, work: Path, mark: str) -> None:
    """Interrupt kernel during a processes=2 run: every worker stops, the checkpoint stays, and the kernel's own
    interrupt works again (the second one stops a sleep in the same cell, which an ignored SIGINT would not)."""
    before = set(marked_pids(mark))  # the kernel, its fork server, multiprocessing's resource tracker
    cell, task = kernel.start(f"import time\ntry:\n    {LONG_RUN.format(name='nb-interrupted')}\n"
                              "except KeyboardInterrupt as e:\n    print('caught:', e)\n"
                              "print('sleeping', flush=True)\ntime.sleep(600)", raises=True)
    workers = await kernel.training(work / "runs/nb-interrupted")
    await kernel.client.km.interrupt_kernel()
    await _until("train() to return after the interrupt", lambda: "sleeping" in _text(cell))
    assert "training interrupted; runs/nb-interrupted/checkpoint.pt keeps the last checkpoint" in _text(cell)
    assert spawned_workers(kernel.pid) == [] and not set(workers) & set(marked_pids(mark))
    assert set(marked_pids(mark)) == before
    checkpoint.load(work / "runs/nb-interrupted/checkpoint.pt")  # whole: its digest is checked
    await kernel.client.km.interrupt_kernel()
    done, _ = await asyncio.wait({task}, timeout=HANG)
    if not done:
        pytest.fail(f"a second interrupt did not stop the cell in {HANG} s: the kernel's SIGINT handler is lost")
    assert [e.ename for e in _errors(cell)] == ["KeyboardInterrupt"], cell.outputs


async def _a_worker_killed(kernel: Kernel, work: Path) -> None:
    """SIGKILL to one worker: one exception in the cell, naming the rank, its pid and the cause, as the command
    says it; no traceback of any worker."""
    cell, task = kernel.start(LONG_RUN.format(name="nb-killed"), raises=True)
    victim = (await kernel.training(work / "runs/nb-killed"))[0]
    os.kill(victim, signal.SIGKILL)
    await asyncio.wait_for(task, HANG)
    [error] = _errors(cell)
    assert error.ename == "PeerFailure" and f"(pid {victim}) was killed by SIGKILL" in error.evalue, error
    assert "--resume" in error.evalue and not any("launchers" in line for line in error.traceback), error.traceback
    assert "Traceback" not in _text(cell, "stderr") + _text(cell), cell.outputs



async def _the_kernels_environment_now(kernel: Kernel) -> None:
    """The workers get the kernel's environment as it is at the launch, not the fork server's from its start
    (forkserver.adopt): a GLOO_SOCKET_IFNAME naming no interface, set now, stops them joining; once it is gone
    the next run in the same kernel trains."""
    cell = await kernel.run('import os\nos.environ["GLOO_SOCKET_IFNAME"] = "nosuchif0"\n'
                            + LONG_RUN.format(name="nb-environment"), raises=True)
    [error] = _errors(cell)
    assert error.ename == "UserError" and "could not join the 1 other process" in error.evalue, error
    again = await kernel.run('del os.environ["GLOO_SOCKET_IFNAME"]\n'
                             'run = train(processes=2, out="runs/nb-again", **data)\n'
                             'print(len(run.metrics), run.metrics[-1]["world_size"], run.checkpoint.is_file())')
    assert _text(again).splitlines()[-1] == "2 2 True"  # the recipe's 2 epochs, trained by two processes, saved


# A spy on every torch.cuda entry point that initialises CUDA or asks the driver, installed before the fork
# server's preload is imported as the server imports it; its control calls one afterwards.
CUDA_SPY = """
import importlib, sys
import torch
calls = []
def spy(owner, name):
    real = getattr(owner, name, None)
    if real is not None:
        setattr(owner, name, lambda *a, **k: (calls.append(name), real(*a, **k))[1])
for name in ("is_available", "device_count", "init", "_lazy_init", "current_device", "set_device",
             "get_device_properties", "get_device_capability", "is_bf16_supported", "synchronize", "mem_get_info"):
    spy(torch.cuda, name)
for name in ("_cuda_getDeviceCount", "_cuda_init"):
    spy(torch._C, name)
from mnist_ddp.launchers import forkserver
for module in forkserver.PRELOAD:
    importlib.import_module(module)
print(calls, torch.cuda.is_initialized(), "mnist_ddp.launchers.launch" in sys.modules)
torch.cuda.is_available()
print(calls)
"""


def test_the_fork_servers_preload_makes_no_cuda_call() -> None:
    """What keeps a kernel's CUDA out of the workers: the server is exec'd fresh (the test above sees its command
    line), and what it imports before forking them asks nothing of CUDA, so each worker initialises CUDA itself,
    as a fresh process does (torch refuses CUDA in a child forked after CUDA was initialised). Checked with the
    CPU build of torch: import-time paths that only a CUDA build takes are not run here."""
    r = subprocess.run([sys.executable, "-c", CUDA_SPY], env=cli_env(), capture_output=True, text=True, timeout=HANG)
    assert r.stdout.splitlines() == ["[] False True", "['is_available']"], r.stdout + r.stderr
