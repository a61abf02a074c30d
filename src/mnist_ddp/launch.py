"""Start the training processes: ourselves, or under torchrun / SLURM.

`-n N -g G -nr R` (the tutorial's flags) spawns G local processes with
`torch.multiprocessing.spawn`; process `local` gets rank R*G + local in a world of
N*G. Node 0's parent holds the rendezvous store before it spawns, so a taken port
is reported up front and the children can never race for it. Under torchrun or
srun the launcher already started one process per rank and we only read who we are.
"""

import os
import signal
import sys
import tempfile
from pathlib import Path
from types import FrameType

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from . import distributed, train
from .config import TrainConfig
from .distributed import Identity
from .errors import UserError


def _stop_on_sigterm() -> None:
    """SIGTERM (what launchers send to stop a job) unwinds like Ctrl-C, so `finally` blocks run."""
    def handler(signum: int, frame: FrameType | None) -> None:
        raise KeyboardInterrupt(f"signal {signum}")
    signal.signal(signal.SIGTERM, handler)


def run_worker(ident: Identity, cfg: TrainConfig) -> int:
    """One rank, start to finish; the process group is always torn down, also on error."""
    _stop_on_sigterm()
    d = distributed.setup(ident, cfg.device, cfg.backend, cfg.timeout)
    try:
        train.run(cfg, d)
        return 0
    finally:
        distributed.teardown()


def check_out_dir(out: Path, resume: bool) -> None:
    """Refuse an --out that we cannot write or that holds a run we would overwrite."""
    if not resume and ((out / "checkpoint.pt").exists() or (out / "metrics.jsonl").exists()):
        raise UserError(f"{out} already holds a run; pass --resume to continue it, or choose another --out.")
    try:
        out.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryFile(dir=out):
            pass
    except OSError as e:
        raise UserError(f"--out {out} is not a writable folder ({e.strerror}).") from e


def preflight(cfg: TrainConfig) -> None:
    """Checks that need this machine, done once before any process starts."""
    if cfg.sync_bn and not torch.cuda.is_available():
        raise UserError("--sync-bn needs CUDA GPUs (it synchronises BatchNorm over nccl); there are none here.")
    cuda = cfg.device == "cuda" or (cfg.device == "auto" and torch.cuda.is_available())
    if cuda and cfg.gpus > torch.cuda.device_count():
        raise UserError(f"-g/--gpus {cfg.gpus} asks for more GPUs than the {torch.cuda.device_count()} visible here.")
    if not cuda and cfg.amp == "fp16":
        raise UserError("--amp fp16 needs CUDA; use --amp bf16 on the CPU.")


def _spawned(local_rank: int, cfg: TrainConfig, addr: str, port: int, errors: "mp.SimpleQueue") -> None:
    """Entry point of each spawned child: compute its rank, run, report a user error to the parent."""
    ident = Identity(rank=cfg.node_rank * cfg.gpus + local_rank, local_rank=local_rank,
                     world_size=cfg.world_size, local_world_size=cfg.gpus, rendezvous="store",
                     master_addr=addr, master_port=port, launcher="mnist-ddp spawn")
    try:
        run_worker(ident, cfg)
    except UserError as e:
        errors.put(f"rank {ident.rank}: {e}")
        sys.exit(e.exit_code)
    except KeyboardInterrupt:
        sys.exit(130)


def spawn(cfg: TrainConfig) -> int:
    """The tutorial's launch: G local processes of an N-node job, meeting at node 0's store."""
    addr = cfg.master_addr or "127.0.0.1"
    store = None
    if cfg.node_rank == 0:  # node 0 hosts the rendezvous; port 0 lets the OS pick a free one
        try:
            store = dist.TCPStore(addr, cfg.master_port or 0, cfg.world_size, is_master=True,
                                  wait_for_workers=False)
        except (RuntimeError, OSError) as e:
            raise UserError(f"cannot listen on {addr}:{cfg.master_port or 0} for the other processes "
                            f"({str(e).splitlines()[0]}); the port may be in use, pick another --master-port.") from e
    port = store.port if store is not None else cfg.master_port
    assert port
    ctx = mp.get_context("spawn")
    errors = ctx.SimpleQueue()
    try:
        mp.start_processes(_spawned, args=(cfg, addr, port, errors), nprocs=cfg.gpus, join=True,
                           start_method="spawn")
    except mp.ProcessExitedException as e:
        if not errors.empty():
            raise UserError(errors.get()) from None
        if e.exit_code == 130 or e.signal_name in ("SIGINT", "SIGTERM"):
            return 130
        print(f"mnist-ddp: a worker process stopped ({e}).", file=sys.stderr)
        return 1
    finally:
        del store
    return 0


def launch(cfg: TrainConfig) -> int:
    """Run training the way this process was started; returns the exit code."""
    ident = distributed.identity_from_env(os.environ)
    if ident is not None:
        if (cfg.nodes, cfg.gpus, cfg.node_rank) != (1, 1, 0):
            raise UserError(f"{ident.launcher} already started {ident.world_size} processes; "
                            f"-n/-g/-nr are for mnist-ddp's own launcher, so leave them out.")
        preflight(cfg)
        if ident.rank == 0:
            check_out_dir(Path(cfg.out), cfg.resume)
        return run_worker(ident, cfg)
    preflight(cfg)
    if cfg.node_rank == 0:  # rank 0, on node 0, is the only writer
        check_out_dir(Path(cfg.out), cfg.resume)
    if cfg.world_size == 1:
        return run_worker(Identity(), cfg)
    return spawn(cfg)
