"""The GPU check: the GPU statements of docs/gpu.md measured in one prepared run on a lent GPU machine.

    PYTHONPATH=src python3 benchmarks/gpu_check.py            # on the GPU machine; results in $OUT (else --out)
    python benchmarks/gpu_check.py --device cpu --quick       # the same plumbing on a CPU, tiny data
    python benchmarks/gpu_check.py --plan                     # what it would run, and each part's time limit

Each part runs `mnist-ddp` (python -m mnist_ddp, from this checkout) in processes of its own, under its own time
limit, inside one overall --budget (default 470 s: the check fits in 8 minutes on one H200; the parts' limits add
up to more, so the last ones are skipped on one GPU unless `--only` picks them). After every part the summary is
written again and a line is printed, so a part that runs past its limit, or a check cut short, still leaves the
numbers of the parts before it. Parts, in this order:
  env            torch, CUDA, GPU name and count, the packages the train path imports (tqdm, pillow)
  to99           `mnist-ddp train` on the synthetic digits, the default recipe (its 2 epochs) with --target-accuracy
                 0.99: the wall time of the process until it exits with a 99% model (data generation included),
                 the run's own split of it (timing.jsonl: start, join, data, warm-up, training, evaluation,
                 outputs), which step ran, the accuracy reached, each epoch's seconds
  graph          --graph-step on vs off (the step as one CUDA graph, replayed, vs the eager textbook step) at batch
                 100: images/s of the second epoch, the graph run's first epoch over its second, both accuracies
  ddp_capture    ddp_capture.py: DDP itself captured in a world of one over a real NCCL communicator, against the
                 same code eagerly and the eager textbook step: images/s, the same bytes?, and captured DDP's
                 images/s over the graph part's graph step
  share          -g 2 --backend gloo on one GPU (the two processes share it) against -g 2 on the CPU: both
                 accuracies and images/s, and the line saying they share
  replay         the same steps as a graph and eagerly, SGD fp32 --deterministic, one short epoch: whether the two
                 saved model states are the same bytes, and their largest difference
  bench          `mnist-ddp bench`: ours vs the tutorial, images/s and seconds to the target, with the ratios
  amp            --amp bf16 vs off, each with the step that runs by default (the graph step on CUDA): images/s of
                 the second epoch (off: the graph part's graph run, where it finished)
  compile        --compile (which keeps the eager step) vs off: images/s of the second epoch against the graph
                 part's graph and eager runs; compile seconds = the compiled run's first epoch less its second
  deterministic  --deterministic twice: the SHA-256 of the two saved model states, and whether they are equal
  bitwise        --bitwise (bitwise_check.py): the same run twice on one GPU must save the same bytes; 2
                 micro-batches of 2B are another run (other bytes); DDP's mean twice promises nothing
  profile        --profile: where a one-GPU step's time goes (phases.json), and clock_check.py: the all-reduce of
                 a world of one (DDP's comm hook runs there too) as --profile's CUDA events read it, beside
                 perf_counter read when the hook's future called back (under NCCL: when it was queued)
  multi          -g 2, eager (--graph-step auto keeps several GPUs eager until they have run it) and captured
                 (--graph-step on): two GPUs and more only; with one GPU it is skipped and the summary says so
Writes three files to the output folder, nothing else: summary.json, summary.md and gpu_check.log (every part's
output). The runs' own folders and the data cache go to --work (a temporary folder), not there.
It prints and records; it asserts nothing.
"""

import argparse
import json
import os
import platform
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
SRC = REPO / "src"
RESERVE_S = 10  # of the budget, kept for writing the summary after the last part


@dataclass
class Part:
    name: str
    limit: float  # seconds, at most (the overall budget may leave less)
    run: Callable[["Check"], dict[str, Any]]
    what: str


@dataclass
class Check:
    args: argparse.Namespace
    out: Path
    work: Path
    log: Any  # the open gpu_check.log
    deadline: float = 0.0  # monotonic: the end of the current part
    results: dict[str, Any] = field(default_factory=dict)

    @property
    def device(self) -> str:
        return self.args.device

    def source(self) -> list[str]:
        """MNIST if it is on this machine (never downloaded: the lent machine is offline), else the synthetic
        digits, cached in --work for every part."""
        return ["--dataset", "auto", "--no-download", "--data-dir", str(self.work / "data")]

    def data_flags(self, train_samples: int | None) -> list[str]:
        flags = self.source() + (["--train-samples", str(train_samples)] if train_samples else [])
        return flags + (["--test-samples", "300"] if self.args.quick else [])

    def mnist_ddp(self, *args: str) -> tuple[int | None, str]:
        """`python -m mnist_ddp ARGS` from this checkout (`python`)."""
        return self.python("-m", "mnist_ddp", *args)

    def python(self, *args: str, env: dict[str, str] | None = None) -> tuple[int | None, str]:
        """`python ARGS` with this checkout's src importable (and `env` set), until the part's deadline; its output
        goes to the log. Returns (exit code, or None when the deadline stopped it; its output)."""
        cmd = [sys.executable, *args]
        path = os.pathsep.join(filter(None, [str(SRC), os.environ.get("PYTHONPATH")]))
        env = os.environ | (env or {}) | {"PYTHONPATH": path, "PYTHONUNBUFFERED": "1"}
        self.say(f"$ {' '.join(cmd[1:])}", console=False)
        proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                start_new_session=True)  # its own process group: a timeout stops its children too
        try:
            output, _ = proc.communicate(timeout=max(1.0, self.deadline - time.monotonic()))
            code: int | None = proc.returncode
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            output, _ = proc.communicate()
            code = None
        self.log.write(output)
        self.log.flush()
        return code, output

    def train(self, label: str, *flags: str, samples: int | None = None, epochs: int = 2) -> dict[str, Any]:
        """One `mnist-ddp train` run; its metrics.jsonl epochs (and where it ran) or why it has none."""
        run_dir, began = self.work / label, time.monotonic()
        code, output = self.mnist_ddp("train", *self.data_flags(samples), "--device", self.device,
                                      "--epochs", str(epochs), "--no-progress", "--no-plots", "--out", str(run_dir),
                                      *flags)
        if code != 0:
            why = "stopped by its time limit" if code is None else f"exit code {code}: {last_line(output)}"
            raise PartFailed(f"{label}: {why}")
        epochs_done = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
        said = {key: next((line for line in output.splitlines() if line.startswith(f"{key}: ")), "")
                for key in ("data", "step", "gpu")}
        return {"dir": run_dir, "epochs": epochs_done, "data": said["data"], "gpu": said["gpu"],
                "step": said["step"].removeprefix("step: ") or "eager", "wall_seconds": time.monotonic() - began}

    def say(self, line: str, console: bool = True) -> None:
        self.log.write(line + "\n")
        self.log.flush()
        if console:
            print(line, flush=True)


class PartFailed(Exception):
    """A part's run did not finish; the summary records why and the check goes on."""


def last_line(output: str) -> str:
    lines = [line for line in output.splitlines() if line.strip()]
    return lines[-1][:300] if lines else "(no output)"


def speed(run: dict[str, Any]) -> float:
    """Images/s of the run's last epoch (the first pays for warm-up: cuDNN autotuning, compilation)."""
    return run["epochs"][-1]["images_per_second"]


def state_digest(run_dir: Path) -> str:
    """SHA-256 of the saved model state, buffers included (bitwise_check.model_hash: checkpoint.digest)."""
    sys.path.insert(0, str(SRC))
    import bitwise_check  # beside this file; it imports mnist_ddp from SRC

    return bitwise_check.model_hash(run_dir)


# --- the parts ----------------------------------------------------------------------------------------------------

def part_env(c: Check) -> dict[str, Any]:
    probe = ("import json, torch, importlib.util as u; print(json.dumps({'torch': torch.__version__, "
             "'cuda': torch.version.cuda, 'gpus': torch.cuda.device_count() if torch.cuda.is_available() else 0, "
             "'gpu': torch.cuda.get_device_name(0) if torch.cuda.is_available() else None, "
             "'packages': {n: u.find_spec(n) is not None for n in ('tqdm', 'PIL', 'matplotlib', 'numpy')}}))")
    proc = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True,
                          timeout=max(1.0, c.deadline - time.monotonic()))
    if proc.returncode:
        raise PartFailed(f"torch does not load: {last_line(proc.stderr)}")
    env = json.loads(proc.stdout) | {"python": platform.python_version(), "cpu_cores": os.cpu_count()}
    if c.device == "cuda" and not env["gpus"]:
        raise PartFailed(f"torch {env['torch']} sees no CUDA GPU here")
    missing = [n for n, found in env["packages"].items() if not found and n in ("tqdm", "PIL")]
    if missing:
        raise PartFailed(f"the train path imports {', '.join(missing)}, which this Python lacks; carry its wheel")
    c.results["gpus"] = env["gpus"]
    note = "one GPU: the -g 2 parts (bench's -g G runs, multi) are skipped" if env["gpus"] == 1 else ""
    return env | ({"note": note} if note else {})


def part_to99(c: Check) -> dict[str, Any]:
    flags = ["--target-accuracy", "0.99", "--dataset", "synthetic"]  # the last --dataset given wins
    run = c.train("to99", *flags, samples=c.args.samples if c.args.quick else None)  # all of it, on the GPU
    acc = run["epochs"][-1]["test_accuracy"]
    c.say(f"   mnist-ddp train to a {acc:.2%} model: {run['wall_seconds']:.1f} s, the process's wall time")
    timed = run["dir"] / "timing.jsonl"  # the run's own split of it (docs/speed.md#where-the-time-went)
    split = json.loads(timed.read_text().splitlines()[-1]) if timed.is_file() else None
    if split:
        c.say("   of which " + " + ".join(f"{part} {s:.2f}" for part, s in split.items() if part != "total"))
    return {"wall_seconds": run["wall_seconds"], "test_accuracy": acc, "reached_99": acc >= 0.99,
            "epochs_run": len(run["epochs"]), "epoch_seconds": [e["epoch_seconds"] for e in run["epochs"]],
            "step": run["step"], "data": run["data"], "timing": split}


def part_graph(c: Check) -> dict[str, Any]:
    eager = c.train("graph-off", "--graph-step", "off", samples=c.args.samples)
    graph = c.train("graph-on", "--graph-step", "on", samples=c.args.samples)  # on a CPU: the graph step, eagerly
    first, second = (e["epoch_seconds"] for e in graph["epochs"][:2])
    c.results["speeds"] = {"eager": speed(eager), "graph": speed(graph)}  # the amp and compile parts' baselines
    return {"images_per_second_eager": speed(eager), "images_per_second_graph": speed(graph),
            "graph_over_eager": speed(graph) / speed(eager), "first_over_second_epoch": first / second,
            "step_graph": graph["step"], "test_accuracy_eager": eager["epochs"][-1]["test_accuracy"],
            "test_accuracy_graph": graph["epochs"][-1]["test_accuracy"]}


def ddp_capture(c: Check, env: dict[str, str] | None = None) -> dict[str, Any]:
    """benchmarks/ddp_capture.py's JSON line."""
    code, output = c.python("benchmarks/ddp_capture.py", "--device", c.device, "--samples", str(c.args.samples),
                            "--data-dir", str(c.work / "data"), env=env)
    if code != 0:
        raise PartFailed("stopped by its time limit" if code is None else f"exit code {code}: {last_line(output)}")
    return json.loads(output.strip().splitlines()[-1])


def part_ddp_capture(c: Check) -> dict[str, Any]:
    result = ddp_capture(c)
    if c.device == "cuda" and "captured" not in result["step"]:  # refused under mnist-ddp's setting: the recipe's
        result["under_async_error_handling_0"] = ddp_capture(c, {"TORCH_NCCL_ASYNC_ERROR_HANDLING": "0"})
    if (graph := c.results.get("speeds", {}).get("graph")) and "captured" in result["images_per_second"]:
        result["captured_ddp_over_graph_step"] = result["images_per_second"]["captured"] / graph
    return result


def part_share(c: Check) -> dict[str, Any]:
    shared = c.train("share-gpu", "-g", "2", "--backend", "gloo", samples=c.args.samples)
    cpu = c.train("share-cpu", "-g", "2", "--device", "cpu", samples=c.args.samples)  # the last --device wins
    return {"said": shared["gpu"], "step": shared["step"],
            "test_accuracy_shared": shared["epochs"][-1]["test_accuracy"],
            "test_accuracy_cpu": cpu["epochs"][-1]["test_accuracy"],
            "images_per_second_shared": speed(shared), "images_per_second_cpu": speed(cpu)}


def part_replay(c: Check) -> dict[str, Any]:
    sys.path.insert(0, str(SRC))
    from mnist_ddp.outputs import checkpoint

    flags = ["--optimizer", "sgd", "--amp", "off", "--deterministic"]
    runs = {step: c.train(f"replay-{step}", *flags, "--graph-step", step, samples=c.args.replay_samples, epochs=1)
            for step in ("on", "off")}
    on, off = (checkpoint.load(runs[step]["dir"] / "checkpoint.pt")["model"] for step in ("on", "off"))
    largest = max(float((on[k].double() - off[k].double()).abs().max()) for k in off if off[k].is_floating_point())
    steps = c.args.replay_samples // 100
    return {"steps": steps, "same_bytes": state_digest(runs["on"]["dir"]) == state_digest(runs["off"]["dir"]),
            "largest_difference": largest, "step_on": runs["on"]["step"]}


def part_bench(c: Check) -> dict[str, Any]:
    out = c.work / "bench"
    flags = ["--quick", "-g", "1", "--tutorial-seconds", "5"] if c.args.quick else ["--tutorial-seconds", "30"]
    code, output = c.mnist_ddp("bench", "--device", c.device, "--out", str(out), *flags, *c.source())
    if code != 0:
        raise PartFailed("stopped by its time limit" if code is None else f"exit code {code}: {last_line(output)}")
    bench = json.loads((out / "bench.json").read_text())
    return {"dataset": bench["dataset"], "ratios": {k: v["value"] for k, v in bench["ratios"].items()},
            "images_per_second": {k: r["images_per_second"] for k, r in bench["runs"].items()}}


def baseline(c: Check, which: str) -> float:
    """Images/s of the graph part's `which` run ("graph" or "eager"), or of a run made now where it has none."""
    if which not in c.results.get("speeds", {}):
        run = c.train(f"baseline-{which}", "--graph-step", "on" if which == "graph" else "off",
                      samples=c.args.samples)
        c.results.setdefault("speeds", {})[which] = speed(run)
    return c.results["speeds"][which]


def part_amp(c: Check) -> dict[str, Any]:
    bf16 = c.train("amp-bf16", "--amp", "bf16", samples=c.args.samples)
    off = baseline(c, "graph" if "graph" in bf16["step"] else "eager")  # the same step, in fp32
    return {"images_per_second_off": off, "images_per_second_bf16": speed(bf16), "bf16_over_off": speed(bf16) / off,
            "step": bf16["step"]}


def part_deterministic(c: Check) -> dict[str, Any]:
    digests = [state_digest(c.train(f"deterministic-{i}", "--deterministic", samples=c.args.samples,
                                    epochs=1)["dir"]) for i in (1, 2)]
    return {"sha256": digests, "bitwise_equal": digests[0] == digests[1]}


def part_bitwise(c: Check) -> dict[str, Any]:
    import bitwise_check

    hashes = {}
    for i, (name, flags) in enumerate(bitwise_check.runs(c.device).items()):
        code, output = c.mnist_ddp("train", *bitwise_check.RECIPE, "--device", c.device, *flags, "--out",
                                   str(c.work / f"bitwise-{i}"))
        if code != 0:
            raise PartFailed(f"{name}: " + ("stopped by its time limit" if code is None else
                                            f"exit code {code}: {last_line(output)}"))
        hashes[name] = state_digest(c.work / f"bitwise-{i}")
    return {"sha256": hashes, "verdict": bitwise_check.verdict(c.device, hashes)}


def part_profile(c: Check) -> dict[str, Any]:
    run = c.train("profile", "--profile", "10" if c.args.quick else "20", samples=c.args.samples, epochs=1)
    split = json.loads((run["dir"] / "profile" / "phases.json").read_text())
    steps = split["ranks"][0]["steps"]
    ms = {phase: 1e3 * statistics.mean(s["split"][phase] for s in steps) for phase in split["phases"]}
    code, output = c.python("benchmarks/clock_check.py", "--device", c.device)
    if code != 0:
        raise PartFailed("clock_check: " + ("stopped by its time limit" if code is None else
                                            f"exit code {code}: {last_line(output)}"))
    return {"ms_per_step": ms, "all_reduce_clock": json.loads(last_line(output))}


def part_compile(c: Check) -> dict[str, Any]:
    compiled = c.train("compile-on", "--compile", samples=c.args.samples)
    first, second = (e["epoch_seconds"] for e in compiled["epochs"][:2])
    graph, eager = baseline(c, "graph"), baseline(c, "eager")
    return {"images_per_second_compiled": speed(compiled), "step": compiled["step"],
            "compiled_over_graph": speed(compiled) / graph, "compiled_over_eager": speed(compiled) / eager,
            "compile_seconds_estimate": first - second}


def part_multi(c: Check) -> dict[str, Any]:
    if c.device != "cuda" or c.results.get("gpus", 0) < 2:
        return {"skipped": "needs two GPUs or more; this machine has "
                           f"{c.results.get('gpus', 0) if c.device == 'cuda' else 'no GPU (CPU mode)'}"}
    one, two = c.train("multi-1", samples=c.args.samples), c.train("multi-2", "-g", "2", samples=c.args.samples)
    captured = c.train("multi-2-graph", "-g", "2", "--graph-step", "on", samples=c.args.samples)
    return {"images_per_second_1": speed(one), "images_per_second_2": speed(two),
            "two_over_one": speed(two) / speed(one),
            "images_per_second_2_graph": speed(captured), "step_2_graph": captured["step"],
            "graph_over_eager_2": speed(captured) / speed(two),
            "test_accuracy": {"1": one["epochs"][-1]["test_accuracy"], "2": two["epochs"][-1]["test_accuracy"],
                              "2_graph": captured["epochs"][-1]["test_accuracy"]}}


PARTS = [  # limits: what one H200 needs, with room. In this order the parts not yet measured on a GPU come first;
    # on one GPU the --budget runs out during bench, and the rest are skipped (`--only` picks others).
    Part("env", 15, part_env, "torch, CUDA, GPU, packages"),
    Part("to99", 40, part_to99, "mnist-ddp train to a 99% model on the synthetic digits: wall time"),
    Part("graph", 45, part_graph, "--graph-step on vs off: images/s, first vs second epoch"),
    Part("ddp_capture", 60, part_ddp_capture, "DDP captured in a world of one vs eager: images/s, the same bytes?"),
    Part("share", 60, part_share, "-g 2 --backend gloo sharing one GPU vs -g 2 on the CPU: accuracy"),
    Part("replay", 60, part_replay, "graph vs eager, SGD fp32: the same bytes?"),
    Part("bitwise", 75, part_bitwise, "--bitwise: the same run twice, another run once (SHA-256)"),
    Part("bench", 75, part_bench, "mnist-ddp bench: ours vs the tutorial"),
    Part("amp", 25, part_amp, "--amp bf16 vs off, the step that runs: images/s"),
    Part("compile", 55, part_compile, "--compile vs off: images/s, compile seconds"),
    Part("deterministic", 40, part_deterministic, "--deterministic twice: SHA-256 of the model state"),
    Part("profile", 35, part_profile, "--profile: phases of a step"),
    Part("multi", 45, part_multi, "-g 2, eager and captured (two GPUs or more)"),
]


# --- running and recording ---------------------------------------------------------------------------------------

def brief(value: Any) -> Any:
    """`value` with its floats to 4 significant digits, for the table and the console."""
    if isinstance(value, float):
        return float(f"{value:.4g}")
    if isinstance(value, dict):
        return {k: brief(v) for k, v in value.items()}
    return [brief(v) for v in value] if isinstance(value, list) else value


def write_summary(c: Check) -> None:
    (c.out / "summary.json").write_text(json.dumps(c.results, indent=1, default=str) + "\n")
    lines = ["| part | status | seconds | result |", "|---|---|---|---|"]
    for name, r in c.results.get("parts", {}).items():
        shown = brief({k: v for k, v in r.get("result", {}).items() if k not in ("packages",)})
        lines.append(f"| {name} | {r['status']} | {r['seconds']:.0f} | {json.dumps(shown, default=str)[:600]} |")
    (c.out / "summary.md").write_text(f"# GPU check ({c.results.get('started', '')}, {c.device}"
                                      f"{', quick' if c.args.quick else ''})\n\n" + "\n".join(lines) + "\n")


def stalled(c: Check) -> dict[str, Any]:
    """A part that never ends by itself (--stall, for the tests): what its time limit then does is recorded."""
    code, output = c.python("-c", "import time; time.sleep(10**6)")
    raise PartFailed("stopped by its time limit" if code is None else f"exit code {code}: {last_line(output)}")


def run_part(c: Check, part: Part, start: float) -> None:
    left = c.args.budget - (time.monotonic() - start) - RESERVE_S
    limit = min(c.args.limits.get(part.name, part.limit), left)
    record: dict[str, Any] = {"status": "skipped", "seconds": 0.0, "limit": limit}
    if limit < 1:
        record["result"] = {"why": f"the overall --budget {c.args.budget:g} s was spent"}
    else:
        c.say(f"== {part.name} ({part.what}; at most {limit:.0f} s)")
        began = time.monotonic()
        c.deadline = began + limit
        try:
            record |= {"status": "done", "result": (stalled if part.name in c.args.stall else part.run)(c)}
        except (PartFailed, subprocess.TimeoutExpired, OSError, ValueError, KeyError) as e:
            timed_out = isinstance(e, subprocess.TimeoutExpired) or "time limit" in str(e)
            record |= {"status": "timed out" if timed_out else "failed", "result": {"why": str(e)}}
        record["seconds"] = time.monotonic() - began
    c.results.setdefault("parts", {})[part.name] = record
    write_summary(c)
    c.say(f"-> {part.name}: {record['status']}, {record['seconds']:.0f} s: "
          f"{json.dumps(brief(record.get('result', {})), default=str)[:400]}")


def parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    p.add_argument("--quick", action="store_true", help="tiny data and short runs: the plumbing, in about a minute")
    p.add_argument("--only", help="comma-separated parts to run (default: all, in order)")
    p.add_argument("--budget", type=float, default=470.0, help="seconds for all parts together (default %(default)s)")
    p.add_argument("--limit", action="append", default=[], metavar="PART=SECONDS", help="one part's time limit")
    p.add_argument("--out", help="where the three result files go (default: $OUT, else runs/gpu-check-<time>)")
    p.add_argument("--work", help="the runs' folders and the data cache (default: a temporary folder, removed)")
    p.add_argument("--plan", action="store_true", help="print the parts and their limits, run nothing")
    p.add_argument("--stall", action="append", default=[], metavar="PART",
                   help="for the tests: PART runs a process that never ends, so that its time limit stops it")
    a = p.parse_args(argv)
    names = [part.name for part in PARTS]
    a.only = a.only.split(",") if a.only else names
    a.limits = {}
    for item in a.limit:
        name, _, seconds = item.partition("=")
        if name not in names or not seconds.replace(".", "", 1).isdigit():
            p.error(f"--limit {item}: expected PART=SECONDS with PART one of {', '.join(names)}")
        a.limits[name] = float(seconds)
    if unknown := sorted(set(a.only) - set(names)):
        p.error(f"--only: no part {', '.join(unknown)} (parts: {', '.join(names)})")
    a.samples = 1200 if a.quick else 20000  # training images of the throughput parts (to99 uses them all)
    a.replay_samples = 400 if a.quick else 2000  # replay: 4 or 20 steps of 100
    return a


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    parts = [part for part in PARTS if part.name in args.only]
    if args.plan:
        for part in parts:
            print(f"{part.name:14s} at most {args.limits.get(part.name, part.limit):4.0f} s  {part.what}")
        print(f"{'all':14s} at most {args.budget:4.0f} s (--budget)")
        return 0
    out = Path(args.out or os.environ.get("OUT") or REPO / "runs" / time.strftime("gpu-check-%Y%m%d-%H%M%S"))
    out.mkdir(parents=True, exist_ok=True)
    work = Path(args.work) if args.work else Path(tempfile.mkdtemp(prefix="gpu-check-"))
    start = time.monotonic()
    with (out / "gpu_check.log").open("w") as log:
        c = Check(args, out, work, log, results={"started": time.strftime("%Y-%m-%d %H:%M:%S"), "device": args.device,
                                                 "quick": args.quick, "budget_s": args.budget})
        c.say(f"gpu_check: {', '.join(part.name for part in parts)} on {args.device}, within {args.budget:g} s; "
              f"results in {out}")
        try:
            for part in parts:
                run_part(c, part, start)
        finally:
            c.results["seconds"] = time.monotonic() - start
            write_summary(c)
            if not args.work:
                shutil.rmtree(work, ignore_errors=True)
    print(f"gpu_check: done in {time.monotonic() - start:.0f} s; {out / 'summary.md'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
