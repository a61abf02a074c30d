"""model.safetensors: a real run writes best.pt's weights and what their user needs; `evaluate` and `predict` take it
as they take a checkpoint; the `safetensors` package reads what we write and writes what we read; a damaged or
foreign file is one sentence naming it, exit 2, and nothing in it is ever unpickled."""

import io
import json
import struct
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import torch

from conftest import TRAINED_TEST_SAMPLES, metrics
from datafiles import one_thread, write_idx
from mnist_ddp import cli
from mnist_ddp.common.results import Run
from mnist_ddp.core.batches import MEAN, STD
from mnist_ddp.data import synthetic
from mnist_ddp.outputs import checkpoint, model_file
from test_untrusted import _torch_file

pytest.importorskip("safetensors")  # the dev extra installs it
from safetensors import safe_open
from safetensors.torch import load_file, save_file

EVALUATE = ("--dataset", "synthetic", "--test-samples", TRAINED_TEST_SAMPLES)


@pytest.fixture(autouse=True, scope="module")
def _single_thread() -> Iterator[None]:
    with one_thread():
        yield


def _main(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    code = cli.main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def _best_weights(run: Path) -> dict[str, torch.Tensor]:
    return {k: v.contiguous() for k, v in checkpoint.load(run / "best.pt")["model"].items()}


def _same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(a[k].dtype == b[k].dtype and torch.equal(a[k], b[k]) for k in a)


def test_a_run_writes_best_pts_weights_and_what_they_need(trained_run: Path) -> None:
    path = trained_run / "model.safetensors"
    assert Run.load(trained_run).model == path
    theirs = load_file(path)  # the reference implementation reads it
    assert _same(theirs, _best_weights(trained_run)) and len(theirs) == 16  # 10 parameters, 6 BatchNorm buffers
    with safe_open(path, "pt") as f:
        meta = f.metadata()
    rows = metrics(trained_run)
    best = max(rows, key=lambda row: row["test_accuracy"])
    assert meta["format"] == model_file.FORMAT and meta["dataset"] == "synthetic"
    assert json.loads(meta["classes"]) == list("0123456789")
    assert json.loads(meta["normalize"]) == {"mean": MEAN, "std": STD}
    assert float(meta["test_accuracy"]) == best["test_accuracy"] and int(meta["test_count"]) == best["test_count"]
    assert int(meta["epoch"]) == best["epoch"]
    config = json.loads(meta["config"])
    assert (config["recipe"], config["optimizer"], config["lr"], config["world_size"]) == ("default", "adamw", 3e-3, 1)
    assert "out" not in config and "data_dir" not in config["data"] and str(trained_run) not in meta["config"]
    ours = model_file.load(path)
    assert _same(ours["model"], theirs) and ours["config"] == config


def test_evaluate_and_predict_take_it_as_they_take_best_pt(trained_run: Path, tmp_path: Path,
                                                           capsys: pytest.CaptureFixture[str]) -> None:
    images = tmp_path / "digits-idx3-ubyte"
    write_idx(images, synthetic.generate(8, seed=5)[0])
    said = {}
    for name in ("best.pt", "model.safetensors"):
        evaluated = _main(capsys, "evaluate", str(trained_run / name), *EVALUATE)
        predicted = _main(capsys, "predict", str(trained_run / name), str(images), "--top", "2")
        assert evaluated[0] == predicted[0] == 0, evaluated[2] + predicted[2]
        said[name] = evaluated[1], predicted[1]
    assert said["best.pt"] == said["model.safetensors"] and "/200) on synthetic" in said["best.pt"][0], said


def test_the_safetensors_package_writes_what_we_read(trained_run: Path, tmp_path: Path,
                                                     capsys: pytest.CaptureFixture[str]) -> None:
    """Rewritten by the package (its own layout and header), ours still verifies; its plain save of a state_dict
    is a stranger's weights, as a bare state_dict is; a weight it changed under our metadata is refused."""
    path = trained_run / "model.safetensors"
    with safe_open(path, "pt") as f:
        meta = f.metadata()
    rewritten, plain, changed = tmp_path / "rewritten.safetensors", tmp_path / "plain.safetensors", tmp_path / "x.bin"
    save_file(dict(reversed(load_file(path).items())), rewritten, metadata=meta)
    assert rewritten.read_bytes() != path.read_bytes()
    assert model_file.load(rewritten)["config"] == json.loads(meta["config"])
    save_file(_best_weights(trained_run), plain)
    assert model_file.load(plain).keys() == {"model"}
    code, out, err = _main(capsys, "evaluate", str(plain), *EVALUATE)
    assert code == 0 and "/200) on synthetic" in out, err
    weights = load_file(path)
    weights["fc.bias"][3] += 1e-3
    save_file(weights, changed, metadata=meta)  # any name: a safetensors file is told by its first bytes
    code, _, err = _main(capsys, "evaluate", str(changed), *EVALUATE)
    assert code == 2 and f"{changed}: damaged: its contents no longer match the digest" in err, err


def _split(data: bytes) -> tuple[dict, bytes]:
    size = struct.unpack("<Q", data[:8])[0]
    return json.loads(data[8:8 + size]), data[8 + size:]


def _joined(header: dict, body: bytes) -> bytes:
    text = json.dumps(header).encode()
    return struct.pack("<Q", len(text)) + text + body


def _edit_header(edit: Callable[[dict], None]) -> Callable[[bytes], bytes]:
    def damage(data: bytes) -> bytes:
        header, body = _split(data)
        edit(header)
        return _joined(header, body)
    return damage


def _flip_last_byte(data: bytes) -> bytes:
    return data[:-1] + bytes([data[-1] ^ 1])


def _pickled(_: bytes) -> bytes:
    """What torch.save writes: a pickle, which a file read as safetensors must never be unpickled as."""
    buffer = io.BytesIO()
    torch.save({"model": {"fc.bias": torch.zeros(10)}}, buffer)
    return buffer.getvalue()


def _shift(header: dict, by: int) -> None:
    """Move one tensor's byte range (not the first's) by `by` bytes, leaving a hole or an overlap."""
    header["layer1.0.weight"]["data_offsets"] = [n + by for n in header["layer1.0.weight"]["data_offsets"]]


def _another_network(header: dict) -> None:
    """A stranger's file (no metadata of ours) whose tensors are not the ConvNet's."""
    del header["__metadata__"]
    header["extra.weight"] = header.pop("fc.bias")


DAMAGE: dict[str, tuple[Callable[[bytes], bytes], str]] = {
    "empty": (lambda data: b"", "header too small"),
    "truncated": (lambda data: data[:-7], "file not fully covered"),
    "one bit of a weight": (_flip_last_byte, "damaged: its contents no longer match the digest"),
    "header length past the end": (lambda data: struct.pack("<Q", 2**63) + data[8:], "header too large"),
    "header not JSON": (lambda data: data[:8] + b"[" + data[9:], "invalid JSON in header"),
    "nested past recursion": (lambda data: struct.pack("<Q", 200_000) + b"[" * 200_000, "invalid JSON in header"),
    "offsets overlapping": (_edit_header(lambda h: _shift(h, -4)), "invalid offset for tensor"),
    "offsets beyond the data": (_edit_header(lambda h: _shift(h, 10**12)), "invalid offset for tensor"),
    "shape lies": (_edit_header(lambda h: h["fc.bias"].__setitem__("shape", [1000000])), "invalid shape, data type"),
    "unknown dtype": (_edit_header(lambda h: h["fc.bias"].__setitem__("dtype", "F8_E4M3")), "invalid shape, data type"),
    "metadata not strings": (_edit_header(lambda h: h["__metadata__"].__setitem__("epoch", 2)),
                             "expected a string"),
    "another network": (_edit_header(_another_network), "not a checkpoint of this ConvNet"),
    "a PNG": (lambda data: b"\x89PNG\r\n\x1a\n" + b"\0" * 64, "not a safetensors file"),
    "a pickle": (_pickled, "not a safetensors file"),
}


@pytest.mark.parametrize("command", ["evaluate", "predict"])
def test_a_pickle_that_runs_code_named_safetensors_is_never_unpickled(tmp_path: Path, command: str,
                                                                      capsys: pytest.CaptureFixture[str]) -> None:
    """A torch.save'd payload that creates a file when unpickled (test_untrusted shows that it does), saved as
    model.safetensors: refused as not a safetensors file, and the file is never made."""
    marker, path = tmp_path / "code-ran", tmp_path / "model.safetensors"
    path.write_bytes(_torch_file(marker))
    image = tmp_path / "zeros-idx3-ubyte"
    write_idx(image, torch.zeros(1, 28, 28, dtype=torch.uint8))
    argv = ["evaluate", str(path), *EVALUATE] if command == "evaluate" else ["predict", str(path), str(image)]
    code, _, err = _main(capsys, *argv)
    assert code == 2 and "not a safetensors file" in err, err
    assert not marker.exists()


@pytest.mark.parametrize("kind", DAMAGE)
@pytest.mark.parametrize("command", ["evaluate", "predict"])
def test_a_damaged_or_foreign_file_is_one_sentence_exit_2(trained_run: Path, tmp_path: Path, kind: str, command: str,
                                                          capsys: pytest.CaptureFixture[str]) -> None:
    damage, said = DAMAGE[kind]
    path = tmp_path / "model.safetensors"
    path.write_bytes(damage((trained_run / "model.safetensors").read_bytes()))
    image = tmp_path / "zeros-idx3-ubyte"
    write_idx(image, torch.zeros(1, 28, 28, dtype=torch.uint8))
    argv = ["evaluate", str(path), *EVALUATE] if command == "evaluate" else ["predict", str(path), str(image)]
    code, out, err = _main(capsys, *argv)
    lines = err.strip().splitlines()
    assert (code, out) == (2, ""), err
    assert len(lines) == 1 and lines[0].startswith(f"mnist-ddp: error: {path}: ") and said in lines[0], err
