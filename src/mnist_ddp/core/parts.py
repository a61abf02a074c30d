"""Every rank's parts on every rank, in part order: one all-gather of rows laid out rank by rank, summed in part
order so that the sum has the same bits wherever the parts were computed. What BatchNorm's statistics per part
(bnstats.PartStats) and `--bitwise`'s gradients (reduction.SlotReduction) are gathered by (docs/design/bitwise.md)."""

import math
from collections.abc import Sequence

import torch
import torch.distributed as dist

from .batches import Share


def per_rank(share: Share) -> int:
    """Rows each rank sends in a gather of every part: the most parts one rank trains (the others pad)."""
    return math.ceil(share.parts / share.world)


def padded_rows(rows: Sequence[torch.Tensor], share: Share, like: torch.Tensor) -> torch.Tensor:
    """This rank's parts as the rows it sends, `per_rank` rows as long as `like` (and of its dtype and device),
    zero rows after them where it trains fewer."""
    out = like.new_zeros(per_rank(share), like.numel())
    for i, row in enumerate(rows):
        out[i] = row
    return out


def in_part_order(gathered: torch.Tensor, share: Share) -> list[torch.Tensor]:
    """The gathered rows (rank by rank, each `per_rank` of them) as parts 0…parts−1: rank r's i-th row is part
    r + i·world (`Share.parts_of`)."""
    rows, w = per_rank(share), share.world
    return [gathered[(j % w) * rows + j // w] for j in range(share.parts)]


def ordered_sum(parts: Sequence[torch.Tensor], out: torch.Tensor | None = None) -> torch.Tensor:
    """parts[0] + parts[1] + … added one at a time, in that order (into `out` if given): the same bits wherever
    the parts were computed."""
    total = parts[0].clone() if out is None else out.copy_(parts[0])
    for part in parts[1:]:
        total.add_(part)
    return total


def gather(mine: Sequence[torch.Tensor], share: Share, like: torch.Tensor,
           async_op: bool = False) -> tuple[dist.Work | None, torch.Tensor]:
    """Every rank's parts (rows shaped like `like`; this rank's are `mine`, in its part order) on every rank:
    one all-gather into the tensor returned, `per_rank` rows from each rank in rank order (`in_part_order`)."""
    send = padded_rows(mine, share, like)
    gathered = send.new_empty(share.world * per_rank(share), like.numel())
    # torch 2.13 renamed all_gather_into_tensor to all_gather_single (pytorch#186123) and deprecated the old
    # name, which older torch (down to our floor, 2.10) has alone.
    collective = dist.all_gather_single if hasattr(dist, "all_gather_single") else dist.all_gather_into_tensor
    return collective(gathered, send, async_op=async_op), gathered


def all_parts(mine: Sequence[torch.Tensor], share: Share, like: torch.Tensor) -> list[torch.Tensor]:
    """Every rank's parts on every rank, in part order (`gather`, waited for). Used for BatchNorm's statistics
    per part (bnstats.PartStats)."""
    if share.world == 1:
        return list(mine)
    return in_part_order(gather(mine, share, like)[1], share)
