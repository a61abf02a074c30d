"""Lesson 0: the classic distributed-MNIST tutorial's program, fixed: DDP's six essentials in one file.

    python -m mnist_ddp.lesson -g 2                       # 2 processes on this machine (CPU: gloo, GPUs: nccl)
    torchrun --nproc-per-node 2 -m mnist_ddp.lesson       # the same, started by torchrun

The tutorial's flags mean what they meant (-n nodes, -g processes per node, -nr this node's index, --epochs). The
six essentials are numbered (1 join … 6 teardown) as README.md's "Where DDP lives" sets them beside the product's;
each of the tutorial's mistakes is marked FIX where it is fixed. `mnist-ddp train` does not use this file.
"""

import argparse
import os
import socket
from contextlib import nullcontext

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

from .common.config import DataConfig
from .core.batches import model_input
from .data.datasets import Split, load
from .model import ConvNet


def main(argv: list[str] | None = None) -> None:
    a = parse(argv)
    if "RANK" in os.environ:  # torchrun started this process, one per rank, and set the variables below
        worker(int(os.environ["LOCAL_RANK"]), int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]), a)
        return
    # FIX: the tutorial hard-coded MASTER_ADDR. Node 0's address and port come from the environment; one node may
    # leave them out (this machine and a free port).
    if a.nodes > 1 and not ("MASTER_ADDR" in os.environ and "MASTER_PORT" in os.environ):
        raise SystemExit("lesson: with several nodes, set MASTER_ADDR and MASTER_PORT to node 0's address and a port")
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(free_port()))
    mp.spawn(spawned, args=(a,), nprocs=a.gpus)  # rank = node index × processes per node + local index


def spawned(local_rank: int, a: argparse.Namespace) -> None:
    worker(local_rank, a.nr * a.gpus + local_rank, a.nodes * a.gpus, a)


def worker(local_rank: int, rank: int, world: int, a: argparse.Namespace) -> None:
    cuda = torch.cuda.is_available()
    device = torch.device("cuda", local_rank) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    # 1 join: every process meets the others at MASTER_ADDR:MASTER_PORT (env://) as rank `rank` of `world`.
    # FIX: the tutorial's "CPU" script asked for nccl and CUDA; gloo is the CPU's backend, nccl the GPUs'.
    dist.init_process_group("nccl" if cuda else "gloo", init_method="env://", rank=rank, world_size=world)
    try:
        train(local_rank, rank, world, device, a)
    finally:
        dist.destroy_process_group()  # 6 teardown. FIX: the tutorial never left the group, not even after an error


def train(local_rank: int, rank: int, world: int, device: torch.device, a: argparse.Namespace) -> None:
    # FIX: every process downloaded at once. Here the first process of each node reads (or downloads) the data
    # while the others wait at the barrier; then they read what it left.
    if local_rank != 0:
        dist.barrier()
    data = load(DataConfig(a.dataset, train_samples=a.train_samples, test_samples=a.test_samples))
    if local_rank == 0:
        dist.barrier()
    train_set = TensorDataset(data.train.images, data.train.labels)
    # 2 shard: each rank trains its own 1/world of every epoch.
    sampler = DistributedSampler(train_set, num_replicas=world, rank=rank, shuffle=True, seed=0)
    loader = DataLoader(train_set, batch_size=a.batch_size, sampler=sampler)
    torch.manual_seed(0)
    model = ConvNet().to(device)
    # 3 wrap: DDP sends rank 0's weights to every rank now, and all-reduces the gradients in every backward.
    net = DDP(model, device_ids=[device.index] if device.type == "cuda" else None)
    # FIX: the tutorial's SGD at lr 1e-4 barely learns in its 2 epochs; AdamW at 3e-3 reaches ~99% on MNIST.
    opt = torch.optim.AdamW(net.parameters(), lr=3e-3, weight_decay=5e-4)
    for epoch in range(a.epochs):
        sampler.set_epoch(epoch)  # FIX: never called in the tutorial, so every epoch repeated the first's order
        for i, (images, labels) in enumerate(loader):
            x, y = model_input(images.to(device), normalize=True), labels.to(device)
            group = min(a.accumulate, len(loader) - i // a.accumulate * a.accumulate)  # the epoch's last may be short
            last = (i + 1) % a.accumulate == 0 or i + 1 == len(loader)
            # 4 all-reduce: inside backward DDP averages the gradients over the ranks. With --accumulate K, the
            # first K-1 backwards run under no_sync (gradients only add up here) and the K-th all-reduces the sum.
            with nullcontext() if last else net.no_sync():
                loss = F.cross_entropy(net(x), y)
                (loss / group).backward()
            if last:
                opt.step()
                opt.zero_grad()
        # FIX: the tutorial never evaluated. Through DDP: its first forward gives every rank rank 0's BatchNorm
        # statistics (each rank's own moved on in its last step), so all score the model rank 0 saves.
        accuracy = evaluate(net, data.test, rank, world, device)
        # 5 rank 0: one process prints and saves; the others would only repeat it (and race for the file).
        if rank == 0:
            print(f"epoch {epoch + 1}/{a.epochs}  last batch's loss {loss.item():.4f}  "
                  f"test accuracy {accuracy:.2%}", flush=True)
            torch.save(model.state_dict(), a.out)  # FIX: the tutorial never saved; this loads into ConvNet()


@torch.no_grad()
def evaluate(model: nn.Module, test: Split, rank: int, world: int, device: torch.device) -> float:
    """Each rank scores every world-th test image; one all_reduce adds the counts up, each image counted once."""
    model.eval()
    counts = torch.zeros(2, device=device)  # correct, seen
    images, labels = test.images[rank::world], test.labels[rank::world]
    for lo in range(0, len(labels), 1000):
        x, y = model_input(images[lo:lo + 1000].to(device), normalize=True), labels[lo:lo + 1000].to(device)
        counts += torch.stack([(model(x).argmax(1) == y).sum(), torch.tensor(len(y), device=device)])
    dist.all_reduce(counts)
    model.train()
    return float(counts[0] / counts[1])


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m mnist_ddp.lesson", description=__doc__.splitlines()[0])
    p.add_argument("-n", "--nodes", type=int, default=1, help="number of nodes (machines)")
    p.add_argument("-g", "--gpus", type=int, default=1, help="processes per node: one per GPU, or CPU processes")
    p.add_argument("-nr", "--nr", type=int, default=0, help="this node's index, 0 to nodes-1")
    p.add_argument("--epochs", type=int, default=2)
    p.add_argument("--batch-size", type=int, default=100, help="per process")
    p.add_argument("--accumulate", type=int, default=1, metavar="K", help="micro-batches per optimizer step")
    p.add_argument("--dataset", default="auto", choices=("auto", "mnist", "fashion-mnist", "synthetic"),
                   help="auto: MNIST if here or downloadable, else the built-in digits")
    p.add_argument("--train-samples", type=int, help="use the first N training images (default: all)")
    p.add_argument("--test-samples", type=int, help="use the first N test images (default: all)")
    p.add_argument("--out", default="lesson.pt", help="where rank 0 saves the weights (default %(default)s)")
    return p.parse_args(argv)


if __name__ == "__main__":
    main()
