"""Start the training processes: ourselves, or under torchrun / MPI / SLURM.

`-n N -g G -nr R` (the tutorial's flags) starts G local processes with
`torch.multiprocessing.start_processes`, forked from a server that imported torch once
(forkserver.py); process `local` gets rank R*G + local in a world of N*G. Node 0's parent
holds the rendezvous store before it starts them, so a taken port is reported up front and
the children can never race for it. Under torchrun, mpirun or srun the launcher already started one
process per rank and we only read who we are. Each process then runs one rank, start to finish: worker.py.

Stopping is part of starting: Ctrl-C or SIGTERM unwinds every process like a
KeyboardInterrupt (so `finally` blocks leave the process group and a checkpoint being
written is never left half-done), and the parent takes its children down with it.
"""

import logging
import multiprocessing.connection
import os
import secrets
import signal
import time
from collections.abc import Callable
from contextlib import nullcontext, suppress
from dataclasses import replace
from datetime import timedelta
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Protocol

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from ..common import console, errors, timing
from ..common.config import TrainConfig, run_settings
from ..common.errors import UserError
from ..core import compute, divergence
from ..core.distributed import PeerFailure
from ..joining import heartbeat, identity, rendezvous
from ..joining.identity import Identity
from ..joining.membership import Credentials
from ..outputs import outdir, tb, tracking
from ..recovery import successor
from . import forkserver, worker

GRACE_S = 10.0  # how long stopped children get to unwind before they are killed
SETTLE_S = 1.0  # after one child failed, how long the others get to end by themselves (their message: the same)
LOOK_S = 1.0  # how often a waiting launcher looks whether its children are stopped (Frozen)


def preflight(cfg: TrainConfig, rank0_here: bool = True) -> None:
    """Checks that need this machine, done once before any process starts; `rank0_here`: this node (or process) is
    where rank 0 will run."""
    cuda = cfg.device == "cuda" or (cfg.device == "auto" and torch.cuda.is_available())
    if cuda and cfg.gpus > torch.cuda.device_count() and cfg.backend != "gloo":
        raise UserError(f"-g/--gpus {cfg.gpus} asks for more GPUs than the {torch.cuda.device_count()} visible here "
                        f"(NCCL needs one GPU per process; --backend gloo lets processes share them).")
    if not cuda:  # asked for explicitly (--device cpu/mps) or because there is no GPU
        fits_cores_and_memory(cfg.gpus)
        if cfg.sync_bn:
            raise UserError("--sync-bn needs CUDA GPUs (it synchronises BatchNorm over nccl); this run has none.")
        if cfg.recipe.amp == "fp16":
            raise UserError(divergence.FP16_NEEDS_CUDA)
        if cfg.backend == "nccl":
            raise UserError("--backend nccl needs CUDA GPUs; use gloo (the default) without them.")
    # a bad CUBLAS_WORKSPACE_CONFIG is refused now (--bitwise on CUDA runs the deterministic kernels too)
    compute.cublas_workspace(cfg.deterministic or cfg.bitwise, "cuda" if cuda else "cpu", os.environ)
    if cfg.tensorboard:  # under a launcher every rank checks: none waits for a rank 0 that refused
        tb.check_installed()
    if cfg.mlflow is not None:
        tracking.check_installed(cfg.mlflow)
        if rank0_here:  # the one process that logs to it (a server on node 0's loopback is not on the others')
            tracking.check_reachable(cfg.mlflow)


PROCESSES_PER_CORE = 4  # -g on a CPU: worker processes; more than this many a core only wait for each other
WORKER_BYTES = 500 << 20  # what a CPU worker holds at its peak on MNIST's 60,000 images (measured: ~475 MB)


def fits_cores_and_memory(processes: int) -> None:
    """Refuse more CPU worker processes than this machine can run: `PROCESSES_PER_CORE` a core (8 at least), and
    `WORKER_BYTES` each of the memory available now."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    most = max(8, PROCESSES_PER_CORE * cores)
    if processes > most:
        raise UserError(f"-g/--gpus {processes} asks for more worker processes than this machine's {cores} CPU "
                        f"core(s) can run ({most} at most here); use fewer.")
    available = compute.available_memory()
    if available is not None and processes * WORKER_BYTES > available:
        raise UserError(f"-g/--gpus {processes} worker processes need ~{processes * WORKER_BYTES / 2**30:.1f} GiB of "
                        f"memory and {available / 2**30:.1f} GiB is free; use fewer.")


class ErrorPipe:
    """How spawned children hand their errors to the parent: as JSON (`errors.relay`) over a pipe, which the
    parent reads with recv_bytes — not as exception objects, which the parent would have to unpickle."""

    def __init__(self) -> None:
        ctx = mp.get_context("forkserver")
        self.reader, self.writer = ctx.Pipe(duplex=False)
        self.lock = ctx.Lock()  # one child's message at a time
        self.found: list[tuple[UserError, bool]] = []  # read, not yet handed out by cause(): (error, echo)

    def put(self, e: UserError) -> None:
        """In a child: send `e`; it is in the pipe when put returns."""
        with self.lock:
            self.writer.send_bytes(errors.relay(e, echo=isinstance(e, PeerFailure)))

    def cause(self) -> UserError | None:
        """In the parent: of the children's errors, the one that started it (None if none sent one). A PeerFailure
        only echoes another rank's failure (rank 0 that could not write a checkpoint, and the rank that then lost
        contact with it, both report)."""
        self._read()
        found, self.found = self.found, []
        return next((e for e, echo in found if not echo), found[0][0]) if found else None

    def failed(self) -> bool:
        """In the parent: whether a child sent a failure of its own, not an echo: one every rank meets (a world
        that never formed, bad input, a full disk), which --recover cannot go on from."""
        return any(not echo for _, echo in self._read())

    def _read(self) -> list[tuple[UserError, bool]]:
        while self.reader.poll():
            try:
                self.found.append(errors.relayed(self.reader.recv_bytes()))
            except ValueError as why:
                self.found.append((PeerFailure(f"a worker sent the launcher an unreadable error ({why})"), False))
        return self.found


def _spawned(local_rank: int, cfg: TrainConfig, addr: str, port: int, reports: ErrorPipe,
             output: Connection, environ: dict[str, str], standby: tuple[str, int] | None,
             began: float | None = None) -> None:
    """Entry point of each spawned child: compute its rank, run, hand a clear error to the parent. Interrupted at
    any point, also before run_worker, it ends with 130 (torch's wrapper would end it with 0, "finished")."""
    try:
        forkserver.release_interrupts()
        forkserver.die_with_launcher()
        forkserver.adopt(environ)
        console.attach(output)  # the parent shows what this process prints, and rank 0's bar (console.py)
        ident = identity.spawned(cfg.node_rank, local_rank, cfg.gpus, cfg.nodes, addr, port, standby)
        worker.run_worker(ident, cfg, report=reports.put, began=began)
    except UserError as e:
        worker.leave(e.exit_code)
    except KeyboardInterrupt:
        worker.leave(130)


def _after_abort(children: mp.ProcessContext, cfg: TrainConfig, store: "dist.TCPStore | None") -> str:
    """Who the children that SIGABRT ended were waiting for, from the beats, read while the others still run;
    '' when the heartbeat is off, or names nobody (then the aborted rank is the cause).

    NCCL's watchdog ends a rank that way when its collective timed out or a peer failed (torch's default
    TORCH_NCCL_ASYNC_ERROR_HANDLING; mnist-ddp sets 2, which raises instead, only where you set nothing), and
    the first to go is a survivor, not the culprit. So each aborted rank is marked as having left, and the
    reading is repeated while more of them end during it, so that only a rank that stopped answering on its own
    (or failed for its own reason) is named. Node 0's parent reads its own store; the others have none."""
    if not cfg.heartbeat or store is None:
        return ""
    beats = heartbeat.Heartbeat.reader(dist.PrefixStore(heartbeat.BEATS_PREFIX, store), cfg.world_size,
                                       cfg.heartbeat)

    def ended() -> set[int]:
        return {cfg.node_rank * cfg.gpus + i for i, p in enumerate(children.processes) if p.exitcode == -signal.SIGABRT}
    marked: set[int] = set()
    while marked != ended():
        for rank in ended() - marked:
            beats.mark_left(rank, "ended by SIGABRT")
            marked.add(rank)
        said = beats.diagnose()
    return "" if said.startswith("every rank still answers") else said


class Child(Protocol):
    """What the launcher reads of a spawned process (multiprocessing's)."""

    @property
    def sentinel(self) -> int: ...

    @property
    def exitcode(self) -> int | None: ...

    @property
    def pid(self) -> int | None: ...


class Frozen:
    """Children that all stay stopped (SIGSTOP, a debugger) for longer than --timeout: their peers gave up on them
    by then, and with no child left running, nobody else would, so the launcher ends the job (docs/faults.md)."""

    def __init__(self, processes: "list[Child]", first_rank: int, timeout: float) -> None:
        self.processes, self.first_rank, self.timeout = processes, first_rank, timeout
        self.since: float | None = None  # when every running child was first seen stopped

    def check(self) -> None:
        """Raises PeerFailure, after killing them, once every running child has been stopped for --timeout."""
        running = {self.first_rank + i: p.pid for i, p in enumerate(self.processes) if p.exitcode is None and p.pid}
        if not running or not all(heartbeat.stopped(pid) for pid in running.values()):
            self.since = None
            return
        self.since = self.since or time.monotonic()
        if time.monotonic() - self.since < self.timeout:
            return
        for pid in running.values():  # now, not after Workers.stop's grace: a stopped child never unwinds
            with suppress(ProcessLookupError):  # it ended since it was looked at
                os.kill(pid, signal.SIGKILL)
        ranks = ", ".join(f"{rank} (pid {pid})" for rank, pid in running.items())
        raise PeerFailure(f"rank{'s' * (len(running) > 1)} {ranks} stopped answering: stopped (SIGSTOP, or a "
                          f"debugger) for --timeout {self.timeout:g} s with no other process of this launcher "
                          f"running; killed. Run again with --resume to continue from the last checkpoint.")


def await_every_child(processes: list[Child], failed: Callable[[], bool] = lambda: False,
                      frozen: Callable[[], None] = lambda: None,
                      finished_run: Callable[[], None] = lambda: None) -> bool:
    """--recover, where a lost child does not end the job (recovery.py): wait until every child has ended, or, once
    one finished the run, SETTLE_S more (a rank presumed lost may be frozen for good: the caller stops it), or until
    one ended with a failure nobody goes on from (`failed`, ErrorPipe.failed: the caller stops the rest); whether
    some finished the run (else the first failure is the job's). Each wait is on the children it saw running, and
    `frozen` (Frozen.check) is called every LOOK_S, `finished_run` (Standby.retire) once a child finished the run."""
    finished = None  # when a child was first seen to have finished the run
    while running := [p.sentinel for p in processes if p.exitcode is None]:
        if any(p.exitcode not in (None, 0) for p in processes) and failed():
            return False
        if finished is None and any(p.exitcode == 0 for p in processes):
            finished = time.monotonic()
            finished_run()
        left = LOOK_S if finished is None else finished + SETTLE_S - time.monotonic()
        if left <= 0:
            break
        multiprocessing.connection.wait(running, min(left, LOOK_S))
        frozen()
    return any(p.exitcode == 0 for p in processes)


def spawn(cfg: TrainConfig, began: float) -> int:
    """The tutorial's launch: G local processes of an N-node job, meeting at node 0's store. On one node the
    parent makes the job's secret and hands it to its children alone (never to the store, never to disk).
    `began`: when the command started, where the children count the run's wall time from."""
    addr = cfg.master_addr or "127.0.0.1"
    if cfg.nodes == 1:
        cfg = replace(cfg, secret=secrets.token_bytes(32))
    store, standby = None, None
    with worker.signals_interrupt(), console.relay() as output:
        if cfg.node_rank == 0:  # node 0 hosts the rendezvous; port 0 lets the OS pick a free one
            store = rendezvous.host_store(addr, cfg.master_port or 0, cfg.world_size, timedelta(seconds=cfg.timeout),
                                          one_node=cfg.nodes == 1)
        elif cfg.recover:  # where the others meet again should node 0's launcher be lost (successor.py)
            standby = successor.Standby(addr, cfg.world_size, Credentials(cfg.secret or b"", run_settings(
                cfg, cfg.world_size)), timedelta(seconds=cfg.timeout))
        port = store.port if store is not None else cfg.master_port
        forkserver.start()  # already running when started from the command line (cli.py)
        reports = ErrorPipe()
        # When one child fails, torch stops the rest and logs each stop; our one line on the cause says enough.
        logging.getLogger("torch.multiprocessing.spawn").setLevel(logging.ERROR)
        children = mp.start_processes(_spawned, args=(cfg, addr, port, reports, output, dict(os.environ),
                                                      standby and standby.where, began),
                                      nprocs=cfg.gpus, join=False, start_method="forkserver")
        workers = forkserver.Workers([p.pid for p in children.processes])
        frozen = Frozen(children.processes, cfg.node_rank * cfg.gpus, cfg.timeout)
        try:
            aborted = ""  # who the ranks that SIGABRT ended were waiting for
            # Returns early when one child fails: the others get SETTLE_S to end by themselves (they lost contact
            # too, and are naming who hangs), then SIGTERM, then after SETTLE_S more (a frozen one) SIGKILL.
            while True:
                if not cfg.recover:
                    while not multiprocessing.connection.wait(list(children.sentinels), LOOK_S):
                        frozen.check()
                elif await_every_child(children.processes, reports.failed, frozen.check,  # the others finished
                                       standby.retire if standby else lambda: None):
                    break
                if not aborted and any(p.exitcode == -signal.SIGABRT for p in children.processes):
                    aborted = _after_abort(children, cfg, store)
                if children.join(grace_period=SETTLE_S):
                    break
        except mp.ProcessExitedException as e:
            rank = cfg.node_rank * cfg.gpus + e.error_index
            if e.signal_name == "SIGABRT" and aborted:
                raise PeerFailure(f"rank {rank} (pid {e.error_pid}) was ended by SIGABRT, as NCCL's watchdog ends a "
                                  f"rank whose collective timed out or lost a peer, while {aborted}; the other "
                                  f"processes were stopped. Run again with --resume to continue from the last "
                                  f"checkpoint.") from None
            if e.signal_name not in (None, "SIGINT", "SIGTERM"):  # the cause, even if the others then complained
                hint = " (on a GPU, NCCL's watchdog ends a rank so when a collective fails: see its log)" \
                    if e.signal_name == "SIGABRT" else ""
                after = "the other processes were stopped. Run again with --resume to continue from the last checkpoint"
                if cfg.recover and cfg.node_rank:
                    after = ("under --recover the other nodes go on without this node's ranks: run the same command "
                             "again to rejoin them (once the job has ended, with --resume)")
                elif cfg.recover and cfg.nodes > 1:  # this launcher held the store (successor.py)
                    after = ("under --recover the other nodes go on without this node, whose launcher held the "
                             "rendezvous store: the next node's takes it over, and the new rank 0 writes its --out")
                raise PeerFailure(f"rank {rank} (pid {e.error_pid}) was killed by {e.signal_name}{hint}; {after}.") \
                    from None
            cause = reports.cause()
            if cause is not None:
                raise cause from None
            if e.exit_code == 130 or e.signal_name:
                raise KeyboardInterrupt from None
            raise PeerFailure(f"rank {rank} stopped with exit code {e.exit_code}; see its messages above.") from None
        finally:
            workers.stop(GRACE_S)  # however it ends, no worker outlives this (after success: all have ended)
            if standby is not None:
                standby.close()
            del store, standby  # closes the listening ports now, not whenever the exception is freed
    return 0


def launch(cfg: TrainConfig, began: float | None = None) -> int:
    """Run training the way this process was started; returns the exit code. `began`: when the command started
    (`time.time()`; default: this process's start)."""
    ident = identity.from_env(os.environ)
    preflight(cfg, rank0_here=ident.rank == 0 if ident is not None else cfg.node_rank == 0)
    if ident is not None:
        if (cfg.nodes, cfg.gpus, cfg.node_rank) != (1, 1, 0):
            raise UserError(f"{ident.launcher} already started {ident.world_size} processes; "
                            f"-n/-g/-nr are for mnist-ddp's own launcher, so leave them out.")
        return worker.run_worker(ident, cfg, claim_out=True, began=began)
    # Rank 0, on node 0, is the only writer; this process outlives it, so it holds --out for the whole run.
    with outdir.claim(Path(cfg.out), cfg.resume) if cfg.node_rank == 0 else nullcontext():
        if cfg.world_size == 1:
            return worker.run_worker(Identity(), cfg, began=began)
        return spawn(cfg, timing.process_start() if began is None else began)
