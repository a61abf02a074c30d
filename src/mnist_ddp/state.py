"""A run's state: what its checkpoint holds, saving it (rank 0), and continuing from it (`--resume`).

The file itself (atomic writes, the digest, the safe loader) is checkpoint.py's."""

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn

from . import checkpoint, model_file
from .batches import Share
from .config import BITWISE_MUST_MATCH, RESUME_MUST_MATCH, TrainConfig
from .distributed import Dist
from .errors import UserError
from .evaluation import EvalResult


@dataclass
class Progress:
    """Where the run stands; saved in every checkpoint."""

    epoch: int = 0  # epochs completed
    consumed: int = 0  # samples of the current epoch's permutation trained on, over all ranks (padding not counted)
    loss_sum: float = 0.0  # over all ranks, for the current epoch so far
    seen: int = 0  # training images over all ranks, current epoch so far
    best_accuracy: float = -1.0


@dataclass
class Stretch:
    """What a rank adds up between two folds (trainer.Trainer._fold)."""

    loss_sum: torch.Tensor  # this rank's, on the device (no sync per step)
    seen: int = 0  # this rank's samples
    samples: int = 0  # the whole steps' samples, all ranks'
    # (samples done, lr, this rank's loss sum, the step's samples) of every --log-every-th step
    logged: list[tuple[int, float, torch.Tensor, int]] = field(default_factory=list)

    def add(self, step_loss: torch.Tensor, here: int, samples: int) -> None:
        """One step's: this rank's mean loss over its `here` samples, of the step's `samples` over all ranks."""
        self.loss_sum.add_(step_loss, alpha=here)
        self.seen += here
        self.samples += samples

    def copy(self) -> "Stretch":
        return Stretch(self.loss_sum.clone(), self.seen, self.samples, list(self.logged))


@dataclass
class Training:
    """What training changes, and a checkpoint saves and restores."""

    model: nn.Module  # the plain ConvNet, holding BatchNorm statistics averaged over every part
    opt: torch.optim.Optimizer
    scaler: torch.amp.GradScaler | None  # fp16's
    progress: Progress


@dataclass
class Resumed:
    """What a resume found beyond the restored state: where from, and the run's global batch."""

    path: Path
    share: Share  # the checkpoint's M slots, dealt over this world
    batchnorm_parts: torch.Tensor | None  # every part's statistics
    world_was: int


def save(out: Path, t: Training, cfg: TrainConfig, d: Dist, slots: int, batchnorm_parts: torch.Tensor | None,
         best: EvalResult | None = None, classes: tuple[str, ...] = ()) -> None:
    """Write the run's checkpoint (the one before it kept as checkpoint.prev.pt), and where this epoch's result is
    the `best` so far, best.pt and model.safetensors (model_file.py). Rank 0 alone calls it (Trainer._save)."""
    d.raise_if_aborted()  # numbers made after NCCL aborted its communicator are no checkpoint
    d.set_phase("saving checkpoint.pt")
    weights = checkpoint.plain_module(t.model).state_dict()
    contents = {
        "model": weights,
        "optimizer": t.opt.state_dict(),
        "progress": vars(t.progress).copy(),
        "rng": torch.get_rng_state(),
        "config": cfg.to_dict() | {"world_size": d.world_size},
        "slots": slots,  # the run's global batch: M micro-batches of batch_size
        "batchnorm_parts": batchnorm_parts,
        **({"scaler": t.scaler.state_dict()} if t.scaler is not None else {}),
        "run_id": d.run_id,  # a torchrun restart of this same job continues it without --resume
    }
    checkpoint.save(out / "checkpoint.pt", contents, keep_previous=True)
    if best is not None:
        checkpoint.save(out / "best.pt", contents, keep_previous=False)
        model_file.save(out / "model.safetensors", weights, contents["config"], classes, best.accuracy, best.count,
                        t.progress.epoch)


def check_same_run(cfg: TrainConfig, path: Path, ckpt: dict[str, Any]) -> None:
    """Refuse a checkpoint of another run: one saved with other settings, or of another dataset."""
    saved, current = ckpt.get("config", {}), cfg.to_dict()
    keys = RESUME_MUST_MATCH + (BITWISE_MUST_MATCH if saved.get("bitwise") else ())
    changed = [k for k in keys if k in saved and saved[k] != current[k]]
    if saved.get("data", {}).get("dataset") not in (None, cfg.data.dataset):
        changed.append("dataset")
    if changed:
        raise UserError(f"{path} was saved with different settings ({', '.join(changed)}); "
                        f"resume with the same settings or start a new --out.")


def resume(path: Path, t: Training, cfg: TrainConfig, d: Dist, n: int, say: Any) -> Resumed | None:
    """Restore `t` from `path` (else the intact checkpoint saved before it); None if there is none yet.
    Rank 0 reads it and sends it to every rank, so nodes without a shared file system resume too."""
    found = d.from_main(lambda: checkpoint.load_latest(path, lambda p, c: check_same_run(cfg, p, c), say),
                        checkpoint.pack, checkpoint.unpack)
    if found is None:
        say(f"resume: no checkpoint in {cfg.out} yet, starting from scratch")
        return None
    where, ckpt = found
    saved = ckpt.get("config", {})
    checkpoint.restore_model(t.model, ckpt["model"], where)
    t.opt.load_state_dict(ckpt["optimizer"])
    if t.scaler is not None and "scaler" in ckpt:
        t.scaler.load_state_dict(ckpt["scaler"])
    torch.set_rng_state(ckpt["rng"])
    progress = ckpt["progress"]
    if "step" in progress:  # saved before positions were counted in samples: per-rank steps
        steps = progress.pop("step")
        progress["consumed"] = min(n, steps * cfg.recipe.batch_size * saved.get("world_size", 1))
    t.progress = Progress(**progress)
    say(f"resume: from {where}, epoch {t.progress.epoch + 1}, {t.progress.consumed:,} of its {n:,} samples done")
    was = saved.get("world_size", d.world_size)
    # Checkpoints from before the run's M was recorded: one micro-batch per process.
    slots = ckpt.get("slots", ckpt.get("micro_batches", was))
    return Resumed(where, Share(slots=slots, world=d.world_size, whole=cfg.bitwise), ckpt.get("batchnorm_parts"),
                   was)
