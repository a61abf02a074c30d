"""The training loop: one code path for one process and for any number of DDP ranks.

Every rank runs `run`; the launcher has already joined the process group (distributed.join) and leaves it
afterwards. Each epoch: `set_epoch` (every rank draws the same new shuffle and takes its shard), a training
step per batch (steps.train_step: DDP all-reduces the gradients inside backward), then the ranks' loss sums
added up (`_fold`), an evaluation whose counts are all-reduced (evaluation.py), and rank 0's checkpoint and
report (state.save, report.py). Stopping early (divergence, --target-accuracy) is decided from numbers every
rank shares, so all ranks stop at the same step.
"""

import math
import time
from dataclasses import replace
from pathlib import Path

import torch
from torch import nn

from . import compute, datasets, ddp, divergence, graphstep, reduction, schedule, state, summary
from .batches import ShardedBatches, Share, Step, StepBatches
from .config import TrainConfig
from .distributed import Dist
from .divergence import nonfinite
from .evaluation import EvalResult, evaluate
from .model import ConvNet
from .report import Reporter
from .state import Progress
from .steps import PartStats, slot_step, train_step
from .timeline import StepProfiler


class Trainer:
    """One run, built once: the data's batches, the model, its optimizer; `run` trains it epoch by epoch."""

    def __init__(self, cfg: TrainConfig, d: Dist, data: datasets.Dataset, report: Reporter) -> None:
        self.cfg, self.d, self.data, self.report = cfg, d, data, report
        r = cfg.recipe
        self.amp = compute.amp_for(r.amp, d.device)
        self.channels_last = compute.channels_last_for(cfg.channels_last, d.device)
        self.test_batches = ShardedBatches(data.test.images, data.test.labels, cfg.eval_batch_size, shuffle=False,
                                           pad=False, rank=d.rank, world=d.world_size, device=d.device,
                                           normalize=r.normalize, channels_last=self.channels_last)
        model = ConvNet().to(d.device)  # the plain ConvNet: what is evaluated and saved
        if self.channels_last:
            model = model.to(memory_format=torch.channels_last)
        opt, self.schedule = schedule.build_optimizer(r, model)
        self.t = state.Training(model, opt, divergence.grad_scaler(d.device, self.amp), Progress())
        self.target_outcome: str | None = None  # --target-accuracy: "reached", "already" (before resuming), "missed"
        # (samples done, lr, this rank's loss sum, the step's samples) of every --log-every-th step, until the next fold
        self.logged: list[tuple[int, float, torch.Tensor, int]] = []
        self.ckpt_path = Path(cfg.out) / "checkpoint.pt"
        self.profiler = StepProfiler(cfg.profile, d, report, Path(cfg.out) / "profile")  # --profile (timeline.py)
        # The run's global batch: M micro-batches of batch_size, M = world × --accumulate (a resume: the checkpoint's).
        self._deal(Share(slots=d.world_size * cfg.accumulate, world=d.world_size, whole=cfg.bitwise))

    def _deal(self, share: Share, saved_stats: torch.Tensor | None = None) -> None:
        """Deal the run's M slots over this world: this rank's batches, its BatchNorm sets and the reduction.
        Where each rank trains one whole slot (W = M) the step is the textbook's."""
        cfg, r, d, train = self.cfg, self.cfg.recipe, self.d, self.data.train
        ddp.check_sync_bn(cfg.sync_bn, share)
        self.share = share
        self.textbook = share.slots == share.world and not cfg.bitwise and not cfg.profile
        how = {"device": d.device, "normalize": r.normalize, "channels_last": self.channels_last}
        self.train_batches: ShardedBatches | StepBatches = (
            ShardedBatches(train.images, train.labels, r.batch_size, rank=d.rank, world=d.world_size, shuffle=True,
                           seed=cfg.seed, **how) if self.textbook else
            StepBatches(train.images, train.labels, r.batch_size, share, rank=d.rank, seed=cfg.seed, **how))
        self.stats = PartStats(self.t.model, share, d.rank, saved_stats)
        self.reduction = reduction.for_run(cfg.bitwise, self.t.model, share, d.rank)

    def run(self) -> EvalResult:
        """Train the remaining epochs; returns the last evaluation (the same on every rank)."""
        if self.cfg.resume:
            self._resume()
        self.report.say(summary.run_line(self.cfg, self.d, self.share, self.amp, self.channels_last))
        self.report.begin(self.samples_done)
        if self._reached(self.t.progress.best_accuracy):  # an epoch before the resume reached the target
            self.target_outcome = "already"
            return evaluate(self.t.model, self.test_batches, self.d, self.amp)
        self.profiler.watch(self.reduction)
        self.graph = self._graph_step()
        self.graph_loss = torch.zeros((), device=self.d.device)
        hook = self.reduction if self.cfg.bitwise or self.cfg.profile else None  # else: DDP's own all-reduce
        net = self.t.model if self.graph else ddp.wrap(
            self.t.model, self.d, sync_bn=self.cfg.sync_bn, compile=self.cfg.compile,
            accumulating=self.share.parts > self.share.world, hook=hook)
        result = None
        for epoch in range(self.t.progress.epoch, self.cfg.recipe.epochs):
            seen_before, start = self.t.progress.seen, time.perf_counter()
            self.train_batches.set_epoch(epoch, start=self.t.progress.consumed)
            if self.graph:
                self.graph.set_epoch(epoch, self.train_batches.first, self.cfg.recipe.epochs)
            seconds = self._train_epoch(net, epoch)
            result = evaluate(self.t.model, self.test_batches, self.d, self.amp)
            speed = (self.t.progress.seen - seen_before) / seconds if seconds > 0 else math.nan
            self._record(epoch, result, speed, time.perf_counter() - start)
            best = max(self.t.progress.best_accuracy, result.accuracy)
            self.t.progress = Progress(epoch=epoch + 1, best_accuracy=best)
            self._save(self.ckpt_path)
            if result.accuracy >= best:
                self._save(self.ckpt_path.with_name("best.pt"))
            if self._reached(result.accuracy):  # the same all-reduced number on every rank: all stop here
                self.target_outcome = "reached"
                return result
        if self.cfg.target_accuracy is not None:
            self.target_outcome = "missed"
        if result is None:  # resumed a finished run: nothing left to train, so just report
            result = evaluate(self.t.model, self.test_batches, self.d, self.amp)
        return result

    def _graph_step(self) -> graphstep.GraphStep | None:
        """The step as a CUDA graph (graphstep.py) where it applies, and one line saying so; else None."""
        why = graphstep.eager_because(self.cfg, self.d.device, self.amp, self.textbook)
        if why:
            if self.cfg.graph_step == "on" or self.d.device.type == "cuda":
                self.report.say(f"step: eager ({why})")
            return None
        capture = self.d.device.type == "cuda"
        how = "captured as a CUDA graph and replayed" if capture else "the graph step, eagerly"
        reduced = "; gradients averaged by one all-reduce of a flat buffer" if self.d.world_size > 1 else ""
        self.report.say(f"step: {how}{reduced}")
        return graphstep.GraphStep(self.t.model, self.t.opt, self.train_batches.data, self.cfg.recipe, self.d,
                                   seed=self.cfg.seed, amp=self.amp, capture=capture, timeout_s=self.cfg.timeout)

    def _train_epoch(self, net: nn.Module, epoch: int) -> float:
        """Train one epoch from `progress.consumed` on; returns the seconds it took."""
        cfg, d, progress, batches = self.cfg, self.d, self.t.progress, self.train_batches
        n, r = len(self.data.train.labels), cfg.recipe
        self.stats.train()
        compute.sync(d.device)
        start = time.perf_counter()
        loss_sum = torch.zeros((), device=d.device)  # this rank's, since the last fold: on the device, no sync
        seen_here = 0
        steps = range(batches.first, batches.steps_per_epoch) if self.graph else batches
        for batch in self.report.bar(steps, batches.steps_per_epoch, f"epoch {epoch + 1}/{r.epochs}",
                                     initial=batches.first):
            d.set_phase("training", epoch + 1, self.step_in_epoch + 1)  # for a peer's timeout message
            self.schedule(self.samples_done / (r.epochs * n))
            step_loss = self._step(net, batch)
            here, samples = self._samples(batch)
            loss_sum.add_(step_loss, alpha=here)
            seen_here += here
            progress.consumed = min(n, progress.consumed + samples)  # the padding is not a sample consumed
            if self.steps_done % cfg.log_every == 0:
                self._log_step(step_loss.mul(here), samples)
            if cfg.checkpoint_every and self.step_in_epoch % cfg.checkpoint_every == 0 and progress.consumed < n:
                self._fold(loss_sum, seen_here)
                loss_sum.zero_()
                seen_here = 0
                self._save(self.ckpt_path)
                self.stats.train()
            self.profiler.step(self.step_in_epoch, batches.steps_per_epoch)
        self._fold(loss_sum, seen_here)
        compute.sync(d.device)
        return time.perf_counter() - start

    def _step(self, net: nn.Module, batch: tuple[torch.Tensor, torch.Tensor] | Step | int) -> torch.Tensor:
        """One optimizer step; returns the mean loss over this rank's samples (on the device)."""
        r = self.cfg.recipe
        if isinstance(batch, int):  # the graph step's index in the epoch
            self.graph.step(batch)
            return self.graph_loss.copy_(self.graph.loss)  # the step's buffer, which the next replay overwrites
        if self.textbook:
            x, y = batch
            return train_step(net, self.t.opt, x, y, amp=self.amp, label_smoothing=r.label_smoothing,
                              scaler=self.t.scaler)
        loss_sum = slot_step(net, self.t.opt, batch, self.stats, self.reduction, amp=self.amp,
                             label_smoothing=r.label_smoothing, scaler=self.t.scaler, phase=self.profiler.phase)
        return loss_sum.div(max(self._samples(batch)[0], 1))  # a rank of --bitwise may train no sample

    def _samples(self, batch: tuple[torch.Tensor, torch.Tensor] | Step | int) -> tuple[int, int]:
        """This rank's samples in the step, and the whole step's (all ranks')."""
        if isinstance(batch, int):
            return self.graph.size(batch), self.graph.size(batch) * self.d.world_size
        if self.textbook:
            return len(batch[1]), len(batch[1]) * self.d.world_size
        return sum(len(mb.y) for mb in batch.micro_batches), batch.samples

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

    def _log_step(self, loss_sum: torch.Tensor, samples: int) -> None:
        """Keep this step's loss sum (on the device) and lr; the next `_fold` adds them up over the ranks."""
        self.logged.append((self.samples_done, self.t.opt.param_groups[0]["lr"], loss_sum, samples))

    def _fold(self, loss_sum: torch.Tensor, seen_here: int) -> None:
        """Before every save and evaluation: average BatchNorm's statistics, and add every rank's loss sum, image
        count, kept step losses and count of non-finite numbers, in one all-reduce; stop if the run diverged."""
        self.stats.average(self.steps_done)
        totals = self.d.all_sum(torch.stack([loss_sum.float(), torch.tensor(float(seen_here), device=self.d.device),
                                             nonfinite(self.t.model),
                                             *(loss for _, _, loss, _ in self.logged)]))
        p, n = self.t.progress, len(self.data.train.labels)
        p.loss_sum += float(totals[0])
        p.seen += int(totals[1])
        self.report.steps([{"samples": done, "epoch": done / n, "train_loss": loss / samples, "lr": lr}
                           for (done, lr, _, samples), loss in zip(self.logged, totals[3:].tolist())])
        self.logged.clear()
        divergence.check(math.isfinite(p.loss_sum) and not totals[2], self.t.scaler, p.epoch + 1, self.step_in_epoch,
                         self.t.opt.param_groups[0]["lr"], self.cfg.recipe.lr)

    def _reached(self, accuracy: float) -> bool:
        return self.cfg.target_accuracy is not None and accuracy >= self.cfg.target_accuracy

    def _record(self, epoch: int, result: EvalResult, images_per_second: float, seconds: float) -> None:
        """One line of metrics.jsonl, the console line and the plots (rank 0)."""
        p, r = self.t.progress, self.cfg.recipe
        self.report.epoch({
            "epoch": epoch + 1, "epochs": r.epochs,
            "train_loss": p.loss_sum / max(p.seen, 1),
            "test_loss": result.loss, "test_accuracy": result.accuracy,
            "test_correct": result.correct, "test_count": result.count,
            "train_samples": p.seen,  # over all ranks, the sampler's padding included
            "images_per_second": images_per_second, "epoch_seconds": seconds, "lr": self.t.opt.param_groups[0]["lr"],
            "world_size": self.d.world_size, "batch_size": r.batch_size,
            "global_batch": self.train_batches.global_batch, "dataset": self.data.name,
        }, result.confusion, self.data.classes, self.samples_done)

    def _save(self, path: Path) -> None:
        state.save(path, self.t, self.cfg, self.d, self.share.slots, self.stats.parts,
                   keep_previous=path == self.ckpt_path)

    def _resume(self) -> None:
        """Continue from `<out>/checkpoint.pt`, at any world size: the run's M slots are the checkpoint's."""
        n = len(self.data.train.labels)
        resumed = state.resume(self.ckpt_path, self.t, self.cfg, self.d, n, self.report.say)
        if resumed is None:
            self.report.say(f"resume: no checkpoint in {self.cfg.out} yet, starting from scratch")
            return
        p = self.t.progress
        self.report.keep_epochs_before(p.epoch)  # a line of the epoch in progress was never saved
        self.report.say(f"resume: from {resumed.path}, epoch {p.epoch + 1}, {p.consumed:,} of its {n:,} samples done")
        self._deal(resumed.share, resumed.batchnorm_parts)
        if line := summary.world_change(resumed.world_was, resumed.share, self.cfg):
            self.report.say(line)


def run(cfg: TrainConfig, d: Dist) -> float:
    """Train for the recipe's epochs; returns the final test accuracy (the same on every rank)."""
    report = Reporter(Path(cfg.out), d.is_main, cfg.progress, cfg.plots, cfg.tensorboard)
    torch.manual_seed(cfg.seed)  # the same initial weights on every rank (DDP broadcasts rank 0's anyway)
    data = datasets.load(cfg.data)
    cfg = replace(cfg, data=replace(cfg.data, dataset=data.name))  # `auto` resolved, as checkpoints record it
    report.say(f"data: {data.name}, {len(data.train.labels):,} train / {len(data.test.labels):,} test images, "
               f"from {data.where}")
    trainer = Trainer(cfg, d, data, report)
    result = trainer.run()
    report.close()
    report.say(summary.final_line(cfg, d, trainer.t.progress, trainer.target_outcome, result))
    return result.accuracy
