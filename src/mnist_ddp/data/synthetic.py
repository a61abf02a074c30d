"""MNIST-shaped handwritten-looking digits, generated from a seed in pure torch: the dataset that always works (no
network, no files). A digit is a stroke template, jittered, warped, drawn with a random pen and noised, varied
enough that the tutorial CNN learns it well but not perfectly: a sanity check that is not a tautology. Every CPU
draws the same bytes: only uniform draws and correctly rounded arithmetic, no torch.randn, sin or matmul, whose
kernels differ between AVX2 and AVX-512 (docs/data.md)."""

import itertools
import math

import torch

Polyline = list[tuple[float, float]]
VERSION = 2  # raise it with any change to the bytes `generate` makes: it names the cached copies (datasets.py)


def _sin_pi(x: torch.Tensor) -> torch.Tensor:
    """sin(pi x) to ~1e-7, by its Taylor polynomial on x brought into [-1/2, 1/2]: the same bytes on every CPU."""
    r = x - 2 * ((x + 1) / 2).floor()  # sin(pi x) = sin(pi r), r in [-1, 1)
    r = torch.where(r > 0.5, 1 - r, torch.where(r < -0.5, -1 - r, r))  # sin(pi (1 - r)) = sin(pi r)
    r2 = r * r
    odd = -0.59926453 + r2 * (0.08214589 - r2 * 0.00737043)  # pi^(2k+1) / (2k+1)!, signs alternating
    return r * (3.14159265 + r2 * (-5.16771278 + r2 * (2.55016404 + r2 * odd)))


def _bell(g: torch.Generator, *shape: int) -> torch.Tensor:
    """Draws of mean 0 and standard deviation 1, bell-shaped (the difference of two uniforms, scaled)."""
    u = torch.rand(2, *shape, generator=g)
    return (u[0] - u[1]) * math.sqrt(6)


def _arc(cx: float, cy: float, rx: float, ry: float, start: float, end: float, n: int = 8) -> Polyline:
    """Points on an elliptical arc; angles in degrees, 0 = right, 90 = down (image axes)."""
    turn = (start + (end - start) * torch.arange(n + 1, dtype=torch.float64) / n) / 180
    return list(zip((cx + rx * _sin_pi(turn + 0.5)).tolist(), (cy + ry * _sin_pi(turn)).tolist(), strict=True))


# Strokes in a unit box, x to the right and y downwards, like image coordinates.
_TEMPLATES: dict[int, list[Polyline]] = {
    0: [_arc(0.5, 0.5, 0.32, 0.45, 0, 360, 14)],
    1: [[(0.35, 0.22), (0.55, 0.05), (0.55, 0.95)]],
    2: [[*_arc(0.5, 0.3, 0.3, 0.25, 190, 390, 7), (0.2, 0.95), (0.85, 0.95)]],
    3: [_arc(0.48, 0.28, 0.3, 0.23, 200, 450, 7), _arc(0.48, 0.72, 0.33, 0.23, 270, 520, 7)],
    4: [[(0.62, 0.05), (0.15, 0.65), (0.88, 0.65)], [(0.65, 0.3), (0.65, 0.97)]],
    5: [[(0.82, 0.05), (0.3, 0.05), (0.25, 0.45), *_arc(0.5, 0.68, 0.32, 0.27, 240, 500, 8)]],
    6: [_arc(0.6, 0.5, 0.4, 0.45, 270, 180, 5) + _arc(0.5, 0.7, 0.3, 0.25, 180, 540, 10)],
    7: [[(0.15, 0.05), (0.85, 0.05), (0.4, 0.97)]],
    8: [_arc(0.5, 0.27, 0.25, 0.22, 0, 360, 10), _arc(0.5, 0.72, 0.3, 0.24, 0, 360, 10)],
    9: [_arc(0.5, 0.3, 0.3, 0.25, 0, 360, 10), [(0.8, 0.3), (0.75, 0.97)]],
}


def _segments(strokes: list[Polyline]) -> torch.Tensor:
    """(S, 2, 2) start/end points of every segment of every stroke."""
    pairs = [(a, b) for line in strokes for a, b in itertools.pairwise(line)]
    return torch.tensor(pairs, dtype=torch.float32)


def _padded_templates() -> tuple[torch.Tensor, torch.Tensor]:
    """All templates padded to one segment count; a mask marks the real segments."""
    segs = [_segments(_TEMPLATES[d]) for d in range(10)]
    most = max(len(s) for s in segs)
    out = torch.zeros(10, most, 2, 2)
    mask = torch.zeros(10, most, dtype=torch.bool)
    for d, s in enumerate(segs):
        out[d, : len(s)] = s
        mask[d, : len(s)] = True
    return out, mask


WINDOWS = (6, 8, 10, 13, 28)  # the widths and heights, in pixels, of the windows a segment is measured on


def _render(seg: torch.Tensor, mask: torch.Tensor, width: torch.Tensor) -> torch.Tensor:
    """Rasterise (B, S, 2, 2) pixel-space segments with pen `width` (B,) into (B, 28, 28) in [0, 1]; `mask` marks
    each image's real segments. A pixel's ink comes from its distance to the nearest segment and is 0 from
    `width` + 0.45 px on, so each segment is measured only on a window around it (its box, widened by `width` +
    0.5 px), not on all 784 pixels: a tenth of the work, and the same bytes (docs/data.md)."""
    b, s = mask.nonzero(as_tuple=True)  # the real segments, each image b's segment s
    a, e = seg[b, s, 0], seg[b, s, 1]  # its ends, (P, 2)
    ax, ay = a[:, 0, None, None], a[:, 1, None, None]
    dx, dy = e[:, 0, None, None] - ax, e[:, 1, None, None] - ay
    length2 = (dx * dx + dy * dy).clamp_min(1e-6)
    reach = (width[b] + 0.5)[:, None]
    first = (torch.minimum(a, e) - reach - 0.5).ceil().clamp(0, 27)  # the first column and row whose pixel centre
    last = (torch.maximum(a, e) + reach - 0.5).floor().clamp(0, 27)  # is within reach of the box, and the last
    # The window: the smallest of WINDOWS that fits, across and down; the segments of one shape are measured together.
    fits = torch.searchsorted(torch.tensor(WINDOWS, dtype=torch.float32), (last - first + 1).contiguous())
    shape = fits[:, 0] * len(WINDOWS) + fits[:, 1]
    nearest = torch.full((len(seg) * 784,), float("inf"))  # each pixel's squared distance to the nearest segment
    groups = shape.argsort().split(torch.bincount(shape, minlength=len(WINDOWS) ** 2).tolist())
    for k, group in enumerate(groups):
        if not len(group):
            continue
        across, down = WINDOWS[k // len(WINDOWS)], WINDOWS[k % len(WINDOWS)]
        corner = torch.minimum(first[group], torch.tensor([28.0 - across, 28.0 - down]))  # the window in the image
        px = corner[:, 0, None, None] + torch.arange(across, dtype=torch.float32) + 0.5  # pixel centres, (G, 1, w)
        py = corner[:, 1, None, None] + torch.arange(down, dtype=torch.float32)[:, None] + 0.5  # (G, h, 1)
        gx, gy, gdx, gdy = ax[group], ay[group], dx[group], dy[group]
        t = (((px - gx) * gdx + (py - gy) * gdy) / length2[group]).clamp(0, 1)
        d2 = (px - gx - t * gdx).square() + (py - gy - t * gdy).square()
        at = corner.long()
        pixel = (b[group] * 784 + at[:, 1] * 28 + at[:, 0])[:, None, None] + torch.arange(down)[:, None] * 28 \
            + torch.arange(across)
        nearest.scatter_reduce_(0, pixel.view(-1), d2.view(-1), "amin")
    ink = nearest.view(len(seg), 28, 28).sqrt_()
    return ink.neg_().add_(width[:, None, None]).div_(0.9).add_(0.5).clamp_(0, 1)  # ~1 px soft edge


def generate(n: int, seed: int, chunk: int = 2048) -> tuple[torch.Tensor, torch.Tensor]:
    """`n` images (uint8, n×28×28) and labels (int64), identical for the same seed."""
    g = torch.Generator().manual_seed(seed)
    templates, masks = _padded_templates()
    labels = torch.randint(0, 10, (n,), generator=g)
    images = torch.empty(n, 28, 28, dtype=torch.uint8)
    for lo in range(0, n, chunk):
        lab = labels[lo : lo + chunk]
        m = len(lab)
        seg = templates[lab]
        # A smooth random warp bends strokes without breaking them apart.
        freq, phase = 2 + 3 * torch.rand(2, m, 1, 1, 2, generator=g)
        seg = seg + 0.06 * _sin_pi(freq * seg.flip(-1) + phase)
        # Random affine: rotation, anisotropic scale, shear, translation, into a 20-px box.
        turn = _bell(g, m, 1, 1) * (0.22 / math.pi)  # the angle in half-turns
        sx, sy = (0.75 + 0.3 * torch.rand(2, m, 1, 1, generator=g)) * 20
        shear = _bell(g, m, 1, 1) * 0.25
        cos, sin = _sin_pi(turn + 0.5), _sin_pi(turn)
        x, y = (seg - 0.5).unbind(-1)  # (m, S, 2) each: the matrix product by hand, in one order on every CPU
        shift = 14 + 2.0 * _bell(g, 2, m, 1, 1)
        pix = torch.stack([cos * sx * x + (shear * cos - sin) * sy * y + shift[0],
                           sin * sx * x + (shear * sin + cos) * sy * y + shift[1]], -1)
        width = 0.8 + 1.4 * torch.rand(m, generator=g)
        ink = _render(pix, masks[lab], width)
        ink.mul_(0.6 + 0.4 * torch.rand(m, 1, 1, generator=g))  # in place: the same numbers, no new 6 MB tensors
        spread = 0.12 * math.sqrt(12) * torch.rand(m, 1, 1, generator=g)  # uniform noise of deviation 0..0.12
        ink.add_(torch.rand(m, 28, 28, generator=g).sub_(0.5).mul_(spread))
        images[lo : lo + m] = ink.clamp_(0, 1).mul_(255).round_()
    return images, labels
