"""Soak: 20 back-to-back 2-process training runs, and nothing leaks between them.

Interpreter start-up would dominate 20 runs on a small box, so two worker processes are started once
(torch.multiprocessing, as spawn mode does) and each runs the 20 jobs through the real launch code:
the parent opens the rendezvous store with `distributed.host_store`, exactly as `mnist-ddp train -g 2`
does, and every worker calls `worker.run_worker` (join, train, tear down) once per run. Long-lived
processes are the harder case for leaks: a socket, file or process group left behind by one run is
still there, and counted, at the next.
"""

import os
from datetime import timedelta
from pathlib import Path

import torch.multiprocessing as mp

from mnist_ddp.common.config import DataConfig, TrainConfig, recipe
from mnist_ddp.joining import identity, rendezvous
from mnist_ddp.launchers import worker
from mnist_ddp.outputs import outdir
from procfs import children, listening_inodes, needs_proc, socket_inodes

RUNS = 20
WORLD = 2
pytestmark = needs_proc


def _worker(local_rank: int, jobs: "mp.Queue", results: "mp.Queue") -> None:
    """Run jobs until told to stop; after each, report what this process still holds open."""
    while (job := jobs.get()) is not None:
        ident, cfg = job
        try:
            worker.run_worker(ident, cfg)
            error = None
        except BaseException as e:  # report, keep serving: the parent decides
            error = f"{type(e).__name__}: {e}"
        results.put((local_rank, error, len(os.listdir("/proc/self/fd")), socket_inodes(os.getpid())))


def _config(out: Path, seed: int) -> TrainConfig:
    return TrainConfig(data=DataConfig("synthetic", train_samples=200, test_samples=50),
                       recipe=recipe("default", epochs=1), seed=seed,
                       out=str(out), progress=False, plots=False, timeout=60, device="cpu")


def test_twenty_runs_leak_no_port_process_or_file(tmp_path: Path) -> None:
    private_tmp = tmp_path / "tmp"
    private_tmp.mkdir()
    os.environ["TMPDIR"] = str(private_tmp)  # the workers inherit it: any temp file of theirs lands here
    try:
        ctx = mp.get_context("spawn")
        jobs = [ctx.Queue() for _ in range(WORLD)]
        results = ctx.Queue()
        workers = [ctx.Process(target=_worker, args=(r, jobs[r], results)) for r in range(WORLD)]
        for w in workers:
            w.start()
    finally:
        del os.environ["TMPDIR"]
    ours = [os.getpid(), *(w.pid for w in workers)]
    fds: list[list[int]] = []
    kept: list[set[int]] = []
    try:
        for run in range(RUNS):
            out = tmp_path / f"run{run:02d}"
            cfg = _config(out, run)
            claim = outdir.claim(out, resume=False)  # what the parent does before it spawns
            store = rendezvous.host_store("127.0.0.1", 0, WORLD, timedelta(seconds=60))
            for r in range(WORLD):
                jobs[r].put((identity.spawned(0, r, WORLD, 1, "127.0.0.1", store.port), cfg))
            reports = sorted(results.get(timeout=120) for _ in range(WORLD))
            claim.release()
            del store
            assert [error for _, error, _, _ in reports] == [None] * WORLD, (run, reports)
            fds.append([n for _, _, n, _ in reports])
            # The store's port closed with the run. In a long-lived process torch keeps the first DDP run's
            # gloo group (and its one listening socket) alive after destroy_process_group: the same socket,
            # run after run. A leak of ours would add one every run.
            listening = listening_inodes()
            assert not socket_inodes(os.getpid()) & listening, f"run {run}: the store's port is still open"
            held = [inodes & listening for *_, inodes in reports]
            kept = kept or held
            assert held == kept and all(len(h) <= 1 for h in held), f"run {run}: listening sockets {held}"
            assert sorted(p.name for p in out.iterdir()) == ["best.pt", "checkpoint.pt", "metrics.jsonl",
                                                             "model.safetensors", "timing.jsonl"], run
        # Open files settle after the first runs (lazy imports, thread pools) and then stay flat.
        assert fds[-1] == fds[2], fds
        assert [p for p in private_tmp.rglob("*") if p.is_file()] == []  # (torch may make an empty cache dir)
    finally:
        for q in jobs:
            q.put(None)
        for w in workers:
            w.join(30)
            if w.is_alive():
                w.kill()
    assert all(w.exitcode == 0 for w in workers)
    assert [p for p in children(os.getpid()) if p in ours] == []  # the workers are gone, not lingering
    assert not socket_inodes(os.getpid()) & listening_inodes()
