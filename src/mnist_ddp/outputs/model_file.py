"""`model.safetensors`: a run's best model in the format to share a model in, with what its user needs to know.

The weights are best.pt's (the plain ConvNet's state_dict, the tutorial's keys); the metadata says how to feed
the model and how good it is: the dataset and its classes, the normalisation, the test accuracy, the epoch,
and the run's settings (the recipe among them), plus a digest of it all that `load` checks, as it checks a
checkpoint's. A safetensors file from elsewhere, without our metadata, loads like a bare state_dict.

The format itself is read and written by the `safetensors` package, the reference implementation (fuzzed
upstream); what it does not check is checked here: this ConvNet's names and shapes, finite weights, our metadata.
"""

import json
import struct
from pathlib import Path
from typing import Any

import safetensors
import safetensors.torch
import torch

from ..common import atomic, inputfile
from ..common.errors import UserError
from ..core.batches import MEAN, STD
from ..model import ConvNet
from . import checkpoint

NAME = "model.safetensors"
SUFFIX = ".safetensors"
FORMAT = "mnist-ddp/model/1"
# Where the run ran, which a shared model does not tell: its folders, addresses and tracking store.
LOCAL = ("out", "mlflow", "master_addr", "master_port")
LOCAL_DATA = ("data_dir", "mirrors")


def save(path: Path, state: dict[str, torch.Tensor], config: dict[str, Any], classes: tuple[str, ...],
         accuracy: float, test_count: int, epoch: int) -> None:
    """Write `state` and its metadata to `path` atomically (`atomic.write`); `config`, the run's settings, without
    where it ran."""
    config = {k: v for k, v in config.items() if k not in LOCAL}
    config["data"] = {k: v for k, v in config["data"].items() if k not in LOCAL_DATA}
    normalize = {"mean": MEAN, "std": STD} if config.get("normalize") else None
    metadata = {
        "format": FORMAT,
        "model": "mnist_ddp.model.ConvNet: input (N, 1, 28, 28) float32, output (N, 10) logits",
        "input": ("pixels / 255, then (x - mean) / std with the normalize entry's numbers" if normalize else
                  "pixels / 255, not normalised"),
        "normalize": json.dumps(normalize),
        "dataset": config["data"]["dataset"],
        "classes": json.dumps(list(classes)),
        "test_accuracy": repr(accuracy),
        "test_count": str(test_count),
        "epoch": str(epoch),
        "config": json.dumps(config, sort_keys=True),
        "torch": str(torch.__version__),  # a str subclass, which the digest would tell apart
    }
    tensors = {key: value.detach().to("cpu").contiguous() for key, value in checkpoint.clean_state_dict(state).items()}
    metadata["digest"] = _digest(tensors, metadata)
    data = encode(tensors, metadata)
    atomic.write(path, lambda f: f.write(data))


def encode(tensors: dict[str, torch.Tensor], metadata: dict[str, str]) -> bytes:
    """The file's bytes, made by the package's serializer from the tensors' own memory (its torch helper would
    need numpy, which the base install does not have). `tensors`: contiguous CPU tensors, alive while it runs."""
    specs = {name: safetensors.TensorSpec(dtype=str(t.dtype).removeprefix("torch."), shape=list(t.shape),
                                          data_ptr=t.data_ptr(), data_len=t.numel() * t.element_size())
             for name, t in tensors.items()}
    return bytes(safetensors.serialize(specs, metadata=metadata))


def _digest(tensors: dict[str, torch.Tensor], metadata: dict[str, str]) -> str:
    """`checkpoint.digest` of the tensors and metadata (without the digest), whatever order a writer kept."""
    told = {key: value for key, value in sorted(metadata.items()) if key != "digest"}
    return checkpoint.digest({"tensors": dict(sorted(tensors.items())), "metadata": told})


def is_safetensors(path: Path, data: bytes) -> bool:
    """Whether `path`, holding `data`, is meant as a safetensors file: named so, or starting like one (a header
    length, then `{`); PyTorch's checkpoints start otherwise (a zip's "PK", a pickle's 0x80)."""
    return path.suffix == SUFFIX or (len(data) >= 9 and data[8:9] == b"{"
                                     and struct.unpack("<Q", data[:8])[0] <= len(data))


def parse(data: bytes, name: str) -> dict[str, Any]:
    """A safetensors file's bytes as `checkpoint.parse` returns a checkpoint: {"model": state_dict, "config": …, …}.
    Ours must match its digest; one from elsewhere (no "format" of ours) is weights only."""
    try:
        tensors = safetensors.torch.load(data)
        header = json.loads(data[8:8 + struct.unpack("<Q", data[:8])[0]])  # read, and so checked, just above
    except (safetensors.SafetensorError, ValueError, TypeError, struct.error) as e:
        raise UserError(f"{name}: not a safetensors file, or a damaged one ({str(e).splitlines()[0][:200]}).") from None
    metadata = header.get("__metadata__") or {}
    if not tensors:
        raise UserError(f"{name}: a safetensors file with no tensors, not a model.")
    if metadata.get("format") != FORMAT:
        return {"model": tensors}
    if metadata.get("digest") != _digest(tensors, metadata):
        raise checkpoint.changed(name)
    try:
        config = json.loads(metadata["config"])
        accuracy = float(metadata["test_accuracy"])
    except (KeyError, ValueError, RecursionError) as e:
        raise UserError(f"{name}: its metadata lacks a readable {str(e)[:40]}.") from None
    if not (isinstance(config, dict) and isinstance(config.get("data"), dict)):
        raise UserError(f"{name}: its metadata's config is not the settings of a run.")
    return {"model": tensors, "config": config, "test_accuracy": accuracy, "format": FORMAT}


def load(path: Path) -> dict[str, Any]:
    """Any model file: a safetensors file (ours or another's) or any ConvNet checkpoint, as a checkpoint."""
    data = inputfile.read(path, checkpoint.MOST_FILE, "checkpoint")
    name = inputfile.shown(path)
    return parse(data, name) if is_safetensors(path, data) else checkpoint.parse(data, name)


def load_model(path: Path) -> tuple[ConvNet, dict[str, Any]]:
    """A ConvNet with the weights of `path`: a safetensors file (ours or another's) or any ConvNet checkpoint."""
    ckpt = load(path)
    model = ConvNet()
    checkpoint.restore_model(model, ckpt["model"], inputfile.shown(path))
    return model, ckpt
