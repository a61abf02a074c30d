"""One run, any world size: the step's gradient is the same for every way of sharing the run's global batch.

Real gloo ranks run the real pieces (`StepBatches`, `ddp.wrap`, `steps.accumulate`, `PartStats`, the
reductions) for the first and the last (shorter) step of an epoch and save the reduced gradient, once with
each reduction: DDP's own (no comm hook), ours of DDP's mean, and --bitwise's slot order. The run's global
batch is M = 4 micro-batches; worlds 1, 2, 4 (accumulating 4, 2, 1 each) and 3 (sharing 4 unevenly) must
agree to float summation order with the mean, to the last bit with --bitwise; our mean must be DDP's own bit
for bit; a run of another global batch must differ, and the gradient must be the mean over the step's
samples, written here independently. An observer of the reduction counts the buckets: one per step.
"""

import math
import os
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DistributedSampler

from conftest import metrics, spawn_gloo, tiny
from datafiles import one_thread
from mnist_ddp.core import ddp, reduction
from mnist_ddp.core.batches import Share, StepBatches, model_input
from mnist_ddp.core.bnstats import PartStats
from mnist_ddp.core.distributed import Dist
from mnist_ddp.core.steps import accumulate
from mnist_ddp.model import ConvNet
from mnist_ddp.outputs import checkpoint
from procfs import finish, marked_env, reaped, start

N, BATCH, SLOTS = 203, 8, 4  # 51 samples per slot: 7 steps, the last of 3 samples per slot
LAST = math.ceil(math.ceil(N / SLOTS) / BATCH) - 1
CPU = torch.device("cpu")


def _data() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(3)
    return torch.randint(0, 256, (N, 28, 28), dtype=torch.uint8, generator=g), torch.randint(0, 10, (N,), generator=g)


def _grads(model: torch.nn.Module) -> torch.Tensor:
    return torch.cat([p.grad.reshape(-1) for p in model.parameters()])


class _Buckets:
    """An observer of the reduction (what --profile's clock is): counts the buckets handed over."""

    def __init__(self) -> None:
        self.handed_over_count = 0

    def handed_over(self, bucket: int) -> None:
        self.handed_over_count += 1

    def back(self, bucket: int) -> None:
        pass


# DDP without a comm hook; our hook of DDP's mean; --bitwise's slot order, in one bucket (as ddp.wrap makes
# it: 116 kB) and in several (DDP rebuilds its buckets after the first backward: the last step has 3)
MODES = ("ddp", "mean", "bitwise", "bitwise, buckets of 50 kB")


def _rank(d: Dist, out: str, slots: int) -> None:
    """Rank d.rank of a world sharing `slots` micro-batches, in each mode: the gradients of steps 0 and -1, and
    the number of buckets each reduced."""
    saved = {}
    for mode in MODES:
        torch.manual_seed(0)
        # channels_last, the CPU default: a bucket is laid out in each parameter's memory order (reduction.laid_out)
        model = ConvNet().to(memory_format=torch.channels_last)
        bitwise = mode.startswith("bitwise")
        share = Share(slots, d.world_size, whole=bitwise)
        reduce = reduction.for_run(bitwise, model, share, d.rank)
        accumulating = share.parts > share.world
        if mode in ("ddp", "bitwise, buckets of 50 kB") and d.world_size > 1:
            # (a static graph would rebuild its buckets only after the second backward)
            net = DDP(model, gradient_as_bucket_view=True, static_graph=not (accumulating or bitwise),
                      bucket_cap_mb=0.05 if bitwise else 1, **ddp.NO_BUFFER_SYNC)
            if bitwise:
                net.register_comm_hook(reduce, reduction.comm_hook)
        else:
            net = ddp.wrap(model, d, accumulating=accumulating, hook=reduce)
        buckets = reduce.observer = _Buckets()
        images, labels = _data()
        batches = StepBatches(images, labels, BATCH, share, rank=d.rank, device=CPU, seed=0, channels_last=True)
        stats = PartStats(model, share, d.rank)
        steps = list(batches)
        for name, step in (("first", steps[0]), ("last", steps[-1])):  # no optimizer step: both from the same weights
            before = buckets.handed_over_count
            model.zero_grad(set_to_none=True)
            accumulate(net, step, stats, reduce)
            saved[f"{mode} {name}"] = _grads(model)
            saved[f"{mode} {name} buckets"] = buckets.handed_over_count - before
        saved["micro_batches"] = len(steps[0].micro_batches)
    torch.save(saved, os.path.join(out, f"rank{d.rank}.pt"))


def _reference(step: int) -> torch.Tensor:
    """The definition: the mean loss over the step's samples, each slot's micro-batch forwarded on its own
    (BatchNorm statistics per micro-batch); slot j's samples are rank j's of a world of M, DistributedSampler's."""
    images, labels = _data()
    torch.manual_seed(0)
    model = ConvNet()
    losses = []
    for j in range(SLOTS):
        slot = list(DistributedSampler(range(N), num_replicas=SLOTS, rank=j, shuffle=True, seed=0))  # type: ignore[arg-type]
        idx = torch.tensor(slot[step * BATCH : (step + 1) * BATCH])
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


SAME_RUN = ("1x4", "2x2", "4x1", "3 sharing 4")


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("step", ["first", "last"])
def test_every_world_computes_the_global_batch_mean_gradient(results: dict[str, list[dict]], step: str,
                                                             mode: str) -> None:
    with one_thread():
        expected = _reference(0 if step == "first" else LAST)
    key = f"{mode} {step}"
    for name in SAME_RUN:
        ranks = results[name]
        for r in ranks[1:]:
            assert torch.equal(r[key], ranks[0][key]), name  # the reduction left every rank the same gradient
        assert _rel(ranks[0][key], expected) < 1e-5, (name, _rel(ranks[0][key], expected))
    assert _rel(results["control: 2x1"][0][key], expected) > 1e-2  # another global batch: another gradient


@pytest.mark.parametrize("step", ["first", "last"])
def test_bitwise_gradient_is_the_same_bits_at_every_world(results: dict[str, list[dict]], step: str) -> None:
    """One thread per process (spawn_gloo), as --bitwise pins it: every world's gradient is the same bits, in
    one bucket or several."""
    one_process = results["1x4"][0][f"bitwise {step}"]
    for name in SAME_RUN:
        for mode in ("bitwise", "bitwise, buckets of 50 kB"):
            assert torch.equal(results[name][0][f"{mode} {step}"], one_process), (name, mode)
    # The same check has teeth: DDP's mean of the same micro-batches, at another world, rounds differently.
    assert not all(torch.equal(results[name][0][f"mean {step}"], results["1x4"][0][f"mean {step}"])
                   for name in SAME_RUN)


@pytest.mark.parametrize("step", ["first", "last"])
def test_our_mean_is_ddps_own_bit_for_bit(results: dict[str, list[dict]], step: str) -> None:
    for name in ("2x2", "4x1", "3 sharing 4"):
        assert torch.equal(results[name][0][f"mean {step}"], results[name][0][f"ddp {step}"]), name


def test_one_reduction_per_step_however_many_micro_batches(results: dict[str, list[dict]]) -> None:
    assert [r["micro_batches"] for r in results["2x2"]] == [2, 2]
    assert [r["micro_batches"] for r in results["3 sharing 4"]] == [2, 1, 1]  # rank 0 takes one more
    for name in ("2x2", "4x1", "3 sharing 4"):
        for r in results[name]:
            for mode in ("mean", "bitwise"):
                assert (r[f"{mode} first buckets"], r[f"{mode} last buckets"]) == (1, 1), (name, mode)
            assert r["bitwise, buckets of 50 kB last buckets"] == 3, name  # 116 kB in buckets of 50 kB


# --- end to end: the same run from scratch at worlds 1, 2 and 4 ---------------------------------------------------

# fp32 SGD at a constant lr: 300 synthetic images in 4 micro-batches of 25, 3 steps, where float rounding is still
# ~1e-8 (the chaos grows it: ~1e-6 after 6 steps on some CPUs, 1e-3 after 30; README "One run, any world size").
# One thread per process, since the thread count changes the kernels' summation order too.
SGD = [*tiny(300, 100, epochs=1), "--batch-size", "25", "--optimizer", "sgd", "--momentum", "0", "--lr", "0.05",
       "--scheduler", "none", "--amp", "off", "--seed", "5"]
COMMANDS = {"-g 1 --accumulate 4": ["--accumulate", "4"], "-g 2 --accumulate 2": ["-g", "2", "--accumulate", "2"],
          "-g 4": ["-g", "4"], "another global batch: -g 2": ["-g", "2"]}


def _final_weights(out: Path) -> torch.Tensor:
    state = checkpoint.load(out / "checkpoint.pt")["model"]
    return torch.cat([v.reshape(-1).double() for v in state.values() if v.is_floating_point()])


def test_the_same_run_at_worlds_1_2_and_4_ends_with_the_same_weights(tmp_path: Path) -> None:
    """docs/world-size.md: the weights of `--accumulate 4`, `-g 2 --accumulate 2` and `-g 4` are under 1e-6 apart
    after 3 fp32 SGD steps (float summation order); a run of another global batch (2 micro-batches: 6 steps) is far
    from them."""
    env, mark = marked_env()
    with reaped(mark):
        runs = {name: start(["mnist_ddp", "train", *SGD, *extra, "--out", str(tmp_path / str(n))], env, tmp_path,
                            tmp_path / f"{n}.log") for n, (name, extra) in enumerate(COMMANDS.items())}
        for n, proc in enumerate(runs.values()):
            rc, log = finish(proc, tmp_path / f"{n}.log", 300)
            assert rc == 0, log
    weights = {name: _final_weights(tmp_path / str(n)) for n, name in enumerate(COMMANDS)}
    assert [metrics(tmp_path / str(n))[-1]["global_batch"] for n in range(4)] == [100, 100, 100, 50]
    reference = weights["-g 4"]
    distance = {name: float((w - reference).norm() / reference.norm()) for name, w in weights.items()}
    print("relative distance from -g 4:", {k: f"{v:.2g}" for k, v in distance.items()})
    assert distance["-g 1 --accumulate 4"] < 1e-6 and distance["-g 2 --accumulate 2"] < 1e-6, distance
    assert distance["another global batch: -g 2"] > 1e-2, distance
