"""The `mnist-ddp` command line: strings in, one config dataclass out, an exit code back.

`main(argv)` never raises for bad input: it prints one sentence and returns 2, so
tests (and shells) can rely on the exit code. Exit codes: 0 done, 1 a worker failed,
2 bad input, 130 interrupted.
"""

import argparse
import atexit
import os
import signal
import sys
import threading
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any, NoReturn

from .common import extras
from .common.config import (
    AMP,
    BACKENDS,
    DATASETS,
    DEVICES,
    KNOBS,
    OPTIMIZERS,
    RECIPES,
    SCHEDULERS,
    BenchConfig,
    DataConfig,
    EvalConfig,
    ExportConfig,
    PredictConfig,
    TrainConfig,
    default,
    read_secret,
    recipe,
)
from .common.errors import UserError, last_word
from .joining import identity
from .outputs import tracking

PROFILE_STEPS = 5  # what a bare --profile profiles


class _DefaultOnce(argparse.HelpFormatter):
    """Each option's help ends with its default, once: argparse's value, unless the help says it in words
    already (`(default…`); a switch's default is off (not given), whatever value its flag stores."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        help = action.help or ""
        if not action.option_strings or action.default is argparse.SUPPRESS or "(default" in help:
            return help
        if isinstance(action, argparse._StoreTrueAction | argparse._StoreFalseAction):
            return f"{help} (default: off)"
        return f"{help} (default: %(default)s)"


def _by_recipe(knob: str) -> str:
    """A recipe knob's default, for its help: the default recipe's value, and the others' where they differ."""
    def said(value: object) -> str:
        return {True: "on", False: "off"}.get(value, str(value)) if isinstance(value, bool) else str(value)
    ours = getattr(RECIPES["default"], knob)
    others = [f"{said(getattr(r, knob))} for --recipe {name}" for name, r in RECIPES.items()
              if name != "default" and getattr(r, knob) != ours]
    return f"(default: the recipe's: {', '.join([said(ours), *others])})"


class _Parser(argparse.ArgumentParser):
    """argparse, but a bad flag is one line (not a usage dump) and still exit code 2."""

    def error(self, message: str) -> None:  # type: ignore[override]
        raise UserError(f"{message} (see `{self.prog} --help`).")


def _data_args(p: argparse.ArgumentParser, dataset: str | None, dataset_help: str | None = None) -> None:
    g = p.add_argument_group("data")
    g.add_argument("--dataset", default=dataset, choices=DATASETS,
                   help=f"auto = MNIST if found or downloadable, else synthetic (default: {dataset_help or dataset})")
    g.add_argument("--data-dir", help="folder holding the four IDX files (plain or .gz; torchvision's "
                   "MNIST/raw layout works too); searched first, and downloads go there (default: none: ./data, "
                   "then the system's dataset folders; downloads go to ./data)")
    g.add_argument("--no-download", dest="download", action="store_false",
                   help="never download (default: off: files found nowhere are downloaded)")
    g.add_argument("--mirror", dest="mirrors", action="append", default=[], metavar="URL",
                   help="download from this base URL instead of the standard mirrors (default: those; "
                   "repeatable)")
    g.add_argument("--download-timeout", type=float, default=default(DataConfig, "download_timeout"),
                   help="seconds each read of a download may wait; past twice that it must keep up 16 KiB/s "
                        "(default: %(default)s)")
    g.add_argument("--train-samples", type=int, help="use only the first N training images (default: all)")
    g.add_argument("--test-samples", type=int, help="use only the first N test images (default: all)")


def _data_config(a: argparse.Namespace) -> DataConfig:
    return DataConfig(a.dataset, Path(a.data_dir) if a.data_dir else None, a.download, tuple(a.mirrors),
                      a.download_timeout, a.train_samples, a.test_samples)


def _train_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("train", help="train the ConvNet (one process, spawned processes, torchrun, mpirun or srun)",
                       formatter_class=_DefaultOnce)
    _data_args(p, "mnist")
    g = p.add_argument_group("launch (the tutorial's flags; leave them out under torchrun, mpirun or srun)")
    g.add_argument("-n", "--nodes", type=int, default=1, help="number of nodes (machines)")
    g.add_argument("-g", "--gpus", type=int, default=1,
                   help="processes on this node: one per GPU, or CPU worker processes without GPUs")
    g.add_argument("-nr", "--nr", dest="node_rank", type=int, default=0, help="this node's index, 0 to nodes-1")
    g.add_argument("--master-addr", help="node 0's address (default: $MASTER_ADDR, else 127.0.0.1 on one node)")
    g.add_argument("--master-port", type=int,
                   help="node 0's port (default: $MASTER_PORT, else a free port on one node)")
    g.add_argument("--secret-file", metavar="PATH",
                   help="a file (mode 600) holding the job's secret, the same on every node, which every process "
                   "proves it knows before it may join (default: $MNIST_DDP_SECRET; one node makes its own; none: "
                   "anyone who reaches node 0 may join; see docs/security.md)")
    g.add_argument("--device", default="auto", choices=DEVICES, help="auto = cuda, else mps, else cpu")
    g.add_argument("--backend", choices=BACKENDS, help="collective backend (default: nccl on CUDA, else gloo)")
    g.add_argument("--timeout", type=float, default=default(TrainConfig, "timeout"),
                   help="seconds to wait for a peer (rendezvous and collectives) before failing")
    g.add_argument("--heartbeat", type=float, default=default(TrainConfig, "heartbeat"),
                   help="seconds between each rank's beats to the rendezvous store, so that a timeout names the rank "
                        "that stopped answering (default %(default)s; 0: off)")
    g.add_argument("--recover", action="store_true",
                   help="when a process is lost, the others re-form without it and train on, losing no step "
                   "(mnist-ddp's own launcher: -g, -n/-nr; see docs/faults.md)")
    g = p.add_argument_group("recipe (unset knobs come from --recipe)")
    g.add_argument("--recipe", default="default", choices=RECIPES,
                   help="default: AdamW + one-cycle, ~99%% MNIST in 2 epochs; tutorial: SGD lr 1e-4, as the tutorial")
    g.add_argument("--optimizer", choices=OPTIMIZERS, help=_by_recipe("optimizer"))
    g.add_argument("--lr", type=float,
                   help=f"peak learning rate; not scaled with the world size (docs/world-size.md) {_by_recipe('lr')}")
    g.add_argument("--momentum", type=float, help=f"SGD momentum, or AdamW's beta1 {_by_recipe('momentum')}")
    g.add_argument("--weight-decay", type=float, help=_by_recipe("weight_decay"))
    g.add_argument("--batch-size", type=int, help="per micro-batch; the global batch is this × world size × "
                   f"--accumulate (see docs/world-size.md) {_by_recipe('batch_size')}")
    g.add_argument("--epochs", type=int, help=_by_recipe("epochs"))
    g.add_argument("--scheduler", choices=SCHEDULERS,
                   help=f"per-step learning-rate schedule {_by_recipe('scheduler')}")
    g.add_argument("--label-smoothing", type=float, help=_by_recipe("label_smoothing"))
    g.add_argument("--normalize", action=argparse.BooleanOptionalAction, default=None,
                   help=f"normalise pixels with MNIST's mean and std {_by_recipe('normalize')}")
    g.add_argument("--seed", type=int, default=default(TrainConfig, "seed"),
                   help="initial weights and the per-epoch shuffles")
    g.add_argument("--accumulate", type=int, default=default(TrainConfig, "accumulate"), metavar="K",
                   help="micro-batches per process per optimizer step (gradients all-reduced once per step); fixes "
                   "the run's global batch at its first start, which resumes at any world size keep")
    g.add_argument("--eval-batch-size", type=int, default=default(TrainConfig, "eval_batch_size"),
                   help="images per process per evaluation batch")
    g = p.add_argument_group("compute")
    g.add_argument("--amp", choices=AMP,
                   help="mixed precision (bf16 on CPU or CUDA, fp16 on CUDA); auto = bf16 on CPUs that do bf16 in "
                   f"hardware, else off {_by_recipe('amp')}")
    g.add_argument("--channels-last", action=argparse.BooleanOptionalAction, default=None,
                   help="NHWC memory layout (default: on for CPU, off for GPUs)")
    g.add_argument("--compile", action="store_true",
                   help="torch.compile the model (off by default: 0.6-0.85x the eager step on the 2-core CPUs "
                   "measured, and slower than the CUDA graph step on a GPU; docs/speed.md)")
    g.add_argument("--graph-step", choices=("auto", "on", "off"), default=default(TrainConfig, "graph_step"),
                   help="the step as one CUDA graph, replayed (auto: on CUDA where each process trains one whole "
                   "micro-batch; on: also run eagerly on a CPU; docs/gpu.md)")
    g.add_argument("--sync-bn", action="store_true", help="synchronise BatchNorm statistics across GPUs (CUDA)")
    g.add_argument("--deterministic", action="store_true", help="deterministic kernels only")
    g.add_argument("--bitwise", action="store_true",
                   help="the same weights, bit for bit, at any world size and through resumes at any world: each "
                   "micro-batch's gradient kept apart and summed in a fixed order, one thread per CPU process "
                   "(slower where a process has several cores; see docs/world-size.md)")
    g = p.add_argument_group("outputs")
    g.add_argument("--out", default=None, help="run folder (default: runs/<date-time>)")
    g.add_argument("--resume", action="store_true",
                   help="continue from <out>/checkpoint.pt if there is one (start fresh if not)")
    g.add_argument("--checkpoint-every", type=int, default=0, metavar="STEPS",
                   help="also checkpoint every STEPS optimizer steps within an epoch (0: epoch ends only)")
    g.add_argument("--target-accuracy", type=float, metavar="ACC",
                   help="stop after the first epoch whose test accuracy reaches ACC (0.99 for 99%%); not a "
                   "setting --resume insists on: raise it or leave it out to train a finished run on (default: "
                   "none: every epoch)")
    g.add_argument("--no-progress", dest="progress", action="store_false", help="no progress bar")
    g.add_argument("--no-plots", dest="plots", action="store_false", help="no curves.png / confusion.png")
    g.add_argument("--tensorboard", action="store_true",
                   help="also write TensorBoard event files to <out>/tb/ (needs the tensorboard package)")
    g.add_argument("--mlflow", nargs="?", const="", metavar="URI",
                   help="also log the run to MLflow: settings, metrics, logged steps, files (needs the mlflow extra); "
                   "a bare --mlflow logs to $MLFLOW_TRACKING_URI, else ./mlflow.db (default: off)")
    g.add_argument("--log-every", type=int, default=default(TrainConfig, "log_every"), metavar="STEPS",
                   help="the train loss (mean over all ranks) and lr every STEPS optimizer steps: steps.jsonl, "
                   "curves.png and TensorBoard")
    g.add_argument("--profile", type=int, nargs="?", const=PROFILE_STEPS, metavar="STEPS",
                   help=f"profile STEPS steps (a bare --profile: {PROFILE_STEPS}) of the first epoch after a short "
                   "warm-up: a Chrome trace per rank, each rank's phases as a table, <out>/profile/timeline.png "
                   "(default: off)")


def _parser() -> argparse.ArgumentParser:
    p = _Parser(prog="mnist-ddp", description="Train the classic MNIST CNN with DistributedDataParallel.")
    sub = p.add_subparsers(dest="command", required=True, parser_class=_Parser)
    _train_parser(sub)
    e = sub.add_parser("evaluate", help="test accuracy of a checkpoint or a model.safetensors")
    e.add_argument("checkpoint", help="a checkpoint (checkpoint.pt, best.pt, a bare state_dict) or a safetensors file")
    _data_args(e, "auto")
    e.add_argument("--device", default="auto", choices=DEVICES)
    e.add_argument("--batch-size", type=int, default=default(EvalConfig, "batch_size"))
    pr = sub.add_parser("predict", help="classify images (PNG, JPEG, BMP, GIF; any size), folders of them, "
                        "or IDX files")
    pr.add_argument("checkpoint", help="a checkpoint or a safetensors file, as evaluate takes")
    pr.add_argument("files", nargs="+", metavar="FILE",
                    help="an image, a folder of images, or an IDX file (…-images-idx3-ubyte[.gz])")
    pr.add_argument("--device", default="auto", choices=DEVICES)
    pr.add_argument("--top", type=int, default=default(PredictConfig, "top"), help="show the K most likely classes")
    _export_parser(sub)
    _bench_parser(sub)
    return p


def _export_parser(sub: argparse._SubParsersAction) -> None:
    x = sub.add_parser("export", help="write a trained model for inference outside PyTorch (ONNX)")
    x.add_argument("source", metavar="RUN_OR_FILE",
                   help="a run folder (its model.safetensors) or a model file: a safetensors file or a checkpoint")
    x.add_argument("--onnx", required=True, metavar="FILE",
                   help="write an ONNX model here, then check it in onnxruntime against PyTorch (needs the onnx "
                   "extra: pip install 'mnist-ddp[onnx]')")
    x.add_argument("--check-images", type=int, default=default(ExportConfig, "check_images"), metavar="N",
                   help="synthetic digits that onnxruntime and PyTorch must classify alike (default: %(default)s)")


QUICK = {"train_samples": 6000, "test_samples": 2000, "epochs": 1, "tutorial_epochs": 1}


def _bench_parser(sub: argparse._SubParsersAction) -> None:
    b = sub.add_parser("bench", help="the tutorial's pipeline vs ours, side by side: images/s and time to accuracy")
    _data_args(b, None, "fashion-mnist if it is here, else synthetic")
    b.add_argument("--device", default="auto", choices=("auto", "cpu", "cuda"), help="auto = cuda, else cpu")
    b.add_argument("-g", "--gpus", dest="procs", type=int, metavar="G",
                   help="processes of the multi-process runs (default: 2 on CPU, every GPU on CUDA)")
    b.add_argument("--epochs", type=int, help="epochs of our runs (default: the default recipe's)")
    b.add_argument("--tutorial-epochs", type=int, help="the most epochs the tutorial gets to reach --target "
                   f"(default: {default(BenchConfig, 'tutorial_epochs')})")
    b.add_argument("--tutorial-seconds", type=float, default=default(BenchConfig, "tutorial_seconds"),
                   help="... and the most seconds of training and testing (default: %(default)s)")
    b.add_argument("--target", type=float, default=default(BenchConfig, "target"),
                   help="test accuracy to reach (default: %(default)s)")
    b.add_argument("--quick", action="store_true", help="a smoke run in seconds: " + ", ".join(
        f"--{k.replace('_', '-')} {v}" for k, v in QUICK.items()) + " unless given")
    b.add_argument("--out", help="folder for the runs' outputs (default: runs/bench-<date-time>)")
    b.add_argument("--json", help="where the results go (default: <out>/bench.json)")


def _given(**values: Any) -> dict[str, Any]:
    """The values the user gave: an absent flag (None) leaves the config's own default in place."""
    return {k: v for k, v in values.items() if v is not None}


def _bench_config(a: argparse.Namespace) -> BenchConfig:
    if a.quick:
        for key, value in QUICK.items():
            if getattr(a, key) is None:
                setattr(a, key, value)
    a.dataset, fallback = (a.dataset, False) if a.dataset else ("fashion-mnist", True)
    return BenchConfig(_data_config(a), synthetic_fallback=fallback, device=a.device, procs=a.procs,
                       epochs=a.epochs, tutorial_seconds=a.tutorial_seconds, target=a.target, json=a.json,
                       **_given(tutorial_epochs=a.tutorial_epochs, out=a.out))


def _train_config(a: argparse.Namespace) -> TrainConfig:
    # The environment is read here, as the command runs, not when the parser is built (api.py builds it at import).
    addr = a.master_addr if a.master_addr is not None else os.environ.get("MASTER_ADDR")
    port = a.master_port if a.master_port is not None else identity.env_number(os.environ, "MASTER_PORT")
    return TrainConfig(
        data=_data_config(a), nodes=a.nodes, gpus=a.gpus, node_rank=a.node_rank, master_addr=addr, master_port=port,
        secret=read_secret(a.secret_file, os.environ), device=a.device, backend=a.backend, timeout=a.timeout,
        heartbeat=a.heartbeat, recover=a.recover, recipe_name=a.recipe,
        recipe=recipe(a.recipe, **{k: getattr(a, k) for k in KNOBS}), seed=a.seed,
        accumulate=a.accumulate, eval_batch_size=a.eval_batch_size, channels_last=a.channels_last, compile=a.compile,
        graph_step=a.graph_step, sync_bn=a.sync_bn, deterministic=a.deterministic, bitwise=a.bitwise, resume=a.resume,
        checkpoint_every=a.checkpoint_every, target_accuracy=a.target_accuracy, progress=a.progress, plots=a.plots,
        tensorboard=a.tensorboard, mlflow=tracking.default_uri(os.environ) if a.mlflow == "" else a.mlflow,
        log_every=a.log_every, profile=a.profile, **_given(out=a.out))


def command_parser(command: str) -> argparse.ArgumentParser:
    """The parser of one command (`train`, `evaluate`, …): what api.py turns into keywords."""
    commands = next(a for a in _parser()._actions if isinstance(a, argparse._SubParsersAction))
    return commands.choices[command]


Config = TrainConfig | BenchConfig | EvalConfig | PredictConfig | ExportConfig


def configure(argv: list[str]) -> Config:
    """A command line → its command's config, checked: argparse, then the config's own checks. The Python API
    (api.py) builds its configs here too, so both take the same values and refuse the same ones alike."""
    if argv and argv[0].startswith("-") and argv[0] not in ("-h", "--help"):
        argv = ["train", *argv]  # the tutorial's `script.py -n 1 -g 2 -nr 0` shape
    a = _parser().parse_args(argv)
    if a.command == "train":
        return _train_config(a)
    if a.command == "bench":
        return _bench_config(a)
    if a.command == "evaluate":
        return EvalConfig(a.checkpoint, _data_config(a), a.device, a.batch_size)
    if a.command == "export":
        return ExportConfig(a.source, a.onnx, a.check_images)
    return PredictConfig(a.checkpoint, tuple(a.files), a.device, a.top)


def run_train(cfg: TrainConfig, began: float | None = None) -> int:
    """Train as this process was started (alone, -g's children, or a rank of torchrun/srun/mpirun); the exit code.
    `began`: when the command started (`time.time()`), for the run's `time:` line; default: this process's start."""
    if cfg.gpus > 1:  # the children's fork server imports torch while this process does (forkserver.py)
        from .launchers import forkserver

        forkserver.start()
    from .launchers.launch import launch

    return launch(cfg, began)


def _dispatch(argv: list[str]) -> int:
    # Every config is built and checked before the first module that imports torch (seconds to load), so
    # --help and a bad flag answer at once.
    cfg = configure(argv)
    if isinstance(cfg, TrainConfig):
        return run_train(cfg)
    if isinstance(cfg, BenchConfig):
        from . import bench

        return bench.run(cfg)
    if isinstance(cfg, ExportConfig):
        extras.require("export --onnx", ("onnx", "onnxscript", "onnxruntime"), "onnx")
        from .outputs import export

        return export.run(cfg)
    from .outputs import infer

    return infer.run_evaluate(cfg) if isinstance(cfg, EvalConfig) else infer.run_predict(cfg)


@contextmanager
def _terminate_interrupts() -> Iterator[None]:
    """For the block, SIGTERM (scancel, `kill`, a container's stop) raises KeyboardInterrupt as Ctrl-C does, from the
    start: the launcher's own handler comes only after seconds of importing torch. Main thread only (where handlers
    can be set), and only where SIGTERM has its default action (one set to be ignored stays ignored)."""
    if threading.current_thread() is not threading.main_thread() or \
            signal.getsignal(signal.SIGTERM) is not signal.SIG_DFL:
        yield
        return
    signal.signal(signal.SIGTERM, signal.default_int_handler)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, signal.SIG_DFL)


def main(argv: Sequence[str] | None = None) -> int:
    """Run one command; returns the process exit code."""
    try:
        with _terminate_interrupts():
            return _dispatch(list(sys.argv[1:] if argv is None else argv))
    except (UserError, KeyboardInterrupt) as e:
        line, code = last_word(e)
        print(line, file=sys.stderr)
        return code


def console() -> None:
    """The `mnist-ddp` console script (and `python -m mnist_ddp`)."""
    exit_now(main())


def exit_now(code: int) -> NoReturn:
    """Exit as the interpreter would, less its teardown of every module, which for torch's takes 0.3-1 s
    (docs/speed.md): wait for the threads, run the exit handlers, flush, `os._exit` — as multiprocessing ends a
    child. Every file the command wrote was closed by the code that wrote it."""
    threading._shutdown()  # type: ignore[attr-defined]
    atexit._run_exitfuncs()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
