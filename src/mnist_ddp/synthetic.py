"""MNIST-shaped handwritten-looking digits, generated from a seed in pure torch: the dataset that always works (no
network, no files). A digit is a stroke template, jittered, warped, drawn with a random pen and noised, varied
enough that the tutorial CNN learns it well but not perfectly: a sanity check that is not a tautology."""

import itertools
import math

import torch

Polyline = list[tuple[float, float]]
VERSION = 1  # raise it with any change to the bytes `generate` makes: it names the cached copies (datasets.py)


def _arc(cx: float, cy: float, rx: float, ry: float, start: float, end: float, n: int = 8) -> Polyline:
    """Points on an elliptical arc; angles in degrees, 0 = right, 90 = down (image axes)."""
    return [
        (cx + rx * math.cos(math.radians(a)), cy + ry * math.sin(math.radians(a)))
        for a in (start + (end - start) * i / n for i in range(n + 1))
    ]


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


def _render(seg: torch.Tensor, mask: torch.Tensor, width: torch.Tensor) -> torch.Tensor:
    """Rasterise (B, S, 2, 2) pixel-space segments with pen `width` (B,) into (B, 28, 28) in [0, 1]. `mask` is True
    on a prefix of each row (a template's real segments): a "1" costs 2 segments, not an "8"'s 20 (2.4x faster, same
    bytes)."""
    ys, xs = torch.meshgrid(torch.arange(28.0) + 0.5, torch.arange(28.0) + 0.5, indexing="ij")
    px, py = xs.reshape(1, -1), ys.reshape(1, -1)  # pixel centres, (1, 784)
    nearest = torch.full((seg.shape[0], 784), float("inf"))
    counts = mask.sum(1)
    for s in range(int(counts.max())):  # one segment at a time keeps memory at (B, 784)
        rows = (counts > s).nonzero().squeeze(1)
        ax, ay = seg[rows, s, 0, 0:1], seg[rows, s, 0, 1:2]
        dx, dy = seg[rows, s, 1, 0:1] - ax, seg[rows, s, 1, 1:2] - ay
        t = (((px - ax) * dx + (py - ay) * dy) / (dx * dx + dy * dy).clamp_min(1e-6)).clamp(0, 1)
        d2 = (px - ax - t * dx).square() + (py - ay - t * dy).square()
        nearest[rows] = torch.minimum(nearest[rows], d2)
    ink = ((width[:, None] - nearest.sqrt()) / 0.9 + 0.5).clamp(0, 1)  # ~1 px soft edge
    return ink.reshape(-1, 28, 28)


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
        seg = seg + 0.06 * torch.sin(freq * seg.flip(-1) * math.pi + phase * math.pi)
        # Random affine: rotation, anisotropic scale, shear, translation, into a 20-px box.
        angle = torch.randn(m, generator=g) * 0.22
        sx, sy = (0.75 + 0.3 * torch.rand(2, m, generator=g)) * 20
        shear = torch.randn(m, generator=g) * 0.25
        cos, sin = angle.cos(), angle.sin()
        mat = torch.stack([torch.stack([cos * sx, (shear * cos - sin) * sy], -1),
                           torch.stack([sin * sx, (shear * sin + cos) * sy], -1)], -2)  # (m, 2, 2)
        shift = 14 + 2.0 * torch.randn(m, 2, generator=g)
        pix = torch.einsum("bij,bsej->bsei", mat, seg - 0.5) + shift[:, None, None, :]
        width = 0.8 + 1.4 * torch.rand(m, generator=g)
        ink = _render(pix, masks[lab], width)
        ink = ink * (0.6 + 0.4 * torch.rand(m, 1, 1, generator=g))
        ink = ink + 0.12 * torch.rand(m, 1, 1, generator=g) * torch.randn(m, 28, 28, generator=g)
        images[lo : lo + m] = (ink.clamp(0, 1) * 255).round().to(torch.uint8)
    return images, labels
