"""The training loop: one code path for one process and for any number of DDP ranks.

Every rank runs this same function. The launch mode only decided how `Dist` was
built; here DDP shows up in exactly four places: wrapping the model (gradients are
all-reduced during backward), `set_epoch` on the sharded batches, the all-reduced
metrics, and `d.is_main` deciding who writes files.
"""

import inspect
import math
import platform
import time
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from . import checkpoint, compute, datasets
from .batches import ShardedBatches
from .config import TrainConfig
from .distributed import Dist
from .errors import UserError
from .evaluation import autocast, evaluate
from .model import ConvNet
from .report import Reporter

# Settings that shape the run; resuming with any of them changed would not continue the same run.
RESUME_MUST_MATCH = ("recipe", "optimizer", "lr", "momentum", "weight_decay", "batch_size", "epochs",
                     "scheduler", "normalize", "label_smoothing", "seed", "world_size")


@dataclass
class Progress:
    """Where the run stands; saved in every checkpoint."""

    epoch: int = 0  # epochs completed
    step: int = 0  # optimizer steps done in the current epoch
    loss_sum: float = 0.0  # over all ranks, for the current epoch so far
    seen: int = 0  # training images over all ranks, current epoch so far
    best_accuracy: float = -1.0


def sync(device: torch.device) -> None:
    """Wait for queued GPU work, so that wall-clock timings mean something."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def build_optimizer(cfg: TrainConfig, model: nn.Module, steps: int) -> tuple[torch.optim.Optimizer, Any]:
    """The recipe's optimizer and a per-step LR schedule over `steps` steps (None for constant LR)."""
    assert cfg.lr is not None and cfg.momentum is not None and cfg.weight_decay is not None
    # One fused kernel per step instead of a handful per parameter: ~3x less optimizer time on the CPU.
    fused = {"fused": True} if compute.fused_optimizers(next(model.parameters()).device) else {}
    if cfg.optimizer == "sgd":
        opt: torch.optim.Optimizer = torch.optim.SGD(model.parameters(), lr=cfg.lr, momentum=cfg.momentum,
                                                     weight_decay=cfg.weight_decay, **fused)
    else:
        opt = torch.optim.AdamW(model.parameters(), lr=cfg.lr, betas=(cfg.momentum, 0.999),
                                weight_decay=cfg.weight_decay, **fused)
    if cfg.scheduler == "onecycle":
        # A quarter of the steps warm up; OneCycleLR divides by zero when that is exactly one step.
        pct_start = 0.25 if steps * 0.25 != 1 else 0.5
        return opt, torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=cfg.lr, total_steps=steps, pct_start=pct_start)
    if cfg.scheduler == "cosine":
        return opt, torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=steps)
    return opt, None


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


def average_buffers(model: nn.Module, d: Dist) -> None:
    """Replace every rank's BatchNorm running statistics by their mean over the ranks (one all-reduce).

    Called before each evaluation and checkpoint, so every rank scores, and rank 0 saves, the
    same model; the mean of the ranks' estimates also uses every rank's data, not rank 0's alone.
    """
    stats = [b for b in model.buffers() if b.is_floating_point()]  # not num_batches_tracked: equal anyway
    if d.world_size == 1 or not stats:
        return
    flat = d.all_sum(torch.cat([b.reshape(-1) for b in stats])).div_(d.world_size)
    for b, mean in zip(stats, flat.split([b.numel() for b in stats])):
        b.copy_(mean.view_as(b))


def _resume(cfg: TrainConfig, d: Dist, model: nn.Module, opt: torch.optim.Optimizer, sched: Any,
            report: Reporter) -> Progress:
    """Load `<out>/checkpoint.pt` if there is one. Rank 0 reads it and sends it to all ranks,
    so nodes without a shared file system resume too."""
    path = Path(cfg.out) / "checkpoint.pt"
    ckpt = d.from_main(lambda: checkpoint.load_resumable(path) if path.exists() else None)
    if ckpt is None:
        report.say(f"resume: no checkpoint in {cfg.out} yet, starting from scratch")
        return Progress()
    saved = ckpt.get("config", {})
    current = cfg.to_dict() | {"world_size": d.world_size}
    changed = [k for k in RESUME_MUST_MATCH if k in saved and saved[k] != current[k]]
    if saved.get("data", {}).get("dataset") not in (None, cfg.data.dataset):
        changed.append("dataset")
    if changed:
        raise UserError(f"{path} was saved with different settings ({', '.join(changed)}); "
                        f"resume with the same settings or start a new --out.")
    checkpoint.restore_model(model, ckpt["model"], path)
    opt.load_state_dict(ckpt["optimizer"])
    if sched is not None:
        sched.load_state_dict(ckpt["scheduler"])
    torch.set_rng_state(ckpt["rng"])
    progress = Progress(**ckpt["progress"])
    report.keep_epochs_before(progress.epoch)  # a metrics line of the epoch in progress was never saved in it
    report.say(f"resume: from {path}, epoch {progress.epoch + 1} step {progress.step}")
    return progress


@dataclass
class _Loop:
    """What every epoch uses, built once by `run`: one epoch of training, and saving."""

    cfg: TrainConfig
    d: Dist
    model: nn.Module  # the plain ConvNet: evaluated and saved
    net: nn.Module  # what trains: DDP (and/or torch.compile) around `model`
    opt: torch.optim.Optimizer
    sched: Any
    report: Reporter
    scaler: torch.amp.GradScaler = field(init=False)  # loss scaling for fp16; a no-op otherwise
    ckpt_path: Path = field(init=False)

    def __post_init__(self) -> None:
        self.scaler = torch.amp.GradScaler(self.d.device.type, enabled=self.cfg.amp == "fp16")
        self.ckpt_path = Path(self.cfg.out) / "checkpoint.pt"

    def train_epoch(self, batches: ShardedBatches, epoch: int, progress: Progress) -> float:
        """Train one epoch from `progress.step` on, updating `progress`; returns the seconds it took."""
        cfg, d = self.cfg, self.d
        batches.set_epoch(epoch)  # a new shuffle each epoch, the same on every rank
        steps = len(batches)
        sync(d.device)
        start = time.perf_counter()
        loss_sum = torch.zeros((), device=d.device)  # this rank's, since the last all-reduce
        seen_here = 0
        for x, y in self.report.bar(batches.iterate(skip=progress.step), steps, f"epoch {epoch + 1}/{cfg.epochs}",
                                    initial=progress.step):
            with autocast(d.device, cfg.amp):
                loss = F.cross_entropy(self.net(x), y, label_smoothing=cfg.label_smoothing)
            self.opt.zero_grad(set_to_none=True)
            self.scaler.scale(loss).backward()  # DDP all-reduces the gradients here, once the bucket is full
            self.scaler.step(self.opt)
            self.scaler.update()
            if self.sched is not None:
                self.sched.step()
            loss_sum += loss.detach().float() * len(y)  # stays on the device: no sync per step
            seen_here += len(y)
            progress.step += 1
            if cfg.checkpoint_every and progress.step % cfg.checkpoint_every == 0 and progress.step < steps:
                _fold(d, progress, loss_sum, seen_here)
                loss_sum.zero_()
                seen_here = 0
                average_buffers(self.model, d)
                self.save(self.ckpt_path, progress)
        _fold(d, progress, loss_sum, seen_here)
        average_buffers(self.model, d)
        sync(d.device)
        return time.perf_counter() - start

    def save(self, path: Path, progress: Progress) -> None:
        """Rank 0 writes a checkpoint (of BatchNorm statistics already averaged over the ranks)."""
        if self.d.is_main:
            checkpoint.save(path, {
                "model": checkpoint.plain_module(self.model).state_dict(),
                "optimizer": self.opt.state_dict(),
                "scheduler": self.sched.state_dict() if self.sched is not None else None,
                "progress": vars(progress).copy(),
                "rng": torch.get_rng_state(),
                "config": self.cfg.to_dict() | {"world_size": self.d.world_size},
            })


def run(cfg: TrainConfig, d: Dist) -> float:
    """Train for `cfg.epochs` epochs; returns the final test accuracy (same on every rank)."""
    cfg = compute.resolve(cfg.resolve(), d.device)
    assert cfg.batch_size and cfg.epochs and cfg.normalize is not None and cfg.label_smoothing is not None
    out = Path(cfg.out)
    report = Reporter(out, d.is_main, cfg.progress, cfg.plots)
    torch.manual_seed(cfg.seed)  # the same initial weights on every rank (DDP broadcasts rank 0's anyway)
    compute.configure_backends(d.device, cfg.deterministic)

    data = datasets.load(cfg.data.request())
    cfg = replace(cfg, data=replace(cfg.data, dataset=data.name))  # `auto` resolved, as checkpoints record it
    report.say(f"data: {data.name}, {len(data.train.labels):,} train / {len(data.test.labels):,} test images, "
               f"from {data.where}")
    report.say(f"run: torch {torch.__version__}, python {platform.python_version()}, device {d.device.type}, "
               f"world size {d.world_size}, {torch.get_num_threads()} thread(s) per process, "
               f"batch {cfg.batch_size} per process ({cfg.batch_size * d.world_size} global), "
               f"{cfg.optimizer} lr {cfg.lr}, {cfg.scheduler} schedule, amp {cfg.amp}, "
               f"channels_last {cfg.channels_last}")

    common = {"rank": d.rank, "world": d.world_size, "device": d.device, "normalize": cfg.normalize,
              "channels_last": cfg.channels_last}
    train_batches = ShardedBatches(data.train.images, data.train.labels, cfg.batch_size, shuffle=True,
                                   seed=cfg.seed, **common)
    test_batches = ShardedBatches(data.test.images, data.test.labels, cfg.eval_batch_size, shuffle=False,
                                  pad=False, **common)

    model = ConvNet().to(d.device)
    if cfg.channels_last:
        model = model.to(memory_format=torch.channels_last)
    opt, sched = build_optimizer(cfg, model, len(train_batches) * cfg.epochs)
    progress = _resume(cfg, d, model, opt, sched, report) if cfg.resume else Progress()
    loop = _Loop(cfg, d, model, wrap(model, cfg, d), opt, sched, report)

    result = None
    for epoch in range(progress.epoch, cfg.epochs):
        seen_before, start = progress.seen, time.perf_counter()
        train_seconds = loop.train_epoch(train_batches, epoch, progress)
        result = evaluate(model, test_batches, d, cfg.amp)
        report.epoch({
            "epoch": epoch + 1, "epochs": cfg.epochs,
            "train_loss": progress.loss_sum / max(progress.seen, 1),
            "test_loss": result.loss, "test_accuracy": result.accuracy,
            "test_correct": result.correct, "test_count": result.count,
            "images_per_second": (progress.seen - seen_before) / train_seconds if train_seconds > 0 else math.nan,
            "epoch_seconds": time.perf_counter() - start, "lr": opt.param_groups[0]["lr"],
            "world_size": d.world_size, "batch_size": cfg.batch_size, "dataset": data.name,
        }, result.confusion, data.classes)
        progress = Progress(epoch=epoch + 1, best_accuracy=max(progress.best_accuracy, result.accuracy))
        loop.save(loop.ckpt_path, progress)
        if result.accuracy >= progress.best_accuracy:
            loop.save(out / "best.pt", progress)

    if result is None:  # resumed a finished run: nothing left to train, so just report
        result = evaluate(model, test_batches, d, cfg.amp)
    report.say(f"final: test accuracy {100 * result.accuracy:.2f}% ({result.correct}/{result.count}) on "
               f"{data.name} after {cfg.epochs} epochs, world size {d.world_size}; outputs in {out}")
    return result.accuracy


def _fold(d: Dist, progress: Progress, loss_sum: torch.Tensor, seen_here: int) -> None:
    """Add every rank's loss and image count since the last fold into `progress`."""
    totals = d.all_sum(torch.stack([loss_sum.float(), torch.tensor(float(seen_here), device=d.device)]))
    progress.loss_sum += float(totals[0])
    progress.seen += int(totals[1])
