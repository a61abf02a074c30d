"""DDP captured in a CUDA graph against eager DDP, in one process: a world of one over a real process group (NCCL
on a GPU, gloo on a CPU), the same SGD fp32 steps with deterministic kernels, three ways:

  captured        the graph step: DDP's forward, backward with its all-reduce, and the flat optimizer, replayed
  graph-eager     the same code run eagerly (no capture): the captured weights must be these bytes
  textbook        the eager textbook step (train_step, torch's fused SGD), as `--graph-step off` trains

It prints each one's images/s (the second epoch) and their ratios, whether captured and graph-eager saved the same
bytes, and the largest difference from the textbook step (the flat SGD rounds a few elements an ulp apart from
torch's, docs/design/graph-step.md); the last line is JSON. NCCL routes a one-rank all-reduce to a local copy, so
this proves DDP's host-side logic under capture, not several ranks (docs/gpu.md). It asserts nothing.

    PYTHONPATH=src python benchmarks/ddp_capture.py                  # on a GPU
    PYTHONPATH=src python benchmarks/ddp_capture.py --device cpu     # the plumbing, on a CPU
"""

import argparse
import json
import os
import sys
import time
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))
from mnist_ddp.common.config import DataConfig, Recipe, recipe
from mnist_ddp.core import compute, ddp, distributed, schedule
from mnist_ddp.core.batches import DeviceData, ShardedBatches
from mnist_ddp.core.distributed import Dist
from mnist_ddp.core.steps import train_step
from mnist_ddp.cudagraph.graphstep import GraphStep
from mnist_ddp.data import datasets
from mnist_ddp.model import ConvNet

EPOCHS = 2  # the first pays for warm-up and capture; images/s are the second's


def parse() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    p.add_argument("--samples", type=int, default=20000, help="training images an epoch (default %(default)s)")
    p.add_argument("--batch-size", type=int, default=100)
    p.add_argument("--data-dir", help="where the synthetic digits are cached (default: ./data)")
    return p.parse_args()


def trained(way: str, d: Dist, data: datasets.Dataset, r: Recipe) -> tuple[dict[str, torch.Tensor], float, str]:
    """The model after EPOCHS epochs trained `way`; the second epoch's images/s; the `step:` line (graph ways)."""
    torch.manual_seed(0)
    model = ConvNet().to(d.device)
    opt, set_lr = schedule.build_optimizer(r, model)
    said: list[str] = []
    n, seconds = len(data.train.labels), 0.0
    if way == "textbook":
        net = ddp.wrap(model, d, always=True)
        batches = ShardedBatches(data.train.images, data.train.labels, r.batch_size, rank=0, world=1,
                                 device=d.device, shuffle=True, seed=0)
        for epoch in range(EPOCHS):
            batches.set_epoch(epoch)
            began = time.perf_counter()
            for s, (x, y) in enumerate(batches):
                set_lr((epoch * n + min(n, s * r.batch_size)) / (EPOCHS * n))
                train_step(net, opt, x, y)
            compute.sync(d.device)
            seconds = time.perf_counter() - began
    else:
        step = GraphStep(model, opt, DeviceData(data.train.images, data.train.labels, d.device, True, False), r, d,
                         capture=way == "captured" and d.device.type == "cuda")
        ready = step.prepare(ddp.wrap(model, d, always=True, stream=step.stream, keep_grads=True), said.append)
        if ready is None:
            return {}, float("nan"), said[-1]
        batches = ShardedBatches(data.train.images, data.train.labels, r.batch_size, rank=0, world=1,
                                 device=d.device, shuffle=True, seed=0)
        for epoch in range(EPOCHS):
            batches.set_epoch(epoch)
            began = time.perf_counter()
            for s in step.begin_epoch(epoch, batches.indices()):
                step.step(s)
            compute.sync(d.device)
            seconds = time.perf_counter() - began
    return {k: v.detach().cpu().clone() for k, v in model.state_dict().items()}, n / seconds, "; ".join(said)


def main() -> int:
    a = parse()
    device = distributed.pick_device(a.device, 0, 1)
    os.environ.update(distributed.nccl_error_handling(os.environ) if device.type == "cuda" else {})
    compute.configure_backends(device, deterministic=True)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    backend = "nccl" if device.type == "cuda" else "gloo"
    store = dist.TCPStore("127.0.0.1", 0, 1, is_master=True, timeout=timedelta(seconds=60))
    dist.init_process_group(backend, store=store, rank=0, world_size=1, timeout=timedelta(seconds=60),
                            device_id=device if backend == "nccl" else None)
    try:
        d = Dist(0, 0, 1, 1, device)
        data = datasets.load(DataConfig("synthetic", Path(a.data_dir) if a.data_dir else None,
                                        train_samples=a.samples, test_samples=100))
        r = recipe("default", optimizer="sgd", amp="off", batch_size=a.batch_size, epochs=EPOCHS)
        # On a CPU nothing is captured: a "captured" run would be the graph-eager one again, so it is not run.
        ways = ("captured", "graph-eager", "textbook") if device.type == "cuda" else ("graph-eager", "textbook")
        runs = {way: trained(way, d, data, r) for way in ways}
    finally:
        dist.destroy_process_group()
    speeds = {way: run[1] for way, run in runs.items()}
    captured = runs["captured"][0] if "captured" in runs else None
    eager, textbook = runs["graph-eager"][0], runs["textbook"][0]
    # None where nothing was captured (a CPU, or a capture that fell back): there is no second run to compare.
    same = all(torch.equal(captured[k], eager[k]) for k in eager) if captured else None
    largest = max(float(((captured or eager)[k].double() - textbook[k].double()).abs().max()) for k in textbook
                  if textbook[k].is_floating_point()) if (captured or eager) else float("nan")
    for way, ips in speeds.items():
        print(f"{way:12s} {ips:12,.0f} images/s")
    ratio = (lambda other: speeds["captured"] / speeds[other]) if "captured" in speeds else (lambda other: None)
    result = {"backend": backend, "torch": torch.__version__,
              "nccl": ".".join(map(str, torch.cuda.nccl.version())) if backend == "nccl" else None,
              "async_error_handling": os.environ.get("TORCH_NCCL_ASYNC_ERROR_HANDLING"),
              "step": runs["captured" if "captured" in runs else "graph-eager"][2], "images_per_second": speeds,
              "captured_over_graph_eager": ratio("graph-eager"), "captured_over_textbook": ratio("textbook"),
              "same_bytes_captured_and_graph_eager": same, "largest_difference_from_textbook": largest}
    print(f"captured == graph-eager bytes: {same}; largest difference from the textbook step (the captured "
          f"step's, else the graph-eager one's): {largest:.3g}")
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
