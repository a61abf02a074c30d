"""The tutorial's pipeline, rebuilt as the baseline `mnist-ddp bench` measures against; not used for training. It
does what the classic DDP-on-MNIST tutorial does, step for step (benchmarks/README.md): per sample a PIL image and
ToTensor where torchvision is importable, no input normalisation, and under DDP a DistributedSampler whose epoch is
never set, `mp.spawn`, gloo on CPU, no thread settings. Every rank runs `worker`; rank 0 appends one JSON line per
epoch to `Spec.records`."""

import importlib.util
import json
import time
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist
from PIL import Image
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, DistributedSampler

from .common.config import DataConfig
from .core import distributed
from .data import datasets
from .data.datasets import Split
from .model import ConvNet

PIPELINES = {"pil": "PIL image + ToTensor per sample", "tensor": "a tensor per sample (no torchvision here)"}


class TutorialConvNet(ConvNet):
    """ConvNet as the tutorial runs it: each layer's modules in their order (its ReLU before the max-pool)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(self.layer2(self.layer1(x)).flatten(1))


def pipeline() -> str:
    """The tutorial's per-sample pipeline this machine runs: "pil" where torchvision is importable, else "tensor"."""
    return "pil" if importlib.util.find_spec("torchvision") else "tensor"


def to_tensor(picture: Image.Image) -> torch.Tensor:
    """torchvision's ToTensor for an 8-bit grayscale image: H×W bytes -> 1×H×W float32 in [0, 1]."""
    pixels = torch.frombuffer(bytearray(picture.tobytes()), dtype=torch.uint8)
    return pixels.view(picture.size[1], picture.size[0], 1).permute(2, 0, 1).contiguous().to(torch.float32).div(255)


class PerSampleDataset(torch.utils.data.Dataset):
    """torchvision's MNIST as the tutorial used it: index -> (1×28×28 float tensor in [0, 1], int label); `pil`:
    through a PIL image, as torchvision's __getitem__ and ToTensor."""

    def __init__(self, split: Split, pil: bool = False) -> None:
        self.images, self.labels, self.pil = split.images, split.labels, pil

    def __len__(self) -> int:
        return len(self.labels)

    def __getitem__(self, index: int) -> tuple[torch.Tensor, int]:
        if self.pil:
            height, width = self.images.shape[1:]
            picture = Image.frombytes("L", (width, height), bytes(self.images[index].flatten().tolist()))
            return to_tensor(picture), int(self.labels[index])
        return self.images[index].unsqueeze(0).to(torch.float32).div(255), int(self.labels[index])


@dataclass(frozen=True)
class Spec:
    """One tutorial run: which data, how many epochs at most, and when to stop early."""

    data: DataConfig
    device: str  # "cpu" or "cuda"
    epochs: int
    evaluate: bool = True  # test accuracy after each epoch (the tutorial printed only the loss)
    target: float = 2.0  # stop once the test accuracy reaches this (above 1: never)
    max_seconds: float = float("inf")  # one process: stop after the epoch that passes this much train + test time
    records: str = "tutorial.jsonl"  # rank 0 appends a line per epoch here
    master_port: int = 0  # where the ranks meet when there are several
    pipeline: str = "tensor"  # per sample: "pil" (a PIL image and ToTensor, as torchvision's MNIST) or "tensor"


def _evaluate(model: nn.Module, loader: DataLoader, device: torch.device) -> float:
    """Test accuracy, as a tutorial would write it: eval mode, no_grad, argmax, count."""
    model.eval()
    correct = total = 0
    with torch.no_grad():
        for images, labels in loader:
            images, labels = images.to(device), labels.to(device)
            correct += int((model(images).argmax(1) == labels).sum())
            total += len(labels)
    model.train()
    return correct / total


def worker(local_rank: int, spec: Spec, world_size: int) -> None:
    """One rank of the tutorial's training (`mp.spawn` calls it with the local rank first)."""
    device = torch.device("cuda", local_rank) if spec.device == "cuda" else torch.device("cpu")
    if world_size > 1:
        store = dist.TCPStore("127.0.0.1", spec.master_port, world_size, is_master=False)
        dist.init_process_group("nccl" if device.type == "cuda" else "gloo", store=store, rank=local_rank,
                                world_size=world_size, timeout=timedelta(seconds=120))
    finished = False
    try:
        _train(local_rank, spec, world_size, device)
        finished = True
    finally:
        # Not the tutorial's (it never leaves the group): ours, as without it the baseline's gloo threads now and
        # then abort a rank at exit (SIGABRT, "terminate called without an active exception").
        distributed.teardown(together=finished)


def _train(rank: int, spec: Spec, world_size: int, device: torch.device) -> None:
    torch.manual_seed(0)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    model: nn.Module = TutorialConvNet().to(device)
    criterion = nn.CrossEntropyLoss()
    optimizer = torch.optim.SGD(model.parameters(), 1e-4)
    if world_size > 1:
        model = DDP(model, device_ids=[device.index] if device.type == "cuda" else None)
    data = datasets.load(spec.data)
    pil = spec.pipeline == "pil"
    train_set = PerSampleDataset(data.train, pil)
    sampler: DistributedSampler | None = (
        DistributedSampler(train_set, num_replicas=world_size, rank=rank) if world_size > 1 else None)
    pin = device.type == "cuda"
    train_loader = DataLoader(train_set, batch_size=100, shuffle=sampler is None, num_workers=0, pin_memory=pin,
                              sampler=sampler)
    test_loader = DataLoader(PerSampleDataset(data.test, pil), batch_size=100, shuffle=False, num_workers=0,
                             pin_memory=pin)
    elapsed = 0.0
    for epoch in range(spec.epochs):
        start = time.perf_counter()
        seen = 0
        for i, (images, labels) in enumerate(train_loader):
            images = images.to(device, non_blocking=True)
            labels = labels.to(device, non_blocking=True)
            loss = criterion(model(images), labels)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            seen += len(labels)
            if (i + 1) % 100 == 0 and rank == 0:
                _ = loss.item()  # the tutorial printed the loss every 100 steps: one sync each time
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        train_seconds = time.perf_counter() - start
        accuracy, eval_seconds = None, 0.0
        if spec.evaluate:
            start = time.perf_counter()
            accuracy = _evaluate(model, test_loader, device)
            eval_seconds = time.perf_counter() - start
        elapsed += train_seconds + eval_seconds
        if rank == 0:
            record = {"epoch": epoch + 1, "train_seconds": train_seconds, "eval_seconds": eval_seconds,
                      "images_per_second": seen * world_size / train_seconds, "test_accuracy": accuracy}
            with open(spec.records, "a") as f:
                f.write(json.dumps(record) + "\n")
        # Every rank must take the same decision: accuracy is the same on all (DDP keeps the replicas equal),
        # wall time is not, so the time limit is for one process only.
        if (accuracy is not None and accuracy >= spec.target) or (world_size == 1 and elapsed >= spec.max_seconds):
            break
