"""The training loop: one code path for one process and for any number of DDP ranks (every rank runs `run`).

Read from the top: `run`, then `Trainer`, whose methods come in the order a default run calls them: `_deal`
(ShardedBatches: essential 2), `run` → `_wrap` (ddp.wrap: essential 3), then each epoch `_epoch` (set_epoch) →
`_train_epoch` → `_step` → `_textbook_step` (steps.train_step: essential 4), `_count`, `_fold` (BatchNorm's mean
statistics, the losses' all-reduce), `evaluation.evaluate`, `_save` (rank 0's: essential 5). Below the "Extensions"
line, and in `self.recovery`, `self.graph` and `self.profiler`, is what a first reading can skip (docs/ddp-path.md)."""

import math
import sys
import time
from collections.abc import Iterable
from dataclasses import replace
from pathlib import Path
from typing import Any, NamedTuple

import torch
from torch import nn

from .common import timing
from .common.config import TrainConfig
from .core import compute, ddp, divergence, reduction, schedule, state
from .core.batches import ShardedBatches, Share, Step, StepBatches
from .core.bnstats import PartStats
from .core.distributed import Dist
from .core.divergence import nonfinite
from .core.evaluation import EvalResult, evaluate
from .core.state import Progress, Stretch
from .core.steps import slot_step, train_step
from .cudagraph import graphstep
from .data import datasets
from .model import ConvNet
from .outputs import saving, summary
from .outputs.report import Reporter
from .outputs.timeline import StepProfiler
from .recovery import recovery
from .recovery.recovery import Grow, Recovery


def run(cfg: TrainConfig, d: Dist, recovery: Recovery | None = None) -> float:
    """Train for the recipe's epochs; returns the final test accuracy (the same on every rank)."""
    # Rank 0 alone speaks (`rank0`, whose Reporter on the other ranks is silent) and saves (`_save`).
    rank0 = Reporter.for_run(cfg, enabled=d.is_main, world_size=d.world_size)
    torch.manual_seed(cfg.seed)  # the same initial weights on every rank (DDP broadcasts rank 0's anyway)
    data = datasets.load(cfg.data)
    timing.enter("warm-up")  # the model, its optimizer, the first step
    cfg = replace(cfg, data=replace(cfg.data, dataset=data.name))  # `auto` resolved, as checkpoints record it
    rank0.say(summary.data_line(data))
    trainer = Trainer(cfg, d, data, rank0, recovery)
    try:
        result = trainer.run()
        trainer.rank0.say(summary.final_line(cfg, trainer.d, trainer.t.progress, trainer.target_outcome, result))
    finally:  # trainer.rank0: the one speaking at the end (--recover may have handed it on)
        trainer.rank0.close(sys.exc_info()[0])  # the last epoch's plots, after the result is said
    trainer.rank0.wall_time(timing.finish())
    return result.accuracy


class Stepped(NamedTuple):
    """One optimizer step on this rank: its mean loss over this rank's samples (on the device), this rank's
    samples, and the whole step's (all ranks')."""

    loss: torch.Tensor
    here: int
    samples: int


class Trainer:
    """One run, built once: the data's batches, the model, its optimizer; `run` trains it epoch by epoch."""

    def __init__(self, cfg: TrainConfig, d: Dist, data: datasets.Dataset, rank0: Reporter,
                 recovery: Recovery | None = None) -> None:
        self.cfg, self.d, self.data, self.rank0, self.recovery = cfg, d, data, rank0, recovery
        self.amp = compute.amp_for(cfg.recipe.amp, d.device)
        self.channels_last = compute.channels_last_for(cfg.channels_last, d.device)
        layout = torch.channels_last if self.channels_last else torch.contiguous_format
        # the plain ConvNet: what is evaluated and saved (memory_format: documented, not in torch's stubs)
        model = ConvNet().to(d.device, memory_format=layout)  # type: ignore[call-overload]
        opt, self.schedule = schedule.build_optimizer(cfg.recipe, model)
        self.t = state.Training(model, opt, divergence.grad_scaler(d.device, self.amp), Progress())
        self.target_outcome: str | None = None  # --target-accuracy: "reached", "already" (before resuming), "missed"
        self.stretch = Stretch(torch.zeros((), device=d.device))  # what this rank adds up until the next fold
        self.graph: graphstep.GraphStep | None = None  # the CUDA graph step: `run` decides
        self.graph_loss = torch.zeros((), device=d.device)
        self.clock = (-1, 0, 0.0)  # the epoch, its samples seen before and its start (across a recovery inside it)
        if recovery:  # --recover keeps a copy of the state at each step's start (snapshot.py)
            recovery.follow(self.t)
        self.profiler = StepProfiler(cfg.profile, d, rank0, Path(cfg.out) / "profile")  # --profile (timeline.py)
        # The run's global batch: M micro-batches of batch_size, M = world × --accumulate (a resume: the checkpoint's).
        self._deal(Share(slots=d.world_size * cfg.accumulate, world=d.world_size, whole=cfg.bitwise))

    def _deal(self, share: Share, saved_stats: torch.Tensor | None = None) -> None:
        """Deal the run's M slots over this world: this rank's batches (and test shard), its BatchNorm sets and the
        reduction. Where each rank trains one whole slot (W = M) the step is the textbook's."""
        cfg, r, d, train, test = self.cfg, self.cfg.recipe, self.d, self.data.train, self.data.test
        ddp.check_sync_bn(cfg.sync_bn, share)
        self.share = share
        # The default run (no --accumulate, --bitwise or --profile, the world the run began with) is the textbook's:
        # M = W, so each rank trains one micro-batch a step (slots == parts == world), with ShardedBatches and
        # train_step (on one GPU, the same step captured: `run` picks the graph; on a CPU `self.graph` stays None).
        # `-g 2` on a CPU: Share(slots=2, world=2), textbook, ShardedBatches; `_wrap`: static_graph, no hook; no graph.
        self.textbook = share.slots == share.world and not cfg.bitwise and not cfg.profile
        how: dict[str, Any] = {"device": d.device, "normalize": r.normalize, "channels_last": self.channels_last}
        self.train_batches: ShardedBatches | StepBatches = (
            ShardedBatches(train.images, train.labels, r.batch_size, rank=d.rank, world=d.world_size, shuffle=True,
                           seed=cfg.seed, **how) if self.textbook else
            StepBatches(train.images, train.labels, r.batch_size, share, rank=d.rank, seed=cfg.seed, **how))
        self.test_batches = ShardedBatches(test.images, test.labels, cfg.eval_batch_size, rank=d.rank,
                                           world=d.world_size, shuffle=False, each_sample_once=True, **how)
        self.stats = PartStats(self.t.model, share, d.rank, saved_stats)
        self.reduction = reduction.for_run(cfg.bitwise, self.t.model, share, d.rank)
        if self.recovery and isinstance(self.reduction, reduction.SlotReduction):  # --recover keeps every part's set
            self.reduction.carry_sets(self.stats.held, sum(b.numel() for b in self.stats.live), saved_stats)

    def run(self) -> EvalResult:
        """Train the remaining epochs; returns the last evaluation (the same on every rank)."""
        if self.cfg.resume:
            self._resume()
        self.rank0.say(summary.run_line(self.cfg, self.d, self.share, self.amp, self.channels_last))
        self.rank0.begin(self.samples_done)
        if self._reached(self.t.progress.best_accuracy):  # an epoch before the resume reached the target
            self.target_outcome = "already"
            return evaluate(self.t.model, self.test_batches, self.d, self.amp)
        self.profiler.watch(self.reduction)
        if self.recovery and self.recovery.joining:  # a replacement of a lost rank: the run's state from rank 0
            self.recovery.handover(self)
        self.graph = graphstep.choose(self.cfg, self.d, self.t, self.train_batches, self.textbook, self.rank0.say)
        net = self._wrap()
        if self.graph:  # None: some rank could not capture it, and every rank trains the eager step
            self.graph = self.graph.prepare(net, self.rank0.say)
        result = None
        while (epoch := self.t.progress.epoch) < self.cfg.recipe.epochs:
            try:
                result = self._epoch(net, epoch)
            except (Grow, RuntimeError) as e:  # --recover: a rank was lost, or replacements join (recovery.py)
                change = recovery.world_change(self.recovery, e)
            else:
                if self._reached(result.accuracy):  # the same all-reduced number on every rank: all stop here
                    self.target_outcome = "reached"
                    return result
                continue
            del net  # the old group's DDP wrapper goes before the group (out here: the error's frames hold it)
            assert self.recovery is not None  # world_change raised the error again without it
            self.recovery.change(self, change)
            net = self._wrap()
        if self.cfg.target_accuracy is not None:
            self.target_outcome = "missed"
        return result or evaluate(self.t.model, self.test_batches, self.d, self.amp)  # None: a finished run resumed

    def _wrap(self) -> nn.Module:
        """The model under DDP in this world (ddp.wrap). A default run passes accumulating=False (so `static_graph`:
        each rank trains one micro-batch a step, none under no_sync), hook=None (DDP's own all-reduce), no stream and
        keep_grads=False (no CUDA graph)."""
        hook = self.reduction if self.cfg.bitwise or self.cfg.profile else None  # else: DDP's own all-reduce
        g = self.graph  # the graph step's DDP: on its capture stream, the gradients in its flat buffer
        return ddp.wrap(self.t.model, self.d, sync_bn=self.cfg.sync_bn, compile=self.cfg.compile,
                        accumulating=self.share.parts > self.share.world, hook=hook, stream=g.stream if g else None,
                        keep_grads=g is not None)

    def _epoch(self, net: nn.Module, epoch: int) -> EvalResult:
        """Train the rest of `epoch`, evaluate, record, save."""
        if self.clock[0] != epoch:
            self.clock = (epoch, self.t.progress.seen, time.perf_counter())
        _, seen_before, start = self.clock
        self.train_batches.set_epoch(epoch, start=self.t.progress.consumed)
        seconds = self._train_epoch(net, epoch, start)
        self._lose_here("evaluation")
        result = evaluate(self.t.model, self.test_batches, self.d, self.amp)
        speed = (self.t.progress.seen - seen_before) / seconds if seconds > 0 else math.nan
        lr = self.t.opt.param_groups[0]["lr"]
        record = summary.epoch_record(epoch, self.cfg, self.d, self.t.progress, result, speed,
                                      time.perf_counter() - start, lr, self.train_batches.global_batch, self.data.name)
        self.rank0.epoch(record, result.confusion, self.data.classes, self.samples_done)  # a metrics.jsonl line
        best = max(self.t.progress.best_accuracy, result.accuracy)
        self.t.progress = Progress(epoch=epoch + 1, best_accuracy=best)
        self._lose_here("save")
        self._save(best=result if result.accuracy >= best else None)
        if self.recovery:  # --recover: a rank lost while rank 0 saved is lost inside the loop (recovery.py)
            self.recovery.saved(self)
        return result

    def _train_epoch(self, net: nn.Module, epoch: int, began: float) -> float:
        """Train one epoch from `progress.consumed` on; returns the seconds since it `began`."""
        d, batches = self.d, self.train_batches
        n, r = len(self.data.train.labels), self.cfg.recipe
        self.stats.use_own()  # each rank trains with its own BatchNorm statistics (the last fold left the mean)
        steps: Iterable[Any] = batches  # the step's kind (`_step`) takes what they hold; the graph, the step's index
        if self.graph:
            assert isinstance(batches, ShardedBatches)  # the graph step is the textbook's
            steps = self.graph.begin_epoch(epoch, batches.indices(), batches.first)
        for batch in self.rank0.bar(steps, batches.steps_per_epoch, f"epoch {epoch + 1}/{r.epochs}",
                                     initial=batches.first):
            self._before_step(epoch)  # extensions: --recover, the heartbeat's position
            self.schedule(self.samples_done / (r.epochs * n))
            stepped = self._step(net, batch)
            self._count(stepped)
            self._after_step()  # extensions: --checkpoint-every, --profile, the warm-up's end
        self._fold()
        compute.sync(d.device)
        return time.perf_counter() - began

    def _step(self, net: nn.Module, batch: Any) -> Stepped:
        """One optimizer step, of the kind this run trains, chosen here alone (each takes the batches its kind deals):
        - the textbook step: each rank one micro-batch of a global batch, DDP's all-reduce mean (`train_step`);
        - the slot step: --bitwise, --accumulate, --profile, or a world re-formed smaller than the run's slots
          (`slot_step`: the micro-batches in slot order, the reduction in `reduction.py`);
        - the CUDA graph: the textbook step captured once and replayed (graphstep.py)."""
        if self.graph:
            return self._graph_step(net, batch)
        return self._textbook_step(net, batch) if self.textbook else self._slot_step(net, batch)

    def _textbook_step(self, net: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> Stepped:
        x, y = batch
        loss = train_step(net, self.t.opt, x, y, amp=self.amp, label_smoothing=self.cfg.recipe.label_smoothing,
                          scaler=self.t.scaler)
        return Stepped(loss, len(y), len(y) * self.d.world_size)

    def _count(self, stepped: Stepped) -> None:
        """The step's loss and samples added to this rank's stretch, on the device (nothing waits for it: the next fold
        adds the ranks' up), every --log-every-th step's loss kept, and the epoch's position moved on."""
        progress, n = self.t.progress, len(self.data.train.labels)
        self.stretch.add(stepped.loss, stepped.here, stepped.samples)
        progress.consumed = min(n, progress.consumed + stepped.samples)  # the padding is not a sample consumed
        if self.steps_done % self.cfg.log_every == 0:
            self.stretch.logged.append((self.samples_done, self.t.opt.param_groups[0]["lr"],
                                        stepped.loss.mul(stepped.here), stepped.samples))

    def _fold(self) -> None:
        """Before every save and evaluation: average BatchNorm's statistics, and add every rank's loss sum, image
        count, kept step losses and count of non-finite numbers, in one all-reduce; stop if the run diverged."""
        if self.recovery:  # --recover: the state this fold starts from is kept
            self.recovery.fold_begins(self)
        s = self.stretch
        self.stats.average(self.steps_done)
        totals = self.d.all_sum(torch.stack([s.loss_sum.float(), torch.tensor(float(s.seen), device=self.d.device),
                                             nonfinite(self.t.model), *(loss for _, _, loss, _ in s.logged)]))
        self._lose_here("folded")
        p, n = self.t.progress, len(self.data.train.labels)
        p.loss_sum += float(totals[0])
        p.seen += int(totals[1])
        self.rank0.steps([{"samples": done, "epoch": done / n, "train_loss": loss / samples, "lr": lr}
                           for (done, lr, _, samples), loss in zip(s.logged, totals[3:].tolist())])
        self.stretch = Stretch(torch.zeros((), device=self.d.device))
        divergence.check(math.isfinite(p.loss_sum) and not totals[2], self.t.scaler, p.epoch + 1, self.step_in_epoch,
                         self.t.opt.param_groups[0]["lr"], self.cfg.recipe.lr)

    @timing.charged("outputs")
    def _save(self, best: EvalResult | None = None) -> None:
        """The checkpoint; where `best` is this epoch's result, the best model too (best.pt, model.safetensors)."""
        if self.d.is_main:  # rank 0 alone saves (and speaks, through `rank0`: see `run`)
            saving.save(Path(self.cfg.out), self.t, self.cfg, self.d, self.share.slots, self.stats.parts, best,
                       self.data.classes)

    @property
    def step_in_epoch(self) -> int:
        """Optimizer steps of the current epoch done (what --checkpoint-every counts): the same at any world."""
        return math.ceil(self.t.progress.consumed / self.train_batches.global_batch)

    @property
    def steps_done(self) -> int:
        """Optimizer steps of the run so far (what --log-every counts)."""
        return self.t.progress.epoch * self.train_batches.steps_per_epoch + self.step_in_epoch

    @property
    def samples_done(self) -> int:
        """Training samples of the run so far, over all ranks: the schedule's clock and TensorBoard's x-axis."""
        return self.t.progress.epoch * len(self.data.train.labels) + self.t.progress.consumed

    def _reached(self, accuracy: float) -> bool:
        return self.cfg.target_accuracy is not None and accuracy >= self.cfg.target_accuracy

    # Extensions, which a first reading can skip: around each step (`--recover`, `--checkpoint-every`,
    # `--profile`), the slot step and the CUDA graph step, `--resume`, and `--recover`'s planned losses.

    def _before_step(self, epoch: int) -> None:
        """What a step's start means beyond the lesson's loop: a default run only tells the heartbeat where it is."""
        if self.recovery:  # --recover: replacements may join here; the state this step starts from is kept
            self.recovery.step_begins(self)
        self.d.set_phase("training", epoch + 1, self.step_in_epoch + 1)  # for a peer's timeout message

    def _after_step(self) -> None:
        """What a step's end means beyond the lesson's loop: a default run only ends the warm-up's clock."""
        cfg, n = self.cfg, len(self.data.train.labels)
        timing.stepped()  # the first step ends the warm-up (timing.py)
        if cfg.checkpoint_every and self.step_in_epoch % cfg.checkpoint_every == 0 and self.t.progress.consumed < n:
            self._fold()
            self._save()
            self.stats.use_own()  # as in `_train_epoch`: the rank's own statistics back after the fold's mean
        self.profiler.step(self.step_in_epoch, self.train_batches.steps_per_epoch)

    def _slot_step(self, net: nn.Module, batch: Step) -> Stepped:
        loss_sum = slot_step(net, self.t.opt, batch, self.stats, self.reduction, amp=self.amp,
                             label_smoothing=self.cfg.recipe.label_smoothing, scaler=self.t.scaler,
                             phase=self.profiler.phase)
        here = sum(len(mb.y) for mb in batch.micro_batches)
        return Stepped(loss_sum.div(max(here, 1)), here, batch.samples)  # a rank of --bitwise may train no sample

    def _graph_step(self, net: nn.Module, batch: int) -> Stepped:
        """`batch`: the step's index in its epoch (graphstep.py)."""
        assert self.graph is not None
        here = self.graph.size(batch)  # a loss made on the device (tests/collectives.py)
        return Stepped(self.graph_loss.copy_(self.graph.step(batch)), here, here * self.d.world_size)

    def _resume(self) -> None:
        """Continue from `<out>/checkpoint.pt`, at any world size: the run's M slots are the checkpoint's."""
        resumed = saving.resume(Path(self.cfg.out) / "checkpoint.pt", self.t, self.cfg, self.d,
                               len(self.data.train.labels), self.rank0.say)
        if resumed is None:  # none yet: the run starts from scratch (saving.resume said so)
            return
        self.rank0.keep_epochs_before(self.t.progress.epoch)  # a line of the epoch in progress was never saved
        self._deal(resumed.share, resumed.batchnorm_parts)
        if line := summary.resume_line(resumed.world_was, resumed.share, self.cfg):
            self.rank0.say(line)

    def _lose_here(self, point: str) -> None:
        """Tests of --recover only: a loss planned at this point of the loop (lossplan.py)."""
        if self.recovery:
            self.recovery.plan.reached(point, self.steps_done)
