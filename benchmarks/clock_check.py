"""What --profile's clock reads for the gradient all-reduce on this device, CUDA events against perf_counter.

    PYTHONPATH=src python3 benchmarks/clock_check.py --device cuda     # one GPU (gpu_check.py's profile part)
    python benchmarks/clock_check.py                                   # CPU, gloo: both read perf_counter

One GPU has no peer, but a world of one still runs DDP's comm hook: the process group here is a world of one
(nccl on a GPU, gloo on the CPU), the model our ConvNet in DDP with the run's own reduction (reduction.py's
mean) and two observers on it: `timeline.BucketClock` as --profile makes it (CUDA events on a GPU), and the same
clock reading perf_counter when the observer is told, which under NCCL is when the all-reduce was queued.
Prints one JSON line: the median all-reduce milliseconds each clock saw over the steps. Asserts nothing.
"""

import argparse
import json
import statistics
import time
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.nn.functional as F

from mnist_ddp.core import distributed
from mnist_ddp.core.reduction import MeanReduction, comm_hook
from mnist_ddp.joining import rendezvous
from mnist_ddp.model import ConvNet
from mnist_ddp.outputs import timeline


class Both:
    """One reduction observer that tells two clocks."""

    def __init__(self, *clocks: timeline.BucketClock) -> None:
        self.clocks = clocks

    def handed_over(self, bucket: int) -> None:
        for c in self.clocks:
            c.handed_over(bucket)

    def back(self, bucket: int) -> None:
        for c in self.clocks:
            c.back(bucket)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    p.add_argument("--steps", type=int, default=30)
    a = p.parse_args()
    store = rendezvous.host_store("127.0.0.1", 0, 1, timedelta(seconds=60))
    device = torch.device("cuda", 0) if a.device == "cuda" else torch.device("cpu")
    cuda = a.device == "cuda"
    dist.init_process_group("nccl" if cuda else "gloo", store=store, rank=0, world_size=1,
                            device_id=device if cuda else None)
    try:
        net = torch.nn.parallel.DistributedDataParallel(ConvNet().to(device),
                                                        device_ids=[0] if a.device == "cuda" else None)
        seen: dict[str, list[float]] = {"events": [], "perf_counter": []}
        events = timeline.BucketClock(lambda x, y: seen["events"].append(y - x), device)
        wall = timeline.BucketClock(lambda x, y: seen["perf_counter"].append(y - x), torch.device("cpu"))
        mean = MeanReduction(1)
        mean.observer = Both(events, wall)
        net.register_comm_hook(mean, comm_hook)
        x, y = torch.randn(100, 1, 28, 28, device=device), torch.randint(0, 10, (100,), device=device)
        for _ in range(a.steps):
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            events.start(time.perf_counter())
            F.cross_entropy(net(x), y).backward()
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            events.settle()
            net.zero_grad(set_to_none=True)
        print(json.dumps({"device": str(device), "steps": a.steps,
                          **{f"all_reduce_ms_{k}": 1e3 * statistics.median(v) for k, v in seen.items()}}))
    finally:
        distributed.teardown(together=False)


if __name__ == "__main__":
    main()
