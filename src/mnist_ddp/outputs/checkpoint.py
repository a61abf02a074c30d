"""Checkpoints that are atomic (temp file, fsync, rename), portable (the plain model's state_dict) and safe to
load: plain values for the weights-only loader, a digest of the contents checked on every load, the previous
checkpoint kept to fall back to (docs/design/checkpoints.md)."""

import ctypes
import hashlib
import io
import os
import pickle
import re
import struct
import warnings
import zipfile
from collections.abc import Callable
from pathlib import Path
from typing import Any, BinaryIO

import torch
from torch import nn

from ..common import atomic, inputfile, interrupts
from ..common.errors import UserError

FORMAT = "mnist-ddp/2"  # carries a digest
UNVERIFIED = "mnist-ddp/1"  # saved before digests: still loads, unverified, like a stranger's state_dict
_PREFIXES = ("module.", "_orig_mod.")  # added by DDP and torch.compile
# Before 2.6.0 (CVE-2025-32434) and 2.10.0 (CVE-2026-24747) a crafted file could make torch.load's weights-only
# unpickler run code; pyproject.toml requires torch>=2.10 too, this also covers a torch installed around pip.
SAFE_TORCH = (2, 10)
MOST_FILE = 64 << 20  # bytes of a checkpoint file: one of this ConvNet's holds ~0.4 MB, far more slots included
MOST_PICKLE = 4 << 20  # bytes of its pickle (the plain values around the tensors: a few kB)
MOST_VALUES = 1 << 20  # tensors, numbers, strings, containers in one checkpoint, all counted


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


def digest(obj: Any) -> str:
    """SHA-256 of a checkpoint's contents, the same before `torch.save` and after `torch.load`: every
    tensor's dtype, shape and bytes, every other value's repr, every key, in order (dicts keep it)."""
    h = hashlib.sha256()

    def feed(o: Any) -> None:
        if isinstance(o, torch.Tensor):
            t = o.detach().to("cpu").contiguous()
            h.update(f"T{t.dtype}{tuple(t.shape)}:".encode())
            if t.numel():  # the bytes themselves, read in place (numpy is not a dependency, ctypes is built in)
                h.update((ctypes.c_char * (t.numel() * t.element_size())).from_address(t.data_ptr()))
        elif isinstance(o, dict):
            h.update(f"D{len(o)}:".encode())
            for key, value in o.items():
                feed(key)
                feed(value)
        elif isinstance(o, list | tuple):
            h.update(f"{type(o).__name__}{len(o)}:".encode())
            for value in o:
                feed(value)
        else:
            h.update(f"{type(o).__name__}={o!r};".encode())
    feed(obj)
    return "sha256:" + h.hexdigest()


def previous(path: Path) -> Path:
    """Where the checkpoint before `path`'s is kept: checkpoint.pt -> checkpoint.prev.pt."""
    return path.with_name(f"{path.stem}.prev{path.suffix}")


def save(path: Path, payload: dict[str, Any], keep_previous: bool = False) -> None:
    """Write `payload` and its digest to `path` atomically (`atomic.write`: temp file, fsync, rename).

    Whenever the writer dies, or the disk fills up, `path` is the old checkpoint or the new one, never a mix.
    `keep_previous`: the old one becomes `previous(path)`, renamed once the new one is safely on disk.
    """
    contents = {**payload, "format": FORMAT}
    contents.pop("digest", None)  # a loaded checkpoint saved again gets a digest of what it holds now
    contents["digest"] = digest(contents)
    atomic.write(path, lambda f: _torch_save(contents, f), keep=previous(path) if keep_previous else None)


def _torch_save(obj: Any, f: BinaryIO) -> None:
    """torch.save, with Ctrl-C and SIGTERM held until it returns: its pickler would swallow them (interrupts.py)."""
    with interrupts.held():
        torch.save(obj, f)


def _safe_load(data: bytes, name: str | Path) -> Any:
    """`torch.load(weights_only=True)` of a checkpoint's bytes, each part bounded (`_stored_zip`, `_bounded`); a
    refusal, or bytes it cannot read, is one line naming `name`."""
    version = tuple(int(n) for n in re.findall(r"\d+", torch.__version__)[:2])
    if version < SAFE_TORCH:
        raise UserError(f"{name}: not loaded: PyTorch {torch.__version__} is older than 2.10, and a crafted file can "
                        f"make its weights-only loader run code (CVE-2025-32434, CVE-2026-24747); upgrade it: "
                        f"pip install 'torch>=2.10'.")
    _stored_zip(data, name)
    try:
        with warnings.catch_warnings():  # a foreign pickle also draws a warning; the error below says enough
            warnings.filterwarnings("ignore", message="Detected pickle protocol")
            obj = torch.load(io.BytesIO(data), map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as e:
        # The weights-only unpickler names the import: "GLOBAL os.system", or "Unsupported global: GLOBAL getattr".
        wants = re.search(r"(?:GLOBAL|global:?) (?!GLOBAL )([\w.]+)", str(e))
        if wants:
            raise UserError(f"{name}: refused, loading it would import {inputfile.shown(wants.group(1))} and could "
                            f"run code; only checkpoints of tensors and plain values are accepted.") from e
        raise UserError(f"{name}: not a PyTorch checkpoint (a pickle the weights-only loader cannot read).") from e
    except RecursionError:
        raise UserError(f"{name}: not a checkpoint of ours: it nests values deeper than any checkpoint does.") from None
    except (RuntimeError, EOFError, OSError, zipfile.BadZipFile, ValueError, KeyError, struct.error, TypeError,
            IndexError, AttributeError, OverflowError) as e:  # junk bytes, or junk the unpickler built
        # Only torch's own messages say something (e.g. "failed finding central directory"); a KeyError
        # of junk bytes or an EOFError would just be noise.
        detail = f" ({str(e).strip().splitlines()[0].split('. ')[0][:200]})" \
            if type(e) is RuntimeError and str(e) else ""
        raise UserError(f"{name}: not a PyTorch checkpoint, or a truncated one{detail}.") from e
    _bounded(obj, name)
    return obj


def _stored_zip(data: bytes, name: str | Path) -> None:
    """Refuse bytes that are not a zip archive as torch.save writes it: every member stored, none compressed (a
    compressed member could inflate to any size), its pickle at most `MOST_PICKLE` bytes."""
    if not data.startswith(b"PK\x03\x04"):
        legacy = "; this is its legacy format: load it and save it again" if data[:1] == b"\x80" else ""
        raise UserError(f"{name}: not a PyTorch checkpoint (a zip archive, as torch.save writes since PyTorch 1.6"
                        f"{legacy}).")
    try:
        with zipfile.ZipFile(io.BytesIO(data)) as z:
            members = z.infolist()
    except (zipfile.BadZipFile, zipfile.LargeZipFile, ValueError, OSError, struct.error, EOFError) as e:
        raise UserError(f"{name}: not a PyTorch checkpoint, or a truncated one ({str(e)[:100]}).") from None
    for m in members:
        if m.compress_type != zipfile.ZIP_STORED or m.file_size != m.compress_size:
            raise UserError(f"{name}: not a checkpoint torch.save wrote: its member {inputfile.shown(m.filename)} is "
                            f"compressed, and torch.save stores every member as it is.")
        if m.filename.endswith("data.pkl") and m.file_size > MOST_PICKLE:
            raise UserError(f"{name}: its pickle is {m.file_size:,} bytes, more than a checkpoint's "
                            f"({MOST_PICKLE:,} at most).")


def _bounded(obj: Any, name: str | Path) -> None:
    """Refuse what no checkpoint holds: more than `MOST_VALUES` values, or a tensor that is not a plain dense one
    whose elements all lie in its own storage (a view of one element as a billion would take gigabytes the
    moment it is copied)."""
    todo, count = [obj], 0
    while todo:
        o = todo.pop()
        count += 1
        if count > MOST_VALUES:
            raise UserError(f"{name}: holds more than {MOST_VALUES:,} values, more than any checkpoint does.")
        if isinstance(o, dict):
            todo += [*o.keys(), *o.values()]
        elif isinstance(o, list | tuple):
            todo += o
        elif isinstance(o, torch.Tensor):
            if o.layout != torch.strided or o.is_quantized or o.is_nested:
                kind = "quantized" if o.is_quantized else "nested" if o.is_nested else str(o.layout)
                raise UserError(f"{name}: holds a {kind} tensor; a checkpoint holds plain dense tensors only.")
            if o.numel() and o.numel() * o.element_size() > o.untyped_storage().nbytes():
                raise UserError(f"{name}: holds a tensor of shape {tuple(o.shape)} that repeats the "
                                f"{o.untyped_storage().nbytes():,} bytes it stores; a checkpoint's tensors do not.")


def load(path: Path) -> dict[str, Any]:
    """Read a checkpoint safely. A bare state_dict (the tutorial's) comes back as {"model": it}."""
    return parse(inputfile.read(path, MOST_FILE, "checkpoint"), inputfile.shown(path))


def parse(data: bytes, name: str) -> dict[str, Any]:
    """A checkpoint's bytes, read safely and checked (`load`); `name` says whose they are."""
    if not data:
        raise UserError(f"{name}: not a PyTorch checkpoint: the file is empty (0 bytes).")
    obj = _safe_load(data, name)
    if isinstance(obj, dict) and ("digest" in obj or (str(obj.get("format")).startswith("mnist-ddp/")
                                  and obj["format"] != UNVERIFIED)):
        _verify(name, obj)
    if isinstance(obj, dict) and "model" in obj and isinstance(obj["model"], dict):
        return obj
    if isinstance(obj, dict) and obj and all(isinstance(v, torch.Tensor) for v in obj.values()):
        return {"model": obj}
    raise UserError(f"{name}: holds a {type(obj).__name__}, not a model checkpoint.")


def _verify(path: str | Path, obj: dict[str, Any]) -> None:
    """Check (and remove) the digest a checkpoint of ours carries: refuse it, by name, if its contents changed."""
    saved = obj.pop("digest", None)
    if saved is None:
        raise UserError(f"{path}: damaged: a checkpoint of format {obj.get('format')} without the digest it was saved "
                        f"with, so nothing proves it whole.")
    if _digest_of(obj, path) != saved:
        raise changed(path)


def changed(path: str | Path) -> UserError:
    """The refusal of a file whose contents no longer match the digest it was saved with."""
    return UserError(f"{path}: damaged: its contents no longer match the digest they were saved with (bit rot, an "
                     f"interrupted copy or a failing disk); use an intact copy.")


def _digest_of(obj: Any, name: str | Path) -> str:
    """`digest(obj)` of what a file or a peer holds: values nested deeper than Python recurses (which the
    weights-only loader builds, as it does not recurse) are one line, not a traceback."""
    try:
        return digest(obj)
    except RecursionError:
        raise UserError(f"{name}: not a checkpoint of ours: it nests values deeper than any checkpoint does.") from None


def load_resumable(path: Path) -> dict[str, Any]:
    """A checkpoint that `--resume` can continue: ours, with optimizer and progress, not bare weights."""
    return _resumable(load(path), path)


def _resumable(ckpt: dict[str, Any], name: str | Path) -> dict[str, Any]:
    missing = [k for k in ("optimizer", "progress", "rng") if k not in ckpt]
    if missing:
        raise UserError(f"{name}: holds model weights but no training state ({', '.join(missing)}), so a run "
                        f"cannot continue from it; use it with `evaluate`/`predict`, or start a new --out.")
    return ckpt


def pack(found: tuple[Path, dict[str, Any]] | None) -> bytes:
    """What `load_latest` found, as bytes for the other ranks (`Dist.from_main`): torch.save of its tensors and
    plain values (all that a weights-only load gave) and their digest, so that every rank checks what it got."""
    buffer = io.BytesIO()
    _torch_save({} if found is None else {"path": str(found[0]), "checkpoint": found[1], "digest": digest(found[1])},
                buffer)
    return buffer.getvalue()


def unpack(data: bytes) -> tuple[Path, dict[str, Any]] | None:
    """`pack`'s bytes back, read as a stranger's file is: by the weights-only loader, the digest checked."""
    name = "the checkpoint rank 0 sent"
    sent = _safe_load(data, name)
    if isinstance(sent, dict) and not sent:
        return None
    if not (isinstance(sent, dict) and isinstance(sent.get("path"), str) and isinstance(sent.get("checkpoint"), dict)
            and isinstance(sent["checkpoint"].get("model"), dict)
            and sent.get("digest") == _digest_of(sent["checkpoint"], name)):
        raise UserError(f"{name}: damaged: not a checkpoint with the digest of its contents")
    return Path(sent["path"]), _resumable(sent["checkpoint"], name)


def newest_intact(path: Path, check: Callable[[Path, dict[str, Any]], None] = lambda p, c: None
                  ) -> tuple[Path | None, dict[str, Any] | None, list[UserError]]:
    """The newest of `path` and `previous(path)` that loads, passes `check` and can be resumed, with the
    refusals of those before it; touches nothing. (None, None, refusals) when neither can be used."""
    refused = []
    for candidate in (path, previous(path)):
        if not os.path.lexists(candidate):  # a link to nowhere is there, and refused as it is read
            continue
        try:
            ckpt = load_resumable(candidate)
            check(candidate, ckpt)
        except UserError as e:
            refused.append(e)
            continue
        return candidate, ckpt, refused
    return None, None, refused


def load_latest(path: Path, check: Callable[[Path, dict[str, Any]], None], say: Callable[[str], None]
                ) -> tuple[Path, dict[str, Any]] | None:
    """What `--resume` continues from: `path`, else the checkpoint before it, saying so; None if there is
    neither. `check` raises a UserError for a checkpoint of another run (its settings differ).

    A refused `path` is renamed to `<path>.rejected` (the next save would otherwise rotate it over the good
    previous one), its bytes kept for whoever wants to look. When neither can be used, the error names
    both and nothing on disk changes.
    """
    found, ckpt, refused = newest_intact(path, check)
    if found is None:
        if not refused:
            return None
        if len(refused) == 1:
            raise refused[0]
        raise UserError(f"{str(refused[0]).rstrip('.')}; and the checkpoint before it cannot be used either: "
                        f"{refused[1]}")
    if refused:
        aside = path.with_name(f"{path.name}.rejected")
        os.replace(path, aside)
        say(f"resume: {str(refused[0]).rstrip('.')}; falling back to {found}, the checkpoint saved before it "
            f"(the refused file is kept as {aside})")
    elif found != path:
        say(f"resume: {path} is missing; resuming from {found}, the checkpoint saved before it")
    assert ckpt is not None  # found with it
    return found, ckpt


def restore_model(model: nn.Module, state: dict[str, torch.Tensor], path: str | Path) -> None:
    """Load `state` into `model`, or say clearly that it belongs to some other network or holds no numbers."""
    check_weights(state, plain_module(model).state_dict(), path)
    plain_module(model).load_state_dict(clean_state_dict(state))


def check_weights(state: Any, want: dict[str, torch.Tensor], path: str | Path) -> None:
    """Refuse `state` unless it is `want`'s tensors by name and shape (wrapper prefixes aside), floating where
    those are, every number finite."""
    if not (isinstance(state, dict) and all(isinstance(k, str) for k in state)):
        raise UserError(f"{path}: its model is not a state_dict (tensors by name).")
    state = clean_state_dict(state)
    missing, unknown = [k for k in want if k not in state], [k for k in state if k not in want]
    wrong = [k for k in want if k in state and getattr(state[k], "shape", None) != want[k].shape]
    if missing or unknown or wrong:
        why = [f"it lacks {len(missing)} of the ConvNet's {len(want)} tensors (e.g. {missing[0]})" if missing else "",
               f"has {len(unknown)} the ConvNet does not (e.g. {inputfile.shown(unknown[0])})" if unknown else "",
               f"has {wrong[0]} of shape {tuple(getattr(state[wrong[0]], 'shape', ()))}, not "
               f"{tuple(want[wrong[0]].shape)}" if wrong else ""]
        raise UserError(f"{path}: not a checkpoint of this ConvNet: {', '.join(w for w in why if w)}.")
    for key, t in state.items():
        if t.is_floating_point() != want[key].is_floating_point() or t.is_complex():
            raise UserError(f"{path}: {key} holds {t.dtype} numbers, where the ConvNet's are {want[key].dtype}.")
        if t.is_floating_point() and not bool(torch.isfinite(t).all()):
            raise UserError(f"{path}: {key} holds NaN or infinite numbers; a trained model has none.")
