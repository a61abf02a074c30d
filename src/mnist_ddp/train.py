"""The training loop: one code path for one process and for any number of DDP ranks.

Every rank runs `run`; the launcher has already joined the process group (launch.py,
distributed.py) and leaves it afterwards. What makes the loop distributed, in the order
`Trainer.run` meets it:
- `wrap`: DDP around the model. It broadcasts rank 0's weights once, then all-reduces the
  gradients during every backward, so every rank takes the same optimizer step;
- `set_epoch`: every rank draws the same new shuffle and takes its own shard of it (batches.py);
- `_fold`: the ranks' loss sums and image counts (and the losses of the logged steps), added up with
  one all-reduce;
- `average_buffers`: BatchNorm's running statistics, averaged over the ranks before evaluating
  and saving, so that every rank scores, and rank 0 saves, the same model;
- `evaluate`: each rank scores its shard of the test set; one all-reduce makes it exact (evaluation.py);
- `d.is_main`: rank 0 alone writes checkpoints (here) and reports (report.py, whose methods do
  nothing on other ranks); `d.from_main` hands every rank what rank 0 read (the checkpoint);
- stopping early — divergence (`_stop_if_diverged`) or `--target-accuracy` — is decided from numbers
  every rank already shares (the all-reduced gradients, the folded loss, the all-reduced accuracy), so
  all ranks stop at the same step without a collective of their own, and none is left waiting.
"""

import inspect
import math
import platform
import time
from dataclasses import dataclass, replace
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from . import checkpoint, compute, datasets, schedule
from .batches import ShardedBatches
from .compute import autocast
from .config import Recipe, TrainConfig
from .distributed import Dist
from .errors import UserError
from .evaluation import EvalResult, evaluate
from .model import ConvNet
from .report import Reporter
from .timeline import StepProfiler

# Settings that shape the run; resuming with any of them changed would not continue the same run.
# The world size may change: the samples that remain are re-sharded over the new world (batches.py),
# and the lr follows the samples seen, not the steps taken (schedule.py).
RESUME_MUST_MATCH = ("recipe", "optimizer", "lr", "momentum", "weight_decay", "batch_size", "epochs",
                     "scheduler", "normalize", "label_smoothing", "seed")


class Diverged(UserError):
    """The loss or the gradients stopped being finite: not bad input, so exit code 1."""

    exit_code = 1


# How often the loop reads the scaler's verdict (`_stop_if_diverged`). Reading it waits for the device's
# queued work: free on the CPU, a stall on a GPU, so there once per this many steps (and before every save).
CHECK_EVERY_ON_ACCELERATORS = 50


def guard(device: torch.device, amp: str) -> torch.amp.GradScaler:
    """A GradScaler in every precision, as the guard against divergence: it checks the gradients on the
    device and skips (also on the device, with fused optimizers) every step whose gradients are not finite,
    so non-finite weights are never made. With fp16 it also scales the loss (skipped steps are normal while
    it finds the scale); otherwise its scale stays 1 (multiplying by 1 changes no bit) until a step is skipped.
    Either way a scale below 1 means divergence: in fp16, gradients that overflow even unscaled."""
    if amp == "fp16":
        return torch.amp.GradScaler(device.type)
    return torch.amp.GradScaler(device.type, init_scale=1.0, growth_interval=2**30)  # halves on a skip, never grows


@dataclass
class Progress:
    """Where the run stands; saved in every checkpoint."""

    epoch: int = 0  # epochs completed
    consumed: int = 0  # samples of the current epoch's permutation trained on, over all ranks (padding not counted)
    loss_sum: float = 0.0  # over all ranks, for the current epoch so far
    seen: int = 0  # training images over all ranks, current epoch so far
    best_accuracy: float = -1.0


def sync(device: torch.device) -> None:
    """Wait for queued GPU work, so that wall-clock timings mean something."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def build_optimizer(r: Recipe, model: nn.Module) -> tuple[torch.optim.Optimizer, schedule.Schedule]:
    """The recipe's optimizer, and its schedule: call it with the fraction of the run done before each step."""
    # One fused kernel per step instead of a handful per parameter: ~3x less optimizer time on the CPU.
    fused = {"fused": True} if compute.fused_optimizers(next(model.parameters()).device) else {}
    if r.optimizer == "sgd":
        opt: torch.optim.Optimizer = torch.optim.SGD(model.parameters(), lr=r.lr, momentum=r.momentum,
                                                     weight_decay=r.weight_decay, **fused)
    else:
        opt = torch.optim.AdamW(model.parameters(), lr=r.lr, betas=(r.momentum, 0.999),
                                weight_decay=r.weight_decay, **fused)
    return opt, schedule.build(r, opt)


# By default DDP re-sends rank 0's BatchNorm running statistics before every forward: one more collective
# per step, as slow as the gradient all-reduce itself at this size (~10% of a step with gloo on 2 cores).
# Each rank keeps its own statistics instead, and `average_buffers` makes them equal wherever they are
# used or saved. (torch 2.13 renamed the switch; `broadcast_buffers` is its older name.)
_NEW_NAME = "forward_sync_buffers" in inspect.signature(DDP).parameters
_NO_BUFFER_SYNC_PER_STEP = {"forward_sync_buffers": False} if _NEW_NAME else {"broadcast_buffers": False}


def wrap(model: nn.Module, cfg: TrainConfig, d: Dist) -> nn.Module:
    """DDP around the model when there are several ranks; torch.compile on request."""
    if d.world_size > 1:
        if cfg.sync_bn:
            model = nn.SyncBatchNorm.convert_sync_batchnorm(model)
        # DDP broadcasts rank 0's weights now, then all-reduces gradients in buckets during backward.
        # The model is tiny (29k parameters, 116 kB): one bucket, no copies (gradient_as_bucket_view),
        # and the same graph every step (static_graph) lets DDP skip its per-step bookkeeping.
        model = DDP(model, device_ids=[d.device.index] if d.device.type == "cuda" else None,
                    gradient_as_bucket_view=True, static_graph=True, bucket_cap_mb=1, **_NO_BUFFER_SYNC_PER_STEP)
    return torch.compile(model) if cfg.compile else model


def running_stats(model: nn.Module) -> list[torch.Tensor]:
    """BatchNorm's running statistics (not num_batches_tracked: equal on every rank anyway)."""
    return [b for b in model.buffers() if b.is_floating_point()]


def average_buffers(model: nn.Module, d: Dist) -> None:
    """Replace every rank's BatchNorm running statistics by their mean over the ranks (one all-reduce).

    The mean of the ranks' estimates also uses every rank's data, not rank 0's alone.
    """
    stats = running_stats(model)
    if d.world_size == 1 or not stats:
        return
    flat = d.all_sum(torch.cat([b.reshape(-1) for b in stats])).div_(d.world_size)
    for b, mean in zip(stats, flat.split([b.numel() for b in stats])):
        b.copy_(mean.view_as(b))


class Trainer:
    """One run, built once: the data's batches, the model, its optimizer; `run` trains it epoch by epoch."""

    def __init__(self, cfg: TrainConfig, d: Dist, data: datasets.Dataset, report: Reporter) -> None:
        self.cfg, self.d, self.data, self.report = cfg, d, data, report
        r = cfg.recipe
        self.amp = compute.amp_for(r.amp, d.device)
        self.channels_last = compute.channels_last_for(cfg.channels_last, d.device)
        layout = {"rank": d.rank, "world": d.world_size, "device": d.device, "normalize": r.normalize,
                  "channels_last": self.channels_last}
        self.train_batches = ShardedBatches(data.train.images, data.train.labels, r.batch_size, shuffle=True,
                                            seed=cfg.seed, **layout)
        self.test_batches = ShardedBatches(data.test.images, data.test.labels, cfg.eval_batch_size, shuffle=False,
                                           pad=False, **layout)
        self.model = ConvNet().to(d.device)  # the plain ConvNet: evaluated and saved
        if self.channels_last:
            self.model = self.model.to(memory_format=torch.channels_last)
        self.opt, self.schedule = build_optimizer(r, self.model)
        self.scaler = guard(d.device, self.amp)
        self.check_every = 1 if d.device.type == "cpu" else CHECK_EVERY_ON_ACCELERATORS
        self.target_outcome: str | None = None  # --target-accuracy: "reached", "already" (before resuming), "missed"
        self.progress = Progress()
        self.logged: list[tuple[int, float, torch.Tensor]] = []  # (samples, lr, this rank's loss), every --log-every
        self.ckpt_path = Path(cfg.out) / "checkpoint.pt"
        self.profiler = StepProfiler(cfg.profile, d, report, Path(cfg.out) / "profile")  # --profile (timeline.py)

    def run(self) -> EvalResult:
        """Train the remaining epochs; returns the last evaluation (the same on every rank)."""
        if self.cfg.resume:
            self._resume()
        self.report.begin(self.samples_done)
        if self._reached(self.progress.best_accuracy):  # an epoch before the resume reached the target
            self.target_outcome = "already"
            return evaluate(self.model, self.test_batches, self.d, self.amp)
        net = wrap(self.model, self.cfg, self.d)  # what trains; `self.model` is what is scored and saved
        self.profiler.watch(net)
        result = None
        for epoch in range(self.progress.epoch, self.cfg.recipe.epochs):
            seen_before, start = self.progress.seen, time.perf_counter()
            # A new shuffle each epoch, the same on every rank; resumed mid-epoch, only what remains of it.
            self.train_batches.set_epoch(epoch, start=self.progress.consumed)
            seconds = self._train_epoch(net, epoch)
            result = evaluate(self.model, self.test_batches, self.d, self.amp)
            speed = (self.progress.seen - seen_before) / seconds if seconds > 0 else math.nan
            self._record(epoch, result, speed, time.perf_counter() - start)
            self.progress = Progress(epoch=epoch + 1, best_accuracy=max(self.progress.best_accuracy, result.accuracy))
            self._save(self.ckpt_path)
            if result.accuracy >= self.progress.best_accuracy:
                self._save(self.ckpt_path.with_name("best.pt"))
            if self._reached(result.accuracy):  # the same all-reduced number on every rank: all stop here
                self.target_outcome = "reached"
                return result
        if self.cfg.target_accuracy is not None:
            self.target_outcome = "missed"
        if result is None:  # resumed a finished run: nothing left to train, so just report
            result = evaluate(self.model, self.test_batches, self.d, self.amp)
        return result

    def _train_epoch(self, net: nn.Module, epoch: int) -> float:
        """Train one epoch from `progress.consumed` on; returns the seconds it took."""
        cfg, d, progress = self.cfg, self.d, self.progress
        n, global_batch = len(self.data.train.labels), cfg.recipe.batch_size * d.world_size
        steps, done = len(self.train_batches), progress.consumed // global_batch  # of this epoch, at this world
        sync(d.device)
        start = time.perf_counter()
        loss_sum = torch.zeros((), device=d.device)  # this rank's, since the last fold
        seen_here = 0
        desc = f"epoch {epoch + 1}/{cfg.recipe.epochs}"
        for step, (x, y) in enumerate(self.report.bar(self.train_batches, done + steps, desc, initial=done), 1):
            self.schedule(self.samples_done / (cfg.recipe.epochs * n))
            with autocast(d.device, self.amp), self.profiler.phase("forward"):
                loss = F.cross_entropy(net(x), y, label_smoothing=cfg.recipe.label_smoothing)
            self.opt.zero_grad(set_to_none=True)
            with self.profiler.phase("backward"):
                self.scaler.scale(loss).backward()  # DDP all-reduces the gradients here, once the bucket is full
            with self.profiler.phase("optimizer"):
                self.scaler.step(self.opt)
                self.scaler.update()
            loss_sum += loss.detach().float() * len(y)  # stays on the device: no sync per step
            seen_here += len(y)
            progress.consumed = min(n, progress.consumed + global_batch)  # the padding is not a sample consumed
            if self.steps_done % cfg.log_every == 0:
                self._log_step(loss)
            if step % self.check_every == 0:
                self._stop_if_diverged()
            if cfg.checkpoint_every and step % cfg.checkpoint_every == 0 and step < steps:
                self._fold(loss_sum, seen_here)
                loss_sum.zero_()
                seen_here = 0
                average_buffers(self.model, d)
                self._save(self.ckpt_path)
            self.profiler.step(step, steps)
        self._fold(loss_sum, seen_here)
        average_buffers(self.model, d)
        sync(d.device)
        return time.perf_counter() - start

    @property
    def steps_done(self) -> int:
        """Optimizer steps of the run so far, counted at this world size (what --log-every counts)."""
        global_batch, n = self.cfg.recipe.batch_size * self.d.world_size, len(self.data.train.labels)
        return self.progress.epoch * math.ceil(n / global_batch) + math.ceil(self.progress.consumed / global_batch)

    @property
    def samples_done(self) -> int:
        """Training samples of the run so far, over all ranks: the schedule's clock and TensorBoard's x-axis,
        both of which must mean the same whatever the world size (a resume may change it)."""
        return self.progress.epoch * len(self.data.train.labels) + self.progress.consumed

    def _log_step(self, loss: torch.Tensor) -> None:
        """Keep this step's loss, on the device (no sync), and lr, for curves.png and TensorBoard. The next
        `_fold` averages the kept losses over the ranks (the global batch's loss, not rank 0's shard's) in
        the all-reduce it does anyway: no collective of their own."""
        self.logged.append((self.samples_done, self.opt.param_groups[0]["lr"], loss.detach().float()))

    def _fold(self, loss_sum: torch.Tensor, seen_here: int) -> None:
        """Add every rank's loss and image count since the last fold into `progress`; stop if the run diverged.

        Every save and evaluation comes after a fold, so none of them sees a diverged run. The same all-reduce
        counts the ranks' non-finite BatchNorm statistics, which no optimizer step guards (the forward pass
        updates them), so that every rank reaches the same verdict."""
        bad_stats = (~torch.cat([b.reshape(-1) for b in running_stats(self.model)]).isfinite()).sum().float()
        totals = self.d.all_sum(torch.stack([loss_sum.float(), torch.tensor(float(seen_here), device=self.d.device),
                                             bad_stats, *(loss for _, _, loss in self.logged)]))
        self.progress.loss_sum += float(totals[0])
        self.progress.seen += int(totals[1])
        n = len(self.data.train.labels)
        self.report.steps([{"samples": samples, "epoch": samples / n, "train_loss": loss / self.d.world_size,
                            "lr": lr} for (samples, lr, _), loss in zip(self.logged, totals[3:].tolist())])
        self.logged.clear()
        self._stop_if_diverged(finite=math.isfinite(self.progress.loss_sum) and not totals[2])

    def _reached(self, accuracy: float) -> bool:
        return self.cfg.target_accuracy is not None and accuracy >= self.cfg.target_accuracy

    def _stop_if_diverged(self, finite: bool = True) -> None:
        """Raise `Diverged`, on every rank at the same step, once the guard skipped a step or the caller saw
        something non-finite. The scale is the same on every rank without a collective of its own: it follows
        the gradients DDP all-reduced (`finite` must be such an agreed verdict too: see `_fold`)."""
        if finite and self.scaler.get_scale() >= 1:
            return
        lr, peak = self.opt.param_groups[0]["lr"], self.cfg.recipe.lr
        step = math.ceil(self.progress.consumed / (self.cfg.recipe.batch_size * self.d.world_size))
        raise Diverged(f"training diverged in epoch {self.progress.epoch + 1} by step {step} at lr "
                       f"{lr:.4g}: the loss, the gradients or BatchNorm's statistics are no longer finite. The "
                       f"checkpoints keep the last finite weights; start again with a smaller --lr (e.g. "
                       f"{peak / 10:.4g}) in a new --out.")

    def _record(self, epoch: int, result: EvalResult, images_per_second: float, seconds: float) -> None:
        """One line of metrics.jsonl, the console line and the plots (rank 0)."""
        p, r = self.progress, self.cfg.recipe
        self.report.epoch({
            "epoch": epoch + 1, "epochs": r.epochs,
            "train_loss": p.loss_sum / max(p.seen, 1),
            "test_loss": result.loss, "test_accuracy": result.accuracy,
            "test_correct": result.correct, "test_count": result.count,
            "train_samples": p.seen,  # over all ranks, the sampler's padding included
            "images_per_second": images_per_second, "epoch_seconds": seconds, "lr": self.opt.param_groups[0]["lr"],
            "world_size": self.d.world_size, "batch_size": r.batch_size, "dataset": self.data.name,
        }, result.confusion, self.data.classes, self.samples_done)

    def _save(self, path: Path) -> None:
        """Rank 0 writes a checkpoint (of BatchNorm statistics already averaged over the ranks)."""
        if self.d.is_main:
            checkpoint.save(path, {
                "model": checkpoint.plain_module(self.model).state_dict(),
                "optimizer": self.opt.state_dict(),
                "progress": vars(self.progress).copy(),
                "rng": torch.get_rng_state(),
                "config": self.cfg.to_dict() | {"world_size": self.d.world_size},
                "run_id": self.d.run_id,  # a torchrun restart of this same job continues it without --resume
            })

    def _resume(self) -> None:
        """Continue from `<out>/checkpoint.pt` if there is one. Rank 0 reads it and sends it to all ranks,
        so nodes without a shared file system resume too."""
        cfg, path = self.cfg, self.ckpt_path
        ckpt = self.d.from_main(lambda: checkpoint.load_resumable(path) if path.exists() else None)
        if ckpt is None:
            self.report.say(f"resume: no checkpoint in {cfg.out} yet, starting from scratch")
            return
        saved = ckpt.get("config", {})
        current = cfg.to_dict()
        changed = [k for k in RESUME_MUST_MATCH if k in saved and saved[k] != current[k]]
        if saved.get("data", {}).get("dataset") not in (None, cfg.data.dataset):
            changed.append("dataset")
        if changed:
            raise UserError(f"{path} was saved with different settings ({', '.join(changed)}); "
                            f"resume with the same settings or start a new --out.")
        checkpoint.restore_model(self.model, ckpt["model"], path)
        self.opt.load_state_dict(ckpt["optimizer"])
        torch.set_rng_state(ckpt["rng"])
        n, saved_progress = len(self.data.train.labels), ckpt["progress"]
        if "step" in saved_progress:  # saved before positions were counted in samples: per-rank steps
            steps = saved_progress.pop("step")
            saved_progress["consumed"] = min(n, steps * cfg.recipe.batch_size * saved.get("world_size", 1))
        self.progress = Progress(**saved_progress)
        self.report.keep_epochs_before(self.progress.epoch)  # a line of the epoch in progress was never saved
        self.report.say(f"resume: from {path}, epoch {self.progress.epoch + 1}, {self.progress.consumed:,} of its "
                        f"{n:,} samples done")
        was, now, batch = saved.get("world_size", self.d.world_size), self.d.world_size, cfg.recipe.batch_size
        if was != now:
            self.report.say(f"resume: world size changed {was} → {now}, global batch {batch * was} → {batch * now}; "
                            f"allowed: the per-process batch and lr are unchanged, the global batch follows the world "
                            f"(README: Learning rate and world size), and the remaining samples are re-sharded")


def run(cfg: TrainConfig, d: Dist) -> float:
    """Train for the recipe's epochs; returns the final test accuracy (the same on every rank)."""
    report = Reporter(Path(cfg.out), d.is_main, cfg.progress, cfg.plots, cfg.tensorboard)
    torch.manual_seed(cfg.seed)  # the same initial weights on every rank (DDP broadcasts rank 0's anyway)
    compute.configure_backends(d.device, cfg.deterministic)
    data = datasets.load(cfg.data)
    cfg = replace(cfg, data=replace(cfg.data, dataset=data.name))  # `auto` resolved, as checkpoints record it
    report.say(f"data: {data.name}, {len(data.train.labels):,} train / {len(data.test.labels):,} test images, "
               f"from {data.where}")
    trainer = Trainer(cfg, d, data, report)
    r = cfg.recipe
    report.say(f"run: torch {torch.__version__}, python {platform.python_version()}, device {d.device.type}, "
               f"world size {d.world_size}, {torch.get_num_threads()} thread(s) per process, "
               f"batch {r.batch_size} per process ({r.batch_size * d.world_size} global), "
               f"{r.optimizer} lr {r.lr}, {r.scheduler} schedule, amp {trainer.amp}, "
               f"channels_last {trainer.channels_last}")
    result = trainer.run()
    report.close()
    report.say(final_line(cfg, trainer, result))
    return result.accuracy


def final_line(cfg: TrainConfig, trainer: Trainer, result: EvalResult) -> str:
    """The run's last word: the accuracy, and how the run ended against --target-accuracy if one was set."""
    r, target, done = cfg.recipe, f"{cfg.target_accuracy or 0:.2%}", trainer.progress.epoch
    score = f"test accuracy {100 * result.accuracy:.2f}% ({result.correct}/{result.count}) on {cfg.data.dataset}"
    where = f"world size {trainer.d.world_size}; outputs in {cfg.out}"
    if trainer.target_outcome == "already":
        return (f"final: already done: an earlier epoch reached the target {target} (best test accuracy "
                f"{trainer.progress.best_accuracy:.2%}), so nothing was trained; raise --target-accuracy or leave "
                f"it out to train on; outputs in {cfg.out}")
    if trainer.target_outcome == "reached":
        return f"final: reached the target {target} after epoch {done} of {r.epochs}: {score}, {where}"
    if trainer.target_outcome == "missed":
        return f"final: did not reach the target {target} in {r.epochs} epochs: {score}, {where}"
    return f"final: {score} after {r.epochs} epochs, {where}"
