"""`mnist-ddp export RUN --onnx FILE`: the file a real run's model exports to runs in onnxruntime and classifies real
test images (MNIST's t10k where ../shared has it, Fashion-MNIST and synthetic digits everywhere) as PyTorch does;
the export's own check can fail; without the onnx extra, or given a bad --onnx, it is one sentence, exit 2."""

import contextlib
import io
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from conftest import FASHION, HAS_T10K, MNIST_T10K
from datafiles import one_thread
from mnist_ddp import cli
from mnist_ddp.common.config import DataConfig
from mnist_ddp.core.batches import model_input
from mnist_ddp.data import datasets, synthetic
from mnist_ddp.model import ConvNet
from mnist_ddp.outputs import export, model_file

pytest.importorskip("onnxruntime")  # the dev extra installs the onnx extra's packages
import onnx
import onnxruntime


@pytest.fixture(autouse=True, scope="module")
def _single_thread() -> Iterator[None]:
    with one_thread():
        yield


@pytest.fixture(scope="module")
def exported(trained_run: Path, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, str]:
    """The run folder exported by the command (from its model.safetensors); the file and the line it printed."""
    path = tmp_path_factory.mktemp("export") / "model.onnx"
    with contextlib.redirect_stdout(io.StringIO()) as said:
        code = cli.main(["export", str(trained_run), "--onnx", str(path)])
    assert code == 0 and path.is_file()
    return path, said.getvalue()


def _test_images(name: str) -> torch.Tensor:
    if name == "synthetic":
        return synthetic.generate(2000, seed=7)[0]
    where = {"mnist t10k": DataConfig("mnist", data_dir=MNIST_T10K, download=False, test_only=True),
             "fashion-mnist": DataConfig("fashion-mnist", data_dir=FASHION, download=False, test_only=True,
                                         test_samples=2000)}[name]
    return datasets.load(where).test.images


T10K = [pytest.mark.skipif(not HAS_T10K, reason=f"the MNIST test files are not in {MNIST_T10K}"),
        pytest.mark.ci_may_skip]  # as conftest.needs_t10k


@pytest.mark.parametrize("images", [pytest.param("mnist t10k", marks=T10K), "fashion-mnist", "synthetic"])
def test_onnxruntime_classifies_test_images_as_pytorch_does(exported: tuple[Path, str], trained_run: Path,
                                                            images: str) -> None:
    """The exported graph takes pixels in [0, 1] and normalises inside; PyTorch gets them as `predict` feeds
    them. Every image: the same class; the logits: float32's rounding apart."""
    path, _ = exported
    x = _test_images(images)
    session = onnxruntime.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    [name] = [i.name for i in session.get_inputs()]
    theirs = torch.from_numpy(session.run(None, {name: (x[:, None].float() / 255).numpy()})[0])
    model, ckpt = model_file.load_model(trained_run / "best.pt")
    with torch.inference_mode():
        ours = model.eval()(model_input(x, ckpt["config"]["normalize"]))
    difference = float((theirs - ours).abs().max())
    print(f"{images}: {len(x):,} images, the same class for {int((theirs.argmax(1) == ours.argmax(1)).sum()):,}, "
          f"largest logit difference {difference:.2e}")
    assert theirs.shape == (len(x), 10) and torch.equal(theirs.argmax(1), ours.argmax(1))
    assert difference < 1e-3 and len(set(ours.argmax(1).tolist())) >= 3  # a model that tells classes apart


def test_the_file_says_what_it_takes_and_is_a_valid_model(exported: tuple[Path, str], trained_run: Path) -> None:
    path, said = exported
    assert said.startswith(f"export: {path} (") and said.count("\n") == 1, said
    assert "the same class for 1,000 of 1,000 synthetic digits, largest logit difference" in said, said
    model = onnx.load(path)
    onnx.checker.check_model(model)
    props = {p.key: p.value for p in model.metadata_props}
    assert props["source"] == str(trained_run / "model.safetensors") and props["dataset"] == "synthetic"
    assert '"applied": "inside the graph"' in props["normalization"] and props["classes"].startswith('["0", "1"')
    assert [i.name for i in model.graph.input] == ["pixels"] and [o.name for o in model.graph.output] == ["logits"]
    assert model.graph.input[0].type.tensor_type.shape.dim[0].dim_param  # any batch size


def test_the_exports_check_tells_another_model_apart() -> None:
    """The check the command runs before it writes the file (`export.compare`) sees a file of another model."""
    torch.manual_seed(0)
    one, other = ConvNet().eval(), ConvNet().eval()
    data = export.to_onnx(one, True, {})
    digits = synthetic.generate(200, seed=3)[0]
    same = export.compare(data, one, True, digits)
    assert same.same_class == 200 and same.largest_difference < 1e-4
    assert export.compare(data, other, True, digits).largest_difference > 1e-2
    assert export.compare(data, one, False, digits).largest_difference > 1e-2  # the normalisation is in the graph


@pytest.mark.parametrize("case", ["exists", "not .onnx", "no model in the folder"])
def test_bad_export_is_one_sentence_exit_2(trained_run: Path, tmp_path: Path, case: str,
                                           capsys: pytest.CaptureFixture[str]) -> None:
    target, source = tmp_path / "model.onnx", trained_run
    if case == "exists":
        target.write_bytes(b"keep me")
    elif case == "not .onnx":
        target = tmp_path / "model.pt"
    elif case == "no model in the folder":
        source = tmp_path
    code = cli.main(["export", str(source), "--onnx", str(target)])
    out, err = capsys.readouterr()
    assert (code, out) == (2, "") and len(err.strip().splitlines()) == 1, err
    said = {"exists": "already exists", "not .onnx": "name the file *.onnx", "no model in the folder":
            "a folder without model.safetensors or best.pt"}[case]
    assert said in err, err
    assert case != "exists" or target.read_bytes() == b"keep me"
