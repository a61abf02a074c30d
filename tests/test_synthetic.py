"""The built-in digits: the same seed gives the same bytes, the bytes of a version never change, and the
rasteriser draws exactly the strokes."""

import os
import subprocess
import sys

import torch

from mnist_ddp.data import synthetic

# SHA-256 of generate(2500, 20240601)'s images and labels as IDX bytes, per synthetic.VERSION: the cached copies of
# a version (data/synthetic/v<VERSION>/) are trusted to be these bytes, so a change to them must raise VERSION.
BYTES = {2: "a7d85d2208f7011a593a5be61ad16ec731ebee296e438431accd84feeac35ae0"}
KERNELS = ["default", "avx2", "avx512"]  # ATEN_CPU_CAPABILITY's values, in the order CPUs gain them
DIGEST = """
import hashlib
from mnist_ddp.data import idx, synthetic
images, labels = synthetic.generate(2500, 20240601)
print(hashlib.sha256(idx.encode(images) + idx.encode(labels)).hexdigest())
"""


def test_same_seed_same_bytes_other_seed_other_digits() -> None:
    a, b, c = synthetic.generate(300, 7), synthetic.generate(300, 7), synthetic.generate(300, 8)
    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])
    assert not torch.equal(a[0], c[0])
    assert a[0].dtype == torch.uint8 and a[0].shape == (300, 28, 28) and set(a[1].tolist()) == set(range(10))


def test_a_version_keeps_its_bytes_on_every_cpu() -> None:
    """Two chunks (2,048 + 452 images) of the training set's seed: the bytes the version was released with, with
    each set of kernels torch picks by CPU that this CPU can run (plain C++ at least, and AVX2 or AVX-512). Nodes
    with other CPUs generate their own copies: their ranks must train on the same digits."""
    best = torch.backends.cpu.get_cpu_capability().lower()
    kernels = KERNELS[: KERNELS.index(best) + 1] if best in KERNELS else ["default", best]
    for each in kernels:
        env = {**os.environ, "ATEN_CPU_CAPABILITY": each}
        digest = subprocess.run([sys.executable, "-c", DIGEST], env=env, capture_output=True, text=True, check=True)
        assert digest.stdout.strip() == BYTES[synthetic.VERSION], each


def _plain_render(seg: torch.Tensor, mask: torch.Tensor, width: torch.Tensor) -> torch.Tensor:
    """The definition: every pixel's distance to every real segment (the same arithmetic, in the same order)."""
    centres = torch.arange(28.0) + 0.5
    px, py = centres.repeat(28), centres.repeat_interleave(28)  # row by row, like the image
    out = []
    for i in range(len(seg)):
        (ax, ay), (ex, ey) = seg[i, mask[i], 0].T[:, :, None], seg[i, mask[i], 1].T[:, :, None]  # (2, S, 1) each
        dx, dy = ex - ax, ey - ay
        t = (((px - ax) * dx + (py - ay) * dy) / (dx * dx + dy * dy).clamp_min(1e-6)).clamp(0, 1)
        nearest = ((px - ax - t * dx).square() + (py - ay - t * dy).square()).amin(0)
        out.append(((width[i] - nearest.sqrt()) / 0.9 + 0.5).clamp(0, 1).reshape(28, 28))
    return torch.stack(out)


def test_render_draws_every_real_segment_and_nothing_else() -> None:
    """The windowed rasteriser gives the plain definition's floats exactly, also for strokes at and beyond the
    image's edges and for the widest pen, where a window is cut short by the border or as big as the image."""
    templates, masks = synthetic._padded_templates()
    g = torch.Generator().manual_seed(0)
    labels = torch.arange(10).repeat(6)
    scale = torch.tensor([20.0, 20.0, 36.0, 36.0, 8.0, 8.0]).repeat_interleave(10)[:, None, None, None]
    offset = torch.tensor([4.0, -6.0, -4.0, 0.0, 0.0, 21.0]).repeat_interleave(10)[:, None, None, None]
    seg = templates[labels] * scale + offset + torch.rand(len(labels), 1, 1, 2, generator=g)
    width = 0.8 + 1.4 * torch.rand(len(labels), generator=g)
    width[::7] = 2.2  # the widest pen generate draws with
    got = synthetic._render(seg, masks[labels], width)
    assert torch.equal(got, _plain_render(seg, masks[labels], width))
    assert got.amax((1, 2)).gt(0.5).all() and got.eq(0).any()  # every digit drawn, and not everywhere
