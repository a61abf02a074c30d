"""The graph step (graphstep.py), run eagerly on the CPU: what a CUDA graph's replay would do. A replay cannot read
the host, and replays the addresses it captured, so: no host synchronisation inside a step, every buffer keeps its
address, and it trains what the textbook step trains; with 2 real gloo ranks, its flat all-reduce gives DDP's. A
hung peer: the Pacer turns a step that never finishes into a peer failure (stand-in events), and a real frozen rank
is named by the survivor."""

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.data import DistributedSampler

from conftest import progress, run_cli, spawn_gloo, tiny
from datafiles import ONE_THREAD
from mnist_ddp.common.config import TrainConfig, recipe
from mnist_ddp.core import ddp, distributed, schedule
from mnist_ddp.core.batches import DeviceData, ShardedBatches
from mnist_ddp.core.distributed import Dist
from mnist_ddp.core.state import Progress, Training
from mnist_ddp.core.steps import train_step
from mnist_ddp.cudagraph import flatopt
from mnist_ddp.cudagraph.graphstep import CAPTURE_FAILS_VAR, GraphStep, Pacer, PeerTimeout, choose
from mnist_ddp.model import ConvNet
from procfs import finish, marked_env, needs_proc, reaped, spawned_workers, start, wait_for
from test_bitwise import model_hash
from test_faults import HANG, _last_error, _train

N, B, EPOCHS = 250, 32, 2  # 8 steps an epoch, the last of 26 samples: both step sizes, and an epoch boundary
CPU = torch.device("cpu")
ONE = Dist(rank=0, local_rank=0, world_size=1, local_world_size=1, device=CPU)
SYNCS = {"_local_scalar_dense", "item", "nonzero", "is_nonzero", "equal", "masked_select", "unique", "_unique2"}


def _data() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return torch.randint(0, 256, (N, 28, 28), dtype=torch.uint8, generator=g), torch.randint(0, 10, (N,), generator=g)


class Double(DeviceData):
    """The batches in float64: the precision in which two orders of the same arithmetic agree to ~1e-15."""

    def batch(self, idx: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        x, y = super().batch(idx)
        return x.double(), y


def _order(epoch: int, d: Dist = ONE) -> torch.Tensor:
    """The epoch's samples of rank d.rank: DistributedSampler's, as the trainer's ShardedBatches give them."""
    sampler = DistributedSampler(range(N), num_replicas=d.world_size, rank=d.rank, shuffle=True, seed=0)
    sampler.set_epoch(epoch)
    return torch.tensor(list(sampler))


def _model(optimizer: str, dtype: torch.dtype) -> tuple[ConvNet, torch.optim.Optimizer, schedule.Schedule]:
    torch.manual_seed(0)
    model = ConvNet().to(dtype)
    return (model, *schedule.build_optimizer(_recipe(optimizer), model))


def _recipe(optimizer: str):
    return recipe("default", optimizer=optimizer, batch_size=B, epochs=EPOCHS, amp="off", momentum=0.9,
                  weight_decay=0.01, label_smoothing=0.0)


def _graph(optimizer: str, dtype: torch.dtype, d: Dist = ONE, *, late: bool = False) -> GraphStep:
    images, labels = _data()
    model, opt, _ = _model(optimizer, dtype)
    data = (Double if dtype == torch.float64 else DeviceData)(images, labels, CPU, True, False)
    step = GraphStep(model, opt, data, _recipe(optimizer), d)
    if late:  # the control: every step's lr and momentum one step late
        hyper = step.hyper
        step.hyper = lambda epoch, s, epochs: hyper(epoch, max(s - 1, 0), epochs)
    return step


def _train_both(optimizer: str, dtype: torch.dtype, *, late: bool = False) -> tuple[ConvNet, GraphStep, list]:
    """The textbook step (fused torch optimizer) and the graph step, side by side, for EPOCHS epochs."""
    images, labels = _data()
    model, opt, set_lr = _model(optimizer, dtype)
    step = _graph(optimizer, dtype, late=late)
    batches = ShardedBatches(images, labels, B, rank=0, world=1, device=CPU, shuffle=True, seed=0)
    losses = []
    for epoch in range(EPOCHS):
        batches.set_epoch(epoch)
        step.begin_epoch(epoch, batches.indices())
        for s, (x, y) in enumerate(batches):
            set_lr((epoch * N + min(N, s * B)) / (EPOCHS * N))
            losses.append((train_step(model, opt, x.to(dtype), y).float(), (step.step(s), step.loss.clone())[1]))
    return model, step, losses


def _largest_difference(a: torch.nn.Module, b: torch.nn.Module) -> float:
    return max((p.double() - q.double()).abs().max().item() for p, q in
               zip(a.state_dict().values(), b.state_dict().values(), strict=True))


def same_bytes_as_the_textbook_step() -> None:
    """fp32 SGD, two epochs with short last steps: the textbook step's bytes and losses."""
    model, step, losses = _train_both("sgd", torch.float32)
    for p, q in zip(model.state_dict().values(), step.model.state_dict().values(), strict=True):
        assert torch.equal(p, q)
    assert all(torch.equal(a, b) for a, b in losses)


def test_sgd_trains_the_same_bytes_as_the_textbook_step() -> None:
    """The gather, normalisation, forward, backward, BatchNorm statistics, the lr table and SGD's update all give
    the textbook step's bytes, with torch's plain C++ kernels. Its AVX2 kernels fuse the multiply-add in a tensor's
    vector body but not in its tail, and the flat buffer puts an element in another part than its own parameter
    does: an ulp apart there, which the float64 test below bounds."""
    env = {**os.environ, "ATEN_CPU_CAPABILITY": "default"}
    code = f"import {Path(__file__).stem} as t; t.{same_bytes_as_the_textbook_step.__name__}()"
    subprocess.run([sys.executable, "-c", code], env=env, cwd=Path(__file__).parent, check=True)


@pytest.mark.parametrize("optimizer", ["sgd", "adamw"])
def test_the_step_trains_what_the_textbook_step_trains_and_a_late_lr_does_not(optimizer: str) -> None:
    """With the kernels this CPU runs, in float64, where two orders of the same rounding agree to ~1e-16: within
    1e-7 after 16 steps; the same run with every lr one step late is not. AdamW's update is written as tensor
    operations (torch's own AdamW on the CPU cannot take its lr from the device without reading it), in another
    order than torch's fused kernel, and its division by sqrt(v) amplifies an ulp where a gradient is near zero."""
    model, step, _ = _train_both(optimizer, torch.float64)
    assert _largest_difference(model, step.model) < 1e-7
    model, late, _ = _train_both(optimizer, torch.float64, late=True)
    assert _largest_difference(model, late.model) > 1e-4


def test_the_adamw_update_is_torchs_to_an_ulp() -> None:
    """The same gradients into torch's fused AdamW and into flatopt.adamw, five steps along the one-cycle schedule."""
    r = _recipe("adamw")
    reference, opt, set_lr = _model("adamw", torch.float32)
    model, flat_opt, _ = _model("adamw", torch.float32)
    flat = flatopt.flatten(model, flat_opt, torch.zeros(sum(p.numel() for p in model.parameters())))
    for k in range(5):
        set_lr(0.1 * k)
        lr, momentum = schedule.at(r, 0.1 * k)
        for p, q in zip(reference.parameters(), model.parameters(), strict=True):
            p.grad = torch.randn_like(p)
            q.grad.copy_(p.grad)
        opt.step()
        flatopt.update(flat_opt, flat, torch.tensor(lr), torch.tensor(momentum))
    for p, q in zip(reference.parameters(), model.parameters(), strict=True):
        torch.testing.assert_close(q, p, rtol=0, atol=2.5e-7)


class NoHostReads(TorchDispatchMode):
    """Fails on every operator that makes the host wait for the device's result."""

    def __init__(self) -> None:
        super().__init__()
        self.seen: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.overloadpacket.__name__ in SYNCS:
            self.seen.append(func.overloadpacket.__name__)
            raise AssertionError(f"{func} reads a device value on the host")
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("optimizer", ["adamw", "sgd"])
def test_a_step_never_reads_the_device(optimizer: str) -> None:
    """Every step of an epoch, the short last one too, under a mode that fails on any host read. The control:
    torch's AdamW without capturable reads its step count with .item(), and the mode catches it."""
    step = _graph(optimizer, torch.float32)
    step.begin_epoch(0, _order(0))
    with NoHostReads():
        for s in range(step.steps_per_epoch):
            step.step(s)
    model = ConvNet()
    opt = torch.optim.AdamW(model.parameters(), foreach=False, fused=False)
    for p in model.parameters():
        p.grad = torch.ones_like(p)
    mode = NoHostReads()
    with pytest.raises(AssertionError, match="reads a device value"), mode:
        opt.step()
    assert mode.seen == ["_local_scalar_dense"]


def _addresses(step: GraphStep) -> list[int]:
    params = list(step.model.parameters())
    return ([t.data_ptr() for t in step.state()] + [p.data_ptr() for p in params] +
            [p.grad.data_ptr() for p in params] + [t.data_ptr() for t in (step.order, step.table, step.flat.grads)])


def test_every_buffer_keeps_its_address() -> None:
    """A graph replays the addresses it captured: a tensor rebound between steps would silently stop being trained.
    Across an epoch boundary, both step sizes and a new epoch's order and table, nothing moves; parameters and
    gradients are views of the flat buffers. The control: a rebound bias is seen."""
    step = _graph("adamw", torch.float32)
    step.begin_epoch(0, _order(0))
    step.step(0)
    before = _addresses(step)
    for epoch in range(EPOCHS):
        step.begin_epoch(epoch, _order(epoch))
        for s in range(step.steps_per_epoch):
            step.step(s)
    assert _addresses(step) == before
    lo, hi = step.flat.params.data_ptr(), step.flat.params.data_ptr() + step.flat.params.nbytes
    assert all(lo <= p.data_ptr() < hi for p in step.model.parameters())
    step.model.fc.bias.data = step.model.fc.bias.data.clone()
    assert _addresses(step) != before


@pytest.mark.parametrize("recover", [True, False])
def test_recover_keeps_the_eager_step_and_says_so(recover: bool) -> None:
    """--graph-step on with --recover: the eager step, whose state --recover's snapshots hold, and one line saying
    why. The control: without --recover the same run gets the graph step."""
    images, labels = _data()
    model, opt, _ = _model("sgd", torch.float32)
    t = Training(model, opt, None, Progress())
    batches = ShardedBatches(images, labels, B, rank=0, world=1, device=CPU, shuffle=True, seed=0)
    said: list[str] = []
    chosen = choose(TrainConfig(graph_step="on", recover=recover), ONE, t, batches, True, said.append)
    if recover:
        assert chosen is None and said == ["step: eager DDP (--recover snapshots and restores the eager step's state)"]
    else:
        assert isinstance(chosen, GraphStep) and said == []
        assert chosen.prepare(model, said.append) is chosen
        assert said == ["step: the graph step, eagerly (forward, backward, the optimizer)"]


WORLD = 2


def _ranks(d: Dist, out: str) -> None:
    """Each rank: the eager textbook step under DDP and the graph step under its own DDP, side by side."""
    images, labels = _data()
    model, opt, set_lr = _model("sgd", torch.float32)  # SGD: its flat update is the textbook's bytes
    net = ddp.wrap(model, d)
    step = _graph("sgd", torch.float32, d)
    said: list[str] = []
    step = step.prepare(ddp.wrap(step.model, d, keep_grads=True), said.append)
    batches = ShardedBatches(images, labels, B, rank=d.rank, world=WORLD, device=CPU, shuffle=True, seed=0)
    for epoch in range(EPOCHS):
        batches.set_epoch(epoch)
        step.begin_epoch(epoch, batches.indices())
        for s, (x, y) in enumerate(batches):
            set_lr((epoch * N + min(N, s * B * WORLD)) / (EPOCHS * N))
            train_step(net, opt, x, y)
            step.step(s)
    weights = {"ddp": [p.tolist() for p in model.parameters()], "said": said,
               "graph": [p.tolist() for p in step.model.parameters()]}
    Path(out, f"rank{d.rank}.json").write_text(json.dumps(weights))


def test_the_graph_step_under_ddp_trains_the_eager_ddp_steps_bytes(tmp_path: Path) -> None:
    """2 real gloo ranks, two epochs with both step sizes: the graph step, whose model is under DDP (gradients kept
    in its flat buffer), trains the same bytes as the eager textbook step under DDP, on both ranks."""
    spawn_gloo(_ranks, WORLD, str(tmp_path))
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(WORLD)]
    assert ranks[0]["said"] == ["step: the graph step, eagerly (DDP's forward, backward with its all-reduce, the "
                                "optimizer)"]
    for r in ranks:
        assert r["graph"] == r["ddp"]
    assert ranks[0]["graph"] == ranks[1]["graph"]


# --- a hung peer ----------------------------------------------------------------------------------------------------

class StandIn:
    """A stand-in for torch.cuda.Event: the device reaches it on its `after`-th query (None: never, as a step whose
    all-reduce waits for a frozen peer)."""

    def __init__(self, after: int | None) -> None:
        self.after, self.queries = after, 0

    def record(self) -> None:
        pass

    def query(self) -> bool:
        self.queries += 1
        return self.after is not None and self.queries >= self.after


def _paced(after: int | None, steps: int, timeout: float) -> tuple[Pacer, list[StandIn]]:
    """A Pacer 3 steps deep over stand-in events, after `steps` steps queued."""
    made: list[StandIn] = []
    pacer = Pacer(timeout, depth=3, poll_s=0.001, event=lambda: made.append(StandIn(after)) or made[-1])
    for step in range(steps):
        pacer.wait()
        pacer.record(step)
    return pacer, made


def test_the_pacer_turns_a_step_that_never_finishes_into_a_peer_failure() -> None:
    """Before each step the Pacer waits for the one 3 back, polling its event until the device reaches it; one that
    never finishes raises within the timeout, naming the step, as a peer failure (which worker.py reports with the
    heartbeat's diagnosis). The control: events the device reaches on their third poll let six steps through."""
    _, made = _paced(3, 6, timeout=60)  # a loaded machine may sleep far past a millisecond's poll
    assert [e.queries for e in made] == [3, 3, 3, 0, 0, 0]  # each wait polled the oldest only, until it was done
    hung, _ = _paced(None, 3, timeout=0.05)
    with pytest.raises(PeerTimeout, match=r"^step 1 of its epoch did not finish within --timeout 0.05 s$") as raised:
        hung.wait()
    assert distributed.is_peer_failure(raised.value)


@needs_proc
def test_a_frozen_peer_is_named_under_the_graph_step(tmp_path: Path) -> None:
    """-g 2 with --graph-step on (on the CPU: the graph step eagerly, its one flat all-reduce a real gloo one); one
    worker frozen with SIGSTOP: the launcher exits 1 with the line naming that process, stopped, within --timeout."""
    env, mark = marked_env()
    out = tmp_path / "run"
    args = ("-n", "1", "-g", "2", "--graph-step", "on", "--epochs", "50", "--timeout", "15", "--checkpoint-every", "2")
    with reaped(mark):
        proc = start(_train(out, *args), env, tmp_path, tmp_path / "log")
        wait_for("training", lambda: progress(out), HANG, running=proc)
        frozen = max(spawned_workers(proc.pid))
        os.kill(frozen, signal.SIGSTOP)
        rc, log = finish(proc, tmp_path / "log", HANG)
    assert "step: the graph step, eagerly (DDP's forward, backward with its all-reduce" in log, log
    line = _last_error(log)
    assert rc == 1 and "Traceback" not in log, log
    assert "lost contact with the other processes" in line and "--resume" in line, line
    assert f"pid {frozen}) stopped answering: stopped (SIGSTOP" in line, line


def _capture_run(out: Path, graph_step: str, fails: str = "") -> tuple[str, str]:
    """A -g 2 run's `step:` line and the SHA-256 of its saved model; `fails`: ranks whose capture fails (test hook)."""
    r = run_cli("train", *tiny(), "-g", "2", "--graph-step", graph_step, "--out", str(out),
                env={CAPTURE_FAILS_VAR: fails, **ONE_THREAD})
    assert r.returncode == 0, r.stderr
    return next((line for line in r.stdout.splitlines() if line.startswith("step:")), ""), model_hash(out)


def test_one_ranks_failed_capture_makes_every_rank_eager_with_the_eager_runs_bytes(tmp_path: Path) -> None:
    """Every rank captures or none does: `-g 2 --graph-step on` where rank 1's capture attempt fails (the test hook)
    trains the eager DDP step on both ranks, says so naming rank 1, and saves byte for byte the model of a run that
    was eager from the start (--graph-step off). The control: without the failure the graph step trains, and its
    AdamW, rounding an ulp apart from torch's, saves other bytes."""
    failed, line = _capture_run(tmp_path / "failed", "on", fails="1")
    _, eager = _capture_run(tmp_path / "eager", "off")
    graph_line, graph = _capture_run(tmp_path / "graph", "on")
    assert failed == "step: eager DDP on every rank, as rank 1 could not capture the step: RuntimeError: " \
                        f"capture failed ({CAPTURE_FAILS_VAR})"
    assert line == eager
    assert graph_line.startswith("step: the graph step, eagerly") and graph != eager
