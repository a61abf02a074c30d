"""Rank 0's save of the run's state (checkpoint.pt, best.pt, model.safetensors), and `--resume`'s read of it.

The file itself (atomic writes, the digest, the safe loader) is checkpoint.py's."""

import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from ..common import inputfile
from ..common.config import BITWISE_MUST_MATCH, MOST_SLOTS, RESUME_MUST_MATCH, TrainConfig
from ..common.errors import UserError
from ..core import schedule
from ..core.batches import Share
from ..core.bnstats import running_stats
from ..core.distributed import Dist
from ..core.evaluation import EvalResult
from ..core.state import Progress, Training
from ..model import ConvNet
from . import checkpoint, model_file


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
    contents: dict[str, Any] = {
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


STEP_SETTINGS = ("lr", "betas", "eps", "weight_decay", "momentum")  # what the step reads of a group (flatopt.py)


def check_resumable(cfg: TrainConfig, path: Path, ckpt: dict[str, Any]) -> None:
    """Refuse a checkpoint that `resume` could not continue: another run's (`check_same_run`), or one whose
    training state is not what a run of this ConvNet saves: each part is tried on a scratch copy, so that a
    damaged checkpoint.pt is refused here, where checkpoint.prev.pt can still stand in (`checkpoint.load_latest`)."""
    name = inputfile.shown(path)

    def refuse(part: str, why: str) -> UserError:
        return UserError(f"{name}: damaged: its {part} {why}, not what a run saves.")

    saved = ckpt.get("config", {})
    if not (isinstance(saved, dict) and isinstance(saved.get("data", {}), dict) and _plain(saved)):
        raise refuse("config", "is not a run's settings (plain values by name)")
    check_same_run(cfg, path, ckpt)

    scratch = ConvNet()
    checkpoint.restore_model(scratch, ckpt["model"], name)
    opt, _ = schedule.build_optimizer(cfg.recipe, scratch)
    _check_optimizer(ckpt["optimizer"], opt, refuse)
    rng = ckpt["rng"]
    if not (isinstance(rng, torch.Tensor) and rng.dtype == torch.uint8 and rng.shape == torch.get_rng_state().shape):
        raise refuse("rng", "is not the CPU generator's state")
    try:
        torch.Generator().set_state(rng)
    except RuntimeError:
        raise refuse("rng", "is not a valid generator state") from None
    progress = ckpt["progress"]
    fields = {f: type(getattr(Progress(), f)) for f in vars(Progress())}
    if not (isinstance(progress, dict) and set(progress) in (set(fields), set(fields) - {"consumed"} | {"step"})):
        raise refuse("progress", f"is not {', '.join(fields)}")
    for key, value in progress.items():
        kind = fields.get(key, int)
        if not (type(value) is kind or (kind is float and type(value) is int)) or not math.isfinite(value) \
                or value < (-1 if key == "best_accuracy" else 0) or value > (1 if key == "best_accuracy" else 1e15):
            raise refuse("progress", f"has {key} = {inputfile.shown(repr(value))[:40]}")
    for key in ("world_size", "slots", "micro_batches"):
        value = saved.get(key, 1) if key == "world_size" else ckpt.get(key, 1)
        if not (type(value) is int and 1 <= value <= MOST_SLOTS):
            raise refuse(key, f"is {inputfile.shown(repr(value))[:40]}")
    parts = ckpt.get("batchnorm_parts")
    width = sum(b.numel() for b in running_stats(scratch))
    if parts is not None and not (isinstance(parts, torch.Tensor) and parts.is_floating_point() and parts.dim() == 2
                                  and parts.shape[1] == width and bool(torch.isfinite(parts).all())):
        raise refuse("batchnorm_parts", f"are not rows of this ConvNet's {width} BatchNorm statistics")
    if not isinstance(ckpt.get("run_id", ""), str) or not isinstance(ckpt.get("scaler", {}), dict):
        raise refuse("run_id or scaler", "is of the wrong kind")


def _check_optimizer(saved: Any, opt: torch.optim.Optimizer, refuse: Any) -> None:
    """Refuse an optimizer state that is not `opt`'s kind: its groups' settings of the same types, finite, and each
    parameter's state tensors of that parameter's shape, finite."""
    fresh = opt.state_dict()
    groups = saved.get("param_groups") if isinstance(saved, dict) else None
    if not (isinstance(saved, dict) and isinstance(saved.get("state"), dict) and isinstance(groups, list)
            and len(groups) == len(fresh["param_groups"])):
        raise refuse("optimizer", "is not a state_dict of the recipe's optimizer")
    params = [p for group in opt.param_groups for p in group["params"]]
    for group, want in zip(saved["param_groups"], fresh["param_groups"], strict=True):
        # The settings the step reads must be there; others (flags that differ by device or torch version) may not.
        if not (isinstance(group, dict) and group.get("params") == want["params"]
                and all(k in group for k in STEP_SETTINGS if k in want)):
            raise refuse("optimizer", "has groups that are not the recipe optimizer's")
        for key, value in group.items():
            if key != "params" and not (_like(value, want[key]) if key in want else _plain(value)):
                raise refuse("optimizer", f"has {key} = {inputfile.shown(repr(value))[:40]}")
    for index, state in saved["state"].items():
        if not (type(index) is int and 0 <= index < len(params) and isinstance(state, dict)):
            raise refuse("optimizer", "has state for a parameter the ConvNet does not have")
        for key, value in state.items():
            shape = () if key == "step" else params[index].shape
            if not (isinstance(value, torch.Tensor) and value.is_floating_point() and value.shape == shape
                    and bool(torch.isfinite(value).all())):
                raise refuse("optimizer", f"has a {inputfile.shown(str(key))[:40]} that is not {tuple(shape)} "
                             f"finite numbers")


def _plain(value: Any) -> bool:
    """Whether `value` is made of what JSON holds (what a run's settings are), with string keys."""
    if isinstance(value, dict):
        return all(isinstance(k, str) and _plain(v) for k, v in value.items())
    if isinstance(value, list | tuple):
        return all(map(_plain, value))
    return value is None or isinstance(value, str | int | float)


def _like(value: Any, want: Any) -> bool:
    """Whether a saved setting is of the fresh one's kind: a finite number for a number, the same for the rest."""
    if isinstance(want, bool) or want is None:  # a flag (fused, foreach, …): another device's may differ
        return value is None or isinstance(value, bool)
    if isinstance(want, str):
        return isinstance(value, str)
    if isinstance(want, int | float):
        return type(value) in (int, float) and math.isfinite(value)
    if isinstance(want, tuple | list):
        return isinstance(value, tuple | list) and len(value) == len(want) and all(map(_like, value, want))
    if isinstance(want, torch.Tensor):
        return isinstance(value, torch.Tensor) and value.shape == want.shape and bool(torch.isfinite(value).all())
    return False


def resume(path: Path, t: Training, cfg: TrainConfig, d: Dist, n: int, say: Any) -> Resumed | None:
    """Restore `t` from `path` (else the intact checkpoint saved before it); None if there is none yet.
    Rank 0 reads it and sends it to every rank, so nodes without a shared file system resume too."""
    found = d.from_main(lambda: checkpoint.load_latest(path, lambda p, c: check_resumable(cfg, p, c), say),
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
