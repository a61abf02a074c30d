"""`evaluate` and `predict`: use any ConvNet checkpoint or safetensors file, one process. The command prints what
the Python API (api.py) returns: an `Evaluation`, and a `Prediction` per image."""

from collections.abc import Iterable, Iterator
from dataclasses import dataclass, replace
from pathlib import Path

import torch

from ..common import inputfile
from ..common.config import AMP, DATASETS, EvalConfig, Known, PredictConfig
from ..common.errors import UserError
from ..common.results import Evaluation, Prediction
from ..core import compute
from ..core.batches import ShardedBatches, model_input
from ..core.distributed import Dist, pick_device
from ..core.evaluation import evaluate
from ..data import datasets, idx, images
from . import model_file


@dataclass(frozen=True)
class Trained:
    """What a model file says of how its model was trained, checked: a bare state_dict says nothing, so MNIST's
    pixels, not normalised, in fp32."""

    dataset: Known = "mnist"
    normalize: bool = False
    amp: str = "off"
    channels_last: bool | None = None

    @property
    def classes(self) -> tuple[str, ...]:
        """The names of the model's 10 outputs: its dataset's (synthetic's are digits, as MNIST's)."""
        return datasets.SOURCES.get(self.dataset, datasets.SOURCES["mnist"]).classes


def trained(ckpt: dict, name: str | Path) -> Trained:
    """`ckpt`'s record of its training, each value of the kind a run writes, else one sentence naming `name`."""
    config = ckpt.get("config", {})
    data = config.get("data", {}) if isinstance(config, dict) else None
    if not isinstance(data, dict):
        raise UserError(f"{inputfile.shown(name)}: its recorded settings are not a run's.")
    found = Trained(data.get("dataset", "mnist"), **{k: config[k] for k in ("normalize", "amp", "channels_last")
                                                       if k in config})
    if not (found.dataset in DATASETS and found.dataset != "auto" and isinstance(found.normalize, bool)
            and found.amp in AMP and found.channels_last in (None, True, False)):
        raise UserError(f"{inputfile.shown(name)}: its recorded settings are not a run's (dataset, normalize, amp, "
                        f"channels_last): {inputfile.shown(repr(found))[:200]}.")
    return found


def evaluation(cfg: EvalConfig) -> Evaluation:
    """The checkpoint's test metrics, in the precision and layout it was trained in."""
    model, ckpt = model_file.load_model(Path(cfg.checkpoint))
    was = trained(ckpt, cfg.checkpoint)
    device = pick_device(cfg.device, 0, 1)
    name = was.dataset if cfg.data.dataset == "auto" else cfg.data.dataset
    data = datasets.load(replace(cfg.data, dataset=name, train_samples=None, test_only=True))
    # The precision and layout the run evaluated in, so that on the same device this reproduces its test
    # metrics (a bare state_dict says nothing: fp32).
    amp = compute.amp_for(was.amp, device)
    channels_last = compute.channels_last_for(was.channels_last, device)
    batches = ShardedBatches(data.test.images, data.test.labels, cfg.batch_size, rank=0, world=1, device=device,
                             shuffle=False, each_sample_once=True, normalize=was.normalize, channels_last=channels_last)
    layout = torch.channels_last if channels_last else torch.preserve_format
    model = model.to(device, memory_format=layout)  # type: ignore[call-overload]  # documented; not in the stubs
    result = evaluate(model, batches, Dist(0, 0, 1, 1, device), amp)
    return Evaluation(result.accuracy, result.correct, result.count, result.loss, data.name, data.where,
                      result.confusion.tolist())


def run_evaluate(cfg: EvalConfig) -> int:
    print(evaluation(cfg))
    return 0


def _inputs(names: tuple[str, ...]) -> list[Path]:
    """The files to classify: each FILE, or the image files of a FOLDER (sorted by name; subfolders,
    hidden files and files not named like an image are skipped). Missing ones are refused up front."""
    paths = []
    for name in map(Path, names):
        if name.is_dir():
            # hidden files include macOS's "._digit.png" resource forks, which are not images
            found = sorted(p for p in name.iterdir() if images.is_image(p) and p.is_file() and p.name[0] != ".")
            if not found:
                raise UserError(f"{name}: a folder with no {'/'.join(images.SUFFIXES)} files.")
            paths += found
        elif name.exists() or name.is_symlink():  # what is not a regular file is refused as it is read (inputfile)
            paths.append(name)
        else:
            raise UserError(f"{inputfile.shown(name)}: no such file or folder.")
    return paths


def _images(path: Path) -> torch.Tensor:
    """(N, 28, 28) uint8 images from an image file (one image) or an IDX file."""
    if images.is_image(path):
        return images.read_digit(path)[None]
    return idx.read(path, idx.IMAGES_MAGIC)  # 28x28 images, or refused


def read_files(names: tuple[str, ...]) -> Iterator[tuple[str, torch.Tensor]]:
    """Each file's name and its (N, 28, 28) uint8 images, read as they are needed."""
    for path in _inputs(names):
        yield str(path), _images(path)


def predictions(cfg: PredictConfig, sources: Iterable[tuple[str, torch.Tensor]]) -> Iterator[Prediction]:
    """The top classes of every image of each (name, (N, 28, 28) uint8 images) source, one by one."""
    model, ckpt = model_file.load_model(Path(cfg.checkpoint))
    device = pick_device(cfg.device, 0, 1)
    model.to(device).eval()
    was = trained(ckpt, cfg.checkpoint)
    names = was.classes
    for name, batch in sources:
        x = model_input(batch.to(device), was.normalize)
        with torch.inference_mode():
            probs = torch.cat([model(chunk).softmax(1) for chunk in x.split(1000)]).cpu()
        top = probs.topk(cfg.top, dim=1)
        for i, (p, c) in enumerate(zip(top.values.tolist(), top.indices.tolist())):
            yield Prediction(name if len(batch) == 1 else f"{name}[{i}]", [names[k] for k in c], p)


def run_predict(cfg: PredictConfig) -> int:
    for prediction in predictions(cfg, read_files(cfg.files)):
        print(prediction)
    return 0
