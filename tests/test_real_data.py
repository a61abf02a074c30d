"""The loader on the real files: MNIST's test split from ../shared/data/mnist-t10k, Fashion-MNIST where installed.

The checksums are the published ones torchvision uses, and the label counts are the published
counts, so these tests catch a reader that is subtly wrong (byte order, offsets, off-by-one)
in a way tiny synthetic files might not.
"""

import hashlib
import re
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from conftest import FASHION, MNIST_T10K, needs_t10k
from datafiles import one_thread
from mnist_ddp import cli
from mnist_ddp.common.config import DataConfig
from mnist_ddp.data import datasets
from mnist_ddp.model import ConvNet

MNIST_TEST_COUNTS = [980, 1135, 1032, 1010, 982, 892, 958, 1028, 974, 1009]
MNIST_FIRST_TEST_LABELS = [7, 2, 1, 0, 4, 1, 4, 9, 5, 9]
needs_fashion = pytest.mark.skipif(not (FASHION / "train-images-idx3-ubyte.gz").is_file(),
                                   reason=f"Fashion-MNIST is not installed in {FASHION} (apt: dataset-fashion-mnist)")


@pytest.fixture(autouse=True)
def _isolated(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """Nothing found by accident in ./data, and nothing written next to the shared files."""
    monkeypatch.chdir(tmp_path)
    with one_thread():
        yield


def _md5(path: Path) -> str:
    return hashlib.md5(path.read_bytes()).hexdigest()


@needs_t10k
def test_mnist_t10k_checksums_are_the_published_ones() -> None:
    published = datasets.SOURCES["mnist"].md5
    for name in ("t10k-images-idx3-ubyte.gz", "t10k-labels-idx1-ubyte.gz"):
        assert _md5(MNIST_T10K / name) == published[name], name


@needs_t10k
def test_mnist_test_split_reads_correctly() -> None:
    data = datasets.load(DataConfig("mnist", data_dir=MNIST_T10K, download=False, test_only=True))
    assert data.name == "mnist" and data.where == str(MNIST_T10K)
    images, labels = data.test.images, data.test.labels
    assert images.shape == (10_000, 28, 28) and images.dtype == torch.uint8
    assert torch.bincount(labels, minlength=10).tolist() == MNIST_TEST_COUNTS
    assert labels[:10].tolist() == MNIST_FIRST_TEST_LABELS
    assert len(data.train.labels) == 0


@needs_t10k
def test_training_needs_the_train_files_too() -> None:
    """mnist-t10k holds only the test split: a training load says so instead of half-working."""
    with pytest.raises(datasets.DataNotFound, match="mnist was not found"):
        datasets.load(DataConfig("mnist", data_dir=MNIST_T10K, download=False))


@needs_t10k
def test_evaluate_runs_on_the_test_files_alone(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    torch.manual_seed(0)
    model = ConvNet().eval()
    torch.save(model.state_dict(), tmp_path / "tutorial.pt")  # bare weights: trained on raw [0, 1] pixels
    assert cli.main(["evaluate", str(tmp_path / "tutorial.pt"), "--dataset", "mnist", "--data-dir", str(MNIST_T10K),
                     "--no-download"]) == 0
    out = capsys.readouterr().out
    m = re.search(r"\((\d+)/(\d+)\) on mnist \(" + re.escape(str(MNIST_T10K)) + r"\)", out)
    assert m and int(m[2]) == 10_000, out
    test = datasets.load(DataConfig("mnist", data_dir=MNIST_T10K, download=False, test_only=True)).test
    with torch.inference_mode():
        correct = int((model(test.images.unsqueeze(1).float() / 255).argmax(1) == test.labels).sum())
    assert int(m[1]) == correct  # every image counted once, scored like the model scores it
    assert not (MNIST_T10K / ".download.lock").exists()


@needs_fashion
def test_fashion_mnist_from_the_system_folder() -> None:
    """Debian re-compresses the files (so their .gz MD5s differ from the published ones): check the content."""
    data = datasets.load(DataConfig("fashion-mnist", download=False))  # found via /usr/share/datasets
    assert Path(data.where) == FASHION and data.classes[9] == "Ankle boot"
    assert torch.bincount(data.train.labels).tolist() == [6000] * 10
    assert torch.bincount(data.test.labels).tolist() == [1000] * 10
