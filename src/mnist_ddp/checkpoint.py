"""Checkpoints that are atomic, portable and safe to load.

Saved: the plain model's state_dict (no `module.`/`_orig_mod.` prefixes, so it loads
into the tutorial's model as it is), optimizer, scheduler, progress, RNG state and the
config — plain tensors and Python values only, so `torch.load(weights_only=True)`
reads it and a checkpoint from a stranger cannot run code. A save writes a temp file,
fsyncs it and renames it over the old one, so a crash or a full disk mid-save leaves the
previous checkpoint whole.
"""

import pickle
import re
import struct
import warnings
import zipfile
from pathlib import Path
from typing import Any

import torch
from torch import nn

from . import atomic
from .errors import UserError
from .model import ConvNet

FORMAT = "mnist-ddp/1"
_PREFIXES = ("module.", "_orig_mod.")  # added by DDP and torch.compile


def plain_module(model: nn.Module) -> nn.Module:
    """The ConvNet inside DDP and/or torch.compile wrappers."""
    while True:
        inner = getattr(model, "module", None) or getattr(model, "_orig_mod", None)
        if inner is None:
            return model
        model = inner


def clean_state_dict(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Keys without the wrapper prefixes, so any ConvNet checkpoint loads into a plain ConvNet."""
    out = {}
    for key, value in state.items():
        while key.startswith(_PREFIXES):
            key = key.split(".", 1)[1]
        out[key] = value
    return out


def save(path: Path, payload: dict[str, Any]) -> None:
    """Write `payload` to `path` atomically (`atomic.write`: temp file, fsync, rename).

    Whenever the writer dies, or the disk fills up, `path` is the old checkpoint or the new one, never a mix.
    """
    atomic.write(path, lambda f: torch.save({"format": FORMAT, **payload}, f))


def load(path: Path) -> dict[str, Any]:
    """Read a checkpoint safely. A bare state_dict (the tutorial's) comes back as {"model": it}."""
    if not path.is_file():
        raise UserError(f"{path}: no such checkpoint file.")
    try:
        with warnings.catch_warnings():  # a foreign pickle also draws a warning; the error below says enough
            warnings.filterwarnings("ignore", message="Detected pickle protocol")
            obj = torch.load(path, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as e:
        wants = re.search(r"(?:GLOBAL|global:?) ([\w.]+)", str(e))  # the weights-only unpickler names the import
        if wants:
            raise UserError(f"{path}: refused, loading it would import {wants.group(1)} and could run code; only "
                            f"checkpoints of tensors and plain values are accepted.") from e
        raise UserError(f"{path}: not a PyTorch checkpoint (a pickle the weights-only loader cannot read).") from e
    except (RuntimeError, EOFError, OSError, zipfile.BadZipFile, ValueError, KeyError, struct.error) as e:  # junk bytes
        # Only torch's own messages say something (e.g. "failed finding central directory"); a KeyError
        # of junk bytes or an EOFError would just be noise.
        detail = f" ({str(e).strip().splitlines()[0].split('. ')[0]})" if type(e) is RuntimeError and str(e) else ""
        raise UserError(f"{path}: not a PyTorch checkpoint, or a truncated one{detail}.") from e
    if isinstance(obj, dict) and "model" in obj and isinstance(obj["model"], dict):
        return obj
    if isinstance(obj, dict) and obj and all(isinstance(v, torch.Tensor) for v in obj.values()):
        return {"model": obj}
    raise UserError(f"{path}: holds a {type(obj).__name__}, not a model checkpoint.")


def load_resumable(path: Path) -> dict[str, Any]:
    """A checkpoint that `--resume` can continue: ours, with optimizer and progress, not bare weights."""
    ckpt = load(path)
    missing = [k for k in ("optimizer", "progress", "rng") if k not in ckpt]
    if missing:
        raise UserError(f"{path}: holds model weights but no training state ({', '.join(missing)}), so a run "
                        f"cannot continue from it; use it with `evaluate`/`predict`, or start a new --out.")
    return ckpt


def load_model(path: Path) -> tuple[ConvNet, dict[str, Any]]:
    """A ConvNet with the weights of any ConvNet checkpoint (ours, DDP-saved, or the tutorial's)."""
    ckpt = load(path)
    model = ConvNet()
    restore_model(model, ckpt["model"], path)
    return model, ckpt


def restore_model(model: nn.Module, state: dict[str, torch.Tensor], path: Path) -> None:
    """Load `state` into `model`, or say clearly that it belongs to some other network."""
    state, want = clean_state_dict(state), plain_module(model).state_dict()
    missing, unknown = [k for k in want if k not in state], [k for k in state if k not in want]
    wrong = [k for k in want if k in state and getattr(state[k], "shape", None) != want[k].shape]
    if missing or unknown or wrong:
        why = [f"it lacks {len(missing)} of the ConvNet's {len(want)} tensors (e.g. {missing[0]})" if missing else "",
               f"has {len(unknown)} the ConvNet does not (e.g. {unknown[0]})" if unknown else "",
               f"has {wrong[0]} of shape {tuple(getattr(state[wrong[0]], 'shape', ()))}, not "
               f"{tuple(want[wrong[0]].shape)}" if wrong else ""]
        raise UserError(f"{path}: not a checkpoint of this ConvNet: {', '.join(w for w in why if w)}.")
    plain_module(model).load_state_dict(state)
