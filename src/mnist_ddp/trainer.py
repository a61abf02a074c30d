"""The training loop as the textbook has it: every rank trains one micro-batch of each step (DistributedSampler's
shard), DDP all-reduces the gradients inside backward, rank 0 saves. Every rank builds a `Trainer` and calls `run`.

Read from the top: the methods come in the order a run calls them: `_deal` (ShardedBatches: essential 2), `run` →
`_wrap` (ddp.wrap: essential 3), then each epoch `_epoch` (set_epoch) → `_train_epoch` → `_step` (steps.train_step:
essential 4), `_count`; at the epoch's end `_fold` (BatchNorm's statistics averaged, the losses all-reduced),
`evaluation.evaluate`, `_save` (rank 0's: essential 5). This class is all a default run on a CPU trains with. What
`--accumulate`, `--bitwise`, `--profile`, `--resume`, `--recover` and the CUDA graph add is a subclass a first
reading skips: extended.py's `ExtendedTrainer`."""

import math
import time
from pathlib import Path
from typing import Any, NamedTuple

import torch
from torch import nn

from .common import timing
from .common.config import TrainConfig
from .core import compute, ddp, divergence, schedule, state
from .core.batches import Batches, ShardedBatches, Share
from .core.bnstats import RankStats, Statistics
from .core.distributed import Dist
from .core.divergence import nonfinite
from .core.evaluation import EvalResult, evaluate
from .core.state import Progress, Stretch
from .core.steps import train_step
from .data import datasets
from .model import ConvNet
from .outputs import saving, summary
from .outputs.report import Reporter


class Stepped(NamedTuple):
    """One optimizer step on this rank: its mean loss over this rank's samples (on the device), this rank's
    samples, and the whole step's (all ranks')."""

    loss: torch.Tensor
    here: int
    samples: int


class Trainer:
    """One run, built once: the data's batches, the model, its optimizer; `run` trains it epoch by epoch.

    `rank0` speaks and writes the metrics on rank 0 and is silent on the others (`Reporter.for_run`)."""

    def __init__(self, cfg: TrainConfig, d: Dist, data: datasets.Dataset, rank0: Reporter) -> None:
        self.cfg, self.d, self.data, self.rank0 = cfg, d, data, rank0
        self.amp = compute.amp_for(cfg.recipe.amp, d.device)
        self.channels_last = compute.channels_last_for(cfg.channels_last, d.device)
        layout = torch.channels_last if self.channels_last else torch.contiguous_format
        # how every batch is made, where the data stays: on the device, normalised there, in the model's layout
        self.batch_form: dict[str, Any] = {"device": d.device, "normalize": cfg.recipe.normalize,
                                           "channels_last": self.channels_last}
        # the plain ConvNet: what is evaluated and saved (memory_format: documented, not in torch's stubs)
        model = ConvNet().to(d.device, memory_format=layout)  # type: ignore[call-overload]
        opt, self.schedule = schedule.build_optimizer(cfg.recipe, model)
        self.t = state.Training(model, opt, divergence.grad_scaler(d.device, self.amp), Progress())
        self.net: nn.Module = model  # what the steps run: the model under DDP, once `run` wraps it
        self.target_outcome: str | None = None  # --target-accuracy: "reached", "already" (before resuming), "missed"
        self.stretch = Stretch(torch.zeros((), device=d.device))  # what this rank adds up until the next fold
        self.clock = (-1, 0, 0.0)  # the epoch, its samples seen before and its start (across a recovery inside it)
        self._deal()

    def _deal(self) -> None:
        """This rank's shard of every epoch (torch's DistributedSampler, `ShardedBatches`) and of the test set, and how
        its BatchNorm statistics are averaged with the other ranks'."""
        cfg, r, d, train, test = self.cfg, self.cfg.recipe, self.d, self.data.train, self.data.test
        self.share = Share(slots=d.world_size, world=d.world_size)  # each rank one micro-batch of every step
        self.train_batches: Batches = ShardedBatches(train.images, train.labels, r.batch_size, rank=d.rank,
                                                     world=d.world_size, shuffle=True, seed=cfg.seed, **self.batch_form)
        self.test_batches = ShardedBatches(test.images, test.labels, cfg.eval_batch_size, rank=d.rank,
                                           world=d.world_size, shuffle=False, each_sample_once=True, **self.batch_form)
        self.stats: Statistics = RankStats(self.t.model, d)

    def run(self) -> EvalResult:
        """Train the recipe's epochs; returns the last evaluation (the same on every rank)."""
        self._begin()
        self.net = self._wrap()
        result = None
        while (epoch := self.t.progress.epoch) < self.cfg.recipe.epochs:
            result = self._epoch(epoch)
            if self._reached(result.accuracy):  # the same all-reduced number on every rank: all stop here
                self.target_outcome = "reached"
                return result
        return self._end(result)

    def _begin(self) -> None:
        """Rank 0's line on how the run trains, and its clock of samples started."""
        self.rank0.say(summary.run_line(self.cfg, self.d, self.share, self.amp, self.channels_last))
        self.rank0.begin(self.samples_done)

    def _wrap(self) -> nn.Module:
        """The model under DDP in this world (ddp.wrap; one process: the model itself)."""
        return ddp.wrap(self.t.model, self.d, sync_bn=self.cfg.sync_bn, compile=self.cfg.compile)

    def _epoch(self, epoch: int) -> EvalResult:
        """Train the rest of `epoch`, evaluate, record, save."""
        if self.clock[0] != epoch:
            self.clock = (epoch, self.t.progress.seen, time.perf_counter())
        _, seen_before, start = self.clock
        self.train_batches.set_epoch(epoch, start=self.t.progress.consumed)  # essential 2: a new shuffle each epoch
        seconds = self._train_epoch(epoch, start)
        result = evaluate(self.t.model, self.test_batches, self.d, self.amp)
        speed = (self.t.progress.seen - seen_before) / seconds if seconds > 0 else math.nan
        lr = self.t.opt.param_groups[0]["lr"]
        record = summary.epoch_record(epoch, self.cfg, self.d, self.t.progress, result, speed,
                                      time.perf_counter() - start, lr, self.train_batches.global_batch, self.data.name)
        self.rank0.epoch(record, result.confusion, self.data.classes, self.samples_done)  # a metrics.jsonl line
        best = max(self.t.progress.best_accuracy, result.accuracy)
        self.t.progress = Progress(epoch=epoch + 1, best_accuracy=best)
        self._save(best=result if result.accuracy >= best else None)
        return result

    def _train_epoch(self, epoch: int, began: float) -> float:
        """Train one epoch from `progress.consumed` on; returns the seconds since it `began`."""
        batches, r = self.train_batches, self.cfg.recipe
        self.stats.use_own()  # each rank trains with its own BatchNorm statistics (the last fold left the mean)
        for batch in self.rank0.bar(batches, batches.steps_per_epoch, f"epoch {epoch + 1}/{r.epochs}",
                                     initial=batches.first):
            self._before_step(epoch)
            self.schedule(self.samples_done / (r.epochs * len(self.data.train.labels)))
            stepped = self._step(batch)
            self._count(stepped)
            self._after_step()
        self._fold()
        compute.sync(self.d.device)
        return time.perf_counter() - began

    def _before_step(self, epoch: int) -> None:
        """The heartbeat told where this rank is, for a peer's timeout message."""
        self.d.set_phase("training", epoch + 1, self.step_in_epoch + 1)

    def _step(self, batch: Any) -> Stepped:
        """One optimizer step: forward, backward (inside it DDP all-reduces the gradients' mean), the optimizer."""
        x, y = batch
        loss = train_step(self.net, self.t.opt, x, y, amp=self.amp, label_smoothing=self.cfg.recipe.label_smoothing,
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

    def _after_step(self) -> None:
        """The first step ends the warm-up's clock (timing.py); every --checkpoint-every steps, a fold and a save."""
        timing.stepped()
        every, n = self.cfg.checkpoint_every, len(self.data.train.labels)
        if every and self.step_in_epoch % every == 0 and self.t.progress.consumed < n:
            self._fold()
            self._save()
            self.stats.use_own()  # as in `_train_epoch`: the rank's own statistics back after the fold's mean

    def _fold(self) -> None:
        """Before every save and evaluation: the ranks' sums added up (`_add_up`), the epoch's progress and the kept
        step losses recorded; stop if the run diverged."""
        s, totals = self.stretch, self._add_up()
        p, n = self.t.progress, len(self.data.train.labels)
        p.loss_sum += float(totals[0])
        p.seen += int(totals[1])
        self.rank0.steps([{"samples": done, "epoch": done / n, "train_loss": loss / samples, "lr": lr}
                           for (done, lr, _, samples), loss in zip(s.logged, totals[3:].tolist())])
        self.stretch = Stretch(torch.zeros((), device=self.d.device))
        divergence.check(math.isfinite(p.loss_sum) and not totals[2], self.t.scaler, p.epoch + 1, self.step_in_epoch,
                         self.t.opt.param_groups[0]["lr"], self.cfg.recipe.lr)

    def _add_up(self) -> torch.Tensor:
        """BatchNorm's statistics averaged over the ranks, and every rank's loss sum, image count, count of non-finite
        numbers and kept step losses added up, in one all-reduce."""
        s = self.stretch
        self.stats.average(self.steps_done)
        return self.d.all_sum(torch.stack([s.loss_sum.float(), torch.tensor(float(s.seen), device=self.d.device),
                                           nonfinite(self.t.model), *(loss for _, _, loss, _ in s.logged)]))

    @timing.charged("outputs")
    def _save(self, best: EvalResult | None = None) -> None:
        """The checkpoint; where `best` is this epoch's result, the best model too (best.pt, model.safetensors)."""
        if self.d.is_main:  # essential 5: rank 0 alone saves (and speaks, through `rank0`)
            saving.save(Path(self.cfg.out), self.t, self.cfg, self.d, self.share.slots, self.stats.parts, best,
                        self.data.classes)

    def _end(self, result: EvalResult | None) -> EvalResult:
        """The run's last evaluation, after its last epoch (--target-accuracy: missed)."""
        if self.cfg.target_accuracy is not None:
            self.target_outcome = "missed"
        return result or evaluate(self.t.model, self.test_batches, self.d, self.amp)  # None: no epoch was left

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
