"""`evaluate` and `predict` on a checkpoint a real run saved, on bare state_dicts, PNGs and IDX files."""

import re
import struct
import zlib
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from conftest import TINY, metrics, run_cli
from datafiles import ONE_THREAD, one_thread
from mnist_ddp import checkpoint, cli, idx, png, synthetic
from mnist_ddp.batches import MEAN, STD
from mnist_ddp.model import ConvNet

TEST_SAMPLES = "200"


@pytest.fixture(autouse=True, scope="module")
def _single_thread() -> Iterator[None]:
    with one_thread():
        yield


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("infer") / "run"
    r = run_cli("train", *TINY, "--out", str(out), cwd=out.parent, env=ONE_THREAD)
    assert r.returncode == 0, r.stderr
    return out


@pytest.fixture(scope="module")
def digits() -> tuple[torch.Tensor, torch.Tensor]:
    return synthetic.generate(6, seed=99)


def _main(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    code = cli.main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def _expected(ckpt: Path, images: torch.Tensor) -> torch.Tensor:
    """The model's own answer, computed here without the predict command."""
    model, saved = checkpoint.load_model(ckpt)
    x = images.unsqueeze(1).float() / 255
    if saved.get("config", {}).get("normalize"):
        x = (x - MEAN) / STD
    with torch.inference_mode():
        return model.eval()(x).argmax(1)


def _predicted(stdout: str) -> list[int]:
    return [int(m) for m in re.findall(r": (\d) \(", stdout)]


def test_evaluate_matches_the_runs_final_metric(run: Path, capsys: pytest.CaptureFixture[str]) -> None:
    final = metrics(run)[-1]
    code, out, _ = _main(capsys, "evaluate", str(run / "checkpoint.pt"), "--test-samples", TEST_SAMPLES)
    assert code == 0
    m = re.search(r"test accuracy ([\d.]+)% \((\d+)/(\d+)\) on synthetic .* test loss ([\d.]+)", out)
    assert m, out
    assert (int(m[2]), int(m[3])) == (final["test_correct"], final["test_count"])
    assert float(m[1]) == pytest.approx(100 * final["test_accuracy"], abs=0.005)
    assert float(m[4]) == pytest.approx(final["test_loss"], abs=1e-4)


def test_predict_png_and_idx(run: Path, digits: tuple[torch.Tensor, torch.Tensor], tmp_path: Path,
                             capsys: pytest.CaptureFixture[str]) -> None:
    images, _ = digits
    ckpt = run / "checkpoint.pt"
    expected = _expected(ckpt, images).tolist()
    pngs = []
    for i, image in enumerate(images):
        pngs.append(tmp_path / f"digit{i}.png")
        png.write_gray(pngs[-1], image)
    code, out, _ = _main(capsys, "predict", str(ckpt), *map(str, pngs))
    assert code == 0 and _predicted(out) == expected, out
    assert all(line.startswith(f"{p}: ") for line, p in zip(out.splitlines(), pngs))

    images_idx = tmp_path / "some-images-idx3-ubyte.gz"
    idx.write(images_idx, images)
    code, out, _ = _main(capsys, "predict", str(ckpt), str(images_idx), "--top", "3")
    assert code == 0
    lines = out.splitlines()
    assert [line.split(":")[0] for line in lines] == [f"{images_idx}[{i}]" for i in range(len(images))]
    assert [int(line.split(": ")[1][0]) for line in lines] == expected
    for line in lines:
        probs = [float(p) for p in re.findall(r"\(([\d.]+)%\)", line)]
        assert len(probs) == 3 and probs == sorted(probs, reverse=True) and sum(probs) <= 100.1


def test_predict_png_light_background_and_other_size(run: Path, digits: tuple[torch.Tensor, torch.Tensor],
                                                     tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """A dark digit on white paper is inverted, and a 56x56 image is scaled down to the same 28x28."""
    image = digits[0][0]
    paths = {"plain": tmp_path / "plain.png", "paper": tmp_path / "paper.png", "big": tmp_path / "big.png"}
    png.write_gray(paths["plain"], image)
    png.write_gray(paths["paper"], 255 - image)
    png.write_gray(paths["big"], image.repeat_interleave(2, 0).repeat_interleave(2, 1))
    code, out, _ = _main(capsys, "predict", str(run / "checkpoint.pt"), *map(str, paths.values()))
    assert code == 0
    answers = [line.split(": ", 1)[1] for line in out.splitlines()]
    assert len(answers) == 3 and len(set(answers)) == 1, out  # same class, same probability


def test_bare_and_prefixed_state_dicts_load(run: Path, digits: tuple[torch.Tensor, torch.Tensor], tmp_path: Path,
                                            capsys: pytest.CaptureFixture[str]) -> None:
    weights = checkpoint.load(run / "checkpoint.pt")["model"]
    plain, prefixed = tmp_path / "tutorial.pt", tmp_path / "ddp.pt"
    model = ConvNet()
    model.load_state_dict(weights)
    torch.save(model.state_dict(), plain)  # what the tutorial saves
    torch.save({f"module.{k}": v for k, v in weights.items()}, prefixed)  # a DDP model's state_dict
    image = tmp_path / "d.png"
    png.write_gray(image, digits[0][0])
    answers = []
    for ckpt in (plain, prefixed):
        code, out, err = _main(capsys, "predict", str(ckpt), str(image))
        assert code == 0, err
        answers.append(out.split(": ", 1)[1])
        assert _predicted(out) == _expected(ckpt, digits[0][:1]).tolist()
        code, out, err = _main(capsys, "evaluate", str(ckpt), "--dataset", "synthetic", "--test-samples", "50")
        assert code == 0 and "(" in out and "/50)" in out, err
    assert answers[0] == answers[1]


@pytest.mark.parametrize("case", ["labels file", "32x32 images", "missing file", "not a png", "missing checkpoint",
                                  "not a checkpoint", "empty checkpoint"])
def test_predict_bad_input_is_one_line_exit_2(run: Path, tmp_path: Path, case: str,
                                              capsys: pytest.CaptureFixture[str]) -> None:
    ckpt, target = run / "checkpoint.pt", tmp_path / "input"
    if case == "labels file":
        idx.write(target, torch.zeros(3, dtype=torch.uint8))
    elif case == "32x32 images":
        idx.write(target, torch.zeros(2, 32, 32, dtype=torch.uint8))
    elif case == "not a png":
        target = tmp_path / "fake.png"
        target.write_bytes(b"GIF89a")
    elif case == "missing checkpoint":
        ckpt = tmp_path / "nope.pt"
    elif case in ("not a checkpoint", "empty checkpoint"):
        ckpt = tmp_path / "junk.pt"
        ckpt.write_bytes(b"junk" if case == "not a checkpoint" else b"")
    if "checkpoint" in case:
        target = tmp_path / "d.png"
        png.write_gray(target, torch.zeros(28, 28, dtype=torch.uint8))
    code, out, err = _main(capsys, "predict", str(ckpt), str(target))
    assert code == 2 and out == ""
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("mnist-ddp: error: "), err
    assert str(ckpt if "checkpoint" in case else target) in lines[0]


# --- png.py: the reader must undo every PNG row filter and colour type, not only what write_gray makes ---


def _filtered_png(pixels: torch.Tensor, colour: int) -> bytes:
    """A PNG of (H, W, C) uint8 `pixels` whose rows cycle through all five filter types."""
    height, width, channels = pixels.shape
    rows = pixels.reshape(height, width * channels).tolist()
    raw = b""
    prev = [0] * (width * channels)
    for r, line in enumerate(rows):
        kind = r % 5
        out = []
        for i, x in enumerate(line):
            a = line[i - channels] if i >= channels else 0
            b, c = prev[i], prev[i - channels] if i >= channels else 0
            out.append((x - (0, a, b, (a + b) // 2, png._paeth(a, b, c))[kind]) & 0xFF)
        raw += bytes([kind, *out])
        prev = line

    def chunk(kind: bytes, body: bytes) -> bytes:
        return struct.pack(">I", len(body)) + kind + body + struct.pack(">I", zlib.crc32(kind + body))

    header = struct.pack(">IIBBBBB", width, height, 8, colour, 0, 0, 0)
    return png.SIGNATURE + chunk(b"IHDR", header) + chunk(b"IDAT", zlib.compress(raw)) + chunk(b"IEND", b"")


def test_png_round_trip(tmp_path: Path) -> None:
    image = torch.randint(0, 256, (28, 31), dtype=torch.uint8)
    png.write_gray(tmp_path / "x.png", image)
    assert torch.equal(png.read_gray(tmp_path / "x.png"), image)


@pytest.mark.parametrize(("colour", "channels"), [(0, 1), (2, 3), (4, 2), (6, 4)])
def test_png_filters_and_colour_types(tmp_path: Path, colour: int, channels: int) -> None:
    gray = torch.randint(0, 256, (11, 9), dtype=torch.uint8)
    pixels = gray[..., None].repeat(1, 1, channels)
    if channels in (2, 4):
        pixels[..., -1] = 255  # opaque: compositing onto black changes nothing
    path = tmp_path / "x.png"
    path.write_bytes(_filtered_png(pixels, colour))
    assert torch.equal(png.read_gray(path), gray)


def test_png_damage_is_a_user_error(tmp_path: Path) -> None:
    path = tmp_path / "x.png"
    png.write_gray(path, torch.zeros(28, 28, dtype=torch.uint8))
    path.write_bytes(path.read_bytes()[:-30])
    with pytest.raises(Exception, match=re.escape(str(path))) as e:
        png.read_gray(path)
    assert type(e.value).__name__ == "UserError"
