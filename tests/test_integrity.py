"""Checkpoints prove they are whole: damage of every kind is refused by name, or fallen back from.

A real run leaves checkpoint.pt (end of epoch 2) and checkpoint.prev.pt (mid epoch 2). Each damage below is
done to a copy of its checkpoint.pt, byte by byte, where the part lives in the file: 4 kB of the weights, of
the optimizer state, of the pickle flipped; a single bit of a float in the pickle (it still unpickles, only
the digest can tell); truncated; empty; another run's (other settings). Then:
- `evaluate`, `predict` and `--resume` without a previous checkpoint refuse it: one line naming it, exit 2,
  no file in the folder changed;
- `--resume` with the previous checkpoint falls back to it, says so, keeps the refused file's bytes (as
  checkpoint.pt.rejected) and trains on to the very weights of the undamaged run.
"""

import hashlib
import shutil
import struct
import zipfile
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from conftest import run_cli, tiny
from datafiles import ONE_THREAD
from mnist_ddp import cli
from mnist_ddp.outputs import checkpoint

ARGS = [*tiny(800, 200, epochs=2), "--checkpoint-every", "4"]  # 8 steps per epoch: 4 saves, the last two kept


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Two finished runs: A, and B of another seed (another run, by its settings)."""
    root = tmp_path_factory.mktemp("integrity")
    for name, extra in (("A", []), ("B", ["--seed", "1"])):
        r = run_cli("train", *ARGS, *extra, "--out", str(root / name), cwd=root, env=ONE_THREAD)
        assert r.returncode == 0, r.stderr
    assert checkpoint.load(root / "A" / "checkpoint.prev.pt")["progress"]["consumed"] == 400
    return root


def _data_start(blob: bytes, info: zipfile.ZipInfo) -> int:
    """Where a zip member's bytes begin: after its local header (whose name and extra field torch pads)."""
    name_len, extra_len = struct.unpack("<HH", blob[info.header_offset + 26:info.header_offset + 30])
    return info.header_offset + 30 + name_len + extra_len


def _pickle_span(blob: bytes, path: Path) -> tuple[int, int]:
    with zipfile.ZipFile(path) as z:
        info = next(i for i in z.infolist() if i.filename.endswith("data.pkl"))
    start = _data_start(blob, info)
    return start, start + info.file_size


def _tensor_span(blob: bytes, t: torch.Tensor) -> tuple[int, int]:
    start = blob.find(t.numpy().tobytes())
    assert start > 0
    return start, start + t.numel() * t.element_size()


def _flip(blob: bytes, span: tuple[int, int], n: int = 4096) -> bytes:
    """`n` bytes in the middle of `span` (or all of it, if shorter) inverted."""
    lo, hi = span
    n = min(n, hi - lo)
    at = lo + (hi - lo - n) // 2
    return blob[:at] + bytes(b ^ 0xFF for b in blob[at:at + n]) + blob[at + n:]


def _float_bit(blob: bytes, path: Path) -> bytes:
    """The lowest bit of progress.loss_sum (a BINFLOAT in the pickle) flipped: the file still loads."""
    value = torch.load(path, weights_only=True)["progress"]["loss_sum"]
    lo, hi = _pickle_span(blob, path)
    at = blob.index(b"G" + struct.pack(">d", value), lo, hi) + 8
    return blob[:at] + bytes([blob[at] ^ 1]) + blob[at + 1:]


def _damaged(kind: str, runs: Path, name: str = "checkpoint.pt") -> bytes:
    """Run A's `name` (checkpoint.pt or best.pt), damaged as `kind` says."""
    path = runs / "A" / name
    blob, ckpt = path.read_bytes(), torch.load(path, weights_only=True)
    optimizer_state = max(ckpt["optimizer"]["state"].values(), key=lambda s: s["exp_avg_sq"].numel())
    damage: dict[str, Callable[[], bytes]] = {
        "weights flipped": lambda: _flip(blob, _tensor_span(blob, ckpt["model"]["fc.weight"])),
        "optimizer state flipped": lambda: _flip(blob, _tensor_span(blob, optimizer_state["exp_avg_sq"])),
        "pickle flipped": lambda: _flip(blob, _pickle_span(blob, path)),
        "one bit of a float in the pickle": lambda: _float_bit(blob, path),
        "truncated": lambda: blob[:len(blob) // 2],
        "empty": lambda: b"",
        "another run's": lambda: (runs / "B" / "checkpoint.pt").read_bytes(),
    }
    return damage[kind]()


KINDS = {  # what the one line must say
    "weights flipped": "damaged",
    "optimizer state flipped": "damaged",
    "pickle flipped": "not a PyTorch checkpoint",
    "one bit of a float in the pickle": "damaged",
    "truncated": "not a PyTorch checkpoint, or a truncated one",
    "empty": "the file is empty",
    "another run's": "different settings (seed)",
}


def _fingerprint(folder: Path) -> dict[str, str]:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(folder.iterdir()) if p.is_file()}


def test_digest_survives_save_and_load_and_sees_one_bit(tmp_path: Path) -> None:
    payload = {"model": {"w": torch.arange(6.0).reshape(2, 3), "n": torch.tensor(3)}, "progress": {"epoch": 1}}
    checkpoint.save(tmp_path / "c.pt", payload)
    loaded = checkpoint.load(tmp_path / "c.pt")
    assert "digest" not in loaded and loaded["format"] == checkpoint.FORMAT
    assert checkpoint.digest(loaded) == checkpoint.digest({**payload, "format": checkpoint.FORMAT})
    changed = {**payload, "model": {**payload["model"], "w": payload["model"]["w"].clone()}}
    changed["model"]["w"].view(torch.int32)[1, 1] ^= 1  # one bit of one float
    assert checkpoint.digest(changed) != checkpoint.digest(payload)


# Another run's checkpoint is a good checkpoint to evaluate or predict with: only --resume refuses it. best.pt is
# verified like checkpoint.pt by evaluate and predict (--resume never reads it).
REFUSALS = [*[("train --resume", kind, "checkpoint.pt") for kind in KINDS],
            *[(command, kind, name) for command in ("evaluate", "predict") for kind in KINDS if kind != "another run's"
              for name in ("checkpoint.pt", "best.pt")]]


@pytest.mark.parametrize(("command", "kind", "name"), REFUSALS)
def test_damaged_checkpoint_is_refused_by_name_and_left_alone(runs: Path, tmp_path: Path, kind: str, command: str,
                                                              name: str, capfd: pytest.CaptureFixture[str]) -> None:
    """No previous checkpoint to fall back to: one line naming the file, exit 2, nothing in the folder touched."""
    out = tmp_path / "run"
    shutil.copytree(runs / "A", out)
    (out / "checkpoint.prev.pt").unlink()
    ckpt = out / name
    ckpt.write_bytes(_damaged(kind, runs, name))
    before = _fingerprint(out)
    argv = {"evaluate": ["evaluate", str(ckpt), "--dataset", "synthetic", "--test-samples", "50"],
            "predict": ["predict", str(ckpt), str(tmp_path / "digit.png")],
            "train --resume": ["train", *ARGS, "--out", str(out), "--resume"]}[command]
    code = cli.main(argv)
    _, err = capfd.readouterr()
    lines = err.strip().splitlines()
    assert code == 2, err
    assert len(lines) == 1 and lines[0].startswith(f"mnist-ddp: error: {ckpt}") and "Traceback" not in err, err
    assert KINDS[kind] in lines[0], lines[0]
    assert _fingerprint(out) == before


@pytest.mark.parametrize("kind", [*KINDS, "missing"])
def test_resume_falls_back_to_the_previous_checkpoint(runs: Path, tmp_path: Path, kind: str) -> None:
    """The damaged latest is set aside whole, the previous one resumed from, and the run ends exactly where the
    undamaged run ended (the same steps from the same state)."""
    out = tmp_path / "run"
    shutil.copytree(runs / "A", out)
    ckpt = out / "checkpoint.pt"
    if kind == "missing":  # deleted, or killed mid-save on a file system without hard links
        ckpt.unlink()
    else:
        ckpt.write_bytes(bad := _damaged(kind, runs))
    r = run_cli("train", *ARGS, "--out", str(out), "--resume", cwd=tmp_path, env=ONE_THREAD)
    assert r.returncode == 0, r.stderr
    said = next(line for line in r.stdout.splitlines() if line.startswith("resume: ") and str(ckpt) in line)
    if kind == "missing":
        assert f"{ckpt} is missing" in said and "resuming from" in said, said
    else:
        assert KINDS[kind] in said and f"falling back to {out / 'checkpoint.prev.pt'}" in said, said
        assert (out / "checkpoint.pt.rejected").read_bytes() == bad
    assert f"resume: from {out / 'checkpoint.prev.pt'}, epoch 2, 400 of its 800 samples done" in r.stdout
    mine, reference = (checkpoint.load(p / "checkpoint.pt")["model"] for p in (out, runs / "A"))
    assert all(torch.equal(mine[k], reference[k]) for k in reference)


def test_both_checkpoints_damaged_is_refused_naming_both(runs: Path, tmp_path: Path,
                                                        capfd: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "run"
    shutil.copytree(runs / "A", out)
    (out / "checkpoint.pt").write_bytes(_damaged("weights flipped", runs))
    (out / "checkpoint.prev.pt").write_bytes(b"")
    before = _fingerprint(out)
    code = cli.main(["train", *ARGS, "--out", str(out), "--resume"])
    _, err = capfd.readouterr()
    assert code == 2 and len(err.strip().splitlines()) == 1, err
    assert f"{out / 'checkpoint.pt'}: damaged" in err and f"{out / 'checkpoint.prev.pt'}: not a PyTorch" in err, err
    assert _fingerprint(out) == before
