"""One run, any world size: the step's gradient is the same for every way of sharing the run's global batch.

Real gloo ranks run the real pieces (`StepBatches`, `trainer.wrap`, `steps.accumulate`, `PartStats`) for the
first and the last (shorter) step of an epoch and save the all-reduced gradient. The run's global batch is
M = 4 micro-batches; worlds 1, 2, 4 (accumulating 4, 2, 1 each) and 3 (sharing 4 unevenly) must agree to
float summation order, a run of another global batch must not, and the gradient must be the mean over the
step's samples, written here independently. A comm hook counts the all-reduces: exactly one per step.
"""

import math
import os

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook

from conftest import spawn_gloo
from datafiles import one_thread
from mnist_ddp import trainer
from mnist_ddp.batches import Share, StepBatches, epoch_order, model_input, padded
from mnist_ddp.config import TrainConfig
from mnist_ddp.distributed import Dist
from mnist_ddp.model import ConvNet
from mnist_ddp.steps import PartStats, accumulate

N, BATCH, SLOTS = 203, 8, 4  # 51 samples per slot: 7 steps, the last of 3 samples per slot
LAST = math.ceil(math.ceil(N / SLOTS) / BATCH) - 1
CPU = torch.device("cpu")


def _data() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(3)
    return torch.randint(0, 256, (N, 28, 28), dtype=torch.uint8, generator=g), torch.randint(0, 10, (N,), generator=g)


def _grads(model: torch.nn.Module) -> torch.Tensor:
    return torch.cat([p.grad.reshape(-1) for p in model.parameters()])


def _rank(d: Dist, out: str, slots: int) -> None:
    """Rank d.rank of a world sharing `slots` micro-batches: the gradients of steps 0 and -1, and the
    number of all-reduces each made."""
    torch.manual_seed(0)
    model = ConvNet()
    share = Share(slots, d.world_size)
    net = trainer.wrap(model, TrainConfig(), d, accumulating=share.parts > share.world)
    calls = []
    if d.world_size > 1:
        def counting(state: object, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
            calls.append(bucket.index())
            return allreduce_hook(state, bucket)  # DDP's own all-reduce (the mean), only counted
        net.register_comm_hook(None, counting)
    images, labels = _data()
    batches = StepBatches(images, labels, BATCH, share, rank=d.rank, device=CPU, seed=0)
    stats = PartStats(model, share.mine(d.rank), share.parts, d)
    scaler = trainer.guard(CPU, "off")
    steps = list(batches)
    saved = {}
    for name, step in (("first", steps[0]), ("last", steps[-1])):  # no optimizer step: both from the same weights
        before = len(calls)
        model.zero_grad(set_to_none=True)
        accumulate(net, step, stats, scaler, d.world_size, "off", 0.0)
        saved[name] = _grads(model)
        saved[f"{name}_allreduces"] = len(calls) - before
    saved["micro_batches"] = len(steps[0].micro_batches)
    torch.save(saved, os.path.join(out, f"rank{d.rank}.pt"))


def _reference(step: int) -> torch.Tensor:
    """The definition: the mean loss over the step's samples, each slot's micro-batch forwarded on its own
    (BatchNorm statistics per micro-batch); slot j's samples are rank j's of a world of M, DistributedSampler's."""
    images, labels = _data()
    slots = padded(epoch_order(N, shuffle=True, seed=0, epoch=0), SLOTS)
    torch.manual_seed(0)
    model = ConvNet()
    losses = []
    for j in range(SLOTS):
        idx = slots[j::SLOTS][step * BATCH : (step + 1) * BATCH]
        losses.append(F.cross_entropy(model(model_input(images[idx], True)), labels[idx], reduction="none"))
    torch.cat(losses).mean().backward()
    return _grads(model)


WORLDS = {  # name: (world, micro-batch slots)
    "1x4": (1, SLOTS), "2x2": (2, SLOTS), "4x1": (4, SLOTS), "3 sharing 4": (3, SLOTS),
    "control: 2x1": (2, 2),  # a global batch of 2 micro-batches: another run
}


@pytest.fixture(scope="module")
def results(tmp_path_factory: pytest.TempPathFactory) -> dict[str, list[dict]]:
    out = tmp_path_factory.mktemp("accumulate")
    found = {}
    for name, (world, slots) in WORLDS.items():
        where = out / name.replace(" ", "_").replace(":", "")
        where.mkdir()
        spawn_gloo(_rank, world, str(where), slots)
        found[name] = [torch.load(where / f"rank{r}.pt", weights_only=True) for r in range(world)]
    return found


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / b.norm())


@pytest.mark.parametrize("step", ["first", "last"])
def test_every_world_computes_the_global_batch_mean_gradient(results: dict[str, list[dict]], step: str) -> None:
    with one_thread():
        expected = _reference(0 if step == "first" else LAST)
    for name in ("1x4", "2x2", "4x1", "3 sharing 4"):
        ranks = results[name]
        for r in ranks[1:]:
            assert torch.equal(r[step], ranks[0][step]), name  # the all-reduce left every rank the same gradient
        assert _rel(ranks[0][step], expected) < 1e-5, (name, _rel(ranks[0][step], expected))
    assert _rel(results["control: 2x1"][0][step], expected) > 1e-2  # another global batch: another gradient


def test_one_all_reduce_per_step_however_many_micro_batches(results: dict[str, list[dict]]) -> None:
    assert [r["micro_batches"] for r in results["2x2"]] == [2, 2]
    assert [r["micro_batches"] for r in results["3 sharing 4"]] == [2, 1, 1]  # rank 0 takes one more
    for name in ("2x2", "4x1", "3 sharing 4"):
        for r in results[name]:
            assert (r["first_allreduces"], r["last_allreduces"]) == (1, 1), name
