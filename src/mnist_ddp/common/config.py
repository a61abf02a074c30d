"""One frozen dataclass per command: every setting, checked once, before any work.

The CLI only parses strings; these classes decide what is valid and say so in one
sentence, and their field defaults are the one source of every default (the CLI shows
them in --help). A recipe is resolved once, where the command line is read: the
`Recipe` a run carries has no unset knob. Plain Python, no torch, so `--help` and a
bad flag answer at once.
"""

import math
import os
import stat
import time
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field, fields, replace
from pathlib import Path
from typing import Any, Literal, get_args

from . import inputfile
from .errors import UserError

Known = Literal["mnist", "fashion-mnist", "synthetic"]  # the datasets a run can train on
Dataset = Literal["mnist", "fashion-mnist", "synthetic", "auto"]  # what --dataset takes (auto: mnist, else fashion)
Optimizer = Literal["sgd", "adamw"]
Scheduler = Literal["none", "onecycle", "cosine"]
Amp = Literal["auto", "off", "bf16", "fp16"]  # auto: the fastest for the device (compute.py)
Device = Literal["auto", "cpu", "cuda", "mps"]
Backend = Literal["gloo", "nccl"]
DATASETS, OPTIMIZERS, SCHEDULERS, AMP, DEVICES, BACKENDS = map(
    get_args, (Dataset, Optimizer, Scheduler, Amp, Device, Backend))


def _check(ok: bool, message: str) -> None:
    if not ok:
        raise UserError(message)


MOST_SECONDS = 7 * 24 * 3600.0  # a week: the longest wait (--timeout and the like) a run may ask for
MOST_SLOTS = 65_536  # micro-batches in one step (world × --accumulate): far past any machine's share
MOST_EPOCHS = 100_000
MOST_SAMPLES = 250_000  # synthetic images of one split (MNIST's train split: 60,000): ~200 MB, then refused


def _finite(obj: object) -> None:
    """Refuse a float field of `obj` that is not a finite number (inf, nan): every float flag is a quantity."""
    for name, value in vars(obj).items():
        _check(not isinstance(value, float) or math.isfinite(value),
               f"--{name.replace('_', '-')} must be a finite number, not {value}.")


def timestamped(prefix: str) -> str:
    """A fresh folder name per run, e.g. runs/20261203-101500, or runs/20261203-101500-2 where that is taken (a
    notebook's next cell may start a run in the same second): a run never lands in another's folder."""
    name = candidate = time.strftime(f"{prefix}%Y%m%d-%H%M%S")
    n = 1
    while Path(candidate).exists():
        n += 1
        candidate = f"{name}-{n}"
    return candidate


@dataclass(frozen=True)
class DataConfig:
    """Which dataset, where to find it, and how much of it to use (what `datasets.load` takes)."""

    dataset: Dataset
    data_dir: Path | None = None  # searched first; downloads go there
    download: bool = True
    mirrors: tuple[str, ...] = ()  # replace the published mirrors (tests, proxies)
    download_timeout: float = 60.0  # seconds per request
    train_samples: int | None = None  # the first N of the split (all by default)
    test_samples: int | None = None
    test_only: bool = False  # evaluate needs only the t10k files; the train split is then empty

    def __post_init__(self) -> None:
        _finite(self)
        for name in ("train_samples", "test_samples"):
            value = getattr(self, name)
            _check(value is None or value >= 1, f"--{name.replace('_', '-')} must be at least 1, not {value}.")
            _check(self.dataset != "synthetic" or value is None or value <= MOST_SAMPLES,
                   f"--{name.replace('_', '-')} {value} asks for more synthetic digits than the {MOST_SAMPLES:,} "
                   f"mnist-ddp makes.")
        _check(0 < self.download_timeout <= MOST_SECONDS,
               f"--download-timeout must be positive seconds, at most a week, not {self.download_timeout}.")

    @property
    def splits(self) -> tuple[str, ...]:
        return ("test",) if self.test_only else ("train", "test")


@dataclass(frozen=True)
class Recipe:
    """Every knob of the optimisation, resolved: a recipe's values with the user's flags over them."""

    optimizer: Optimizer
    lr: float  # peak learning rate; not scaled with the world size (README)
    momentum: float  # SGD momentum, or AdamW's beta1
    weight_decay: float
    batch_size: int  # per micro-batch; the global batch is batch_size × world size × --accumulate (README)
    epochs: int
    scheduler: Scheduler  # per-step learning-rate schedule
    normalize: bool  # MNIST's mean and std; the tutorial fed pixels in [0, 1]
    label_smoothing: float
    amp: Amp

    def __post_init__(self) -> None:
        _finite(self)
        _check(self.lr > 0, f"--lr must be positive, not {self.lr}.")
        _check(0 <= self.momentum < 1, f"--momentum must be in [0, 1), not {self.momentum}.")
        _check(self.weight_decay >= 0, "--weight-decay must not be negative.")
        _check(self.batch_size >= 1, f"--batch-size must be at least 1, not {self.batch_size}.")
        _check(self.batch_size <= MOST_SAMPLES, f"--batch-size must be at most {MOST_SAMPLES:,}.")
        _check(self.epochs >= 1, f"--epochs must be at least 1, not {self.epochs}.")
        _check(self.epochs <= MOST_EPOCHS, f"--epochs must be at most {MOST_EPOCHS:,}, not {self.epochs}.")
        _check(0 <= self.label_smoothing < 1, "--label-smoothing must be in [0, 1).")


RECIPES: dict[str, Recipe] = {
    # AdamW with a one-cycle schedule: ≥99% on MNIST and ≥90% on Fashion-MNIST in 2 epochs.
    "default": Recipe(optimizer="adamw", lr=3e-3, momentum=0.9, weight_decay=5e-4, batch_size=100, epochs=2,
                      scheduler="onecycle", normalize=True, label_smoothing=0.0, amp="auto"),
    # The tutorial, exactly: plain SGD at lr 1e-4, no momentum, pixels in [0, 1] without normalisation, fp32.
    "tutorial": Recipe(optimizer="sgd", lr=1e-4, momentum=0.0, weight_decay=0.0, batch_size=100, epochs=2,
                       scheduler="none", normalize=False, label_smoothing=0.0, amp="off"),
}
KNOBS = tuple(Recipe.__dataclass_fields__)


def recipe(name: str, **flags: Any) -> Recipe:
    """Recipe `name` with every flag the user gave (not None) over its values."""
    return replace(RECIPES[name], **{k: v for k, v in flags.items() if v is not None})


@dataclass(frozen=True)
class TrainConfig:
    """Everything `mnist-ddp train` needs."""

    data: DataConfig = field(default_factory=lambda: DataConfig("mnist"))
    # Launch: the tutorial's -n/-g/-nr, and where the processes meet.
    nodes: int = 1
    gpus: int = 1  # processes on this node: one per GPU, or CPU worker processes
    node_rank: int = 0
    master_addr: str | None = None  # None: MASTER_ADDR, else 127.0.0.1 on one node
    master_port: int | None = None  # None: MASTER_PORT, else a free port on one node
    device: Device = "auto"
    backend: Backend | None = None  # None: nccl on CUDA, gloo otherwise
    timeout: float = 180.0  # seconds a collective or the rendezvous may wait for a peer
    # The job's shared secret, which every rank proves it knows (membership.py): --secret-file's or
    # MNIST_DDP_SECRET's (`read_secret`); None: none given. Never printed, never saved (`to_dict`).
    secret: bytes | None = field(default=None, repr=False)
    heartbeat: float = 1.0  # seconds between a rank's beats, so a timeout names who hangs (heartbeat.py); 0 = off
    recover: bool = False  # survivors of a lost rank re-form in place and train on (recovery.py; -g, -n/-nr only)
    # What to train, and how.
    recipe_name: str = "default"
    recipe: Recipe = RECIPES["default"]
    seed: int = 0
    # Micro-batches per process per optimizer step: at a run's first start the global batch becomes
    # batch_size × world × accumulate, kept in the checkpoint and by every resume at any world size.
    accumulate: int = 1
    eval_batch_size: int = 250  # its activations stay in a CPU's caches: 1.2-1.7x faster than 1000 (docs/speed.md)
    # Compute: None = the device's fastest (compute.py); an explicit value always wins.
    channels_last: bool | None = None
    compile: bool = False
    graph_step: str = "auto"  # the step as a CUDA graph (graphstep.py): auto = on CUDA where it applies; on; off
    sync_bn: bool = False
    deterministic: bool = False
    # The same weights, bit for bit, at any world size and through resumes at any world (reduction.py, README).
    bitwise: bool = False
    # Outputs.
    out: str = field(default_factory=lambda: timestamped("runs/"))
    resume: bool = False
    checkpoint_every: int = 0  # steps between mid-epoch checkpoints; 0 = at epoch ends only
    target_accuracy: float | None = None  # stop after the first epoch whose test accuracy reaches it
    progress: bool = True
    plots: bool = True
    tensorboard: bool = False  # opt-in: event files in <out>/tb/ (README says why)
    mlflow: str | None = None  # --mlflow's tracking URI (tracking.py); None: no MLflow
    log_every: int = 20  # optimizer steps between train-loss points (steps.jsonl, curves.png, TensorBoard)
    profile: int | None = None  # --profile: steps to profile in the first epoch (timeline.py); None = off

    def __post_init__(self) -> None:
        _check(bool(self.out.strip()), "--out is empty; name the run's folder (e.g. --out runs/first).")
        _finite(self)
        _check(self.nodes >= 1, f"-n/--nodes must be at least 1, not {self.nodes}.")
        _check(self.gpus >= 1, f"-g/--gpus must be at least 1, not {self.gpus}.")
        _check(0 <= self.node_rank < self.nodes,
               f"-nr/--nr is this node's index, from 0 to {self.nodes - 1} for {self.nodes} node(s); "
               f"{self.node_rank} is outside that range.")
        _check(self.master_port is None or 0 <= self.master_port <= 65535,
               f"--master-port {self.master_port} is not a port number (0-65535).")
        _check(0 < self.timeout <= MOST_SECONDS,
               f"--timeout must be positive seconds, at most a week, not {self.timeout}.")
        _check(self.heartbeat >= 0, f"--heartbeat is seconds between beats (0: off), not {self.heartbeat}.")
        _check(self.heartbeat <= self.timeout, f"--heartbeat {self.heartbeat} is longer than --timeout {self.timeout}: "
               f"a rank would time out between two beats.")
        _check(not self.recover or self.heartbeat > 0,
               "--recover needs the heartbeat (--heartbeat > 0): the survivors tell a lost rank by its silence.")
        _check(not (self.recover and self.profile), "--recover and --profile cannot be combined; choose one.")
        _check(self.eval_batch_size >= 1, "--eval-batch-size must be at least 1.")
        _check(self.eval_batch_size <= MOST_SAMPLES, f"--eval-batch-size must be at most {MOST_SAMPLES:,}.")
        _check(0 <= self.seed < 2**63, f"--seed must be from 0 to 2**63 - 1, not {self.seed}.")
        _check(self.accumulate >= 1, f"--accumulate must be at least 1 micro-batch per step, not {self.accumulate}.")
        _check(self.world_size * self.accumulate <= MOST_SLOTS,
               f"-n × -g × --accumulate = {self.world_size * self.accumulate:,} micro-batches a step, more than the "
               f"{MOST_SLOTS:,} mnist-ddp deals.")
        _check(self.log_every >= 1, f"--log-every must be at least 1 step, not {self.log_every}.")
        _check(self.profile is None or self.profile >= 1,
               f"--profile takes a number of steps of at least 1, not {self.profile}.")
        _check(self.checkpoint_every >= 0, "--checkpoint-every must be 0 (epoch ends only) or a number of steps.")
        _check(self.target_accuracy is None or 0 < self.target_accuracy <= 1,
               f"--target-accuracy is a test accuracy above 0 and at most 1 (0.99: 99%), not {self.target_accuracy}.")
        _check(not (self.bitwise and self.sync_bn),
               "--bitwise and --sync-bn exclude each other: SyncBatchNorm normalises over every process's samples, "
               "so what it computes changes with the world size.")
        _check(self.nodes == 1 or self.master_addr is not None,
               "with -n/--nodes above 1 every node needs the address of node 0: pass --master-addr or set MASTER_ADDR.")
        _check(self.nodes == 1 or bool(self.master_port),
               "with -n/--nodes above 1 every node needs the same port: pass --master-port or set MASTER_PORT.")

    @property
    def world_size(self) -> int:
        return self.nodes * self.gpus

    def to_dict(self) -> dict[str, Any]:
        """Plain values only, so a checkpoint holding it loads with weights_only=True; the recipe's knobs
        sit at the top level, beside the recipe's name."""
        out = asdict(self)
        del out["secret"]
        out |= out.pop("recipe") | {"recipe": out.pop("recipe_name")}
        out["data"]["data_dir"] = str(self.data.data_dir) if self.data.data_dir else None
        return out


# The settings that define a run: resuming with any of them changed would not continue the same run. The world
# size may change (the run's global batch is in its checkpoint: batches.Share).
RESUME_MUST_MATCH = ("recipe", "optimizer", "lr", "momentum", "weight_decay", "batch_size", "epochs",
                     "scheduler", "normalize", "label_smoothing", "seed", "bitwise")
# A --bitwise run promises the same bits through any resume, so the kernels may not change either.
BITWISE_MUST_MATCH = ("amp", "channels_last", "compile", "deterministic")


def run_settings(cfg: TrainConfig, world_size: int) -> dict[str, str]:
    """What every rank of one job must agree on, proven at check-in (membership.py): the settings that define
    the run, its data, --accumulate and the world."""
    flat = cfg.to_dict()
    agreed = {k: flat[k] for k in RESUME_MUST_MATCH} | {
        "dataset": cfg.data.dataset, "train_samples": cfg.data.train_samples, "test_samples": cfg.data.test_samples,
        "accumulate": cfg.accumulate, "world_size": world_size}
    return {k: str(v) for k, v in agreed.items()}


SECRET_VAR = "MNIST_DDP_SECRET"
MOST_SECRET = 4096  # bytes


def read_secret(path: str | None, env: Mapping[str, str]) -> bytes | None:
    """The job's secret: the contents of `path` (--secret-file), else $MNIST_DDP_SECRET, else None. Surrounding
    white space is not part of it (`openssl rand -hex 32 > FILE` ends in a newline). A file that others may
    read is refused, as ssh refuses such a private key: a secret that every user of the machine can read
    proves nothing."""
    if path is None:
        value = env.get(SECRET_VAR)
        _check(value is None or bool(value.strip()),
               f"{SECRET_VAR} is set but empty; give it the job's secret (e.g. `openssl rand -hex 32`) or unset it.")
        return value.strip().encode() if value is not None else None
    fd = inputfile.open_regular(path, "secret")
    try:
        mode, secret = os.fstat(fd).st_mode, os.read(fd, MOST_SECRET + 1)
    except OSError as e:
        raise UserError(f"--secret-file {inputfile.shown(path)} cannot be read ({e.strerror}).") from None
    finally:
        os.close(fd)
    _check(len(secret) <= MOST_SECRET, f"--secret-file {inputfile.shown(path)} holds more than {MOST_SECRET:,} bytes; "
                                       f"a secret is one line (e.g. `openssl rand -hex 32`).")
    secret = secret.strip()
    _check(not mode & 0o044, f"--secret-file {path} can be read by other users (mode {stat.S_IMODE(mode):04o}); "
                             f"make it yours alone: chmod 600 {path}.")
    _check(bool(secret), f"--secret-file {path} is empty; put the job's secret in it (e.g. `openssl rand -hex 32`).")
    return secret


@dataclass(frozen=True)
class EvalConfig:
    """`mnist-ddp evaluate CKPT`: test accuracy of a checkpoint."""

    checkpoint: str
    data: DataConfig
    device: Device = "auto"
    batch_size: int = 1000

    def __post_init__(self) -> None:
        _check(self.batch_size >= 1, "--batch-size must be at least 1.")
        _check(self.batch_size <= MOST_SAMPLES, f"--batch-size must be at most {MOST_SAMPLES:,}.")


@dataclass(frozen=True)
class PredictConfig:
    """`mnist-ddp predict CKPT FILE…`: classify images, folders of them, or IDX files."""

    checkpoint: str
    files: tuple[str, ...]
    device: Device = "auto"
    top: int = 1

    def __post_init__(self) -> None:
        _check(1 <= self.top <= 10, "--top must be between 1 and 10.")


@dataclass(frozen=True)
class ExportConfig:
    """`mnist-ddp export RUN_OR_FILE --onnx FILE`: the model for inference outside PyTorch."""

    source: str  # a run folder (its model.safetensors) or a model file: safetensors or a checkpoint
    onnx: str  # where the ONNX file goes; never over an existing file
    check_images: int = 1000  # synthetic digits that onnxruntime and PyTorch must classify alike

    def __post_init__(self) -> None:
        _check(self.onnx.endswith(".onnx"), f"--onnx {self.onnx}: name the file *.onnx.")
        _check(self.check_images >= 1, f"--check-images must be at least 1, not {self.check_images}.")
        _check(self.check_images <= MOST_SAMPLES, f"--check-images must be at most {MOST_SAMPLES:,}.")


@dataclass(frozen=True)
class BenchConfig:
    """`mnist-ddp bench`: the tutorial's pipeline against ours, side by side, on the same data."""

    data: DataConfig
    synthetic_fallback: bool = False  # the dataset was not named: synthetic if it cannot be had
    device: Literal["auto", "cpu", "cuda"] = "auto"  # auto = cuda, else cpu (the tutorial's DDP has no MPS)
    procs: int | None = None  # processes of the multi-process runs; None = 2 on CPU, every GPU on CUDA
    epochs: int | None = None  # of our runs; None = the default recipe's
    tutorial_epochs: int = 10  # the most epochs the tutorial gets to reach the target
    tutorial_seconds: float = 240.0  # ... and the most seconds
    target: float = 0.89  # test accuracy to reach
    out: str = field(default_factory=lambda: timestamped("runs/bench-"))
    json: str | None = None  # None = <out>/bench.json

    def __post_init__(self) -> None:
        _finite(self)
        _check(bool(self.out.strip()), "--out is empty; name the folder (e.g. --out runs/bench).")
        _check(self.tutorial_seconds <= MOST_SECONDS, "--tutorial-seconds must be at most a week.")
        _check(self.procs is None or self.procs >= 1, f"-g/--gpus must be at least 1, not {self.procs}.")
        _check(self.epochs is None or self.epochs >= 1, f"--epochs must be at least 1, not {self.epochs}.")
        _check(self.epochs is None or self.epochs <= MOST_EPOCHS, f"--epochs must be at most {MOST_EPOCHS:,}.")
        _check(self.tutorial_epochs >= 1, f"--tutorial-epochs must be at least 1, not {self.tutorial_epochs}.")
        _check(self.tutorial_seconds > 0, "--tutorial-seconds must be positive.")
        _check(0 < self.target <= 1, f"--target is a test accuracy between 0 and 1, not {self.target}.")


def default(cls: type, name: str) -> Any:
    """The default of field `name` of config class `cls`: what --help shows and what an absent flag means."""
    f = next(f for f in fields(cls) if f.name == name)
    return f.default_factory() if callable(f.default_factory) else f.default
