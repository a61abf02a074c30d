"""`model.safetensors`: a run's best model in the format to share a model in, with what its user needs to know.

The weights are best.pt's (the plain ConvNet's state_dict, the tutorial's keys); the metadata says how to feed
the model and how good it is: the dataset and its classes, the normalisation, the test accuracy, the epoch,
and the run's settings (the recipe among them), plus a digest of it all that `load` checks, as it checks a
checkpoint's. A safetensors file from elsewhere, without our metadata, loads like a bare state_dict.
"""

import json
from pathlib import Path
from typing import Any

import torch

from . import atomic, checkpoint, safetensors_io
from .batches import MEAN, STD
from .errors import UserError
from .model import ConvNet

NAME = "model.safetensors"
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
    data = safetensors_io.encode(tensors, metadata)
    atomic.write(path, lambda f: f.write(data))


def _digest(tensors: dict[str, torch.Tensor], metadata: dict[str, str]) -> str:
    """`checkpoint.digest` of the tensors and metadata (without the digest), whatever order a writer kept."""
    told = {key: value for key, value in sorted(metadata.items()) if key != "digest"}
    return checkpoint.digest({"tensors": dict(sorted(tensors.items())), "metadata": told})


def load(path: Path) -> dict[str, Any]:
    """A safetensors file as `checkpoint.load` returns a checkpoint: {"model": state_dict, "config": …, …}.
    Ours must match its digest; one from elsewhere (no "format" of ours) is weights only."""
    tensors, metadata = safetensors_io.read(path)
    if not tensors:
        raise UserError(f"{path}: a safetensors file with no tensors, not a model.")
    if metadata.get("format") != FORMAT:
        return {"model": tensors}
    if metadata.get("digest") != _digest(tensors, metadata):
        raise checkpoint.changed(path)
    try:
        config = json.loads(metadata["config"])
        accuracy = float(metadata["test_accuracy"])
    except (KeyError, ValueError) as e:
        raise UserError(f"{path}: its metadata lacks a readable {e}.") from None
    if not (isinstance(config, dict) and isinstance(config.get("data"), dict)):
        raise UserError(f"{path}: its metadata's config is not the settings of a run.")
    return {"model": tensors, "config": config, "test_accuracy": accuracy, "format": FORMAT}


def load_model(path: Path) -> tuple[ConvNet, dict[str, Any]]:
    """A ConvNet with the weights of `path`: a safetensors file (ours or another's) or any ConvNet checkpoint."""
    if not safetensors_io.is_safetensors(path):
        return checkpoint.load_model(path)
    ckpt = load(path)
    model = ConvNet()
    checkpoint.restore_model(model, ckpt["model"], path)
    return model, ckpt
