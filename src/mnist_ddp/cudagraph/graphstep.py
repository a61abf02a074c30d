"""The textbook DDP step as device work alone, captured once per batch shape as a CUDA graph and replayed: DDP's
forward, its backward with the reducer's all-reduce, the optimizer. On the CPU the same code runs eagerly, which is
how the tests prove what a replay does. Only where each rank trains one whole micro-batch (no --bitwise, --profile,
fp16, --sync-bn, --compile, --recover); a reader can skip it (docs/design/graph-step.md)."""

import math
import os
import time
from collections import deque
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from ..common.config import Recipe, TrainConfig
from ..core import compute, schedule
from ..core.batches import Batches, DeviceData, ShardedBatches
from ..core.compute import autocast
from ..core.distributed import Dist
from ..core.state import Training
from . import flatopt

# DDP-enabled eager steps before the captures (torch's CUDA notes, "Usage with DistributedDataParallel"): DDP's
# reducer times its first 10 iterations, and every 100th, with CUDA events it waits on, which no capture may hold.
# The captures follow at once, as iterations 12 and 13.
WARMUP_STEPS = 11
PACE = 8  # on CUDA the host runs at most this many steps ahead of the GPU (graph replays never block on their own)
# Until a run on two or more GPUs is recorded in docs/gpu.md, --graph-step auto keeps several GPUs on the eager step.
RAN_ON_SEVERAL_GPUS = False
CAPTURE_FAILS_VAR = "MNIST_DDP_TEST_CAPTURE_FAILS"  # test hook: ranks (comma-separated) whose capture attempt fails


def eager_because(cfg: TrainConfig, d: Dist, amp: str, textbook: bool) -> str:
    """Why this run's steps are not the graph step ('' where they are): it holds only the textbook case."""
    cuda = d.device.type == "cuda"
    reasons = [(cfg.graph_step == "off", "--graph-step off"),
               (cfg.graph_step == "auto" and not cuda, f"{d.device.type}: CUDA graphs are CUDA's"),
               (not textbook, "each process does not train one whole micro-batch (or --bitwise, --profile)"),
               (cfg.recover, "--recover snapshots and restores the eager step's state"),
               (amp == "fp16", "fp16's loss scaler decides on the host"),
               (cfg.sync_bn, "--sync-bn's collectives run inside the forward"),
               (cfg.compile, "--compile compiles the eager step"),
               (cfg.graph_step == "auto" and cuda and d.world_size > 1 and not RAN_ON_SEVERAL_GPUS,
                "the captured step has not yet run on several GPUs, docs/gpu.md; --graph-step on opts in")]
    return next((why for excluded, why in reasons if excluded), "")


def choose(cfg: TrainConfig, d: Dist, t: Training, batches: Batches, textbook: bool,
           say: Callable[[str], None]) -> "GraphStep | None":
    """The run's graph step where it applies (to `prepare` once the model is wrapped), else None with one line
    through `say` on why (none where a CPU run under --graph-step auto is eager, as it always was)."""
    amp = compute.amp_for(cfg.recipe.amp, d.device)
    if why := eager_because(cfg, d, amp, textbook):
        if cfg.graph_step == "on" or d.device.type == "cuda":
            say(f"step: eager DDP ({why})")
        return None
    assert isinstance(batches, ShardedBatches)  # the textbook's
    return GraphStep(t.model, t.opt, batches.data, cfg.recipe, d, amp=amp,
                     capture=d.device.type == "cuda", timeout_s=cfg.timeout)


class PeerTimeout(dist.DistNetworkError):
    """A step queued `PACE` steps ago did not finish within --timeout: a peer stopped answering (reported as a
    lost peer, with the heartbeat's diagnosis, like a collective's own timeout)."""


class GraphStep:
    """This rank's training steps: the epoch's shard order and lr table in fixed device buffers, the step's index
    a device tensor, the loss in a device buffer; `step` queues one step and reads nothing back."""

    def __init__(self, model: nn.Module, opt: torch.optim.Optimizer, data: DeviceData, recipe: Recipe, d: Dist, *,
                 amp: str = "off", capture: bool = False, timeout_s: float = 1800.0) -> None:
        self.model, self.opt, self.data, self.r, self.d, self.amp = model, opt, data, recipe, d, amp
        self.net = model  # what a step runs: `prepare` puts the model under DDP there
        self.n, self.batch_size = len(data.labels), recipe.batch_size
        first = next(model.parameters())
        device = first.device
        self.grads = torch.zeros(sum(p.numel() for p in model.parameters()), dtype=first.dtype, device=device)
        self.flat = flatopt.flatten(model, opt, self.grads)
        self.shard = math.ceil(self.n / d.world_size)  # DistributedSampler's padded shard: the same every epoch
        self.steps_per_epoch = math.ceil(self.shard / self.batch_size)
        self.order = torch.zeros(self.shard, dtype=torch.long, device=device)
        self.table = torch.zeros(self.steps_per_epoch, 2, dtype=self.flat.params.dtype, device=device)  # lr, momentum
        self.index = torch.zeros((), dtype=torch.long, device=device)  # the step within the epoch
        self.loss = torch.zeros((), device=device)  # the last step's mean loss over this rank's batch
        self.sizes = sorted({self.batch_size, self.shard - (self.steps_per_epoch - 1) * self.batch_size}, reverse=True)
        self.positions = {b: torch.arange(b, device=device) for b in self.sizes}  # a step's rows of the epoch's order
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        # DDP is built, warmed up and captured on one side stream: the gradient accumulators DDP keeps remember
        # the stream they were made on, and a capture on another stream would abort (docs/design/graph-step.md).
        self.stream = torch.cuda.Stream(device) if capture else None
        self.pacer = Pacer(timeout_s) if device.type == "cuda" else None

    @property
    def global_batch(self) -> int:
        return self.d.world_size * self.batch_size

    def prepare(self, net: nn.Module, say: Callable[[str], None]) -> "GraphStep | None":
        """Take `net` (the model, under DDP built on `stream` where there are several ranks) and, on CUDA, capture
        a step of every size after the warm-up. Every rank captures or none does: this step where all did, else
        None on every rank, torch's optimizer back in charge, and one line on which rank could not and why."""
        self.net = net
        failed = self._agree(self._capture() if self.stream else self._injected_failure())
        if failed:
            self.graphs.clear()
            flatopt.unflatten(self.opt, self.flat)
            say(f"step: eager DDP on every rank, as {failed}")
            return None
        how = "captured as a CUDA graph and replayed" if self.stream else "the graph step, eagerly"
        ddp = "DDP's forward, backward with its all-reduce, the optimizer" if isinstance(net, DDP) else \
            "forward, backward, the optimizer"
        say(f"step: {how} ({ddp})")
        return self

    def begin_epoch(self, epoch: int, order: torch.Tensor, first: int = 0) -> range:
        """The epoch's `order` (this rank's samples: ShardedBatches.indices, DistributedSampler's) and lr table into
        the fixed buffers; its step indices from `first` on, for `step`."""
        self.model.train()
        self.order.copy_(self.data.to_device(order))
        table = [self.hyper(epoch, s, self.r.epochs) for s in range(self.steps_per_epoch)]
        self.table.copy_(torch.tensor(table, dtype=torch.float64))  # rounded once, to the parameters' dtype
        self.index.fill_(first)
        return range(first, self.steps_per_epoch)

    def hyper(self, epoch: int, step: int, epochs: int) -> tuple[float, float]:
        """The lr and momentum (AdamW's beta1) of `step` of `epoch`: the schedule at the run's fraction done then."""
        done = (epoch * self.n + min(self.n, step * self.global_batch)) / (epochs * self.n)
        lr, momentum = schedule.at(self.r, done)
        return lr, self.r.momentum if momentum is None else momentum

    def size(self, step: int) -> int:
        """This rank's samples in `step` of an epoch (the last may be short)."""
        return min(self.batch_size, self.shard - step * self.batch_size)

    def step(self, step: int) -> torch.Tensor:
        """Queue `step` (the one `index` points at); returns `loss`, its mean loss, which the next step overwrites."""
        size = self.size(step)
        if self.pacer:
            self.pacer.wait()
        if size in self.graphs:
            self.graphs[size].replay()
        else:
            self.run(size)
        if self.pacer:
            self.pacer.record(step)
        return self.loss

    def run(self, size: int) -> None:
        """One step of `size` samples per rank, as device work only: what a graph holds. The textbook step: forward,
        backward (in which DDP all-reduces the gradients' mean), the optimizer."""
        idx = self.order.index_select(0, self.index * self.batch_size + self.positions[size])
        x, y = self.data.batch(idx)
        lr, momentum = self.table.index_select(0, self.index).unbind(1)
        self.flat.grads.zero_()
        with autocast(x.device, self.amp, cache=False):
            loss = F.cross_entropy(self.net(x), y, label_smoothing=self.r.label_smoothing)
        loss.backward()
        flatopt.update(self.opt, self.flat, lr.squeeze(0), momentum.squeeze(0))
        self.loss.copy_(loss.detach())
        self.index.add_(1)

    def state(self) -> list[torch.Tensor]:
        """Everything a step changes."""
        return [self.flat.params, self.flat.step, self.index, self.loss, *self.flat.state.values(),
                *self.model.buffers()]

    def _capture(self) -> str:
        """Warm up (WARMUP_STEPS eager steps, every size in turn) and capture a step of each size, all on `stream`;
        the warm-up's changes are undone. '' on success, else why not."""
        kept = [t.clone() for t in self.state()]
        try:
            if why := self._injected_failure():
                return why
            assert self.stream is not None  # CUDA: made with the step
            self.stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(self.stream):
                for i in range(WARMUP_STEPS):
                    size = self.sizes[i % len(self.sizes)]
                    self.index.fill_(0 if size == self.batch_size else self.steps_per_epoch - 1)
                    self.run(size)
            torch.cuda.synchronize()
            self.d.barrier()  # no rank captures while another still runs its warm-up's collectives
            pool = torch.cuda.graph_pool_handle()  # one memory pool for both graphs: they never run at once
            for size in self.sizes:
                graph = torch.cuda.CUDAGraph()
                # thread_local: another thread's CUDA call (NCCL's watchdog querying earlier work) cannot invalidate it
                with torch.cuda.graph(graph, pool=pool, stream=self.stream, capture_error_mode="thread_local"):
                    self.run(size)
                self.graphs[size] = graph
            return ""
        except RuntimeError as e:
            return f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
        finally:
            torch.cuda.synchronize()
            for t, k in zip(self.state(), kept, strict=True):
                t.copy_(k)

    def _injected_failure(self) -> str:
        """The test hook's failure for this rank ('' where none): how the CPU tests make one rank's capture fail."""
        ranks = os.environ.get(CAPTURE_FAILS_VAR, "").split(",")
        return f"RuntimeError: capture failed ({CAPTURE_FAILS_VAR})" if str(self.d.rank) in ranks else ""

    def _agree(self, why: str) -> str:
        """Every rank's outcome, on every rank: '' where all captured, else the first failure ('rank R could not
        capture the step: why'). A captured collective must be captured, and replayed, by every rank (NCCL)."""
        reasons = self.d.gather(why)
        return self.d.from_main(lambda: next((f"rank {r} could not capture the step: {w}"
                                              for r, w in enumerate(reasons or []) if w), ""))


class Pacer:
    """Keeps the host at most `PACE` steps ahead of the GPU, and turns a step that does not finish within the
    timeout (a collective waiting for a lost peer: NCCL's watchdog does not see captured collectives) into an
    error (worker.py adds the heartbeat's diagnosis of who stopped answering)."""

    def __init__(self, timeout_s: float, depth: int = PACE, poll_s: float = 1e-4,
                 event: Callable[[], Any] = torch.cuda.Event) -> None:
        self.timeout_s, self.poll_s, self.depth, self.event = timeout_s, poll_s, depth, event
        self.events: deque = deque(maxlen=depth)

    def record(self, step: int) -> None:
        """After queueing `step`: an event (`event()`, with `record` and `query`) the device reaches when it is done."""
        event = self.event()
        event.record()
        self.events.append((step, event))

    def wait(self) -> None:
        """Before queueing a step: wait for the step `depth` back, at most the timeout."""
        if len(self.events) < self.depth:
            return
        step, oldest = self.events.popleft()
        deadline = time.monotonic() + self.timeout_s
        while not oldest.query():
            if time.monotonic() > deadline:
                raise PeerTimeout(f"step {step + 1} of its epoch did not finish within --timeout {self.timeout_s:g} s")
            time.sleep(self.poll_s)


class GraphBatches:
    """A rank's `ShardedBatches` as the graph step takes them: each epoch's order into the step's buffers once
    (`GraphStep.begin_epoch`), then the epoch's step indices."""

    def __init__(self, batches: ShardedBatches, graph: GraphStep) -> None:
        self.batches, self.graph, self.epoch = batches, graph, 0

    @property
    def first(self) -> int:
        return self.batches.first

    @property
    def global_batch(self) -> int:
        return self.batches.global_batch

    @property
    def steps_per_epoch(self) -> int:
        return self.batches.steps_per_epoch

    def set_epoch(self, epoch: int, start: int = 0) -> None:
        self.batches.set_epoch(epoch, start)
        self.epoch = epoch

    def __len__(self) -> int:
        return len(self.batches)

    def __iter__(self) -> Iterator[int]:
        return iter(self.graph.begin_epoch(self.epoch, self.batches.indices(), self.batches.first))
