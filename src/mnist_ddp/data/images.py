"""A user's digit from a PNG, JPEG, BMP or GIF file, the way MNIST draws one, decoded safely by Pillow.

A file is untrusted input: read as every input file is (`inputfile`: a regular file, at most `MOST_BYTES`), its
declared size is checked before any pixel is decoded (Pillow's decompression-bomb limit, its warning made an
error too), JPEGs are decoded at reduced scale, and anything Pillow cannot read becomes one `UserError` naming
the file.
"""

import io
import struct
import warnings
from pathlib import Path

import torch
from PIL import Image, ImageOps, ImageStat, UnidentifiedImageError

from ..common import inputfile
from ..common.errors import UserError

SIDE = 28  # MNIST's images are 28x28
FORMATS = ("PNG", "JPEG", "BMP", "GIF")  # the only Pillow decoders we expose to untrusted files
SUFFIXES = (".png", ".jpg", ".jpeg", ".bmp", ".gif")
# 32 Mi pixels is a 33-megapixel photo (~130 MB decoded as RGBA); a larger declared size is refused before
# decoding. Pillow warns above its limit and refuses above twice it; the warning is an error here, so this is the limit.
MAX_PIXELS = 32 * 1024 * 1024
MOST_BYTES = 64 << 20  # an image file
Image.MAX_IMAGE_PIXELS = MAX_PIXELS


def is_image(path: Path) -> bool:
    """Whether `path` is named like an image we read (anything else given to predict is an IDX file)."""
    return path.suffix.lower() in SUFFIXES


def read_digit(path: Path) -> torch.Tensor:
    """A (28, 28) uint8 image, light digit on black: any size, grey or colour, GIFs by their first frame."""
    data = inputfile.read(path, MOST_BYTES, "image")
    path = inputfile.shown(path)  # type: ignore[assignment]
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error", Image.DecompressionBombWarning)
            with Image.open(io.BytesIO(data), formats=FORMATS) as img:
                img.draft("L", (SIDE, SIDE))  # JPEG: decode straight to grey at up to 1/8 scale; others: no-op
                grey = _grey(img)
    except (Image.DecompressionBombError, Image.DecompressionBombWarning) as e:
        raise UserError(f"{path}: refused, it declares more than {MAX_PIXELS:,} pixels (a decompression bomb?).") from e
    except UnidentifiedImageError as e:
        raise UserError(f"{path}: not a {', '.join(FORMATS)} image.") from e
    except (OSError, SyntaxError, ValueError, EOFError, IndexError, TypeError, struct.error) as e:
        # what Pillow's decoders raise on damaged files
        raise UserError(f"{path}: cannot be read ({str(e)[:200]}); the image is damaged or a variant Pillow cannot "
                        f"decode.") from e
    return _mnist_like(grey)


def from_pil(img: Image.Image) -> torch.Tensor:
    """A Pillow image (a file's, or one the Python API was given) as a (28, 28) uint8 MNIST digit."""
    return _mnist_like(_grey(img))


def from_tensor(images: torch.Tensor, name: str) -> torch.Tensor:
    """A tensor the Python API was given as (N, 28, 28) uint8 digits: (28, 28), (N, 28, 28) or (N, 1, 28, 28),
    uint8 pixels or floats in [0, 1] (what torchvision's ToTensor makes), light digits on black like MNIST's."""
    x = images.detach().cpu()
    if x.dim() == 4 and x.shape[1] == 1:
        x = x[:, 0]
    x = x[None] if x.dim() == 2 else x
    if x.dim() != 3 or tuple(x.shape[1:]) != (SIDE, SIDE):
        raise UserError(f"{name}: a tensor of shape {tuple(images.shape)}; predict takes 28x28 images: (28, 28), "
                        f"(N, 28, 28) or (N, 1, 28, 28) (give an image file or a PIL image of any size instead).")
    if x.dtype == torch.uint8:
        return x
    if not x.is_floating_point():
        raise UserError(f"{name}: a {x.dtype} tensor; predict takes uint8 pixels (0-255) or floats in [0, 1].")
    if x.numel() and not (x.min() >= 0 and x.max() <= 1):
        raise UserError(f"{name}: pixel values from {float(x.min()):.3g} to {float(x.max()):.3g}; predict takes floats "
                        f"in [0, 1], not normalised ones (the checkpoint's own normalisation is applied), or uint8.")
    return (x * 255).round().to(torch.uint8)


def _grey(img: Image.Image) -> Image.Image:
    """8-bit grey levels; transparent pixels become the page, in the colour that contrasts with the ink."""
    if img.mode.startswith("I"):  # 16-bit grey PNG ("I;16", or "I" in older Pillows): convert("L") would clip
        return img.convert("I").point(lambda v: v / 256).convert("L")
    if img.mode not in ("RGBA", "LA", "PA") and "transparency" not in img.info:
        return img.convert("L")
    grey, alpha = img.convert("RGBA").convert("LA").split()
    ink = ImageStat.Stat(grey, mask=alpha).mean[0] if alpha.getbbox() else 0  # over the visible pixels
    return Image.composite(grey, Image.new("L", img.size, 255 if ink < 128 else 0), alpha)


def _mnist_like(grey: Image.Image) -> torch.Tensor:
    """Light on dark (inverted if its border is lighter than mid-grey on average), scaled by area averaging
    to fit 28x28 with its aspect ratio kept, and centred on the page's colour (the border's median)."""
    w, h = grey.size
    edges = [grey.crop(box).histogram() for box in ((0, 0, w, 1), (0, h - 1, w, h), (0, 0, 1, h), (w - 1, 0, w, h))]
    border = ImageStat.Stat([sum(counts) for counts in zip(*edges)])
    page = border.median[0]
    if border.mean[0] > 127:  # dark digit on a light page: MNIST is light on dark
        grey, page = ImageOps.invert(grey), 255 - page
    scale = SIDE / max(w, h)
    size = (max(1, round(w * scale)), max(1, round(h * scale)))
    out = Image.new("L", (SIDE, SIDE), page)
    out.paste(grey.resize(size, Image.Resampling.BOX), ((SIDE - size[0]) // 2, (SIDE - size[1]) // 2))
    return torch.frombuffer(bytearray(out.tobytes()), dtype=torch.uint8).reshape(SIDE, SIDE)
