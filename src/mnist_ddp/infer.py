"""`evaluate` and `predict`: use any ConvNet checkpoint, one process."""

from dataclasses import replace
from pathlib import Path

import torch
import torch.nn.functional as F

from . import checkpoint, datasets, idx, png
from .batches import ShardedBatches, model_input
from .config import EvalConfig, PredictConfig
from .distributed import Dist, pick_device
from .errors import UserError
from .evaluation import evaluate


def _normalizes(ckpt: dict) -> bool:
    """Whether the checkpoint's model was trained on normalised pixels (the tutorial's was not)."""
    return bool(ckpt.get("config", {}).get("normalize", False))


def _trained_on(ckpt: dict) -> str:
    """The --dataset the checkpoint was trained with; a bare state_dict says nothing, so mnist."""
    return ckpt.get("config", {}).get("data", {}).get("dataset", "mnist")


def run_evaluate(cfg: EvalConfig) -> int:
    model, ckpt = checkpoint.load_model(Path(cfg.checkpoint))
    device = pick_device(cfg.device, 0)
    name = _trained_on(ckpt) if cfg.data.dataset == "auto" else cfg.data.dataset
    data = datasets.load(replace(cfg.data, dataset=name, train_samples=None, test_only=True))
    batches = ShardedBatches(data.test.images, data.test.labels, cfg.batch_size, rank=0, world=1, device=device,
                             shuffle=False, pad=False, normalize=_normalizes(ckpt))
    result = evaluate(model.to(device), batches, Dist(0, 0, 1, 1, device))
    print(f"test accuracy {100 * result.accuracy:.2f}% ({result.correct}/{result.count}) on {data.name} "
          f"({data.where}), test loss {result.loss:.4f}")
    return 0


def _images(path: Path) -> torch.Tensor:
    """(N, 28, 28) uint8 images from a PNG (any size, resized; inverted if dark-on-light) or an IDX file."""
    if not path.is_file():
        raise UserError(f"{path}: no such file.")
    if path.suffix.lower() == ".png":
        img = png.read_gray(path).float()
        border = torch.cat([img[0], img[-1], img[:, 0], img[:, -1]])
        if border.mean() > 127:  # dark digit on a light page: MNIST is light on dark
            img = 255 - img
        if img.shape != (28, 28):
            img = F.interpolate(img[None, None], size=(28, 28), mode="area")[0, 0]
        return img.round().clamp(0, 255).to(torch.uint8)[None]
    images = idx.read(path, idx.IMAGES_MAGIC)
    if images.shape[1:] != (28, 28):
        raise UserError(f"{path}: images are {tuple(images.shape[1:])}, the model needs 28x28.")
    return images


def run_predict(cfg: PredictConfig) -> int:
    model, ckpt = checkpoint.load_model(Path(cfg.checkpoint))
    device = pick_device(cfg.device, 0)
    model.to(device).eval()
    classes = datasets.SOURCES.get(_trained_on(ckpt), datasets.SOURCES["mnist"]).classes  # synthetic: digits
    for name in cfg.files:
        images = _images(Path(name))
        x = model_input(images.to(device), _normalizes(ckpt))
        with torch.inference_mode():
            probs = torch.cat([model(chunk).softmax(1) for chunk in x.split(1000)]).cpu()
        top = probs.topk(cfg.top, dim=1)
        for i, (p, c) in enumerate(zip(top.values.tolist(), top.indices.tolist())):
            where = name if len(images) == 1 else f"{name}[{i}]"
            print(f"{where}: " + ", ".join(f"{classes[k]} ({100 * q:.1f}%)" for k, q in zip(c, p)))
    return 0
