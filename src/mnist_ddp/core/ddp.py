"""The DDP wrap: one line in the textbook, plus the few settings that suit this small model."""

import inspect
from contextlib import nullcontext
from typing import Any, cast

import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from ..common.errors import UserError
from . import reduction
from .batches import Share
from .distributed import Dist

# Each rank trains with its own BatchNorm statistics, averaged over the ranks before each evaluation and save
# (bnstats.RankStats; in the loop: `Trainer._add_up`'s `stats.average`, then `stats.use_own` before training goes on),
# instead of DDP re-sending rank 0's before every forward, a collective as slow as the gradient all-reduce here.
# torch 2.13's `forward_sync_buffers` replaces `broadcast_buffers`; unlike the old switch it still copies rank 0's
# buffers once, at the wrap, which changes nothing here (every rank starts alike).
_NEW_NAME = "forward_sync_buffers" in inspect.signature(DDP).parameters
NO_BUFFER_SYNC: dict[str, Any] = {"forward_sync_buffers": False} if _NEW_NAME else {"broadcast_buffers": False}


def wrap(model: nn.Module, d: Dist, *, sync_bn: bool = False, compile: bool = False, accumulating: bool = False,
         hook: reduction.Reduction | None = None, stream: torch.cuda.Stream | None = None,
         keep_grads: bool = False, always: bool = False) -> nn.Module:
    """`model` under DDP when there are several ranks: DDP broadcasts rank 0's weights now, and all-reduces the
    gradients (their mean) during every backward. `hook` replaces DDP's all-reduce (--bitwise, --profile);
    `accumulating`: some rank runs several micro-batches per step under `no_sync`. The graph step's DDP is built on
    its capture `stream` and writes the gradients back into the parameters' own (`keep_grads`: graphstep.py).
    `always`: DDP in a world of one too (benchmarks/ddp_capture.py)."""
    if d.world_size > 1 or always:
        if sync_bn:
            model = nn.SyncBatchNorm.convert_sync_batchnorm(model)
        # Each setting that is not DDP's default, in one line (measured and argued: docs/design/ddp-settings.md).
        with torch.cuda.stream(stream) if stream is not None else nullcontext():
            model = DDP(model,
                        device_ids=[d.device.index] if d.device.type == "cuda" else None,  # this rank's GPU
                        gradient_as_bucket_view=not keep_grads,  # .grad a view of the bucket: the mean not copied out
                        static_graph=not accumulating,  # no per-step bookkeeping; never with no_sync (torch bugs)
                        **NO_BUFFER_SYNC)  # no broadcast of rank 0's BatchNorm buffers before every forward
        if hook is not None:
            model.register_comm_hook(hook, reduction.comm_hook)
    return cast(nn.Module, torch.compile(model)) if compile else model


def check_sync_bn(sync_bn: bool, share: Share) -> None:
    """Refuse --sync-bn where ranks train different numbers of micro-batches per step: their SyncBatchNorm
    collectives would not pair, and every rank would wait until --timeout."""
    counts = {len(share.parts_of(rank)) for rank in range(share.world)}
    if sync_bn and share.world > 1 and len(counts) > 1:
        raise UserError(f"--sync-bn needs every process to run the same number of micro-batches per step, but "
                        f"{share.world} processes share this run's {share.slots} unevenly ({min(counts)} or "
                        f"{max(counts)} each); resume with a world size that divides {share.slots}, or without "
                        f"--sync-bn.")
