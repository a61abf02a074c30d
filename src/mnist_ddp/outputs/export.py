"""`mnist-ddp export RUN_OR_FILE --onnx FILE`: the trained model as ONNX, for inference outside PyTorch, checked.

The graph takes what any image library gives: (N, 1, 28, 28) float32 pixels in [0, 1], light ink on a dark page
as MNIST's; the normalisation the model was trained with is inside it, so its user needs no constants. It
returns (N, 10) logits, and carries the classes, the normalisation and the test accuracy as metadata. Before the
command reports success, onnxruntime runs the file on synthetic digits and must give PyTorch's class for each.
torch.onnx's exporter (torch.export + onnxscript) makes the graph; the `onnx` extra brings what it and the check
need (cli.py refuses the command at once without them).
"""

import contextlib
import json
import logging
import warnings
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from ..common import atomic
from ..common.config import ExportConfig
from ..common.errors import UserError, WriteFailed
from ..core.batches import MEAN, STD, model_input
from ..data import synthetic
from . import infer, model_file

OPSET = 18
INPUT, OUTPUT = "pixels", "logits"
TOLERANCE = 1e-3  # the largest logit difference from PyTorch's that still counts as the same model


class ExportMismatch(UserError):
    """onnxruntime's answers are not PyTorch's: the file is not the model (not bad input: exit code 1)."""

    exit_code = 1


class Pixels(nn.Module):
    """The ConvNet behind its input's normalisation: pixels in [0, 1] in, logits out."""

    def __init__(self, model: nn.Module, normalize: bool) -> None:
        super().__init__()
        self.model, self.normalize = model, normalize

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.model((x - MEAN) / STD if self.normalize else x)


@dataclass(frozen=True)
class Check:
    """onnxruntime against PyTorch on the same images."""

    images: int
    same_class: int  # images both give the same most likely class
    largest_difference: float  # of any logit


def source_file(source: str) -> Path:
    """The model file `source` names: itself, or a run folder's model.safetensors (best.pt in runs from before it)."""
    path = Path(source)
    if not path.is_dir():
        return path
    for name in (model_file.NAME, "best.pt"):
        if (path / name).is_file():
            return path / name
    raise UserError(f"{path}: a folder without {model_file.NAME} or best.pt, so not a run to export.")


@contextlib.contextmanager
def _quiet() -> Iterator[None]:
    """The exporter's progress lines and warnings (missing torchvision ops, deprecations) are not the user's."""
    logger = logging.getLogger("torch.onnx")
    level = logger.level
    logger.setLevel(logging.ERROR)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            yield
    finally:
        logger.setLevel(level)


def to_onnx(model: nn.Module, normalize: bool, metadata: dict[str, str]) -> bytes:
    """The bytes of an ONNX file of `model` (eval mode) behind its normalisation, with a dynamic batch size."""
    import onnx

    net = Pixels(model.eval(), normalize)
    with _quiet():
        program = torch.onnx.export(net, (torch.rand(2, 1, 28, 28),), dynamo=True, opset_version=OPSET,
                                    input_names=[INPUT], output_names=[OUTPUT], external_data=False, verbose=False,
                                    dynamic_shapes=({0: torch.export.Dim("batch")},))
    assert program is not None  # dynamo=True returns the program
    proto = program.model_proto
    onnx.helper.set_model_props(proto, metadata)
    onnx.checker.check_model(proto)
    return proto.SerializeToString()


def compare(onnx_bytes: bytes, model: nn.Module, normalize: bool, images: torch.Tensor) -> Check:
    """Classify (N, 28, 28) uint8 `images` in onnxruntime and in PyTorch (as `predict` feeds them)."""
    import onnxruntime

    session = onnxruntime.InferenceSession(onnx_bytes, providers=["CPUExecutionProvider"])
    theirs = torch.from_numpy(session.run([OUTPUT], {INPUT: (images[:, None].float() / 255).numpy()})[0])
    with torch.inference_mode():
        ours = model.eval()(model_input(images, normalize))
    return Check(len(images), int((theirs.argmax(1) == ours.argmax(1)).sum()), float((theirs - ours).abs().max()))


def run(cfg: ExportConfig) -> int:
    """Export, check, then write the file (atomically, never over an existing one); one line says what was done."""
    out, path = Path(cfg.onnx), source_file(cfg.source)
    if out.exists():
        raise UserError(f"--onnx {out} already exists; choose another name or remove it first.")
    model, ckpt = model_file.load_model(path)
    was = infer.trained(ckpt, path)
    normalize = was.normalize
    metadata = {
        "source": str(path), "input": f"{INPUT}: (N, 1, 28, 28) float32 pixels in [0, 1], light ink on a dark page",
        "output": f"{OUTPUT}: (N, 10), one per class", "normalization": json.dumps(
            {"mean": MEAN, "std": STD, "applied": "inside the graph"} if normalize else None),
        "dataset": was.dataset, "classes": json.dumps(was.classes),
        **({"test_accuracy": repr(ckpt["test_accuracy"])} if "test_accuracy" in ckpt else {}),
    }
    data = to_onnx(model, normalize, metadata)
    check = compare(data, model, normalize, synthetic.generate(cfg.check_images, seed=20_261_205)[0])
    said = (f"onnxruntime and PyTorch: the same class for {check.same_class:,} of {check.images:,} synthetic digits, "
            f"largest logit difference {check.largest_difference:.1e}")
    if check.same_class != check.images or not check.largest_difference <= TOLERANCE:
        raise ExportMismatch(f"{out} was not written: {said}, where the same class for each and at most "
                             f"{TOLERANCE:g} was expected.")
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        atomic.write(out, lambda f: f.write(data))
    except (OSError, WriteFailed) as e:
        cause = e if isinstance(e, OSError) else e.__cause__
        raise UserError(f"--onnx {out} cannot be written ({getattr(cause, 'strerror', None) or cause}).") from None
    print(f"export: {out} ({len(data) / 1000:.0f} kB, ONNX opset {OPSET}) from {path}; input {INPUT!r} (N, 1, 28, 28) "
          f"in [0, 1]{', normalised inside the graph' if normalize else ''}; output {OUTPUT!r} (N, 10); {said}")
    return 0
