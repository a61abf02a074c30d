"""`evaluate` and `predict` on a checkpoint a real run saved, on bare state_dicts, images, folders and IDX files."""

import io
import re
import struct
import subprocess
import sys
import zlib
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from PIL import Image

from conftest import MNIST_T10K, TRAINED_TEST_SAMPLES, cli_env, metrics, needs_t10k
from datafiles import ONE_THREAD, one_thread, write_idx
from mnist_ddp import cli
from mnist_ddp.core.batches import MEAN, STD
from mnist_ddp.data import idx, images, synthetic
from mnist_ddp.model import ConvNet
from mnist_ddp.outputs import checkpoint, model_file


@pytest.fixture(autouse=True, scope="module")
def _single_thread() -> Iterator[None]:
    with one_thread():
        yield


@pytest.fixture(scope="module")
def run(trained_run: Path) -> Path:
    return trained_run


@pytest.fixture(scope="module")
def digits() -> tuple[torch.Tensor, torch.Tensor]:
    return synthetic.generate(6, seed=99)


def _main(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    code = cli.main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def _probabilities(ckpt: Path, images: torch.Tensor) -> torch.Tensor:
    """The model's own class probabilities, computed here without the predict command."""
    model, saved = model_file.load_model(ckpt)
    x = images.unsqueeze(1).float() / 255
    if saved.get("config", {}).get("normalize"):
        x = (x - MEAN) / STD
    with torch.inference_mode():
        return model.eval()(x).softmax(1)


def _expected(ckpt: Path, images: torch.Tensor) -> torch.Tensor:
    """The model's own answer, computed here without the predict command."""
    return _probabilities(ckpt, images).argmax(1)


def _gray(image: torch.Tensor) -> Image.Image:
    """A (H, W) uint8 tensor as a Pillow greyscale image."""
    return Image.frombytes("L", (image.shape[1], image.shape[0]), bytes(image.flatten().tolist()))


def _tensor(img: Image.Image) -> torch.Tensor:
    return torch.tensor(list(img.tobytes()), dtype=torch.uint8).reshape(img.height, img.width)


def _predicted(stdout: str) -> list[int]:
    return [int(m) for m in re.findall(r": (\d) \(", stdout)]


def test_evaluate_matches_the_runs_final_metric(run: Path, capsys: pytest.CaptureFixture[str]) -> None:
    final = metrics(run)[-1]
    code, out, _ = _main(capsys, "evaluate", str(run / "checkpoint.pt"), "--test-samples", TRAINED_TEST_SAMPLES)
    assert code == 0
    m = re.search(r"test accuracy ([\d.]+)% \((\d+)/(\d+)\) on synthetic .* test loss ([\d.]+)", out)
    assert m, out
    assert (int(m[2]), int(m[3])) == (final["test_correct"], final["test_count"])
    assert float(m[1]) == pytest.approx(100 * final["test_accuracy"], abs=0.005)
    assert float(m[4]) == pytest.approx(final["test_loss"], abs=1e-4)


def test_predict_png_and_idx(run: Path, digits: tuple[torch.Tensor, torch.Tensor], tmp_path: Path,
                             capsys: pytest.CaptureFixture[str]) -> None:
    images, labels = digits
    ckpt = run / "checkpoint.pt"
    expected = _expected(ckpt, images).tolist()
    assert sum(e == t for e, t in zip(expected, labels.tolist())) >= 5, (expected, labels)  # a model that reads digits
    pngs = []
    for i, image in enumerate(images):
        pngs.append(tmp_path / f"digit{i}.png")
        _gray(image).save(pngs[-1])
    code, out, _ = _main(capsys, "predict", str(ckpt), *map(str, pngs))
    assert code == 0 and _predicted(out) == expected, out
    assert all(line.startswith(f"{p}: ") for line, p in zip(out.splitlines(), pngs))

    images_idx = tmp_path / "some-images-idx3-ubyte.gz"
    write_idx(images_idx, images)
    code, out, _ = _main(capsys, "predict", str(ckpt), str(images_idx), "--top", "3")
    assert code == 0
    lines = out.splitlines()
    assert [line.split(":")[0] for line in lines] == [f"{images_idx}[{i}]" for i in range(len(images))]
    assert [int(line.split(": ")[1][0]) for line in lines] == expected
    top = _probabilities(ckpt, images).topk(3)  # the model's own three best, in percent
    for line, (values, classes) in zip(lines, zip(top.values.tolist(), top.indices.tolist())):
        probs = [float(p) for p in re.findall(r"\(([\d.]+)%\)", line)]
        said = [int(c) for c in re.findall(r"(\d) \(", line)]
        # to 1 point: predict evaluates in the precision the run trained in (bf16 where the CPU has it)
        assert said == classes and probs == pytest.approx([100 * v for v in values], abs=1.0), line


def test_predict_png_light_background_and_other_size(run: Path, digits: tuple[torch.Tensor, torch.Tensor],
                                                     tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """A dark digit on white paper is inverted, and a 56x56 image is scaled down to the same 28x28: each is read
    as the digit it is."""
    image, label = digits[0][0], int(digits[1][0])
    paths = {"plain": tmp_path / "plain.png", "paper": tmp_path / "paper.png", "big": tmp_path / "big.png"}
    _gray(image).save(paths["plain"])
    _gray(255 - image).save(paths["paper"])
    _gray(image.repeat_interleave(2, 0).repeat_interleave(2, 1)).save(paths["big"])
    code, out, _ = _main(capsys, "predict", str(run / "checkpoint.pt"), *map(str, paths.values()))
    assert code == 0
    answers = [line.split(": ", 1)[1] for line in out.splitlines()]
    assert len(answers) == 3 and len(set(answers)) == 1, out  # same class, same probability
    assert _predicted(out) == [label] * 3, out  # and the right one


def test_bare_and_prefixed_state_dicts_load(run: Path, digits: tuple[torch.Tensor, torch.Tensor], tmp_path: Path,
                                            capsys: pytest.CaptureFixture[str]) -> None:
    """The tutorial's bare state_dict and a DDP model's `module.`-prefixed one give the answer the checkpoint's
    weights give, computed here with a plain ConvNet: a file with no recorded settings is read as the tutorial
    trains, pixels / 255 with no normalisation; both evaluate to the same count and loss."""
    weights = checkpoint.load(run / "checkpoint.pt")["model"]
    plain, prefixed = tmp_path / "tutorial.pt", tmp_path / "ddp.pt"
    model = ConvNet()
    model.load_state_dict(weights)
    torch.save(model.state_dict(), plain)  # what the tutorial saves
    torch.save({f"module.{k}": v for k, v in weights.items()}, prefixed)  # a DDP model's state_dict
    image = tmp_path / "d.png"
    _gray(digits[0][0]).save(image)
    with torch.inference_mode():
        p, c = model.eval()(digits[0][:1, None].float() / 255).softmax(1)[0].max(0)
    answers, scores = [], []
    for ckpt in (plain, prefixed):
        code, out, err = _main(capsys, "predict", str(ckpt), str(image))
        assert code == 0, err
        answers.append(out.split(": ", 1)[1].strip())
        code, out, err = _main(capsys, "evaluate", str(ckpt), "--dataset", "synthetic", "--test-samples", "50")
        assert code == 0 and "/50) on synthetic" in out, err
        scores.append(out)  # accuracy, correct answers and loss
    assert answers == [f"{c.item()} ({100 * p.item():.1f}%)"] * 2 and scores[0] == scores[1], (answers, scores)


@pytest.mark.parametrize("case", ["labels file", "32x32 images", "missing file", "folder without images",
                                  "missing checkpoint", "not a checkpoint", "empty checkpoint"])
def test_predict_bad_input_is_one_line_exit_2(run: Path, tmp_path: Path, case: str,
                                              capsys: pytest.CaptureFixture[str]) -> None:
    ckpt, target = run / "checkpoint.pt", tmp_path / "input"
    if case == "labels file":
        write_idx(target, torch.zeros(3, dtype=torch.uint8))
    elif case == "32x32 images":
        write_idx(target, torch.zeros(2, 32, 32, dtype=torch.uint8))
    elif case == "folder without images":
        target.mkdir()
        (target / "notes.txt").write_text("no digits here")
    elif case == "missing checkpoint":
        ckpt = tmp_path / "nope.pt"
    elif case in ("not a checkpoint", "empty checkpoint"):
        ckpt = tmp_path / "junk.pt"
        ckpt.write_bytes(b"junk" if case == "not a checkpoint" else b"")
    if "checkpoint" in case:
        target = tmp_path / "d.png"
        _gray(torch.zeros(28, 28, dtype=torch.uint8)).save(target)
    code, out, err = _main(capsys, "predict", str(ckpt), str(target))
    assert code == 2 and out == ""
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("mnist-ddp: error: "), err
    assert str(ckpt if "checkpoint" in case else target) in lines[0]




# --- image files: every format, any size, grey or colour, decoded to the digit itself ---


def _rgba(colour: int, alpha: Image.Image) -> Image.Image:
    """Ink of one grey `colour` on a transparent page, `alpha` saying where the ink is."""
    ink = Image.new("L", alpha.size, colour)
    return Image.merge("RGBA", (ink, ink, ink, alpha))


LOSSLESS = {  # name: (how to turn the digit into the saved image, file suffix)
    "png grey": (lambda g: g, ".png"),
    "png 16-bit grey": (lambda g: g.point(lambda v: v * 256, "I").convert("I;16"), ".png"),
    "png rgb": (lambda g: g.convert("RGB"), ".png"),
    "png palette": (lambda g: g.convert("RGB").convert("P", palette=Image.Palette.ADAPTIVE, colors=256), ".png"),
    "png rgba, dark ink on transparent": (lambda g: _rgba(0, g), ".png"),
    "png rgba, light ink on transparent": (lambda g: _rgba(255, g), ".png"),
    "png on white paper": (lambda g: Image.eval(g, lambda v: 255 - v), ".png"),
    "bmp": (lambda g: g.convert("RGB"), ".bmp"),
    "gif": (lambda g: g, ".gif"),
    "large png, 5600x5600": (lambda g: g.resize((5600, 5600), Image.Resampling.NEAREST), ".png"),
}


@pytest.mark.parametrize("kind", LOSSLESS)
def test_lossless_images_decode_to_the_digit(digits: tuple[torch.Tensor, torch.Tensor], tmp_path: Path,
                                             kind: str) -> None:
    image = digits[0][0]
    make, suffix = LOSSLESS[kind]
    path = tmp_path / f"digit{suffix}"
    make(_gray(image)).save(path)
    got = images.read_digit(path)
    if kind == "png palette":  # 256 colours may not hold every grey level of the digit exactly
        assert (got.int() - image.int()).abs().max() <= 2
    else:
        assert torch.equal(got, image)


def test_gif_is_read_by_its_first_frame(digits: tuple[torch.Tensor, torch.Tensor], tmp_path: Path) -> None:
    first, second = digits[0][:2]
    path = tmp_path / "anim.gif"
    _gray(first).save(path, save_all=True, append_images=[_gray(second)])
    assert Image.open(path).n_frames == 2
    assert torch.equal(images.read_digit(path), first)


@pytest.mark.parametrize("side", [28, 2240])
def test_jpeg_decodes_close_to_the_digit(digits: tuple[torch.Tensor, torch.Tensor], tmp_path: Path,
                                         side: int) -> None:
    """Lossy, so close rather than equal; the 2240x2240 one is decoded at 1/8 scale (draft) on white paper."""
    image = digits[0][0]
    path = tmp_path / "digit.jpg"
    Image.eval(_gray(image), lambda v: 255 - v).convert("RGB").resize((side, side), Image.Resampling.NEAREST).save(
        path, quality=95)
    assert (images.read_digit(path).float() - image.float()).abs().mean() < 4


def test_a_tall_image_keeps_its_aspect_ratio(digits: tuple[torch.Tensor, torch.Tensor], tmp_path: Path) -> None:
    """56x112 with the digit (doubled) in its middle becomes a 14x14 digit centred in black, not a stretched one."""
    digit = _gray(digits[0][0])
    tall = Image.new("L", (56, 112))
    tall.paste(digit.resize((56, 56), Image.Resampling.NEAREST), (0, 28))
    tall.save(tmp_path / "tall.png")
    expected = torch.zeros(28, 28, dtype=torch.uint8)
    expected[7:21, 7:21] = _tensor(digit.resize((14, 14), Image.Resampling.BOX))
    assert (images.read_digit(tmp_path / "tall.png").int() - expected.int()).abs().max() <= 1


@needs_t10k
def test_real_mnist_digits_as_png_and_jpeg_predict_as_from_idx(run: Path, tmp_path: Path,
                                                               capsys: pytest.CaptureFixture[str]) -> None:
    real = idx.read(MNIST_T10K / "t10k-images-idx3-ubyte.gz", idx.IMAGES_MAGIC)[:8]
    ckpt = run / "checkpoint.pt"
    write_idx(tmp_path / "real-idx3-ubyte", real)
    for i, image in enumerate(real):
        _gray(image).save(tmp_path / f"{i}.png")
        _gray(image).convert("RGB").save(tmp_path / f"{i}.jpg", quality=95)
    code, out, _ = _main(capsys, "predict", str(ckpt), str(tmp_path / "real-idx3-ubyte"))
    assert code == 0
    from_idx = [line.split(": ", 1)[1] for line in out.splitlines()]
    code, out, _ = _main(capsys, "predict", str(ckpt), *(str(tmp_path / f"{i}.png") for i in range(len(real))))
    assert code == 0 and [line.split(": ", 1)[1] for line in out.splitlines()] == from_idx  # the same numbers
    code, out, _ = _main(capsys, "predict", str(ckpt), *(str(tmp_path / f"{i}.jpg") for i in range(len(real))))
    assert code == 0 and _predicted(out) == [int(answer[0]) for answer in from_idx]


def test_predict_a_folder(run: Path, digits: tuple[torch.Tensor, torch.Tensor], tmp_path: Path,
                          capsys: pytest.CaptureFixture[str]) -> None:
    """Its image files in name order; other files, hidden files and subfolders are skipped."""
    folder = tmp_path / "scans"
    (folder / "sub").mkdir(parents=True)
    names = ["a.png", "b.JPG", "c.gif", "d.bmp"]
    for name, image in zip(names, digits[0]):
        _gray(image).convert("RGB" if name.endswith(".JPG") else "L").save(folder / name)
    _gray(digits[0][5]).save(folder / "sub" / "e.png")
    (folder / "notes.txt").write_text("not an image")
    (folder / "._a.png").write_bytes(b"\x00\x05\x16\x07 a macOS resource fork")
    code, out, err = _main(capsys, "predict", str(run / "checkpoint.pt"), str(folder), str(folder / "a.png"))
    assert code == 0, err
    assert [line.split(": ")[0] for line in out.splitlines()] == [str(folder / n) for n in [*names, "a.png"]]
    assert _predicted(out)[0] == _predicted(out)[-1]


# --- hostile or broken image files: one line and exit 2, without decoding what they declare ---


def _png(width: int, height: int, rows: bytes) -> bytes:
    """A PNG whose header declares `width`x`height` 8-bit grey pixels, and whose IDAT holds only `rows`."""
    def chunk(kind: bytes, body: bytes) -> bytes:
        return struct.pack(">I", len(body)) + kind + body + struct.pack(">I", zlib.crc32(kind + body))

    return (b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", struct.pack(">IIBBBBB", width, height, 8, 0, 0, 0, 0))
            + chunk(b"IDAT", zlib.compress(rows)) + chunk(b"IEND", b""))


def _noise(fmt: str) -> bytes:
    """A 64x64 image of random grey levels, so that nothing compresses it much, as `fmt` bytes."""
    out = io.BytesIO()
    _gray(torch.randint(0, 256, (64, 64), dtype=torch.uint8)).save(out, fmt)
    return out.getvalue()


BOMB = _png(100_000, 100_000, bytes(100_001))  # 10^10 pixels declared (10 GB to decode), one row of data
HOSTILE = {  # case: (suffix, content, what the message must say)
    "100000x100000 png": (".png", lambda: BOMB, "decompression bomb"),
    "10000x10000 png, past our limit only": (".png", lambda: _png(10_000, 10_000, bytes(10_001)), "bomb"),
    "truncated png": (".png", lambda: _noise("PNG")[:-200], "damaged"),
    "truncated jpeg": (".jpg", lambda: _noise("JPEG")[:-200], "damaged"),
    "text named .png": (".png", lambda: b"a digit, honest\n", "not a PNG, JPEG, BMP, GIF image"),
    "gif header named .png": (".png", lambda: b"GIF89a", "not a PNG, JPEG, BMP, GIF image"),
    "empty png": (".png", lambda: b"", "not a PNG"),
    "0x28 png": (".png", lambda: _png(0, 28, b""), "not a PNG, JPEG, BMP, GIF image"),
}


@pytest.mark.parametrize("case", HOSTILE)
def test_hostile_images_are_one_line_exit_2(run: Path, tmp_path: Path, case: str,
                                            capsys: pytest.CaptureFixture[str]) -> None:
    suffix, content, why = HOSTILE[case]
    target = tmp_path / f"input{suffix}"
    target.write_bytes(content())
    code, out, err = _main(capsys, "predict", str(run / "checkpoint.pt"), str(target))
    assert code == 2 and out == ""
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"mnist-ddp: error: {target}: ") and why in lines[0], err


def test_a_decompression_bomb_is_refused_in_bounded_memory(run: Path, tmp_path: Path) -> None:
    """The real CLI in a child; a fresh helper process runs only that child, so RUSAGE_CHILDREN's peak
    RSS is the child's alone (pytest's own earlier children would count otherwise)."""
    bomb = tmp_path / "bomb.png"
    bomb.write_bytes(BOMB)
    helper = ("import resource, subprocess, sys\n"
              "r = subprocess.run(sys.argv[1:], capture_output=True, text=True)\n"
              "print(r.returncode, resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss)\n"
              "sys.stderr.write(r.stderr)\n")
    r = subprocess.run([sys.executable, "-c", helper, sys.executable, "-m", "mnist_ddp", "predict",
                        str(run / "checkpoint.pt"), str(bomb)],
                       env=cli_env(ONE_THREAD), capture_output=True, text=True, timeout=180)
    code, peak_kib = map(int, r.stdout.split())
    assert code == 2 and len(r.stderr.strip().splitlines()) == 1 and str(bomb) in r.stderr, r.stderr
    assert peak_kib < 1.5 * 2**20, f"peak RSS {peak_kib} KiB"  # 1.5 GiB
