"""How mnist-ddp scales: measured on this box, modelled past it with the alpha-beta model of ring all-reduce.

Users ask "what will I get on 8 GPUs / 4 nodes?". This script answers with numbers it shows its work for:

1. A step, split: forward+backward+optimizer (the real ConvNet, the default recipe's optimizer and this
   CPU's precision/layout defaults, one thread per process: a process stands for one device) and the
   all-reduce of the flat gradient (29,034 fp32 = 116,136 bytes), in real gloo worlds of 1, 2 and 4
   processes on 127.0.0.1.
2. All-reduce times for messages of 4 B to 16 MB, for those worlds, and (as root, with iproute2) across
   two network namespaces joined by a veth pair shaped with `tc … tbf` to several rates: two "machines".
3. A least-squares fit, per link, of T(n, p) = 2(p-1)·alpha + 2(p-1)/p · n · beta to the world-2 sizes
   (relative residuals, so 4 B and 16 MB weigh alike); points it did not see (world 4, the 116 kB
   gradient) are predicted and the relative errors reported.
4. Predicted images/s and efficiency for 1-1,024 ranks on the measured links and on stated ones
   (10/100 GbE, NVLink-class), batch 100 and 1,000 per rank, with the all-reduce after backward
   (what DDP does here: the whole gradient is one bucket) and ideally overlapped with backward.

Prints a summary and writes scaling.json and scaling.png to --out; asserts nothing.

    python benchmarks/scaling.py                      # ~3-4 min on 2 busy cores; namespaces when root
    python benchmarks/scaling.py --quick              # smoke run: worlds 1-2, loopback only, ~20 s
    python benchmarks/scaling.py --compute-per-image 2e-6   # your accelerator's forward+backward+step time
"""

import argparse
import json
import math
import os
import shutil
import signal
import statistics
import subprocess
import sys
import time
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, replace
from datetime import datetime, timedelta
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F

from mnist_ddp.common.config import RECIPES
from mnist_ddp.core import compute, distributed, schedule
from mnist_ddp.core.compute import autocast
from mnist_ddp.model import ConvNet

GRADIENT_BYTES = 29_034 * 4
SIZES = [4 ** k for k in range(1, 13)]  # 4 B … 16 MB
QUICK_SIZES = [4, 1024, 65536, 1 << 20]
RANKS = [2 ** k for k in range(11)]  # 1 … 1,024
BATCHES = (100, 1000)
PHASES = ("forward", "backward", "optimizer")
# Links not measured here: (alpha seconds, bytes per second), typical published figures.
STATED_LINKS = {"10GbE (alpha 20 us)": (20e-6, 10e9 / 8), "100GbE (alpha 10 us)": (10e-6, 100e9 / 8),
                "NVLink-class 300 GB/s (alpha 3 us)": (3e-6, 300e9)}
SHAPES = {"veth unshaped": None, "veth 1 Gbit/s": 1e9, "veth 100 Mbit/s": 100e6}  # tbf rate, bits per second
NET = "10.78.0"  # addresses exist only inside the namespaces this script creates
WORKER_TIMEOUT = 600  # seconds: a hang detector for one measurement, never a timing limit


class BadInput(Exception):
    """Something the user must fix: printed as one sentence, exit code 2."""


# ---------------------------------------------------------------- the model and its fit


def ring_time(n: float, p: int, alpha: float, beta: float) -> float:
    """Ring all-reduce of n bytes per rank over p ranks: p-1 reduce-scatter + p-1 all-gather hops of n/p bytes."""
    return 2 * (p - 1) * alpha + 2 * (p - 1) / p * n * beta if p > 1 else 0.0


def fit(points: list[tuple[int, int, float]]) -> tuple[float, float]:
    """(alpha, beta) minimising the relative residuals of ring_time over (bytes, ranks, seconds) points.

    Weighted least squares in closed form: each row is divided by its measured time, so a 16 MB
    message cannot drown the 4 B ones that carry the latency. Non-negative: when noise drives one
    term below zero, it is zero and the other is refitted alone.
    """
    # ring_time is linear in (alpha, beta): its two coefficients per point, over the time. Target: 1 for every row.
    rows = [(ring_time(n, p, 1.0, 0.0) / t, ring_time(n, p, 0.0, 1.0) / t) for n, p, t in points]
    saa, sab, sbb = (sum(a * a for a, _ in rows), sum(a * b for a, b in rows), sum(b * b for _, b in rows))
    sa, sb = sum(a for a, _ in rows), sum(b for _, b in rows)
    det = saa * sbb - sab * sab
    alpha, beta = ((sa * sbb - sb * sab) / det, (saa * sb - sab * sa) / det) if det > 0 else (-1.0, -1.0)
    if alpha < 0 or beta < 0:
        only_alpha, only_beta = (sa / saa, 0.0), (0.0, sb / sbb)
        alpha, beta = min((only_alpha, only_beta), key=lambda ab: _sq_error(points, *ab))
    return alpha, beta


def _sq_error(points: list[tuple[int, int, float]], alpha: float, beta: float) -> float:
    return sum((ring_time(n, p, alpha, beta) / t - 1) ** 2 for n, p, t in points)


@dataclass(frozen=True)
class Compute:
    """One rank's step without communication, in seconds, per batch size: {batch: {phase: seconds}}."""
    phases: dict[int, dict[str, float]]
    source: str

    def step(self, batch: int) -> float:
        return sum(self.phases[batch].values())


def predict(compute_: Compute, alpha: float, beta: float) -> dict[str, dict]:
    """Images/s and efficiency over RANKS for each batch; serial (DDP here) and ideally overlapped all-reduce."""
    out = {}
    for batch in BATCHES:
        ph = compute_.phases[batch]
        rows = {}
        for mode in ("serial", "overlap"):
            steps = []
            for p in RANKS:
                comm = ring_time(GRADIENT_BYTES, p, alpha, beta)
                rest = ph["forward"] + ph["optimizer"]
                steps.append(rest + (max(ph["backward"], comm) if mode == "overlap" else ph["backward"] + comm))
            speed = [p * batch / s for p, s in zip(RANKS, steps)]
            eff = [v / (p * speed[0]) for p, v in zip(RANKS, speed)]
            rows[mode] = {"step_seconds": steps, "images_per_second": speed, "efficiency": eff,
                          "last_ranks_at_half_efficiency": max(p for p, e in zip(RANKS, eff) if e >= 0.5)}
        out[str(batch)] = rows
    return out


# ---------------------------------------------------------------- the measuring processes


def _worker(spec: dict) -> None:
    """One rank: join the gloo group, time training steps and/or an all-reduce sweep, rank 0 prints the JSON."""
    torch.set_num_threads(1)
    rank, world = spec["rank"], spec["world"]
    store = dist.TCPStore(spec["addr"], spec["port"], world, is_master=spec["host_store"],
                          timeout=timedelta(seconds=120))
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world, timeout=timedelta(seconds=300))
    finished = False
    try:
        # A batch of 1,000 is 10x the work of 100: proportionally fewer steps, never under 3.
        mine = {"steps": {b: _time_steps(b, max(3, spec["steps"] * 100 // b), spec["warmup"], world)
                          for b in spec["batches"]},
                "allreduce": _sweep(spec["sizes"], spec["budget"], spec["min_reps"], spec["max_reps"])}
        everyone: list = [None] * world
        dist.all_gather_object(everyone, mine)
        if rank == 0:
            print(json.dumps(everyone))
        finished = True
    finally:
        # The package's teardown stops gloo's threads before the interpreter exits; without it a worker now and
        # then aborted at exit ("terminate called without an active exception", exit -6) after its work was done.
        distributed.teardown(together=finished)


def _time_steps(batch: int, steps: int, warmup: int, world: int) -> dict[str, float]:
    """Mean seconds per phase of a training step; the gradients live in one flat buffer, all-reduced as DDP does."""
    device = torch.device("cpu")
    recipe = replace(RECIPES["default"], scheduler="none")
    amp, channels_last = compute.amp_for(recipe.amp, device), compute.channels_last_for(None, device)
    model = ConvNet()
    if channels_last:
        model = model.to(memory_format=torch.channels_last)  # type: ignore[call-overload]  # not in torch's stubs
    opt, _ = schedule.build_optimizer(recipe, model)
    params = list(model.parameters())
    flat = torch.zeros(sum(p.numel() for p in params))
    offset = 0
    for p in params:  # backward accumulates into these views, so the all-reduce needs no copies
        p.grad = flat[offset:offset + p.numel()].view_as(p)
        offset += p.numel()
    assert flat.numel() * 4 == GRADIENT_BYTES, "the ConvNet is not the one this script models"
    g = torch.Generator().manual_seed(0)
    x = torch.randn(batch, 1, 28, 28, generator=g)
    x = x.to(memory_format=torch.channels_last) if channels_last else x
    y = torch.randint(0, 10, (batch,), generator=g)
    totals = dict.fromkeys((*PHASES, "allreduce"), 0.0)
    for step in range(warmup + steps):
        t0 = time.perf_counter()
        with autocast(device, amp):
            loss = F.cross_entropy(model(x), y)
        opt.zero_grad(set_to_none=False)
        t1 = time.perf_counter()
        loss.backward()
        t2 = time.perf_counter()
        if world > 1:  # one process trains without DDP, as mnist-ddp does
            dist.all_reduce(flat)  # as the step sees it: also waits for the slowest rank
            flat.div_(world)
        t3 = time.perf_counter()
        opt.step()
        t4 = time.perf_counter()
        if step >= warmup:
            for key, dt in zip(("forward", "backward", "allreduce", "optimizer"), (t1 - t0, t2 - t1, t3 - t2, t4 - t3)):
                totals[key] += dt
    return {k: v / steps for k, v in totals.items()}


def _sweep(sizes: list[int], budget: float, min_reps: int, max_reps: int) -> dict[int, float]:
    """Median seconds of one all-reduce per message size; a barrier before each, so rank skew is not timed."""
    out = {}
    for n in sizes:
        buf = torch.zeros(max(1, n // 4))
        times = []
        dist.barrier()
        t0 = time.perf_counter()
        dist.all_reduce(buf)  # warm-up, and it tells how many repetitions fit the budget
        first = torch.tensor([time.perf_counter() - t0], dtype=torch.float64)
        dist.all_reduce(first, op=dist.ReduceOp.MAX)  # every rank must agree on the count
        for _ in range(max(min_reps, min(max_reps, int(budget / first.item())))):
            dist.barrier()
            t0 = time.perf_counter()
            dist.all_reduce(buf)
            times.append(time.perf_counter() - t0)
        out[n] = statistics.median(times)
    return out


@dataclass(frozen=True)
class Plan:
    """What every measurement does: sizes, repetitions, steps."""
    sizes: list[int]
    budget: float
    min_reps: int
    max_reps: int
    steps: int
    warmup: int


def measure(world: int, plan: Plan, batches: tuple[int, ...], sweep: bool,
            places: list[tuple[list[str], str, str]] | None = None) -> dict:
    """Start `world` worker processes and return their combined results.

    `places` is one (command prefix, interface, address) per node, ranks spread evenly over them;
    by default every rank runs here on 127.0.0.1 and a store opened by this process joins them.
    """
    store = None
    if places is None:
        store = dist.TCPStore("127.0.0.1", 0, world, is_master=True, wait_for_workers=False)
        places = [([], "lo", "127.0.0.1")]
    port = store.port if store else 29500  # a fresh namespace: every port is free
    per_node = world // len(places)
    procs = []
    try:
        for rank in range(world):
            prefix, ifname, _ = places[rank // per_node]
            spec = {"rank": rank, "world": world, "addr": places[0][2], "port": port,
                    "host_store": store is None and rank == 0, "batches": list(batches),
                    "sizes": plan.sizes if sweep else [], "steps": plan.steps if batches else 0,
                    "warmup": plan.warmup, "budget": plan.budget, "min_reps": plan.min_reps, "max_reps": plan.max_reps}
            procs.append(subprocess.Popen([*prefix, sys.executable, __file__, "_worker", json.dumps(spec)],
                                          env=os.environ | {"GLOO_SOCKET_IFNAME": ifname, "OMP_NUM_THREADS": "1"},
                                          stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
        outputs = [p.communicate(timeout=WORKER_TIMEOUT) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    for p, (_, err) in zip(procs, outputs):
        if p.returncode != 0:
            raise RuntimeError(f"a worker of world {world} failed (exit {p.returncode}): {err.strip()[-800:]}")
    ranks = json.loads(outputs[0][0])
    steps = {int(b): {k: statistics.mean(r["steps"][b][k] for r in ranks) for k in ranks[0]["steps"][b]}
             for b in ranks[0]["steps"]}
    sizes = {int(n): max(r["allreduce"][n] for r in ranks) for n in ranks[0]["allreduce"]}
    return {"steps": steps, "allreduce": sizes}


# ---------------------------------------------------------------- two machines on one box


def _netns_unavailable() -> str | None:
    """Why the two-namespace measurements cannot run here, or None when they can."""
    missing = [tool for tool in ("ip", "tc") if shutil.which(tool) is None]
    if missing:
        return f"{' and '.join(missing)} not found (package iproute2)"
    if os.geteuid() != 0:
        return "network namespaces need root"
    return None


def _sh(*cmd: str, check: bool = True) -> None:
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=30)
    if check and r.returncode != 0:
        raise RuntimeError(f"`{' '.join(cmd)}` failed: {r.stderr.strip()}")


@contextmanager
def two_machines(net: str = NET, tag: str = "") -> Iterator[tuple[list[tuple[list[str], str, str]],
                                                                   Callable[[float | None], None]]]:
    """Two namespaces joined by a veth pair, always deleted; yields the places (command prefix, link,
    address in `net`) and a shape(rate) function. `tag` (at most 12 characters) names them."""
    tag = tag or "sc" + uuid.uuid4().hex[:6]
    names, links = (f"mddp-{tag}-0", f"mddp-{tag}-1"), (f"m{tag}a", f"m{tag}b")
    made: list[str] = []
    try:
        for name in names:
            _sh("ip", "netns", "add", name)
            made.append(name)
        _sh("ip", "link", "add", links[0], "type", "veth", "peer", "name", links[1])
        for i, (name, link) in enumerate(zip(names, links)):
            _sh("ip", "link", "set", link, "netns", name)
            _sh("ip", "-n", name, "addr", "add", f"{net}.{i + 1}/24", "dev", link)
            _sh("ip", "-n", name, "link", "set", "lo", "up")
            _sh("ip", "-n", name, "link", "set", link, "up")

        def shape(rate: float | None) -> None:
            """Shape both directions with a token bucket (tbf: netem is not in every kernel), or unshape."""
            for name, link in zip(names, links):
                tc = ("ip", "netns", "exec", name, "tc", "qdisc")
                _sh(*tc, "del", "dev", link, "root", check=False)
                if rate is not None:  # a burst of 1 ms at line rate (at least ten frames), queue up to 100 ms
                    burst = max(15_140, int(rate / 8 / 1000))
                    _sh(*tc, "add", "dev", link, "root", "tbf", "rate", f"{int(rate)}bit", "burst", str(burst),
                        "latency", "100ms")

        yield [(["ip", "netns", "exec", name], link, f"{net}.{i + 1}")
               for i, (name, link) in enumerate(zip(names, links))], shape
    finally:  # deleting a namespace deletes the veth end inside it, and with it the pair
        for name in made:
            _sh("ip", "netns", "del", name, check=False)
        _sh("ip", "link", "del", links[0], check=False)


# ---------------------------------------------------------------- the run, the report


def run(args: argparse.Namespace) -> dict:
    """Measure, fit, predict; returns everything scaling.json holds."""
    sizes = (QUICK_SIZES if args.quick else SIZES) + [GRADIENT_BYTES]
    plan = (Plan(sizes, budget=0.1, min_reps=2, max_reps=10, steps=10, warmup=2) if args.quick
            else Plan(sizes, budget=0.4, min_reps=3, max_reps=50, steps=30, warmup=5))
    measured: dict[str, dict[int, dict]] = {"loopback": {}}
    for world in (1, 2) if args.quick else (1, 2, 4):
        print(f"measuring: loopback, world {world}", flush=True)
        measured["loopback"][world] = measure(world, plan, BATCHES if world == 1 else (100,), sweep=world > 1)
    skipped = "--quick" if args.quick else _netns_unavailable()
    if skipped is None:
        with two_machines() as (places, shape):
            for link, rate in SHAPES.items():
                shape(rate)
                print(f"measuring: {link}, worlds 2 (1+1) and 4 (2+2)", flush=True)
                measured[link] = {2: measure(2, plan, (100,), True, places), 4: measure(4, plan, (), True, places)}
    else:
        print(f"skipping the shaped links between two network namespaces: {skipped}")

    one = measured["loopback"][1]["steps"]
    if args.compute_per_image:  # the measured split of a step, scaled to the user's time per image
        per_image = {b: {ph: one[b][ph] / sum(one[b][q] for q in PHASES) * args.compute_per_image * b
                         for ph in PHASES} for b in BATCHES}
        compute_ = Compute(per_image, f"--compute-per-image {args.compute_per_image:g} s (phase split as measured)")
    else:
        compute_ = Compute({b: {ph: one[b][ph] for ph in PHASES} for b in BATCHES},
                           "measured here: this CPU, one process, one thread")
    fits, holdout = {}, []
    links: dict[str, tuple[float, float, str]] = {}  # each link's alpha, beta and where they come from
    for link, worlds in measured.items():
        points = [(n, 2, t) for n, t in worlds[2]["allreduce"].items() if n != GRADIENT_BYTES]
        alpha, beta = fit(points)
        links[link] = (alpha, beta, "fitted")
        rms = math.sqrt(_sq_error(points, alpha, beta) / len(points))
        fits[link] = {"alpha_seconds": alpha, "beta_seconds_per_byte": beta,
                      "bandwidth_bytes_per_second": 1 / beta if beta else None,
                      "fitted_on": f"world 2, {len(points)} sizes", "rms_relative_error_fitted": rms}
        for world, m in worlds.items():
            unseen = {n: t for n, t in m["allreduce"].items() if world != 2 or n == GRADIENT_BYTES}
            in_steps = {GRADIENT_BYTES: m["steps"][100]["allreduce"]} if world > 1 and 100 in m["steps"] else {}
            for kind, found in (("sweep", unseen), ("in a training step", in_steps)):
                for n, t in found.items():
                    pred = ring_time(n, world, alpha, beta)
                    holdout.append({"link": link, "world": world, "bytes": n, "kind": kind, "measured_seconds": t,
                                    "predicted_seconds": pred, "relative_error": (pred - t) / t,
                                    "more_ranks_than_cores": world > (os.cpu_count() or 1)})
    links |= {link: (alpha, 1 / bw, "assumed") for link, (alpha, bw) in STATED_LINKS.items()}
    measured_steps = [{"link": link, "world": world, "batch": batch,
                       "compute_seconds": sum(s[ph] for ph in PHASES), "allreduce_seconds": s["allreduce"],
                       "images_per_second": world * batch / (sum(s[ph] for ph in PHASES) + s["allreduce"])}
                      for link, worlds in measured.items() for world, m in worlds.items()
                      for batch, s in m["steps"].items()]
    return {
        "created": datetime.now().isoformat(timespec="seconds"), "quick": args.quick,
        "machine": {"cpus": os.cpu_count(), "torch": torch.__version__, "threads_per_process": 1},
        "gradient_bytes": GRADIENT_BYTES, "namespaces_skipped": skipped,
        "compute": {"source": compute_.source, "seconds_per_step": compute_.phases},
        "measured_steps": measured_steps,
        "allreduce": [{"link": link, "world": world, "bytes": n, "seconds": t} for link, worlds in measured.items()
                      for world, m in worlds.items() for n, t in m["allreduce"].items()],
        "fits": fits, "holdout": holdout,
        "model": "T(n, p) = 2(p-1)*alpha + 2(p-1)/p*n*beta; serial: step = compute + T (DDP here, one bucket); "
                 "overlap: step = forward + optimizer + max(backward, T) (ideal bucketing)",
        "ranks": RANKS,
        "predictions": {link: {"alpha_seconds": a, "beta_seconds_per_byte": b, "source": src, **predict(compute_, a, b)}
                        for link, (a, b, src) in links.items()},
    }


def fit_line(link: str, f: dict) -> str:
    """One link's fitted alpha and beta. On a loaded box the sizes' times can be noise, and the non-negative fit
    then puts everything on alpha: beta is 0 and there is no bandwidth to print (a CI run divided by it)."""
    us, ns = f["alpha_seconds"] * 1e6, f["beta_seconds_per_byte"] * 1e9
    bandwidth = f"{1e3 / ns:8,.0f} MB/s" if ns else "none measurable: latency alone fits"
    return (f"  {link:16s} alpha {us:8.1f} us   beta {ns:7.3f} ns/B (= {bandwidth})   "
            f"rms error on the fitted points {f['rms_relative_error_fitted']:.0%}")


def summary(r: dict) -> str:
    """The readable version of scaling.json."""
    lines = [f"compute per step ({r['compute']['source']}):"]
    for batch, ph in r["compute"]["seconds_per_step"].items():
        lines.append(f"  batch {batch:>5}: " + ", ".join(f"{k} {v * 1e3:.2f} ms" for k, v in ph.items()))
    lines.append("measured steps (compute = forward+backward+optimizer; all-reduce includes waiting for peers):")
    for s in r["measured_steps"]:
        ms = s["compute_seconds"] * 1e3, s["allreduce_seconds"] * 1e3
        lines.append(f"  {s['link']:16s} world {s['world']} batch {s['batch']:>4}: compute {ms[0]:7.2f} ms, "
                     f"all-reduce {ms[1]:6.2f} ms -> {s['images_per_second']:8,.0f} images/s")
    lines.append("fitted ring all-reduce model, T = 2(p-1)·alpha + 2(p-1)/p·n·beta:")
    lines += [fit_line(link, f) for link, f in r["fits"].items()]
    lines.append("held out (not fitted): predicted vs measured")
    for h in r["holdout"]:
        lines.append(f"  {h['link']:16s} world {h['world']} {h['bytes']:>9,} B {h['kind']:19s} measured "
                     f"{h['measured_seconds'] * 1e3:8.3f} ms  predicted {h['predicted_seconds'] * 1e3:8.3f} ms  "
                     f"{h['relative_error']:+.0%}")
    if any(h["more_ranks_than_cores"] for h in r["holdout"]):
        lines.append(f"  (worlds above {r['machine']['cpus']} ranks share cores: each hop also waits for the "
                     "scheduler, which the model does not describe)")
    lines.append("  (in a training step the all-reduce also waits for the slowest rank's compute)")
    lines.append("predicted efficiency at 8 / 64 / 1,024 ranks; last rank count still >= 50% efficient:")
    for link, pr in r["predictions"].items():
        for batch in map(str, BATCHES):
            for mode in ("serial", "overlap"):
                eff = dict(zip(r["ranks"], pr[batch][mode]["efficiency"]))
                last = pr[batch][mode]["last_ranks_at_half_efficiency"]
                lines.append(f"  {link:36s} batch {batch:>4} {mode:7s} {eff[8]:6.0%} {eff[64]:6.0%} {eff[1024]:6.0%}"
                             f"   up to {last:>4}{'+' if last == RANKS[-1] else ' '} ranks")
    return "\n".join(lines)


def plot(r: dict, path: Path) -> bool:
    """Efficiency vs ranks per batch: the model's curves, the measured steps on top. False without matplotlib."""
    try:
        import matplotlib
    except ImportError:
        return False
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    single = {s["batch"]: s["images_per_second"] for s in r["measured_steps"] if s["world"] == 1}
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.8), sharey=True)
    for ax, batch in zip(axes, BATCHES):
        for i, (link, pr) in enumerate(r["predictions"].items()):
            color = f"C{i}"
            ax.plot(r["ranks"], pr[str(batch)]["serial"]["efficiency"], color=color, label=link)
            ax.plot(r["ranks"], pr[str(batch)]["overlap"]["efficiency"], color=color, ls=":", lw=1)
            seen = [(s["world"], s["images_per_second"] / (s["world"] * single[batch])) for s in r["measured_steps"]
                    if s["link"] == link and s["batch"] == batch]
            if seen:
                ax.plot(*zip(*seen), "o", color=color, ms=6, mec="black")
        ax.axhline(0.5, color="gray", ls="--", lw=1)
        ax.set(xscale="log", xlabel="ranks", title=f"batch {batch} per rank", ylim=(0, 1.15))
        ax.grid(True, which="both", alpha=0.3)
    axes[0].set_ylabel("efficiency = images/s / (ranks x one rank's images/s)")
    axes[1].legend(fontsize=7, loc="lower left", title_fontsize=7,
                   title="solid: all-reduce after backward (DDP here)\ndotted: overlapped; dots: measured here")
    fig.suptitle(f"mnist-ddp ring all-reduce model, compute: {r['compute']['source']}", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=80)
    plt.close(fig)
    return True


def _positive(text: str) -> float:
    value = float(text)
    if not value > 0 or math.isinf(value):
        raise argparse.ArgumentTypeError(f"must be a positive number of seconds, got {text}")
    return value


def _stop(*_: object) -> None:
    raise KeyboardInterrupt  # SIGTERM takes the same way out as Ctrl-C: workers stopped, namespaces deleted


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["_worker"]:
        _worker(json.loads(argv[1]))
        return 0
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", type=Path, default=None, help="output folder (default runs/scaling-<time>)")
    p.add_argument("--quick", action="store_true", help="smoke run: fewer sizes and repetitions, worlds 1-2, "
                   "no namespaces")
    p.add_argument("--compute-per-image", type=_positive, default=None, metavar="SECONDS",
                   help="your device's forward+backward+optimizer time per image (default: measured on this CPU)")
    args = p.parse_args(argv)
    out = args.out or Path("runs") / f"scaling-{datetime.now():%Y%m%d-%H%M%S}"
    try:
        out.mkdir(parents=True, exist_ok=True)
        (out / "scaling.json").touch()
    except OSError as e:
        print(f"scaling.py: cannot write to --out {out}: {e.strerror}.", file=sys.stderr)
        return 2
    signal.signal(signal.SIGTERM, _stop)
    started = time.perf_counter()
    try:
        result = run(args)
    except KeyboardInterrupt:
        print("scaling.py: interrupted; workers stopped, namespaces deleted.", file=sys.stderr)
        return 130
    (out / "scaling.json").write_text(json.dumps(result, indent=1))
    print(summary(result))
    drew = plot(result, out / "scaling.png")
    print(f"wrote {out / 'scaling.json'}" + (f" and {out / 'scaling.png'}" if drew else " (no matplotlib: no plot)")
          + f" in {time.perf_counter() - started:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
