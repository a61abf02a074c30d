"""The built-in digits: the same seed gives the same bytes, and the rasteriser draws exactly the strokes."""

import torch

from mnist_ddp import synthetic


def test_same_seed_same_bytes_other_seed_other_digits() -> None:
    a, b, c = synthetic.generate(300, 7), synthetic.generate(300, 7), synthetic.generate(300, 8)
    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])
    assert not torch.equal(a[0], c[0])
    assert a[0].dtype == torch.uint8 and a[0].shape == (300, 28, 28) and set(a[1].tolist()) == set(range(10))


def test_render_draws_every_real_segment_and_nothing_else() -> None:
    """Against the plain definition: each pixel's ink comes from its distance to the nearest real segment."""
    templates, masks = synthetic._padded_templates()
    g = torch.Generator().manual_seed(0)
    labels = torch.arange(10).repeat(3)
    seg = templates[labels] * 20 + 4 + torch.rand(len(labels), 1, 1, 2, generator=g)
    width = 0.8 + 1.4 * torch.rand(len(labels), generator=g)
    got = synthetic._render(seg, masks[labels], width)
    centres = torch.stack(torch.meshgrid(torch.arange(28.0) + 0.5, torch.arange(28.0) + 0.5, indexing="xy"), -1)
    for i, digit in enumerate(labels.tolist()):
        a, b = seg[i, masks[digit], 0], seg[i, masks[digit], 1]  # (S, 2) ends of the real segments only
        ab, ap = b - a, centres.reshape(-1, 1, 2) - a
        t = ((ap * ab).sum(-1) / (ab * ab).sum(-1).clamp_min(1e-6)).clamp(0, 1)
        dist = (ap - t[..., None] * ab).norm(dim=-1).min(1).values
        want = ((width[i] - dist) / 0.9 + 0.5).clamp(0, 1).reshape(28, 28)
        torch.testing.assert_close(got[i], want, atol=1e-4, rtol=0)
