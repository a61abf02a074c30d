"""The run's sentences read right for one process and for one of anything: `run:` and `final:`."""

import torch

from mnist_ddp.common.config import TrainConfig, recipe
from mnist_ddp.core.batches import Share
from mnist_ddp.core.distributed import Dist
from mnist_ddp.core.evaluation import EvalResult
from mnist_ddp.core.state import Progress
from mnist_ddp.outputs import summary

CPU = torch.device("cpu")


def _run_line(world: int, slots: int, bitwise: bool = False) -> str:
    d = Dist(rank=0, local_rank=0, world_size=world, local_world_size=world, device=CPU)
    return summary.run_line(TrainConfig(bitwise=bitwise), d, Share(slots=slots, world=world), "off", True)


def test_one_process_has_one_micro_batch_and_no_all_reduce() -> None:
    line = _run_line(1, 1)
    assert "global batch 100 (1 micro-batch of 100), one process: no all-reduce," in line, line
    assert "micro-batches" not in line and "all-reduce," not in line.replace("no all-reduce,", "")
    accumulating = _run_line(1, 4)
    assert "(4 micro-batches of 100; one process accumulates 4 micro-batches of 100), one process: no all-reduce" \
        in accumulating, accumulating


def test_several_processes_average_by_all_reduce() -> None:
    assert "global batch 200 (2 micro-batches of 100), gradients averaged by all-reduce," in _run_line(2, 2)
    assert "gradients bitwise: every micro-batch's gradient summed in slot order" in _run_line(2, 2, bitwise=True)


def test_the_final_line_counts_epochs() -> None:
    result = EvalResult(loss=0.1, correct=9, count=10, confusion=torch.zeros(10, 10, dtype=torch.int64))
    d = Dist(0, 0, 1, 1, CPU)
    for epochs, said in ((1, "after 1 epoch, world size 1"), (2, "after 2 epochs, world size 1")):
        cfg = TrainConfig(recipe=recipe("default", epochs=epochs), out="o")
        assert said in summary.final_line(cfg, d, Progress(epoch=epochs), None, result)
    missed = TrainConfig(recipe=recipe("default", epochs=1), target_accuracy=0.99, out="o")
    assert "did not reach the target 99.00% in 1 epoch:" in summary.final_line(missed, d, Progress(1), "missed", result)
    assert [summary.counted(n, "micro-batch", "micro-batches") for n in (1, 3)] == ["1 micro-batch", "3 micro-batches"]
