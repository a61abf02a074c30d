"""checkpoint.py in one process, fast enough for mutation testing (tests/mutate.py): what a save writes, what a
load accepts and refuses and with which sentence, and how --resume falls back to the checkpoint before."""

import io
import re
import struct
import warnings
import zipfile
from pathlib import Path

import pytest
import torch

from mnist_ddp.common.errors import UserError
from mnist_ddp.model import ConvNet
from mnist_ddp.outputs import checkpoint
from test_integrity import _flip, _tensor_span


def _payload(seed: int = 0) -> dict:
    torch.manual_seed(seed)
    return {"model": ConvNet().state_dict(), "optimizer": {"state": {}}, "progress": {"epoch": seed}, "rng": {}}


def _flip_a_weight(path: Path) -> None:
    """Invert bytes of a tensor's stored bytes: the zip and the pickle still read, only the digest can tell."""
    blob = path.read_bytes()
    path.write_bytes(_flip(blob, _tensor_span(blob, torch.load(path, weights_only=True)["model"]["fc.weight"])))


def _saved(path: Path, payload: dict) -> bytes:
    buffer = io.BytesIO()
    torch.save(payload, buffer)
    path.write_bytes(buffer.getvalue())
    return buffer.getvalue()


def test_a_save_loads_as_it_was_and_keeps_the_one_before(tmp_path: Path) -> None:
    path = tmp_path / "checkpoint.pt"
    checkpoint.save(path, _payload(1))
    checkpoint.save(path, {**_payload(2), "digest": "stale"}, keep_previous=True)
    now, before = checkpoint.load(path), checkpoint.load(checkpoint.previous(path))
    assert checkpoint.previous(path).name == "checkpoint.prev.pt"
    assert now["progress"] == {"epoch": 2} and before["progress"] == {"epoch": 1}
    assert now["format"] == checkpoint.FORMAT and "digest" not in now
    assert checkpoint.digest(now["model"]) == checkpoint.digest(_payload(2)["model"])
    checkpoint.save(path, _payload(3))  # without keep_previous the one before stays as it was
    assert checkpoint.load(checkpoint.previous(path))["progress"] == {"epoch": 1}


def test_the_digest_sees_a_bit_a_dtype_a_shape_a_key_and_the_order() -> None:
    t = torch.arange(6, dtype=torch.float32)
    flipped = t.clone()
    flipped.view(torch.int32)[5] ^= 1
    base = checkpoint.digest({"a": t, "b": [1, (2, "x")]})
    others = [{"a": flipped, "b": [1, (2, "x")]}, {"a": t.double(), "b": [1, (2, "x")]},
              {"a": t.view(2, 3), "b": [1, (2, "x")]}, {"c": t, "b": [1, (2, "x")]},
              {"b": [1, (2, "x")], "a": t}, {"a": t, "b": [1, [2, "x"]]}, {"a": t, "b": [1, (2, "y")]},
              {"a": t, "b": [1, (2,)]}]
    assert base == checkpoint.digest({"a": t.clone(), "b": [1, (2, "x")]})
    assert re.fullmatch("sha256:[0-9a-f]{64}", base)  # as files and model.safetensors carry it
    assert len({base, *map(checkpoint.digest, others)}) == len(others) + 1


def test_a_changed_file_is_refused_by_name(tmp_path: Path) -> None:
    path = tmp_path / "checkpoint.pt"
    checkpoint.save(path, _payload())
    _flip_a_weight(path)
    with pytest.raises(UserError, match=r"checkpoint.pt: damaged: its contents no longer match the digest"):
        checkpoint.load(path)


@pytest.mark.parametrize("payload, accepted", [
    ({"model": {"w": torch.ones(2)}, "format": checkpoint.UNVERIFIED}, "model"),  # saved before digests
    ({"w": torch.ones(2)}, "bare"),  # the tutorial's state_dict
])
def test_files_without_a_digest_load_unverified(tmp_path: Path, payload: dict, accepted: str) -> None:
    _saved(tmp_path / "c.pt", payload)
    got = checkpoint.load(tmp_path / "c.pt")
    assert torch.equal(got["model"]["w"], torch.ones(2)) and (accepted == "model") == ("format" in got)


@pytest.mark.parametrize("payload, said", [
    ({"model": {}, "format": checkpoint.FORMAT}, f"damaged: a checkpoint of format {checkpoint.FORMAT} without the "
                                                  "digest it was saved with, so nothing proves it whole."),
    ({"model": {}, "digest": "sha256:0"}, "no longer match the digest"),
    ([torch.ones(1)], "holds a list, not a model checkpoint"),
    ({}, "holds a dict, not a model checkpoint"),
    ({"w": torch.ones(1), "n": 3}, "holds a dict, not a model checkpoint"),
    ({"model": [torch.ones(1)]}, "holds a dict, not a model checkpoint"),
])
def test_what_is_not_a_checkpoint_of_ours_is_refused(tmp_path: Path, payload: object, said: str) -> None:
    _saved(tmp_path / "c.pt", payload)
    with pytest.raises(UserError, match=f"^c.pt: .*{said}"):
        checkpoint.parse((tmp_path / "c.pt").read_bytes(), "c.pt")


def _zip_of(data: bytes, compress: int) -> bytes:
    """`data`'s torch.save archive rewritten with every member stored the `compress` way."""
    out = io.BytesIO()
    with zipfile.ZipFile(io.BytesIO(data)) as z, zipfile.ZipFile(out, "w", compress) as w:
        for m in z.infolist():
            w.writestr(m.filename, z.read(m.filename))
    return out.getvalue()


def _with_pickle(data: bytes, pickle: bytes | None) -> bytes:
    """`data`'s archive with its data.pkl replaced by `pickle`, or left out (None)."""
    out = io.BytesIO()
    with zipfile.ZipFile(io.BytesIO(data)) as z, zipfile.ZipFile(out, "w") as w:
        for m in z.infolist():
            if not m.filename.endswith("data.pkl"):
                w.writestr(m.filename, z.read(m.filename))
            elif pickle is not None:
                w.writestr(m.filename, pickle)
    return out.getvalue()


def _marked_deflated(data: bytes) -> bytes:
    """`data` with every member said to be deflated (method 8) in its headers, its bytes still stored as they are."""
    out = bytearray(data)
    for signature, at in ((b"PK\x03\x04", 8), (b"PK\x01\x02", 10)):  # local headers, central directory entries
        start = out.find(signature)
        while start != -1:
            out[start + at:start + at + 2] = struct.pack("<H", 8)
            start = out.find(signature, start + 4)
    return bytes(out)


def test_bytes_torch_save_does_not_write_are_refused_before_unpickling(tmp_path: Path,
                                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    data = _saved(tmp_path / "c.pt", _payload())
    refusals = {
        b"": "not a PyTorch checkpoint: the file is empty (0 bytes).",
        b"\x80\x02}q\x00.": "not a PyTorch checkpoint (a zip archive, as torch.save writes since PyTorch 1.6; this "
                            "is its legacy format: load it and save it again).",
        b"GIF89a": "not a PyTorch checkpoint (a zip archive, as torch.save writes since PyTorch 1.6).",
        data[:200]: "not a PyTorch checkpoint, or a truncated one (File is not a zip file).",
        _with_pickle(data, b"\x80\x02Xjunk"): "not a PyTorch checkpoint, or a truncated one.",
        _with_pickle(data, None): "not a PyTorch checkpoint, or a truncated one (PytorchStreamReader failed locating "
                                  "file data.pkl: file not found).",
    }
    for bad, said in refusals.items():
        with pytest.raises(UserError, match=f"^{re.escape('c.pt: ' + said)}$"):
            checkpoint.parse(bad, "c.pt")
    for deflated in (_zip_of(data, zipfile.ZIP_DEFLATED), _marked_deflated(data)):  # either size or kind tells
        said = "not a checkpoint torch.save wrote: its member archive/data.pkl is compressed, and torch.save stores "
        with pytest.raises(UserError, match=f"^c.pt: {re.escape(said)}every member as it is.$"):
            checkpoint.parse(deflated, "c.pt")
    assert checkpoint.parse(_zip_of(data, zipfile.ZIP_STORED), "c.pt")["progress"] == {"epoch": 0}
    with zipfile.ZipFile(io.BytesIO(data)) as z:
        size = next(m.file_size for m in z.infolist() if m.filename.endswith("data.pkl"))
    monkeypatch.setattr(checkpoint, "MOST_PICKLE", size)  # at the bound: read
    assert checkpoint.parse(data, "c.pt")["progress"] == {"epoch": 0}
    monkeypatch.setattr(checkpoint, "MOST_PICKLE", size - 1)
    with pytest.raises(UserError, match=f"its pickle is {size:,} bytes, more than a checkpoint's \\({size - 1:,} at"):
        checkpoint.parse(data, "c.pt")


def test_other_pickle_protocols_load_quietly_or_are_refused_in_one_sentence(tmp_path: Path) -> None:
    """Protocol 3 loads, without torch's warning about it; protocol 4's opcodes the weights-only loader refuses."""
    payload = {"model": {"w": torch.ones(1)}}
    for protocol in (3, 4):
        buffer = io.BytesIO()
        torch.save(payload, buffer, pickle_protocol=protocol)
        with warnings.catch_warnings(record=True) as seen:
            warnings.simplefilter("always")
            if protocol == 3:
                assert torch.equal(checkpoint.parse(buffer.getvalue(), "c.pt")["model"]["w"], torch.ones(1))
            else:
                with pytest.raises(UserError, match=r"^c.pt: not a PyTorch checkpoint \(a pickle the weights-only "
                                                    r"loader cannot read\).$"):
                    checkpoint.parse(buffer.getvalue(), "c.pt")
        assert not seen, [str(w.message) for w in seen]


def test_a_path_that_is_not_a_file_is_refused_as_a_checkpoint(tmp_path: Path) -> None:
    with pytest.raises(UserError, match=f"^{re.escape(str(tmp_path))}: a folder, not a file; a checkpoint must be a "
                                        "regular file.$"):
        checkpoint.load(tmp_path)


class Touch:
    """Unpickled, it creates a file: the proof that a refused checkpoint never ran its pickle."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def __reduce__(self) -> tuple:
        return Path.touch, (self.path,)


def test_a_pickle_that_would_run_code_is_refused_naming_what_it_imports(tmp_path: Path) -> None:
    marker = tmp_path / "ran"
    data = _saved(tmp_path / "c.pt", {**_payload(), "extra": Touch(marker)})
    with pytest.raises(UserError, match=r"^c.pt: refused, loading it would import getattr and could run code; "
                                        r"only checkpoints of tensors and plain values are accepted.$"):
        checkpoint.parse(data, "c.pt")
    assert not marker.exists()
    torch.load(io.BytesIO(data), weights_only=False)  # the control: loaded as a trusted file, the pickle runs
    assert marker.exists()


def test_values_no_checkpoint_holds_are_refused(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    big = torch.zeros(100).expand(3, 100)  # a view repeating 400 stored bytes 3 times
    quantized = torch.quantize_per_tensor(torch.ones(2), 0.1, 0, torch.quint8)
    repeats = r"holds a tensor of shape \(3, 100\) that repeats the 400 bytes it stores"
    for payload, said in (({"model": {"w": big}, "notes": [1, 2]}, repeats),
                          ({"model": {"w": torch.eye(3).to_sparse()}}, "holds a torch.sparse_coo tensor; a checkpoint "
                                                                       "holds plain dense tensors only.$"),
                          ({"model": {"q": quantized}}, "holds a quantized tensor")):
        with pytest.raises(UserError, match="^c.pt: " + said):
            checkpoint.parse(_saved(tmp_path / "c.pt", payload), "c.pt")
    assert checkpoint.parse(_saved(tmp_path / "c.pt", {"model": {"w": torch.zeros(0)}}), "c.pt")
    monkeypatch.setattr(checkpoint, "MOST_VALUES", 6)  # the dict, its key, the inner dict, its 2 keys, 2 tensors: 7
    data = _saved(tmp_path / "c.pt", {"model": {"a": torch.ones(1), "b": torch.ones(1)}})
    with pytest.raises(UserError, match=r"^c.pt: holds more than 6 values, more than any checkpoint does.$"):
        checkpoint.parse(data, "c.pt")
    monkeypatch.setattr(checkpoint, "MOST_VALUES", 7)
    assert set(checkpoint.parse(data, "c.pt")["model"]) == {"a", "b"}


def test_a_torch_before_2_10_loads_nothing(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    data = _saved(tmp_path / "c.pt", _payload())
    for version, loads in (("2.9.1+cpu", False), ("2.10.0", True), ("1.13.1", False), ("3.0.0", True)):
        monkeypatch.setattr(torch, "__version__", version)
        if loads:
            assert checkpoint.parse(data, "c.pt")
        else:
            with pytest.raises(UserError, match=re.escape(f"PyTorch {version} is older than 2.10")):
                checkpoint.parse(data, "c.pt")


class Said(list):
    def __call__(self, line: str) -> None:
        self.append(line)


def _pair(tmp_path: Path, damaged: tuple[str, ...] = ()) -> Path:
    path = tmp_path / "checkpoint.pt"
    checkpoint.save(path, _payload(1))
    checkpoint.save(path, _payload(2), keep_previous=True)
    for name in damaged:
        _flip_a_weight(tmp_path / name)
    return path


def test_resume_takes_the_newest_it_can_use(tmp_path: Path) -> None:
    said = Said()
    path = _pair(tmp_path)
    found, ckpt = checkpoint.load_latest(path, lambda p, c: None, said)
    assert found == path and ckpt["progress"] == {"epoch": 2} and said == []
    path.unlink()
    found, ckpt = checkpoint.load_latest(path, lambda p, c: None, said)
    assert found == checkpoint.previous(path) and ckpt["progress"] == {"epoch": 1}
    assert said == [f"resume: {path} is missing; resuming from {found}, the checkpoint saved before it"]
    checkpoint.previous(path).unlink()
    assert checkpoint.load_latest(path, lambda p, c: None, said) is None


@pytest.mark.parametrize("refused", ["damaged", "another run's"])
def test_resume_falls_back_and_sets_the_refused_file_aside(tmp_path: Path, refused: str) -> None:
    def check(p: Path, c: dict) -> None:
        if refused == "another run's" and c["progress"]["epoch"] == 2:
            raise UserError(f"{p}: another run.")

    path, said = _pair(tmp_path, ("checkpoint.pt",) if refused == "damaged" else ()), Said()
    kept = path.read_bytes()
    found, ckpt = checkpoint.load_latest(path, check, said)
    aside = tmp_path / "checkpoint.pt.rejected"
    assert found == checkpoint.previous(path) and ckpt["progress"] == {"epoch": 1}
    assert not path.exists() and aside.read_bytes() == kept
    why = str(checkpoint.changed(path)) if refused == "damaged" else f"{path}: another run."
    assert said == [f"resume: {why[:-1]}; falling back to {found}, the checkpoint saved before it (the refused file "
                    f"is kept as {aside})"]


@pytest.mark.parametrize("damaged", [("checkpoint.pt", "checkpoint.prev.pt"), ("checkpoint.pt",)])
def test_nothing_to_resume_from_is_one_sentence_and_changes_no_file(tmp_path: Path, damaged: tuple[str, ...]) -> None:
    path = _pair(tmp_path, damaged)
    if len(damaged) == 1:
        checkpoint.previous(path).unlink()
    before = {p: p.read_bytes() for p in tmp_path.iterdir()}
    with pytest.raises(UserError) as refusal:
        checkpoint.load_latest(path, lambda p, c: None, Said())
    said, why = str(refusal.value), str(checkpoint.changed("X")).removeprefix("X")
    assert said == (f"{path}{why}" if len(damaged) == 1 else f"{path}{why[:-1]}; and the checkpoint before it cannot "
                                                               f"be used either: {checkpoint.previous(path)}{why}")
    assert {p: p.read_bytes() for p in tmp_path.iterdir()} == before


def test_weights_alone_cannot_be_resumed(tmp_path: Path) -> None:
    path = tmp_path / "checkpoint.pt"
    checkpoint.save(path, {"model": ConvNet().state_dict(), "progress": {}})
    with pytest.raises(UserError, match=f"^{re.escape(str(path))}: holds model weights but no training state "
                                        r"\(optimizer, rng\), so a run cannot continue from it"):
        checkpoint.load_resumable(path)
    assert checkpoint.load(path)["progress"] == {}


def test_what_rank_0_sends_arrives_checked(tmp_path: Path) -> None:
    found = (tmp_path / "checkpoint.pt", _payload(4))
    path, ckpt = checkpoint.unpack(checkpoint.pack(found))
    assert path == found[0] and checkpoint.digest(ckpt) == checkpoint.digest(found[1])
    assert checkpoint.unpack(checkpoint.pack(None)) is None
    buffer = io.BytesIO()
    for sent in ({"path": "p", "checkpoint": _payload(), "digest": checkpoint.digest(_payload(1))},
                 {"path": 3, "checkpoint": _payload(), "digest": checkpoint.digest(_payload())},
                 {"path": "p", "checkpoint": {"model": [1]}, "digest": checkpoint.digest({"model": [1]})},
                 {"path": "p", "checkpoint": [], "digest": checkpoint.digest([])}, [1]):
        buffer.seek(0)
        buffer.truncate()
        torch.save(sent, buffer)
        with pytest.raises(UserError, match=r"^the checkpoint rank 0 sent: damaged"):
            checkpoint.unpack(buffer.getvalue())
    weights_only = {"model": _payload()["model"]}
    for data, said in ((checkpoint.pack((tmp_path, weights_only)), "holds model weights but no training state"),
                       (b"junk", "not a PyTorch checkpoint")):
        with pytest.raises(UserError, match=f"^the checkpoint rank 0 sent: {said}"):
            checkpoint.unpack(data)


def test_wrapped_weights_load_into_a_plain_convnet_and_others_are_refused() -> None:
    want, model = ConvNet().state_dict(), ConvNet()
    state = {f"module._orig_mod.{k}": v + 1 for k, v in want.items()}
    ddp, compiled = torch.nn.Module(), torch.nn.Module()  # what DDP and torch.compile hold the model as
    ddp.module, compiled._orig_mod = compiled, model
    checkpoint.restore_model(ddp, state, "c.pt")
    assert all(torch.equal(v, want[k] + 1) for k, v in model.state_dict().items())
    first, n = next(iter(want)), len(want)
    shape = tuple(want[first].shape)
    bad = {"not a state_dict": ([1], "its model is not a state_dict (tensors by name)."),
           "numbered": ({0: torch.ones(1)}, "its model is not a state_dict (tensors by name)."),
           "missing": ({k: v for k, v in want.items() if k != first},
                       f"not a checkpoint of this ConvNet: it lacks 1 of the ConvNet's {n} tensors (e.g. {first})."),
           "unknown": ({**want, "extra": torch.ones(1)},
                       "not a checkpoint of this ConvNet: has 1 the ConvNet does not (e.g. extra)."),
           "both": ({**{k: v for k, v in want.items() if k != first}, "extra": torch.ones(1)},
                    f"not a checkpoint of this ConvNet: it lacks 1 of the ConvNet's {n} tensors (e.g. {first}), has 1 "
                    "the ConvNet does not (e.g. extra)."),
           "shape": ({**want, first: torch.ones(1)},
                     f"not a checkpoint of this ConvNet: has {first} of shape (1,), not {shape}."),
           "a number": ({**want, first: 3}, f"not a checkpoint of this ConvNet: has {first} of shape (), not {shape}."),
           "integers": ({**want, first: want[first].long()},
                        f"{first} holds torch.int64 numbers, where the ConvNet's are torch.float32."),
           "complex": ({**want, first: want[first].to(torch.complex64)}, f"{first} holds torch.complex64 numbers"),
           "NaN": ({**want, first: want[first] * float("nan")}, f"{first} holds NaN or infinite numbers; a trained "
                                                                "model has none."),
           "a count in floats": ({**want, "layer1.1.num_batches_tracked": torch.tensor(7.0)},
                                 "layer1.1.num_batches_tracked holds torch.float32 numbers, where the ConvNet's are "
                                 "torch.int64."),
           "infinite": ({**want, first: want[first] / 0}, f"{first} holds NaN or infinite numbers")}
    for state, said in bad.values():
        with pytest.raises(UserError, match=f"^{re.escape('c.pt: ' + said)}"):
            checkpoint.restore_model(ddp, state, "c.pt")
    checkpoint.check_weights({**want, "layer1.1.num_batches_tracked": torch.tensor(7)}, want, "c.pt")
