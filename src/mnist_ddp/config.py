"""One frozen dataclass per command: every setting, checked once, before any work.

The CLI only parses strings; these classes decide what is valid and say so in one
sentence. Knobs a recipe sets (optimizer, lr, …) arrive as None when the user did
not give them and are filled in from the recipe, so an explicit flag always wins.
"""

from dataclasses import dataclass, field, fields, replace
from pathlib import Path
from typing import Any

from .datasets import DATASETS, DataRequest
from .errors import UserError

RECIPES: dict[str, dict[str, Any]] = {
    # AdamW with a one-cycle schedule: ≥99% on MNIST and ≥90% on Fashion-MNIST in 2 epochs.
    "default": {"optimizer": "adamw", "lr": 3e-3, "momentum": 0.9, "weight_decay": 5e-4, "batch_size": 100,
                "epochs": 2, "scheduler": "onecycle", "normalize": True, "label_smoothing": 0.0, "amp": "auto"},
    # The tutorial, exactly: plain SGD at lr 1e-4, no momentum, pixels in [0, 1] without normalisation, fp32.
    "tutorial": {"optimizer": "sgd", "lr": 1e-4, "momentum": 0.0, "weight_decay": 0.0, "batch_size": 100,
                 "epochs": 2, "scheduler": "none", "normalize": False, "label_smoothing": 0.0, "amp": "off"},
}
OPTIMIZERS = ("sgd", "adamw")
SCHEDULERS = ("none", "onecycle", "cosine")
AMP = ("auto", "off", "bf16", "fp16")  # auto: the fastest for the device (compute.py)
DEVICES = ("auto", "cpu", "cuda", "mps")
BACKENDS = ("gloo", "nccl")


def _check(ok: bool, message: str) -> None:
    if not ok:
        raise UserError(message)


@dataclass(frozen=True)
class DataConfig:
    """Which dataset, where to find it, and how much of it to use."""

    dataset: str = "mnist"
    data_dir: str | None = None
    download: bool = True
    mirrors: tuple[str, ...] = ()
    download_timeout: float = 60.0
    train_samples: int | None = None
    test_samples: int | None = None

    def __post_init__(self) -> None:
        _check(self.dataset in DATASETS, f"--dataset {self.dataset!r} is not one of {', '.join(DATASETS)}.")
        for name in ("train_samples", "test_samples"):
            value = getattr(self, name)
            _check(value is None or value >= 1, f"--{name.replace('_', '-')} must be at least 1, not {value}.")
        _check(self.download_timeout > 0, "--download-timeout must be positive.")

    def request(self, **changes: Any) -> DataRequest:
        """What `datasets.load` takes: these settings, with `changes` (e.g. test_only=True) applied."""
        req = DataRequest(self.dataset, Path(self.data_dir) if self.data_dir else None, self.download,
                          self.mirrors, self.download_timeout, self.train_samples, self.test_samples)
        return replace(req, **changes)


@dataclass(frozen=True)
class TrainConfig:
    """Everything `mnist-ddp train` needs; the recipe's knobs are filled in by `resolve`."""

    data: DataConfig = field(default_factory=DataConfig)
    # Launch: the tutorial's -n/-g/-nr, and where the processes meet.
    nodes: int = 1
    gpus: int = 1  # processes on this node: one per GPU, or CPU worker processes
    node_rank: int = 0
    master_addr: str | None = None  # None: MASTER_ADDR, else 127.0.0.1 on one node
    master_port: int | None = None  # None: MASTER_PORT, else a free port on one node
    device: str = "auto"
    backend: str | None = None  # None: nccl on CUDA, gloo otherwise
    timeout: float = 180.0  # seconds a collective or the rendezvous may wait for a peer
    # Recipe (None = take the recipe's value).
    recipe: str = "default"
    optimizer: str | None = None
    lr: float | None = None
    momentum: float | None = None
    weight_decay: float | None = None
    batch_size: int | None = None  # per process; the global batch is batch_size × world size
    epochs: int | None = None
    scheduler: str | None = None
    normalize: bool | None = None
    label_smoothing: float | None = None
    seed: int = 0
    eval_batch_size: int = 1000
    # Compute: "auto" / None = the device's fastest (compute.resolve), an explicit value always wins.
    amp: str | None = None  # None: the recipe's ("auto": the fastest for the device, see compute.py)
    channels_last: bool | None = None
    compile: bool = False
    sync_bn: bool = False
    deterministic: bool = False
    # Outputs.
    out: str = "runs/latest"
    resume: bool = False
    checkpoint_every: int = 0  # steps between mid-epoch checkpoints; 0 = at epoch ends only
    progress: bool = True
    plots: bool = True

    def __post_init__(self) -> None:
        _check(self.recipe in RECIPES, f"--recipe {self.recipe!r} is not one of {', '.join(RECIPES)}.")
        _check(self.nodes >= 1, f"-n/--nodes must be at least 1, not {self.nodes}.")
        _check(self.gpus >= 1, f"-g/--gpus must be at least 1, not {self.gpus}.")
        _check(0 <= self.node_rank < self.nodes,
               f"-nr/--nr is this node's index, from 0 to {self.nodes - 1} for {self.nodes} node(s); "
               f"{self.node_rank} is outside that range.")
        _check(self.master_port is None or 0 <= self.master_port <= 65535,
               f"--master-port {self.master_port} is not a port number (0-65535).")
        _check(self.device in DEVICES, f"--device {self.device!r} is not one of {', '.join(DEVICES)}.")
        _check(self.backend is None or self.backend in BACKENDS,
               f"--backend {self.backend!r} is not one of {', '.join(BACKENDS)}.")
        _check(self.timeout > 0, f"--timeout must be positive seconds, not {self.timeout}.")
        _check(self.optimizer is None or self.optimizer in OPTIMIZERS,
               f"--optimizer {self.optimizer!r} is not one of {', '.join(OPTIMIZERS)}.")
        _check(self.scheduler is None or self.scheduler in SCHEDULERS,
               f"--scheduler {self.scheduler!r} is not one of {', '.join(SCHEDULERS)}.")
        _check(self.lr is None or self.lr > 0, f"--lr must be positive, not {self.lr}.")
        _check(self.momentum is None or 0 <= self.momentum < 1, f"--momentum must be in [0, 1), not {self.momentum}.")
        _check(self.weight_decay is None or self.weight_decay >= 0, "--weight-decay must not be negative.")
        _check(self.batch_size is None or self.batch_size >= 1,
               f"--batch-size must be at least 1, not {self.batch_size}.")
        _check(self.epochs is None or self.epochs >= 1, f"--epochs must be at least 1, not {self.epochs}.")
        _check(self.label_smoothing is None or 0 <= self.label_smoothing < 1, "--label-smoothing must be in [0, 1).")
        _check(self.eval_batch_size >= 1, "--eval-batch-size must be at least 1.")
        _check(self.amp is None or self.amp in AMP, f"--amp {self.amp!r} is not one of {', '.join(AMP)}.")
        _check(self.checkpoint_every >= 0, "--checkpoint-every must be 0 (epoch ends only) or a number of steps.")
        _check(self.nodes == 1 or self.master_addr is not None,
               "with -n/--nodes above 1 every node needs the address of node 0: pass --master-addr or set MASTER_ADDR.")
        _check(self.nodes == 1 or bool(self.master_port),
               "with -n/--nodes above 1 every node needs the same port: pass --master-port or set MASTER_PORT.")

    @property
    def world_size(self) -> int:
        return self.nodes * self.gpus

    def resolve(self) -> "TrainConfig":
        """A copy whose recipe knobs that were left at None carry the recipe's values."""
        recipe = RECIPES[self.recipe]
        return replace(self, **{k: v for k, v in recipe.items() if getattr(self, k) is None})

    def to_dict(self) -> dict[str, Any]:
        """Plain values only, so a checkpoint holding it loads with weights_only=True."""
        out = {f.name: getattr(self, f.name) for f in fields(self) if f.name != "data"}
        out["data"] = {f.name: getattr(self.data, f.name) for f in fields(self.data)}
        return out


@dataclass(frozen=True)
class EvalConfig:
    """`mnist-ddp evaluate CKPT`: test accuracy of a checkpoint."""

    checkpoint: str
    data: DataConfig
    device: str = "auto"
    batch_size: int = 1000

    def __post_init__(self) -> None:
        _check(self.device in DEVICES, f"--device {self.device!r} is not one of {', '.join(DEVICES)}.")
        _check(self.batch_size >= 1, "--batch-size must be at least 1.")


@dataclass(frozen=True)
class PredictConfig:
    """`mnist-ddp predict CKPT FILE…`: classify PNG images or the images of an IDX file."""

    checkpoint: str
    files: tuple[str, ...]
    device: str = "auto"
    top: int = 1

    def __post_init__(self) -> None:
        _check(self.device in DEVICES, f"--device {self.device!r} is not one of {', '.join(DEVICES)}.")
        _check(1 <= self.top <= 10, "--top must be between 1 and 10.")


@dataclass(frozen=True)
class BenchConfig:
    """`mnist-ddp bench`: the tutorial's pipeline against ours, side by side, on the same data."""

    data: DataConfig
    synthetic_fallback: bool = False  # the dataset was not named: synthetic if it cannot be had
    device: str = "auto"  # auto = cuda if available, else cpu (the tutorial's DDP has no MPS backend)
    procs: int | None = None  # processes of the multi-process runs; None = 2 on CPU, every GPU on CUDA
    epochs: int | None = None  # of our runs; None = the default recipe's
    tutorial_epochs: int = 10  # the most epochs the tutorial gets to reach the target
    tutorial_seconds: float = 240.0  # ... and the most seconds
    target: float = 0.89  # test accuracy to reach
    out: str = "runs/bench"
    json: str | None = None  # None = <out>/bench.json

    def __post_init__(self) -> None:
        _check(self.device in ("auto", "cpu", "cuda"), f"--device {self.device!r} is not one of auto, cpu, cuda.")
        _check(self.procs is None or self.procs >= 1, f"-g/--gpus must be at least 1, not {self.procs}.")
        _check(self.epochs is None or self.epochs >= 1, f"--epochs must be at least 1, not {self.epochs}.")
        _check(self.tutorial_epochs >= 1, f"--tutorial-epochs must be at least 1, not {self.tutorial_epochs}.")
        _check(self.tutorial_seconds > 0, "--tutorial-seconds must be positive.")
        _check(0 < self.target <= 1, f"--target is a test accuracy between 0 and 1, not {self.target}.")
