"""What survivors hand each other after re-forming (recovery.py): every part's BatchNorm set, and what they added
up since the last fold, so that the new world continues the run (docs/design/recovery.md)."""

from collections.abc import Mapping

import torch

from ..core.batches import Share
from ..core.bnstats import PartStats
from ..core.distributed import Dist
from ..core.state import Stretch


def batchnorm_sets(stats: PartStats, was: Share, d: Dist, known: Mapping[int, torch.Tensor]) -> torch.Tensor | None:
    """Every part's BatchNorm set, on every survivor: its holder's (one all-reduce), else `known` (what the
    last reduction carried), else the survivors' mean. None where the new world cuts the step into other parts."""
    if not stats.live or Share(was.slots, d.world_size, was.whole).parts != was.parts:
        return None
    held = stats.held()
    width = next(iter(held.values())).numel() if held else sum(b.numel() for b in stats.live)
    rows = torch.zeros(was.parts, width + 1, device=stats.live[0].device)
    for part, values in held.items():
        rows[part, :width], rows[part, width] = values, 1
    d.all_sum(rows)  # each part has one holder at most: x + 0 + … = x, exactly
    mean = rows[rows[:, width] > 0, :width].mean(0)
    for part in range(was.parts):
        if rows[part, width] == 0:
            rows[part, :width] = known.get(part, mean)
    return rows[:, :width]


def carried(s: Stretch, d: Dist) -> Stretch:
    """The survivors' stretch since the last fold, added up on the new rank 0 (the others keep none): the lost
    ranks' samples are counted, their losses taken at the survivors' mean."""
    totals = d.all_sum(torch.stack([s.loss_sum.float(), torch.tensor(float(s.seen), device=s.loss_sum.device),
                                    *(loss.float() for _, _, loss, _ in s.logged)]))
    scale = s.samples / max(float(totals[1]), 1.0)
    mine = totals.mul(scale) if d.is_main else totals.new_zeros(totals.shape)
    return Stretch(mine[0].clone(), s.samples if d.is_main else 0, s.samples,
                   [(done, lr, loss, n) for (done, lr, _, n), loss in zip(s.logged, mine[2:])])
