"""`mnist-ddp bench`: how much faster than the tutorial, measured side by side in one run: four runs on the same
data, each in fresh processes (the tutorial's pipeline and ours, in one process and in G), compared by images/s
(the median over a run's epochs) and by seconds to the target accuracy. Loading the data and starting processes
are timed on neither side; it prints, never asserts. What each run and number is: benchmarks/README.md."""

import json
import os
import platform
import statistics
import subprocess
import sys
from dataclasses import dataclass, field, replace
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.multiprocessing as mp

from . import tutorial
from .common.config import BenchConfig, DataConfig
from .common.errors import UserError
from .data import datasets
from .joining import rendezvous
from .joining.identity import without_launcher_vars
from .launchers import launch


class BenchFailed(UserError):
    """One of the measured runs did not finish; its log says why."""

    exit_code = 1


@dataclass
class Run:
    """One measured run: per-epoch records of images/s, seconds (train + test) and test accuracy."""

    label: str
    procs: int
    epochs: list[dict[str, Any]] = field(default_factory=list)
    settings: str = ""

    @property
    def images_per_second(self) -> float:
        return statistics.median(e["images_per_second"] for e in self.epochs)

    @property
    def final_accuracy(self) -> float | None:
        return self.epochs[-1]["test_accuracy"] if self.epochs else None

    def seconds_to(self, target: float) -> tuple[float, bool]:
        """Seconds until the test accuracy first reached `target`, and whether it did (else: all seconds run)."""
        total = 0.0
        for e in self.epochs:
            total += e["seconds"]
            if e["test_accuracy"] is not None and e["test_accuracy"] >= target:
                return total, True
        return total, False

    def to_dict(self, target: float | None) -> dict[str, Any]:
        out: dict[str, Any] = {"label": self.label, "processes": self.procs,
                               "images_per_second": self.images_per_second,
                               "final_test_accuracy": self.final_accuracy, "settings": self.settings,
                               "epochs": self.epochs}
        if target is not None:
            seconds, reached = self.seconds_to(target)
            out |= {"reached_target": reached, "seconds_to_target": seconds if reached else None,
                    "seconds_run": seconds}
        return out


@dataclass(frozen=True)
class Ratio:
    """a / b, or a lower bound on it when `a` was cut short before it got there."""

    value: float | None
    lower_bound: bool = False

    def __str__(self) -> str:
        return "n/a" if self.value is None else f"{'>' if self.lower_bound else ''}{self.value:.2f}x"


def _child_env() -> dict[str, str]:
    """This environment minus any launcher's variables, with this very package importable."""
    env = without_launcher_vars(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(Path(__file__).resolve().parents[1]),
                                                      env.get("PYTHONPATH")]))
    return env


def _pick_data(cfg: BenchConfig) -> tuple[DataConfig, datasets.Dataset]:
    """The data every run uses: the named dataset, or Fashion-MNIST if it is here, else synthetic digits."""
    req = replace(cfg.data, download=cfg.data.download and not cfg.synthetic_fallback)
    try:
        data = datasets.load(req)
    except datasets.DataNotFound:
        if not cfg.synthetic_fallback:
            raise
        req = replace(req, dataset="synthetic")
        data = datasets.load(req)
    return replace(req, dataset=data.name, download=False), data  # the runs must not each download again


def _data_flags(req: DataConfig) -> list[str]:
    flags = ["--dataset", req.dataset, "--no-download"]
    flags += ["--data-dir", str(req.data_dir)] if req.data_dir else []
    flags += ["--train-samples", str(req.train_samples)] if req.train_samples else []
    return flags + (["--test-samples", str(req.test_samples)] if req.test_samples else [])


def run_ours(cfg: BenchConfig, req: DataConfig, device: str, procs: int, out: Path) -> Run:
    """`mnist-ddp train` in a child process, as a user runs it; the epochs are read from its metrics.jsonl."""
    run_dir = out / f"ours-{procs}"
    cmd = [sys.executable, "-m", "mnist_ddp", "train", *_data_flags(req), "--device", device, "-g", str(procs),
           "--out", str(run_dir), "--no-progress", "--no-plots"]
    cmd += ["--epochs", str(cfg.epochs)] if cfg.epochs else []
    log = out / f"ours-{procs}.log"
    with log.open("w") as f:
        rc = subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT, env=_child_env()).returncode
    if rc:
        raise BenchFailed(f"`{' '.join(cmd)}` failed with exit code {rc}; its output is in {log}.")
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    epochs = [{"epoch": m["epoch"], "images_per_second": m["images_per_second"], "seconds": m["epoch_seconds"],
               "test_accuracy": m["test_accuracy"]} for m in map(json.loads, lines)]
    settings = next((line for line in log.read_text().splitlines() if line.startswith("run: ")), "")
    label = "ours, 1 process" if procs == 1 else f"ours, -g {procs}"
    return Run(label, procs, epochs, settings.removeprefix("run: "))


def run_tutorial(spec: tutorial.Spec, procs: int, out: Path) -> Run:
    """The tutorial's training in `procs` spawned processes, as its script starts them."""
    records = out / f"tutorial-{procs}.jsonl"
    # On loopback only, as every one-machine job of ours listens (rendezvous.py).
    store = rendezvous.host_store("127.0.0.1", 0, procs, timedelta(seconds=300)) if procs > 1 else None
    spec = replace(spec, records=str(records), master_port=store.port if store else 0)
    mp.start_processes(tutorial.worker, args=(spec, procs), nprocs=procs, start_method="spawn")
    del store
    epochs = [{"epoch": r["epoch"], "images_per_second": r["images_per_second"],
               "seconds": r["train_seconds"] + r["eval_seconds"], "test_accuracy": r["test_accuracy"]}
              for r in map(json.loads, records.read_text().splitlines())]
    how = f"({'PIL' if spec.pipeline == 'pil' else 'tensor'})"
    label = f"tutorial {how}, 1 process" if procs == 1 else f"tutorial DDP {how}, {procs} processes"
    backend = "nccl" if spec.device == "cuda" else "gloo"
    settings = f"{tutorial.PIPELINES[spec.pipeline]}, SGD lr 1e-4, batch 100" + (
        f" per process, DataLoader num_workers=0, fp32, {backend}" if procs > 1 else
        ", DataLoader num_workers=0, fp32")
    return Run(label, procs, epochs, settings)


def _ratio(a: float, b: float) -> Ratio:
    return Ratio(a / b if b > 0 else None)


def _time_ratio(slow: Run, fast: Run, target: float) -> Ratio:
    """slow's seconds to target / fast's; a lower bound when slow never got there."""
    (t_slow, slow_reached), (t_fast, fast_reached) = slow.seconds_to(target), fast.seconds_to(target)
    if not fast_reached or t_fast <= 0:
        return Ratio(None)
    return Ratio(t_slow / t_fast, lower_bound=not slow_reached)


def environment(device: str) -> dict[str, Any]:
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    env: dict[str, Any] = {"torch": torch.__version__, "python": platform.python_version(), "device": device,
                           "cpu_cores": cores, "cpu_capability": torch.backends.cpu.get_cpu_capability()}
    if device == "cuda":
        env |= {"gpu": torch.cuda.get_device_name(0), "gpus": torch.cuda.device_count(),
                "cuda": torch.version.cuda}
    return env


def _claim_out(out: Path, json_path: Path) -> None:
    """Refuse an --out that holds a bench run already; make it."""
    if json_path.exists() or any(out.glob("ours-*")) or any(out.glob("tutorial-*")):
        raise UserError(f"{out} already holds a bench run; choose another --out.")
    try:
        out.mkdir(parents=True, exist_ok=True)
        json_path.parent.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise UserError(f"cannot create {out} or {json_path.parent} ({e.strerror}).") from e


def run(cfg: BenchConfig) -> int:
    """All four runs, then the table and the ratios; returns 0 (benchmarks report, they do not judge)."""
    out = Path(cfg.out)
    json_path = Path(cfg.json) if cfg.json else out / "bench.json"
    _claim_out(out, json_path)
    device = cfg.device if cfg.device != "auto" else "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cuda" and not torch.cuda.is_available():
        raise UserError("--device cuda was asked for, but PyTorch sees no CUDA GPU here.")
    procs = cfg.procs or (torch.cuda.device_count() if device == "cuda" else 2)
    if device == "cpu":
        launch.fits_cores_and_memory(procs)
    if device == "cuda" and procs > torch.cuda.device_count():
        raise UserError(f"-g/--gpus {procs} asks for more GPUs than the {torch.cuda.device_count()} visible here.")
    req, data = _pick_data(cfg)
    env = environment(device)
    sizes = {"train_images": len(data.train.labels), "test_images": len(data.test.labels)}
    print(f"bench: {data.name}, {sizes['train_images']:,} train / {sizes['test_images']:,} test images "
          f"(from {data.where}); {device}, {env['cpu_cores']} CPU cores, torch {torch.__version__}", flush=True)
    del data  # each run loads its own copy, as it would on its own

    spec = tutorial.Spec(req, device, cfg.tutorial_epochs, target=cfg.target, max_seconds=cfg.tutorial_seconds,
                         pipeline=tutorial.pipeline())
    done = {"tutorial_1": run_tutorial(spec, 1, out)}
    _said(done["tutorial_1"])
    done["ours_1"] = run_ours(cfg, req, device, 1, out)
    _said(done["ours_1"])
    if procs > 1:
        done[f"tutorial_ddp_{procs}"] = run_tutorial(replace(spec, epochs=1, evaluate=False), procs, out)
        _said(done[f"tutorial_ddp_{procs}"])
        done[f"ours_{procs}"] = run_ours(cfg, req, device, procs, out)
        _said(done[f"ours_{procs}"])

    tut, ours = done["tutorial_1"], done["ours_1"]
    ratios: dict[str, tuple[str, Ratio]] = {
        "images_per_second_ours_1_vs_tutorial_1":
            ("(a) images/s, 1 process: ours / tutorial", _ratio(ours.images_per_second, tut.images_per_second)),
    }
    if procs > 1:
        tut_g, ours_g = done[f"tutorial_ddp_{procs}"], done[f"ours_{procs}"]
        ratios[f"images_per_second_ours_{procs}_vs_tutorial_ddp_{procs}"] = (
            f"(b) images/s, {procs} processes: ours -g {procs} / tutorial DDP",
            _ratio(ours_g.images_per_second, tut_g.images_per_second))
        ratios[f"images_per_second_ours_{procs}_vs_ours_1"] = (
            f"(b) images/s: ours -g {procs} / ours 1 process", _ratio(ours_g.images_per_second, ours.images_per_second))
    pct = f"{100 * cfg.target:g}%"
    ratios["time_to_target_tutorial_1_vs_ours_1"] = (f"(c) seconds to {pct}: tutorial / ours, 1 process",
                                                     _time_ratio(tut, ours, cfg.target))
    if procs > 1:
        ratios[f"time_to_target_tutorial_1_vs_ours_{procs}"] = (
            f"(c) seconds to {pct}: tutorial / ours -g {procs}", _time_ratio(tut, done[f"ours_{procs}"], cfg.target))

    print(_table(done, cfg.target, ratios))
    result = {
        "dataset": req.dataset, **sizes, "environment": env, "target_accuracy": cfg.target,
        "tutorial_pipeline": {"name": spec.pipeline, "what": tutorial.PIPELINES[spec.pipeline]},
        "runs": {k: r.to_dict(None if k.startswith("tutorial_ddp") else cfg.target) for k, r in done.items()},
        "ratios": {k: {"label": label, "value": r.value, "lower_bound": r.lower_bound}
                   for k, (label, r) in ratios.items()},
    }
    tmp = json_path.with_suffix(".tmp")
    tmp.write_text(json.dumps(result, indent=2) + "\n")
    tmp.replace(json_path)
    print(f"results: {json_path}")
    return 0


def _said(r: Run) -> None:
    print(f"  done: {r.label}, {len(r.epochs)} epoch(s), {r.images_per_second:,.0f} images/s", flush=True)


def _table(runs: dict[str, Run], target: float, ratios: dict[str, tuple[str, Ratio]]) -> str:
    pct = f"{100 * target:g}%"
    lines = [f"{'run':34s} {'images/s':>10s}   {'seconds to ' + pct:24s} {'final acc':>9s}"]
    for key, r in runs.items():
        if key.startswith("tutorial_ddp"):
            reach = "-"
        else:
            seconds, reached = r.seconds_to(target)
            reach = f"{seconds:.1f}" if reached else f">{seconds:.1f} (not reached)"
        acc = f"{100 * r.final_accuracy:.2f}%" if r.final_accuracy is not None else "-"
        lines.append(f"{r.label:34s} {r.images_per_second:10,.0f}   {reach:24s} {acc:>9s}")
    lines += ["", *(f"{label:52s} {ratio}" for label, ratio in ratios.values())]
    if any(r.lower_bound for _, r in ratios.values()):
        tut = runs["tutorial_1"]
        lines.append(f"  (>: a lower bound; the tutorial stopped at {100 * (tut.final_accuracy or 0):.2f}% after "
                     f"{len(tut.epochs)} epochs, below {pct})")
    for r in runs.values():
        if r.settings:
            lines.append(f"  {r.label}: {r.settings}")
    return "\n".join(lines)
