"""Exact test accuracy over all ranks: each rank scores its own shard, then one all-reduce.

The evaluation shards are not padded (`ShardedBatches(each_sample_once=True)`: every world-th image), so every
test image is counted exactly once however many ranks there are.
"""

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from ..common import timing
from ..model import ConvNet, for_inference
from .batches import ShardedBatches
from .compute import autocast
from .distributed import Dist


@dataclass(frozen=True)
class EvalResult:
    loss: float
    correct: int
    count: int
    confusion: torch.Tensor  # (10, 10) int64, rows = true class, columns = predicted

    @property
    def accuracy(self) -> float:
        return self.correct / self.count


@timing.charged("evaluation")
@torch.inference_mode()
def evaluate(model: ConvNet, batches: ShardedBatches, d: Dist, amp: str = "off") -> EvalResult:
    """Loss, accuracy and confusion matrix of `model` (a plain ConvNet, not the DDP wrapper), computed by its
    inference form (`for_inference`: BatchNorm folded into the convolutions)."""
    d.set_phase("evaluating")
    was_training = model.training
    model.eval()
    net = for_inference(model)
    try:  # a peer lost meanwhile (--recover goes back and trains on): the model is left as it was found
        # The loss sum, then the 100 confusion counts: one tensor, so one all-reduce carries them all.
        # float32 counts are exact up to 2**24 images, far beyond any test set here.
        totals = torch.zeros(1 + 100, device=d.device)
        for x, y in batches:
            with autocast(d.device, amp):
                logits = net(x)
            totals[0] += F.cross_entropy(logits.float(), y, reduction="sum")
            totals[1:] += torch.bincount(y * 10 + logits.argmax(1), minlength=100)
        d.all_sum(totals)
    finally:
        model.train(was_training)
    confusion = totals[1:].round().long().reshape(10, 10).cpu()
    count = int(confusion.sum())
    return EvalResult(float(totals[0]) / max(count, 1), int(confusion.trace()), count, confusion)
