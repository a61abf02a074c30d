"""The textbook step as device work alone, captured once as a CUDA graph and replayed; on the CPU the same code
runs eagerly, which is how the tests prove what a replay does. Only where each rank trains one whole micro-batch
(no --bitwise, --profile, fp16, --sync-bn, --compile, --recover); a reader can skip it (docs/design/graph-step.md)."""

import math
import time
from collections import deque
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from . import compute, flatopt, schedule
from .batches import DeviceData, ShardedBatches, StepBatches, shard_indices
from .compute import autocast
from .config import Recipe, TrainConfig
from .distributed import Dist
from .state import Training

WARMUP_STEPS = 3  # eager steps on a side stream before capture (cuDNN's choices, NCCL's communicator, the allocator)
PACE = 8  # on CUDA the host runs at most this many steps ahead of the GPU (graph replays never block on their own)


def eager_because(cfg: TrainConfig, device: torch.device, amp: str, textbook: bool) -> str:
    """Why this run's steps are not the graph step ('' where they are): it holds only the textbook case."""
    reasons = [(cfg.graph_step == "off", "--graph-step off"),
               (cfg.graph_step == "auto" and device.type != "cuda", f"{device.type}: CUDA graphs are CUDA's"),
               (not textbook, "each process does not train one whole micro-batch (or --bitwise, --profile)"),
               (cfg.recover, "--recover snapshots and restores the eager step's state"),
               (amp == "fp16", "fp16's loss scaler decides on the host"),
               (cfg.sync_bn, "--sync-bn's collectives run inside the forward"),
               (cfg.compile, "--compile compiles the eager step")]
    return next((why for excluded, why in reasons if excluded), "")


def choose(cfg: TrainConfig, d: Dist, t: Training, batches: ShardedBatches | StepBatches, textbook: bool,
           say: Callable[[str], None]) -> "GraphStep | None":
    """The run's graph step where it applies, else None; one line through `say` on which step runs (none where a
    CPU run under --graph-step auto is eager, as it always was)."""
    amp = compute.amp_for(cfg.recipe.amp, d.device)
    if why := eager_because(cfg, d.device, amp, textbook):
        if cfg.graph_step == "on" or d.device.type == "cuda":
            say(f"step: eager ({why})")
        return None
    capture = d.device.type == "cuda"
    how = "captured as a CUDA graph and replayed" if capture else "the graph step, eagerly"
    say(f"step: {how}" + ("; gradients averaged by one all-reduce of a flat buffer" if d.world_size > 1 else ""))
    return GraphStep(t.model, t.opt, batches.data, cfg.recipe, d, seed=cfg.seed, amp=amp, capture=capture,
                     timeout_s=cfg.timeout)


class PeerTimeout(dist.DistNetworkError):
    """A step queued `PACE` steps ago did not finish within --timeout: a peer stopped answering (reported as a
    lost peer, with the heartbeat's diagnosis, like a collective's own timeout)."""


class GraphStep:
    """This rank's training steps: the epoch's shard order and lr table in fixed device buffers, the step's index
    a device tensor, the loss in a device buffer; `step` queues one step and reads nothing back."""

    def __init__(self, model: nn.Module, opt: torch.optim.Optimizer, data: DeviceData, recipe: Recipe, d: Dist, *,
                 seed: int, amp: str = "off", capture: bool = False, timeout_s: float = 1800.0) -> None:
        self.model, self.opt, self.data, self.r, self.d, self.seed, self.amp = model, opt, data, recipe, d, seed, amp
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
        sizes = {self.batch_size, self.shard - (self.steps_per_epoch - 1) * self.batch_size}
        self.positions = {b: torch.arange(b, device=device) for b in sizes}  # a step's rows of the epoch's order
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.capture, self.why_eager = capture, ""
        self.pacer = Pacer(timeout_s) if device.type == "cuda" else None

    @property
    def global_batch(self) -> int:
        return self.d.world_size * self.batch_size

    def begin_epoch(self, epoch: int, first: int = 0) -> range:
        """The epoch's order (this rank's shard, DistributedSampler's rule) and lr table; its step indices from
        `first` on, for `step`."""
        self.model.train()
        order = shard_indices(self.n, self.d.rank, self.d.world_size, shuffle=True, seed=self.seed, epoch=epoch)
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
        if self.capture and size not in self.graphs and not self.why_eager:
            self._capture(size)
        if size in self.graphs:
            self.graphs[size].replay()
        else:
            self.run(size)
        if self.pacer:
            self.pacer.record(step)
        return self.loss

    def run(self, size: int) -> None:
        """One step of `size` samples per rank, as device work only: what a graph holds."""
        idx = self.order.index_select(0, self.index * self.batch_size + self.positions[size])
        x, y = self.data.batch(idx)
        lr, momentum = self.table.index_select(0, self.index).unbind(1)
        self.flat.grads.zero_()
        with autocast(x.device, self.amp, cache=False):
            loss = F.cross_entropy(self.model(x), y, label_smoothing=self.r.label_smoothing)
        loss.backward()
        if self.d.world_size > 1:  # the mean over the ranks, as DDP takes it: divided first, then summed
            self.d.all_sum(self.grads.div_(self.d.world_size))
        flatopt.update(self.opt, self.flat, lr.squeeze(0), momentum.squeeze(0))
        self.loss.copy_(loss.detach())
        self.index.add_(1)

    def state(self) -> list[torch.Tensor]:
        """Everything a step changes."""
        return [self.flat.params, self.flat.step, self.index, self.loss, *self.flat.state.values(),
                *self.model.buffers()]

    def _capture(self, size: int) -> None:
        """Warm up on a side stream, then capture a step of `size`; the warm-up's changes are undone. Any failure:
        one line, and this run trains eagerly."""
        kept = [t.clone() for t in self.state()]
        try:
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                for _ in range(WARMUP_STEPS):
                    self.run(size)
            torch.cuda.current_stream().wait_stream(side)
            for t, k in zip(self.state(), kept, strict=True):
                t.copy_(k)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=next(iter(self.graphs.values())).pool() if self.graphs else None):
                self.run(size)
            self.graphs[size] = graph
        except RuntimeError as e:
            self.why_eager = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
            self.graphs.clear()
            torch.cuda.synchronize()
            for t, k in zip(self.state(), kept, strict=True):
                t.copy_(k)
            if self.d.is_main:
                print(f"graph step: capturing the step failed ({self.why_eager}); training eagerly", flush=True)


class Pacer:
    """Keeps the host at most `PACE` steps ahead of the GPU, and turns a step that does not finish within the
    timeout (a collective waiting for a lost peer: NCCL's watchdog does not see captured collectives) into an
    error (launch.py adds the heartbeat's diagnosis of who stopped answering)."""

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
