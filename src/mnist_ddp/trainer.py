"""The training loop: one code path for one process and for any number of DDP ranks.

Every rank runs `run`; the launcher has already joined the process group (launch.py,
distributed.py) and leaves it afterwards. What makes the loop distributed, in the order
`Trainer.run` meets it:
- `wrap`: DDP around the model. It broadcasts rank 0's weights once, then reduces the gradients
  during backward with the run's comm hook (reduction.py: DDP's mean, or `--bitwise`'s slot order),
  so every rank takes the same optimizer step;
- `set_epoch`: every rank draws the same new shuffle; each step of it is the run's global batch
  (M micro-batches, fixed at the first start), of which each rank takes its share (batches.py);
- `steps.accumulate`: forward and backward of the rank's micro-batches, all but the last inside
  `no_sync`, so the gradients are reduced once per step;
- `_fold`: the ranks' loss sums and image counts (and the losses of the logged steps), added up with
  one all-reduce;
- `stats.average`: BatchNorm's running statistics, averaged over the ranks (and micro-batch parts)
  before evaluating and saving, so that every rank scores, and rank 0 saves, the same model;
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
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from . import checkpoint, compute, datasets, reduction, schedule
from .batches import ShardedBatches, Share, StepBatches
from .config import Recipe, TrainConfig
from .distributed import Dist
from .errors import UserError
from .evaluation import EvalResult, evaluate
from .model import ConvNet
from .report import Reporter
from .steps import PartStats, accumulate, running_stats
from .timeline import StepProfiler

# Settings that shape the run; resuming with any of them changed would not continue the same run.
# The world size may change: the run's global batch (M micro-batches of batch_size) is in the checkpoint,
# and any world shares its micro-batches (batches.py), so the steps, and the lr at each, stay the same.
RESUME_MUST_MATCH = ("recipe", "optimizer", "lr", "momentum", "weight_decay", "batch_size", "epochs",
                     "scheduler", "normalize", "label_smoothing", "seed", "bitwise")
# A --bitwise run promises the same bits through any resume, so the kernels may not change either.
BITWISE_MUST_MATCH = ("amp", "channels_last", "compile", "deterministic")


def run_settings(cfg: TrainConfig, world_size: int) -> dict[str, str]:
    """What every rank of one run must agree on, which each proves at check-in (membership.py): the settings a
    resume must keep, the data and its share per rank, and the world. A rank that differs in any of them would
    compute another run's steps, or wait for collectives the others never make."""
    flat = cfg.to_dict()
    agreed = {k: flat[k] for k in RESUME_MUST_MATCH} | {
        "dataset": cfg.data.dataset, "train_samples": cfg.data.train_samples, "test_samples": cfg.data.test_samples,
        "accumulate": cfg.accumulate, "world_size": world_size}
    return {k: str(v) for k, v in agreed.items()}


class Diverged(UserError):
    """The loss or the gradients stopped being finite: not bad input, so exit code 1."""

    exit_code = 1


# How often the loop reads the scaler's verdict (`_stop_if_diverged`) where reading it costs a wait: on a GPU
# with fused optimizers, whose steps never wait for the device (and before every save).
CHECK_EVERY_ON_ACCELERATORS = 50


def check_every(device: torch.device) -> int:
    """Steps between readings of the guard's verdict. Reading it waits for the device's queued work: free on the
    CPU, a stall on a GPU. Where the optimizer is not fused (MPS) the scaler's step already waits each step
    (GradScaler._maybe_opt_step reads found_inf with .item()), so reading every step costs nothing more."""
    return 1 if device.type == "cpu" or not compute.fused_optimizers(device) else CHECK_EVERY_ON_ACCELERATORS


# GradScaler("mps") raised on torch 2.5-2.6 (its fp64 reciprocal: pytorch#142397) and its MPS kernels came
# later (pytorch#150255); 2.13's grad_scaler.py special-cases mps:0. Older torch on MPS gets a disabled scaler.
# (torch.__version__ compares as a version: "2.10" > "2.4".)
MPS_SCALER_SINCE = "2.10"


def guard(device: torch.device, amp: str) -> torch.amp.GradScaler:
    """A GradScaler in every precision, as the guard against divergence: it checks the gradients on the
    device and skips (also on the device, with fused optimizers) every step whose gradients are not finite,
    so non-finite weights are never made. With fp16 it also scales the loss (skipped steps are normal while
    it finds the scale); otherwise its scale stays 1 (multiplying by 1 changes no bit) until a step is skipped.
    Either way a scale below 1 means divergence: in fp16, gradients that overflow even unscaled.
    On MPS before torch 2.10 it is disabled (its scale reads 1): a diverged run is then caught by the loss and
    BatchNorm checks of the next fold, still before anything is saved."""
    if device.type == "mps" and torch.__version__ < MPS_SCALER_SINCE:
        return torch.amp.GradScaler(device.type, enabled=False)
    if amp == "fp16":
        return torch.amp.GradScaler(device.type)
    return torch.amp.GradScaler(device.type, init_scale=1.0, growth_interval=2**30)  # halves on a skip, never grows


def check_sync_bn(sync_bn: bool, share: Share) -> None:
    """Refuse --sync-bn where ranks run different numbers of micro-batches per step (a resume at a world that
    does not divide the run's M): every forward of a SyncBatchNorm all-gathers statistics and every backward
    all-reduces gradients (torch/nn/modules/_functions.py), so a rank with one more micro-batch would issue
    collectives its peers never match, and every rank would wait until --timeout. Equal shares pair: K
    micro-batches per rank make K all-gathers and K all-reduces per BatchNorm layer on every rank, in the same
    order, and no_sync, which only holds back DDP's gradient all-reduce, changes none of them."""
    counts = {len(share.mine(rank)) for rank in range(share.world)}
    if sync_bn and share.world > 1 and len(counts) > 1:
        raise UserError(f"--sync-bn needs every process to run the same number of micro-batches per step, but "
                        f"{share.world} processes share this run's {share.slots} unevenly ({min(counts)} or "
                        f"{max(counts)} each); resume with a world size that divides {share.slots}, or without "
                        f"--sync-bn.")


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
# Each rank keeps its own statistics instead, and `PartStats.average` makes them equal wherever they are
# used or saved. (torch 2.13 renamed the switch; `broadcast_buffers` is its older name.)
_NEW_NAME = "forward_sync_buffers" in inspect.signature(DDP).parameters
_NO_BUFFER_SYNC_PER_STEP = {"forward_sync_buffers": False} if _NEW_NAME else {"broadcast_buffers": False}


def wrap(model: nn.Module, cfg: TrainConfig, d: Dist, accumulating: bool = False,
         reduce: reduction.Reduction | None = None) -> nn.Module:
    """DDP around the model when there are several ranks, reducing the gradients with `reduce` (default: DDP's
    mean); torch.compile on request.

    `accumulating`: some rank runs several micro-batches per step, under `no_sync`."""
    if d.world_size > 1:
        if cfg.sync_bn:
            model = nn.SyncBatchNorm.convert_sync_batchnorm(model)
        # DDP broadcasts rank 0's weights now, then all-reduces gradients in buckets during backward.
        # The model is tiny (29k parameters, 116 kB): one bucket, no copies (gradient_as_bucket_view),
        # and the same graph every step (static_graph) lets DDP skip its per-step bookkeeping. Not with
        # no_sync: DDP asserts when the first backward is inside no_sync (pytorch#143580), and the proposed fix
        # found that static_graph with no_sync stops all-reducing after the first step (pytorch#187732).
        model = DDP(model, device_ids=[d.device.index] if d.device.type == "cuda" else None,
                    gradient_as_bucket_view=True, static_graph=not accumulating, bucket_cap_mb=1,
                    **_NO_BUFFER_SYNC_PER_STEP)
        # The all-reduce: DDP calls the hook with each bucket of gradients that backward filled (reduction.py).
        model.register_comm_hook(reduce or reduction.MeanReduction(d.world_size), reduction.comm_hook)
    return torch.compile(model) if cfg.compile else model


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
        self.model = ConvNet().to(d.device)  # the plain ConvNet: evaluated and saved
        if self.channels_last:
            self.model = self.model.to(memory_format=torch.channels_last)
        self.opt, self.schedule = build_optimizer(r, self.model)
        # The run's global batch: M micro-batches of batch_size, M = world × --accumulate at the first start
        # (a resume takes the checkpoint's M instead: `_resume`).
        self._share(Share(slots=d.world_size * cfg.accumulate, world=d.world_size, whole=cfg.bitwise))
        self.scaler = guard(d.device, self.amp)
        self.check_every = check_every(d.device)
        self.target_outcome: str | None = None  # --target-accuracy: "reached", "already" (before resuming), "missed"
        self.progress = Progress()
        # (samples done, lr, this rank's loss sum, the step's samples) of every --log-every-th step, until the next fold
        self.logged: list[tuple[int, float, torch.Tensor, int]] = []
        self.ckpt_path = Path(cfg.out) / "checkpoint.pt"
        self.profiler = StepProfiler(cfg.profile, d, report, Path(cfg.out) / "profile")  # --profile (timeline.py)

    def _share(self, share: Share, saved_stats: torch.Tensor | None = None) -> None:
        """Deal the run's micro-batches over this world: this rank's steps, its BatchNorm statistics per part
        (`saved_stats`: every part's, from a checkpoint), and the reduction of their gradients."""
        r, d = self.cfg.recipe, self.d
        check_sync_bn(self.cfg.sync_bn, share)
        self.train_batches = StepBatches(self.data.train.images, self.data.train.labels, r.batch_size, share,
                                         rank=d.rank, device=d.device, seed=self.cfg.seed, normalize=r.normalize,
                                         channels_last=self.channels_last)
        self.stats = PartStats(self.model, share, d.rank, saved_stats)
        self.reduction = reduction.for_run(self.cfg.bitwise, self.model, share, d.rank)

    def run(self) -> EvalResult:
        """Train the remaining epochs; returns the last evaluation (the same on every rank)."""
        if self.cfg.resume:
            self._resume()
        self.report.say(run_line(self))
        self.report.begin(self.samples_done)
        if self._reached(self.progress.best_accuracy):  # an epoch before the resume reached the target
            self.target_outcome = "already"
            return evaluate(self.model, self.test_batches, self.d, self.amp)
        # What trains; `self.model` is what is scored and saved.
        share = self.train_batches.share
        net = wrap(self.model, self.cfg, self.d, accumulating=share.parts > share.world, reduce=self.reduction)
        self.profiler.watch(self.reduction)
        result = None
        for epoch in range(self.progress.epoch, self.cfg.recipe.epochs):
            seen_before, start = self.progress.seen, time.perf_counter()
            # A new shuffle each epoch, the same on every rank; resumed mid-epoch, only the steps that remain.
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
        cfg, d, progress, batches = self.cfg, self.d, self.progress, self.train_batches
        n, r = len(self.data.train.labels), cfg.recipe
        sync(d.device)
        start = time.perf_counter()
        loss_sum = torch.zeros((), device=d.device)  # this rank's, since the last fold
        seen_here = 0
        desc = f"epoch {epoch + 1}/{r.epochs}"
        for step in self.report.bar(batches, batches.steps_per_epoch, desc, initial=batches.first):
            d.at("training", epoch + 1, self.step_in_epoch + 1)  # for a peer's timeout message: who hangs where
            self.schedule(self.samples_done / (r.epochs * n))
            self.opt.zero_grad(set_to_none=True)
            step_loss = accumulate(net, step, self.stats, self.reduction, self.scaler, self.amp, r.label_smoothing,
                                   self.profiler.phase)
            with self.profiler.phase("optimizer"):
                self.scaler.step(self.opt)
                self.scaler.update()
            loss_sum += step_loss  # stays on the device: no sync per step
            seen_here += sum(len(mb.y) for mb in step.micro_batches)
            progress.consumed = min(n, progress.consumed + step.samples)  # the padding is not a sample consumed
            if self.steps_done % cfg.log_every == 0:
                self._log_step(step_loss, step.samples)
            if self.steps_done % self.check_every == 0:
                self._stop_if_diverged()
            if cfg.checkpoint_every and self.step_in_epoch % cfg.checkpoint_every == 0 and progress.consumed < n:
                self._fold(loss_sum, seen_here)
                loss_sum.zero_()
                seen_here = 0
                self._save(self.ckpt_path)
            self.profiler.step(self.step_in_epoch, batches.steps_per_epoch)
        self._fold(loss_sum, seen_here)
        sync(d.device)
        return time.perf_counter() - start

    @property
    def step_in_epoch(self) -> int:
        """Optimizer steps of the current epoch done (what --checkpoint-every counts): the same at any world."""
        return math.ceil(self.progress.consumed / self.train_batches.global_batch)

    @property
    def steps_done(self) -> int:
        """Optimizer steps of the run so far (what --log-every counts)."""
        return self.progress.epoch * self.train_batches.steps_per_epoch + self.step_in_epoch

    @property
    def samples_done(self) -> int:
        """Training samples of the run so far, over all ranks: the schedule's clock and TensorBoard's x-axis."""
        return self.progress.epoch * len(self.data.train.labels) + self.progress.consumed

    def _log_step(self, loss_sum: torch.Tensor, samples: int) -> None:
        """Keep this step's loss sum, on the device (no sync), and lr, for curves.png and TensorBoard. The next
        `_fold` adds the kept sums over the ranks in the all-reduce it does anyway (no collective of their own),
        making each the mean over its step's whole global batch, not rank 0's share alone."""
        self.logged.append((self.samples_done, self.opt.param_groups[0]["lr"], loss_sum.clone(), samples))

    def _fold(self, loss_sum: torch.Tensor, seen_here: int) -> None:
        """Average BatchNorm's statistics, add every rank's loss and image count since the last fold into
        `progress`; stop if the run diverged.

        Every save and evaluation comes after a fold, so none of them sees a diverged run. The same all-reduce
        counts non-finite BatchNorm statistics, which no optimizer step guards (the forward pass updates them),
        so that every rank reaches the same verdict."""
        self.stats.average(self.steps_done)
        bad_stats = (~torch.cat([b.reshape(-1) for b in running_stats(self.model)]).isfinite()).sum().float()
        totals = self.d.all_sum(torch.stack([loss_sum.float(), torch.tensor(float(seen_here), device=self.d.device),
                                             bad_stats, *(loss for _, _, loss, _ in self.logged)]))
        self.progress.loss_sum += float(totals[0])
        self.progress.seen += int(totals[1])
        n = len(self.data.train.labels)
        self.report.steps([{"samples": done, "epoch": done / n, "train_loss": loss / samples, "lr": lr}
                           for (done, lr, _, samples), loss in zip(self.logged, totals[3:].tolist())])
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
        raise Diverged(f"training diverged in epoch {self.progress.epoch + 1} by step {self.step_in_epoch} at lr "
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
            "world_size": self.d.world_size, "batch_size": r.batch_size,
            "global_batch": self.train_batches.global_batch, "dataset": self.data.name,
        }, result.confusion, self.data.classes, self.samples_done)

    def _save(self, path: Path) -> None:
        """Rank 0 writes a checkpoint (of BatchNorm statistics already averaged over the ranks); checkpoint.pt
        keeps the one before it as checkpoint.prev.pt, for `--resume` to fall back to."""
        if self.d.is_main:
            self.d.raise_if_aborted()  # numbers made after NCCL aborted its communicator are no checkpoint
            self.d.at(f"saving {path.name}")
            checkpoint.save(path, {
                "model": checkpoint.plain_module(self.model).state_dict(),
                "optimizer": self.opt.state_dict(),
                "progress": vars(self.progress).copy(),
                "rng": torch.get_rng_state(),
                "config": self.cfg.to_dict() | {"world_size": self.d.world_size},
                "micro_batches": self.train_batches.share.slots,  # the run's global batch: M micro-batches
                "batchnorm_parts": self.stats.parts,  # every part's statistics: the model holds their mean
                "scaler": self.scaler.state_dict(),
                "run_id": self.d.run_id,  # a torchrun restart of this same job continues it without --resume
            }, keep_previous=path == self.ckpt_path)

    def _same_run(self, path: Path, ckpt: dict) -> None:
        """Refuse a checkpoint of another run: one saved with other settings (or of another dataset)."""
        saved, current = ckpt.get("config", {}), self.cfg.to_dict()
        keys = RESUME_MUST_MATCH + (BITWISE_MUST_MATCH if saved.get("bitwise") else ())
        changed = [k for k in keys if k in saved and saved[k] != current[k]]
        if saved.get("data", {}).get("dataset") not in (None, self.cfg.data.dataset):
            changed.append("dataset")
        if changed:
            raise UserError(f"{path} was saved with different settings ({', '.join(changed)}); "
                            f"resume with the same settings or start a new --out.")

    def _resume(self) -> None:
        """Continue from `<out>/checkpoint.pt` if there is one (else from the intact one saved before it).
        Rank 0 reads it and sends it to all ranks, so nodes without a shared file system resume too."""
        cfg = self.cfg
        found = self.d.from_main(lambda: checkpoint.load_latest(self.ckpt_path, self._same_run, self.report.say),
                                 checkpoint.pack, checkpoint.unpack)
        if found is None:
            self.report.say(f"resume: no checkpoint in {cfg.out} yet, starting from scratch")
            return
        path, ckpt = found
        saved = ckpt.get("config", {})
        checkpoint.restore_model(self.model, ckpt["model"], path)
        self.opt.load_state_dict(ckpt["optimizer"])
        if "scaler" in ckpt:
            self.scaler.load_state_dict(ckpt["scaler"])
        torch.set_rng_state(ckpt["rng"])
        n, saved_progress = len(self.data.train.labels), ckpt["progress"]
        if "step" in saved_progress:  # saved before positions were counted in samples: per-rank steps
            steps = saved_progress.pop("step")
            saved_progress["consumed"] = min(n, steps * cfg.recipe.batch_size * saved.get("world_size", 1))
        self.progress = Progress(**saved_progress)
        self.report.keep_epochs_before(self.progress.epoch)  # a line of the epoch in progress was never saved
        self.report.say(f"resume: from {path}, epoch {self.progress.epoch + 1}, {self.progress.consumed:,} of its "
                        f"{n:,} samples done")
        # The run's global batch is the checkpoint's, whatever this world and --accumulate would make of a new run
        # (checkpoints from before it was recorded: one micro-batch per process).
        was, now = saved.get("world_size", self.d.world_size), self.d.world_size
        share = Share(slots=ckpt.get("micro_batches", was), world=now, whole=cfg.bitwise)
        # After restore_model: without every part's saved statistics (or with other parts), each starts from their mean.
        self._share(share, ckpt.get("batchnorm_parts"))
        if was != now or share.slots != now * cfg.accumulate:
            batch = cfg.recipe.batch_size
            how = share.describe(batch)
            self.report.say(f"resume: world size {was} → {now}; the run's global batch stays {share.slots * batch} "
                            f"({share.slots} micro-batches of {batch}), and so do its steps and the lr at each"
                            + (f": {how}" if how else ""))


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
    report.say(final_line(cfg, trainer, result))
    return result.accuracy


def run_line(trainer: Trainer) -> str:
    """What is about to run: the software, the world, and the run's global batch and how this world shares it."""
    r, d, batches, bitwise = trainer.cfg.recipe, trainer.d, trainer.train_batches, trainer.cfg.bitwise
    share = batches.share.describe(r.batch_size)
    pinned = " (pinned by --bitwise: the kernels' sums depend on it)" if bitwise and d.device.type == "cpu" else ""
    reduced = ("bitwise: every micro-batch's gradient summed in slot order" if bitwise
               else "averaged by all-reduce")
    return (f"run: torch {torch.__version__}, python {platform.python_version()}, device {d.device.type}, "
            f"world size {d.world_size}, {torch.get_num_threads()} thread(s) per process{pinned}, "
            f"global batch {batches.global_batch} ({batches.share.slots} micro-batches of {r.batch_size}"
            f"{'; ' + share if share else ''}), gradients {reduced}, {r.optimizer} lr {r.lr}, {r.scheduler} "
            f"schedule, amp {trainer.amp}, channels_last {trainer.channels_last}")


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
