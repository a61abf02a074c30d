"""The CUDA/NCCL path, guarded on the CPU: no GPU has run it here, so every decision it makes that can be taken
without one is tested here, and what only a GPU can show is read (tests/collectives.py) or left to
benchmarks/gpu_check.py.

- which GPU a process takes, and the refusal when several local processes would share one (NCCL's "Duplicate GPU");
- what --deterministic needs from cuBLAS (CUBLAS_WORKSPACE_CONFIG), set in each rank, a bad value refused;
- NCCL's error handling: failures must reach Python as a peer failure; a rank NCCL's watchdog aborted with SIGABRT
  is not named as the culprit when the heartbeat says who it waited for (real processes, gloo, real signals);
- --sync-bn refused where ranks run different numbers of micro-batches; the MPS guard and check cadence;
- the fork server's imports make no CUDA call; every collective's tensor is made on the device; the step loop
  reads nothing back from the device between its check points; the GPU check's own plumbing.
"""

import ast
import json
import os
import re
import signal
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

import collectives
from conftest import REPO, cli_env, progress, tiny
from mnist_ddp import cli, extended, trainer
from mnist_ddp.common.config import DataConfig, TrainConfig
from mnist_ddp.common.errors import UserError
from mnist_ddp.core import compute, ddp, distributed, divergence
from mnist_ddp.core.batches import Share
from mnist_ddp.core.distributed import Dist
from mnist_ddp.cudagraph import graphstep
from mnist_ddp.data import datasets
from mnist_ddp.joining.identity import without_launcher_vars
from mnist_ddp.launchers import forkserver
from mnist_ddp.outputs.report import Reporter
from procfs import finish, marked_env, needs_proc, reaped, spawned_workers, start, wait_for
from test_faults import HANG, _last_error, _train

PACKAGE = REPO / "src" / "mnist_ddp"


# --- which GPU --------------------------------------------------------------------------------------------------

@pytest.mark.parametrize(("local_rank", "local_world", "visible", "env", "index"), [
    (1, 2, 2, {}, 1),  # a GPU each: by local rank
    (3, 4, 8, {}, 3),
    (0, 1, 1, {}, 0),  # one process, one GPU
    (1, 2, 1, {"CUDA_VISIBLE_DEVICES": "1"}, 0),  # a wrapper gave each rank its own GPU
    (3, 4, 1, {"SLURM_GPUS_PER_TASK": "1", "CUDA_VISIBLE_DEVICES": "0"}, 0),  # srun --gpus-per-task 1
    (3, 4, 2, {"SLURM_GPUS_PER_TASK": "2", "CUDA_VISIBLE_DEVICES": "6,7"}, 0),  # srun --gpus-per-task 2: the first
])
def test_each_local_process_gets_its_own_gpu(local_rank: int, local_world: int, visible: int, env: dict[str, str],
                                            index: int) -> None:
    assert distributed.gpu_index(local_rank, local_world, visible, env) == index


@pytest.mark.parametrize(("local_rank", "local_world", "visible", "said"), [
    (0, 2, 1, "2 processes run on this machine but this one sees 1 GPU (so they would all use cuda:0"),
    (1, 2, 1, "2 processes run on this machine but this one sees 1 GPU"),  # every rank refuses, not just rank 1
    (0, 4, 2, "4 processes run on this machine but this one sees 2 GPUs (too few for one each)"),
    (3, 1, 1, "4 processes run on this machine"),  # a launcher that did not say how many: local rank 3 is the 4th
])
def test_local_processes_that_would_share_a_gpu_are_refused(local_rank: int, local_world: int, visible: int,
                                                            said: str) -> None:
    with pytest.raises(UserError, match=re.escape(said)):
        distributed.gpu_index(local_rank, local_world, visible, {"SLURM_GPUS_PER_TASK": ""})  # empty: not set


@pytest.mark.parametrize(("visible", "indices"), [(1, [0, 0, 0]), (2, [0, 1, 0]), (3, [0, 1, 2])])
def test_under_gloo_processes_share_the_gpus_in_turn(visible: int, indices: list[int]) -> None:
    """--backend gloo (`share`): a student with one GPU can run -g 3; NCCL's rule (a GPU each) does not bind gloo. The
    refusal's sentence says so; the control: the same processes without `share` are refused."""
    assert [distributed.gpu_index(r, 3, visible, {}, share=True) for r in range(3)] == indices
    if visible < 3:
        with pytest.raises(UserError, match="or let them share over --backend gloo"):
            distributed.gpu_index(0, 3, visible, {})


def test_processes_sharing_a_gpu_are_told_once(monkeypatch: pytest.MonkeyPatch) -> None:
    """One line says that the processes share the GPU, and only where they do: not one process per GPU, not on the
    CPU, not where the launcher gave each process its own (CUDA_VISIBLE_DEVICES per process)."""
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    gpu = torch.device("cuda", 0)
    assert distributed.sharing(gpu, 2, {}).startswith("gpu: 2 processes share 1 GPU over gloo")
    assert distributed.sharing(gpu, 1, {}) == ""
    assert distributed.sharing(torch.device("cpu"), 2, {}) == ""
    assert distributed.sharing(gpu, 2, {"CUDA_VISIBLE_DEVICES": "1"}) == ""


def test_several_gpus_keep_the_eager_step_until_they_have_run_it() -> None:
    """--graph-step auto on CUDA: one GPU gets the graph step, several the eager DDP step (until a run on several GPUs
    is recorded in docs/gpu.md), saying why and how to opt in; --graph-step on opts in."""
    assert not graphstep.RAN_ON_SEVERAL_GPUS
    one, two = (Dist(0, 0, w, w, torch.device("cuda", 0)) for w in (1, 2))
    assert graphstep.eager_because(TrainConfig(), one, "off", True) == ""
    assert "not yet run on several GPUs" in graphstep.eager_because(TrainConfig(), two, "off", True)
    assert "--graph-step on opts in" in graphstep.eager_because(TrainConfig(), two, "off", True)
    assert graphstep.eager_because(TrainConfig(graph_step="on"), two, "off", True) == ""


def test_torchrun_with_more_processes_than_gpus_is_one_sentence(monkeypatch: pytest.MonkeyPatch,
                                                               capfd: pytest.CaptureFixture[str],
                                                               tmp_path: Path) -> None:
    """`torchrun --nproc-per-node 2` on a one-GPU machine, as rank 0 sees it: exit 2 before joining, one line
    (the CLI in this process; CUDA's two device-count entry points answer as a one-GPU machine would)."""
    for name in set(os.environ) - set(without_launcher_vars(os.environ)) | {"CUDA_VISIBLE_DEVICES"}:
        monkeypatch.delenv(name, raising=False)
    for name, value in {"RANK": "0", "WORLD_SIZE": "2", "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "2"}.items():
        monkeypatch.setenv(name, value)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    code = cli.main(["train", *tiny(200, 100), "--out", str(tmp_path / "o")])
    err = capfd.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1, err
    assert "2 processes run on this machine but this one sees 1 GPU" in err[0] and "--nproc-per-node 1" in err[0], err


def _device_calls(tree: ast.AST) -> list[ast.Call]:
    return [n for n in ast.walk(tree) if isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute)
            and n.func.attr == "device" and isinstance(n.func.value, ast.Name) and n.func.value.id == "torch"]


def test_every_cuda_device_is_built_with_its_index() -> None:
    """torch.cuda.set_device and NCCL need to know which GPU: `torch.device("cuda")` raises in set_device
    ("Expected a torch.device with a specified index"). So in src/ and benchmarks/ a torch.device is built from
    a literal other than "cuda", with an index, or by pick_device (whose own fallback is never "cuda")."""
    wrong = []
    for path in [*PACKAGE.rglob("*.py"), *(REPO / "benchmarks").glob("*.py")]:
        tree = ast.parse(path.read_text())
        inside_pick = {id(n) for f in ast.walk(tree) if isinstance(f, ast.FunctionDef) and f.name == "pick_device"
                       for n in ast.walk(f)}
        for call in _device_calls(tree):
            literal = call.args and isinstance(call.args[0], ast.Constant) and call.args[0].value != "cuda"
            if len(call.args) < 2 and not literal and id(call) not in inside_pick:
                wrong.append(f"{path.relative_to(REPO)}:{call.lineno}: {ast.unparse(call)}")
    assert not wrong, "build CUDA devices with distributed.pick_device(name, local_rank, local_world_size): " + \
        "; ".join(wrong)
    control = ast.parse('import torch\nd = torch.device(args.device)\ne = torch.device("cuda")\n')
    assert len(_device_calls(control)) == 2  # what the check looks for, it finds


# --- --deterministic on CUDA: cuBLAS --------------------------------------------------------------------------

@pytest.mark.parametrize(("deterministic", "device", "env", "sets"), [
    (True, "cuda", {}, {"CUBLAS_WORKSPACE_CONFIG": ":4096:8"}),
    (True, "cuda", {"CUBLAS_WORKSPACE_CONFIG": ":16:8"}, {}),  # the user's deterministic choice stays
    (True, "cpu", {}, {}),
    (False, "cuda", {}, {}),
])
def test_cublas_workspace_for_deterministic_cuda(deterministic: bool, device: str, env: dict[str, str],
                                                 sets: dict[str, str]) -> None:
    assert compute.cublas_workspace(deterministic, device, env) == sets


@pytest.fixture
def kernel_settings():
    """configure_backends changes process-wide settings: put them back."""
    saved = (torch.are_deterministic_algorithms_enabled(), torch.backends.cudnn.benchmark,
             torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32)
    yield
    torch.use_deterministic_algorithms(saved[0])
    torch.backends.cudnn.benchmark, torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = saved[1:]


def test_each_rank_sets_cublas_config_in_its_own_environment(monkeypatch: pytest.MonkeyPatch,
                                                             kernel_settings: None) -> None:
    """configure_backends runs in the rank (worker.run_worker, before joining and before any kernel): a forked
    child has the fork server's environment, not the launcher's, so the launcher could not set it for them."""
    monkeypatch.delenv("CUBLAS_WORKSPACE_CONFIG", raising=False)
    assert compute.configure_backends(torch.device("cpu"), True) == ""
    assert "CUBLAS_WORKSPACE_CONFIG" not in os.environ  # the control: only CUDA needs it
    assert compute.configure_backends(torch.device("cuda", 0), True) == "CUBLAS_WORKSPACE_CONFIG=:4096:8"
    assert os.environ["CUBLAS_WORKSPACE_CONFIG"] == ":4096:8" and torch.are_deterministic_algorithms_enabled()


def test_a_nondeterministic_cublas_config_is_refused_before_any_process_starts(
        monkeypatch: pytest.MonkeyPatch, capfd: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    for name in set(os.environ) - set(without_launcher_vars(os.environ)):
        monkeypatch.delenv(name)
    monkeypatch.setenv("CUBLAS_WORKSPACE_CONFIG", ":0:0")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    code = cli.main(["train", *tiny(200, 100), "--deterministic", "--out", str(tmp_path / "o")])
    err = capfd.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1, err
    assert "--deterministic on CUDA needs CUBLAS_WORKSPACE_CONFIG=:4096:8 or :16:8, but it is set to ':0:0'" in err[0]
    assert not (tmp_path / "o").exists()


# --- NCCL's failures --------------------------------------------------------------------------------------------

@pytest.mark.parametrize("chosen", ["TORCH_NCCL_ASYNC_ERROR_HANDLING", "NCCL_ASYNC_ERROR_HANDLING",
                                    "TORCH_NCCL_BLOCKING_WAIT", "NCCL_BLOCKING_WAIT"])
def test_nccl_errors_are_raised_unless_the_user_chose_otherwise(chosen: str) -> None:
    assert distributed.nccl_error_handling({}) == {"TORCH_NCCL_ASYNC_ERROR_HANDLING": "2"}
    assert distributed.nccl_error_handling({chosen: "3"}) == {}


@pytest.mark.parametrize(("message", "peer"), [
    ("NCCL communicator was aborted on rank 0. Original reason for failure was: [Rank 0] Watchdog caught collective "
     "operation timeout: WorkNCCL(SeqNum=9, OpType=ALLREDUCE) ran for 180000 milliseconds before timing out.", True),
    ("NCCL communicator was aborted (TIMEOUT): a collective timed out or lost a peer", True),  # raise_if_aborted's
    ("NCCL error in: ProcessGroupNCCL.cpp:1969, invalid usage, NCCL version 2.21.5", False),  # a setting: not a peer
])
def test_what_an_aborted_nccl_communicator_raises_is_a_peer_failure(message: str, peer: bool) -> None:
    assert distributed.is_peer_failure(dist.DistBackendError(message)) is peer


@needs_proc
def test_a_rank_aborted_by_sigabrt_names_the_peer_it_waited_for(tmp_path: Path) -> None:
    """Under torch's default TORCH_NCCL_ASYNC_ERROR_HANDLING (3; mnist-ddp sets 2 only where nothing is set), the
    watchdog of a rank whose collective timed out ends it with SIGABRT. Here, with gloo and real signals: -g 2,
    one worker frozen (SIGSTOP), then the other SIGABRTed, as its watchdog would have done. The launcher must name
    the frozen rank, not the aborted one. The control, SIGABRT alone: then the aborted rank itself is named."""
    env, mark = marked_env()
    cases = {"peer frozen": True, "nobody frozen": False}
    jobs, victims = {}, {}
    with reaped(mark):
        for n, case in enumerate(cases):
            args = ("-n", "1", "-g", "2", "--epochs", "50", "--checkpoint-every", "2", "--heartbeat", "0.2",
                    "--timeout", "60")
            jobs[case] = start(_train(tmp_path / str(n), *args), env, tmp_path, tmp_path / f"{n}.log")
        for n, (case, proc) in enumerate(jobs.items()):
            wait_for(f"{case}: training", lambda out=tmp_path / str(n): progress(out), HANG, running=proc)
            frozen, aborted = sorted(spawned_workers(proc.pid))
            if cases[case]:
                os.kill(frozen, signal.SIGSTOP)
            os.kill(aborted, signal.SIGABRT)
            victims[case] = frozen, aborted
        for n, (case, proc) in enumerate(jobs.items()):
            rc, log = finish(proc, tmp_path / f"{n}.log", HANG)
            line, (frozen, aborted) = _last_error(log), victims[case]
            print(f"{case}: {line}")
            assert rc == 1 and "Traceback" not in log, f"{case}: {log}"
            if cases[case]:
                assert f"(pid {aborted}) was ended by SIGABRT" in line, line
                assert f"pid {frozen}) stopped answering: stopped (SIGSTOP" in line and "--resume" in line, line
            else:
                assert f"(pid {aborted}) was killed by SIGABRT" in line and "stopped answering" not in line, line


# --- --sync-bn, MPS ----------------------------------------------------------------------------------------------

@pytest.mark.parametrize(("share", "sync_bn", "refused"), [
    (Share(slots=4, world=3), True, True),  # a resume at world 3 of a run of 4 micro-batches: 2, 1, 1
    (Share(slots=4, world=3), False, False),
    (Share(slots=4, world=2), True, False),  # 2 each: every rank's SyncBatchNorm collectives pair
    (Share(slots=2, world=4), True, False),  # more processes than micro-batches: one part each
    (Share(slots=3, world=1), True, False),  # one process: no collectives
])
def test_sync_bn_needs_equal_shares(share: Share, sync_bn: bool, refused: bool) -> None:
    if refused:
        with pytest.raises(UserError, match=r"--sync-bn needs every process to run the same number of micro-batches "
                                            r"per step, but 3 processes share this run's 4 unevenly \(1 or 2 each\)"):
            ddp.check_sync_bn(sync_bn, share)
    else:
        ddp.check_sync_bn(sync_bn, share)


def test_sync_bn_is_checked_where_a_resume_deals_the_micro_batches(tmp_path: Path) -> None:
    """The seam a resume at another world goes through (ExtendedTrainer._deal), before any training step, on any device
    (the CLI refuses --sync-bn on the CPU earlier, so the seam is tested directly)."""
    data = datasets.load(DataConfig("synthetic", data_dir=tmp_path, train_samples=400, test_samples=100))
    d = Dist(rank=0, local_rank=0, world_size=3, local_world_size=3, device=torch.device("cpu"))  # no group needed
    run = extended.ExtendedTrainer(TrainConfig(sync_bn=True, out=str(tmp_path / "o")), d, data,
                                   Reporter(tmp_path / "o", False, False, False, False))
    run._deal(Share(slots=6, world=3))  # even
    with pytest.raises(UserError, match="--sync-bn needs every process"):
        run._deal(Share(slots=4, world=3))


def test_the_guard_scales_only_fp16() -> None:
    """A GradScaler only where fp16 needs one: every other precision's step is the textbook's, and the
    divergence guard reads the fold's all-reduced count of non-finite numbers instead. Where CUDA is missing
    (as here: conftest hides it) fp16 is refused in the launcher's sentence, never given the scaler torch
    disables with its warning "GradScaler is enabled, but CUDA is not available"."""
    cuda = torch.device("cuda", 0)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # torch's warning would fail the test
        assert isinstance(divergence.grad_scaler(torch.device("cpu"), "fp16"), torch.amp.GradScaler)
        with pytest.raises(UserError, match=re.escape(divergence.FP16_NEEDS_CUDA)):
            divergence.grad_scaler(cuda, "fp16")
        assert divergence.grad_scaler(cuda, "bf16") is None
        assert divergence.grad_scaler(torch.device("cpu"), "off") is None


# --- what the reading found right, kept right -----------------------------------------------------------------

PRELOAD_PROBE = """
import sys, traceback, torch, torch.cuda, torch.accelerator
calls = []
def recorder(name):
    def call(*args, **kwargs):
        calls.append(name + "\\n" + "".join(traceback.format_stack(limit=8)))
        raise RuntimeError(name + " was called")
    return call
for owner, names in ((torch.cuda, ("is_available", "device_count", "_lazy_init", "init", "current_device",
                                   "get_device_properties", "get_device_capability", "set_device", "synchronize")),
                     (torch.accelerator, ("is_available", "device_count", "current_accelerator")),
                     (torch._C, ("_cuda_getDeviceCount", "_cuda_init"))):
    for name in names:
        if hasattr(owner, name):  # never add one: torch tells a CUDA build by hasattr(torch._C, "_cuda_getDeviceCount")
            setattr(owner, name, recorder(owner.__name__ + "." + name))
for module in sys.argv[1:]:
    __import__(module)
print(len(calls))
print("\\n".join(calls))
"""


def test_the_fork_servers_imports_make_no_cuda_call() -> None:
    """A fork server that touched CUDA (even a device count: cuInit) would hand every forked child a CUDA state
    it cannot use. Its preloaded imports run here with torch's device-count and init entry points replaced by
    recorders; the control imports a module that asks torch.cuda.is_available(), and is caught."""
    def probe(*modules: str) -> list[str]:
        r = subprocess.run([sys.executable, "-c", PRELOAD_PROBE, *modules], capture_output=True, text=True,
                           env=cli_env(), timeout=180)
        assert r.returncode == 0, r.stderr
        return r.stdout.split("\n", 1)
    count, where = probe(*forkserver.PRELOAD)
    assert count == "0", where
    control = subprocess.run([sys.executable, "-c", PRELOAD_PROBE.replace("for module in sys.argv[1:]:",
                              "try:\n    torch.cuda.is_available()\nexcept RuntimeError:\n    pass\n"
                              "for module in sys.argv[1:]:")], capture_output=True, text=True, env=cli_env(),
                             timeout=180)
    assert control.stdout.startswith("1\ntorch.cuda.is_available"), control.stdout


def test_collectives_are_called_only_where_their_tensors_are_known_to_be_on_the_device() -> None:
    src = collectives.package(PACKAGE)
    assert collectives.misplaced_collectives(src) == []
    assert collectives.off_device_sums(src) == []


# Each edit puts one CPU tensor in a collective's way (directly, or through a parameter, an attribute, a returned
# value, a list of tuples or a dict of buffers): the reading must find every one.
CPU_TENSOR_EDITS = [
    ("trainer", "torch.tensor(float(s.seen), device=self.d.device)", "torch.tensor(float(s.seen))"),
    ("trainer", "Stretch(torch.zeros((), device=d.device))", "Stretch(torch.zeros(()))"),
    ("steps", "loss_sum = torch.zeros((), device=device)", "loss_sum = torch.zeros(())"),
    ("trainer", "stepped.loss.mul(stepped.here),", "torch.tensor(1.0),"),
    ("regroup", "totals.new_zeros(totals.shape)", "torch.zeros_like(totals)"),
    ("regroup", "(done, lr, loss, n) for", "(done, lr, torch.tensor(1.0), n) for"),
    ("evaluation", "totals = torch.zeros(1 + 100, device=d.device)", "totals = torch.zeros(1 + 100)"),
    ("bnstats", "torch.cat([b.reshape(-1) for b in buffers])", "torch.cat([b.reshape(-1).cpu() for b in buffers])"),
    ("bnstats", "self.d.all_gather(own)", "self.d.all_gather(own.cpu())"),
    ("bnstats", "self.share, _flat(self.live))", "self.share, _flat(self.live).cpu())"),
    ("worker", "torch.tensor(ident.attempt, device=d.device)", "torch.tensor(ident.attempt)"),
]


@pytest.mark.parametrize(("module", "before", "after"), CPU_TENSOR_EDITS)
def test_the_device_rule_finds_a_cpu_tensor_on_its_way_to_a_collective(module: str, before: str, after: str) -> None:
    files = {p.stem: p.read_text() for p in PACKAGE.rglob("*.py")}
    assert before in files[module]
    files[module] = files[module].replace(before, after)
    found = collectives.off_device_sums(collectives.Source(files))
    assert len(found) == 1 and "make it on the rank's device" in found[0], found


def test_a_collective_outside_dist_is_found() -> None:
    files = {p.stem: p.read_text() for p in PACKAGE.rglob("*.py")}
    files["evaluation"] += "\n\ndef also(t):\n    dist.all_reduce(t)\n"
    found = collectives.misplaced_collectives(collectives.Source(files))
    assert len(found) == 1 and found[0].startswith("evaluation.py:") and "go through Dist" in found[0], found


READS = ("item", "tolist", "cpu", "numpy", "__float__", "__int__", "__bool__", "__index__")


def test_the_step_loop_reads_from_the_device_only_at_its_folds(monkeypatch: pytest.MonkeyPatch,
                                                                 tmp_path: Path) -> None:
    """A read of a tensor's value on the host (.item(), float(t), …) waits for the GPU's queued work. A real run
    in this process: every read between two steps' starts is recorded. No training step may read, and the folds
    (a loss sum per epoch, the divergence verdict) must: the control that the recorder sees reads at all."""
    events: list[str] = []
    for name in READS:
        original = getattr(torch.Tensor, name)

        def recorded(self: torch.Tensor, *args: object, _original=original, _name=name, **kwargs: object) -> object:
            events.append(_name)
            return _original(self, *args, **kwargs)
        monkeypatch.setattr(torch.Tensor, name, recorded)
    monkeypatch.setattr(Dist, "set_phase", lambda self, phase, epoch=0, step=0: events.append(f"@{phase}:{step}"))
    fold = trainer.Trainer._fold
    monkeypatch.setattr(trainer.Trainer, "_fold", lambda self, *a: (events.append("@fold"), fold(self, *a))[1])
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    assert cli.main(["train", *tiny(1200, 100), "--device", "cpu", "--out", str(tmp_path / "o")]) == 0
    reads: dict[str, int] = {}
    where = "before"
    for event in events:
        if event.startswith("@"):
            where = event[1:]
        elif where.startswith(("training:", "fold")):
            reads[where] = reads.get(where, 0) + 1
    steps = sorted(int(w.split(":")[1]) for w in reads if w.startswith("training:"))
    assert steps == [] and reads.get("fold"), reads
    # the recorder saw every step begin (1200 images in batches of 100 on one process: 12), else `steps` proves nothing
    assert sum(e.startswith("@training:") for e in events) == 12, events


def test_the_gpu_check_runs_on_the_cpu_and_keeps_what_finished(tmp_path: Path) -> None:
    """benchmarks/gpu_check.py's plumbing, in its quick CPU mode: its three files and nothing else, the parts that
    finished recorded with their results (DDP in a world of one: on the CPU nothing is captured, so no bytes to compare,
    and the graph step's eager arithmetic within 1e-4 of the textbook step's), and a part that never ends by itself
    (--stall) cut short by its time limit and recorded as such (the check goes on). --plan names every part
    without running any, the budget within 8 minutes and the parts not yet measured on a GPU within it."""
    out = tmp_path / "out"
    # The parts that must finish get limits no loaded box reaches (these are hang guards, not timings).
    limits = ["--limit", "env=300", "--limit", "ddp_capture=600", "--limit", "deterministic=600",
              "--limit", "profile=2", "--stall", "profile", "--budget", "1800"]
    r = subprocess.run([sys.executable, "benchmarks/gpu_check.py", "--device", "cpu", "--quick", "--only",
                        "env,ddp_capture,deterministic,profile", *limits, "--out", str(out),
                        "--work", str(tmp_path / "work")],
                       cwd=REPO, env=cli_env(), capture_output=True, text=True, timeout=1900)
    assert r.returncode == 0, r.stdout + r.stderr
    assert sorted(p.name for p in out.iterdir()) == ["gpu_check.log", "summary.json", "summary.md"]
    parts = json.loads((out / "summary.json").read_text())["parts"]
    assert parts["env"]["status"] == "done" and parts["env"]["result"]["torch"] == torch.__version__, parts
    capture = parts["ddp_capture"]["result"]
    # Nothing is captured on a CPU, so there is no second run to compare bytes with: said as such, not True.
    assert capture["same_bytes_captured_and_graph_eager"] is None and capture["captured_over_textbook"] is None, capture
    assert 0 <= capture["largest_difference_from_textbook"] < 1e-4, capture  # the graph step's arithmetic, eager
    assert "DDP's forward, backward with its all-reduce" in parts["ddp_capture"]["result"]["step"]
    digests = parts["deterministic"]["result"]["sha256"]
    assert parts["deterministic"]["result"]["bitwise_equal"]
    assert all(re.fullmatch("sha256:[0-9a-f]{64}", h) for h in digests), digests
    assert parts["profile"]["status"] == "timed out", parts["profile"]
    assert "-> deterministic: done" in r.stdout and "| profile | timed out |" in (out / "summary.md").read_text()
    plan = subprocess.run([sys.executable, "benchmarks/gpu_check.py", "--plan"], cwd=REPO, env=cli_env(),
                          capture_output=True, text=True, timeout=60)
    assert [line.split()[0] for line in plan.stdout.splitlines()] == \
        ["env", "to99", "graph", "ddp_capture", "share", "replay", "bitwise", "bench", "amp", "compile",
         "deterministic", "profile", "multi", "all"], plan.stdout
    limits = {line.split()[0]: float(line.split()[3]) for line in plan.stdout.splitlines()}
    first = ("env", "to99", "graph", "ddp_capture", "share", "replay", "bitwise")
    assert sum(limits[k] for k in first) <= limits["all"] <= 8 * 60, limits
