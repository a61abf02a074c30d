"""One rank, start to finish (`run_worker`): where every launcher's process ends up, whoever started it (`-g`'s
children, torchrun, srun, mpirun, or the command itself in a world of one). The process is set up, joins the process
group (essential 1), trains (`train`: the data, the loop, rank 0's report), and always leaves the group (essential 6),
also after an error.
How the processes are started and watched is launch.py's."""

import os
import signal
import sys
import traceback
from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import replace
from pathlib import Path
from types import FrameType

import torch

from .. import extended
from ..common import errors, timing
from ..common.config import TrainConfig, run_settings
from ..common.errors import UserError
from ..core import compute, distributed
from ..core.distributed import Dist, PeerFailure
from ..data import datasets
from ..joining import heartbeat, rendezvous
from ..joining.identity import Identity
from ..joining.membership import Credentials
from ..outputs import checkpoint, outdir, summary
from ..outputs.report import Reporter
from ..recovery import recovery
from . import forkserver


def run_worker(ident: Identity, cfg: TrainConfig, claim_out: bool = False,
               report: Callable[[UserError], None] | None = None, began: float | None = None) -> int:
    """One rank, start to finish: this process set up, the process group joined, the run trained; the group is
    always left.

    `claim_out`: rank 0 checks and holds --out here, after joining, so that a bad one stops every rank at
    once (torchrun and srun start all ranks before any of them could look). `report` hears this rank's error
    before it leaves the group: leaving is what makes a peer fail next ("Connection closed by peer"), so the
    launcher hears the first rank's words first (docs/design/heartbeat.md). A rank whose group is still closing
    after an error (a dead peer holds its threads) ends at once, its error said (`_leave_now`). `began`: when the
    command started (`time.time()`), where the run's wall time is counted from (timing.py; default: this process's).
    """
    with signals_interrupt(), ExitStack() as held:  # rank 0's claim on --out, let go after the teardown
        d, rec, finished = None, None, False
        try:
            device = _set_up_process(ident, cfg, began)
            timing.enter("join")
            creds = Credentials(cfg.secret or b"", run_settings(cfg, ident.world_size))
            d = distributed.join(ident, device, cfg.backend, cfg.timeout, cfg.heartbeat, creds)
            _warn_if_open(ident, cfg)
            with _named_peer_failure(d, cfg.timeout):
                if claim_out:
                    cfg = _claim_out(cfg, ident, d, held)
                timing.enter("data")
                forkserver.import_in_background()  # the optimizer's torch._dynamo, while the data loads
                rec = recovery.for_run(ident, cfg, d)  # --recover's, else None
                train(cfg, d, rec)
            finished = True
            return 0
        except UserError as e:
            if report:
                report(e)
            raise
        finally:  # essential 6: _stop → leave_group → distributed.teardown (after success a barrier first)
            _stop(ident, d, rec, finished, report)


def train(cfg: TrainConfig, d: Dist, rec: recovery.Recovery | None = None) -> float:
    """Train for the recipe's epochs; returns the final test accuracy (the same on every rank)."""
    # Essential 5: rank 0 alone speaks, through `rank0` (silent on the other ranks), and saves (`Trainer._save`).
    rank0 = Reporter.for_run(cfg, enabled=d.is_main, world_size=d.world_size)
    torch.manual_seed(cfg.seed)  # the same initial weights on every rank (DDP broadcasts rank 0's anyway)
    data = datasets.load(cfg.data)
    timing.enter("warm-up")  # the model, its optimizer, the first step
    cfg = replace(cfg, data=replace(cfg.data, dataset=data.name))  # `auto` resolved, as checkpoints record it
    rank0.say(summary.data_line(data))
    loop = extended.trainer_for(cfg, d, data, rank0, rec)  # the textbook Trainer, unless the run needs more
    try:
        result = loop.run()
        loop.rank0.say(summary.final_line(cfg, loop.d, loop.t.progress, loop.target_outcome, result))
    finally:  # loop.rank0: the one speaking at the end (--recover may have handed it on)
        loop.rank0.close(sys.exc_info()[0])  # the last epoch's plots, after the result is said
    loop.rank0.wall_time(timing.finish())
    return result.accuracy


def _set_up_process(ident: Identity, cfg: TrainConfig, began: float | None) -> torch.device:
    """Before joining: this rank's device, its share of the cores (gloo's threads inherit them) and the
    kernels' settings; the run's clock started."""
    device = distributed.pick_device(cfg.device, ident.local_rank, ident.local_world_size,
                                     share=cfg.backend == "gloo")
    timing.begin(timing.process_start() if began is None else began, lambda: compute.sync(device))
    if ident.rank == 0 and (line := distributed.sharing(device, ident.local_world_size)):
        print(line, flush=True)
    if device.type == "cpu":
        compute.share_cores(ident.local_rank, ident.local_world_size, threads=1 if cfg.bitwise else None)
    settings = compute.configure_backends(device, cfg.deterministic, cfg.bitwise)
    if settings and ident.rank == 0:
        print(f"deterministic: set {settings} (cuBLAS is deterministic only with it)", flush=True)
    return device


def _warn_if_open(ident: Identity, cfg: TrainConfig) -> None:
    """A job without a secret whose store others could reach: a warning, not an error (the tutorial's flags,
    typed as they are, must keep working)."""
    if cfg.secret is None and ident.local_rank == 0 and rendezvous.open_to_network(ident):
        print(f"mnist-ddp: warning: this job has no secret (MNIST_DDP_SECRET or --secret-file), so any "
              f"process that can reach {ident.master_addr}:{ident.master_port} could have joined it; give "
              f"every node the same secret (see docs/security.md).", file=sys.stderr, flush=True)


def _claim_out(cfg: TrainConfig, ident: Identity, d: Dist, held: ExitStack) -> TrainConfig:
    """Rank 0 checks --out and holds it until `held` closes; the config, with --resume where torchrun is
    restarting this job (`restarting`)."""
    if not cfg.resume and restarting(Path(cfg.out), ident, d):
        cfg = replace(cfg, resume=True)
    d.from_main(lambda: held.enter_context(outdir.claim(Path(cfg.out), cfg.resume)))
    return cfg


def _stop(ident: Identity, d: Dist | None, rec: recovery.Recovery | None, finished: bool,
          report: Callable[[UserError], None] | None) -> None:
    """The heartbeat told why this rank leaves, then the group left (`leave_group`); a group still closing
    ends the process now (`_leave_now`)."""
    words = _last_words(sys.exc_info()[1])
    if d and d.heartbeat:
        d.heartbeat.stop(*words)
    if rec:  # after a re-forming, the last generation's heartbeat; after the finish, the standbys told
        rec.stop(*words, finished)
    beats = rec.heartbeat if rec and rec.heartbeat else d.heartbeat if d else None
    if not leave_group(d.rank if d else ident.rank, finished, report, beats.diagnose if beats else None):
        _leave_now(sys.exc_info()[1], told=report is not None)


def leave_group(rank: int, finished: bool, report: Callable[[UserError], None] | None = None,
                diagnose: Callable[[], str] | None = None) -> bool:
    """Leave the process group (distributed.teardown); whether it closed. A rank that finished, whose last wait for
    the others fails because one was lost after the last step (rank 0, maybe, while it saved the final checkpoint),
    says so in one line, naming who where `diagnose` (Heartbeat.diagnose) can, reported as run_worker reports, and
    fails, rather than end in a traceback: the run's end is not known to be saved."""
    try:
        return distributed.teardown(together=finished)
    except RuntimeError as e:
        if not (finished and distributed.is_peer_failure(e)):
            raise
        who = diagnose() if diagnose else ""
        failure = PeerFailure(f"rank {rank} lost contact with the other processes after the run's last step "
                              f"({rendezvous.error_summary(e)}{f'; {who}' if who else ''}): if rank 0 was lost before "
                              f"it saved the final checkpoint, run again with --resume to finish from the last one.")
        if report:
            report(failure)
        if not distributed.teardown(together=False):
            _leave_now(failure, told=report is not None)
        raise failure from e


@contextmanager
def _named_peer_failure(d: Dist, timeout_s: float) -> Iterator[None]:
    """A collective that failed because a peer died or stopped answering becomes a PeerFailure naming who (the
    heartbeat's diagnosis); any other error passes unchanged."""
    try:
        yield
    except RuntimeError as e:
        if d.world_size > 1 and distributed.is_peer_failure(e):
            who = d.heartbeat.diagnose() if d.heartbeat else ""
            who = who or (f"one of them crashed, was killed or stopped answering for --timeout {timeout_s:g} s "
                          f"(see its log)")
            raise PeerFailure(
                f"rank {d.rank} lost contact with the other processes ({rendezvous.error_summary(e)}); {who}. Work "
                f"since the last checkpoint is lost: run again with --resume to continue from it."
            ) from e
        raise


def _last_words(e: BaseException | None) -> tuple[str, bool]:
    """What a rank that leaves tells the others' heartbeat readers: why, and whether that failure is its own."""
    if e is None or isinstance(e, KeyboardInterrupt | SystemExit):
        return ("finished" if e is None else "interrupted"), False
    if isinstance(e, PeerFailure):
        return heartbeat.LOST_CONTACT, False
    return rendezvous.error_summary(e), True


def restarting(out: Path, ident: Identity, d: Dist) -> bool:
    """Whether torchrun is restarting the job that wrote `out`'s checkpoint (a worker died and the agent
    started the workers again, with --max-restarts): then the run continues from it without --resume.

    The same job: the run id recorded in the checkpoint is this one's (--rdzv-id, or --standalone's uuid,
    fixed for the life of one torchrun). A restart: any rank's restart count is ≥ 1, not just this node's:
    after a membership change a newly joined node's agent has restarted nothing yet. A fresh torchrun
    with the same --rdzv-id has every count at 0, and is refused an occupied --out as before.
    """
    attempts = d.all_sum(torch.tensor(ident.attempt, device=d.device))  # every rank takes part, whatever it holds
    if int(attempts) == 0 or not ident.run_id:
        return False
    # The newest intact checkpoint: a damaged checkpoint.pt is passed over for the one saved before it.
    ours = d.from_main(lambda: (checkpoint.newest_intact(out / "checkpoint.pt")[1] or {}).get("run_id") == ident.run_id)
    if ours and d.is_main:
        print(f"restart: torchrun restarted job {ident.run_id} (restart {ident.attempt} here); continuing {out} "
              f"from its checkpoint, as --resume would", flush=True)
    return ours


def _leave_now(e: BaseException | None, told: bool) -> None:
    """End this rank, whose process group is still closing after `e`: the interpreter's own exit would wait for the
    group's threads, up to --timeout on a dead peer. Its error goes to stderr first, as the command would say it,
    unless a launcher of ours was `told` it."""
    if not told and isinstance(e, UserError | KeyboardInterrupt):
        print(errors.last_word(e)[0], file=sys.stderr)
    elif not told and e is not None:
        traceback.print_exception(e)
    leave(errors.last_word(e)[1] if isinstance(e, UserError | KeyboardInterrupt) else 1)


def leave(code: int) -> None:
    """End a child that failed or was stopped, now: its process group may still be closing, and the interpreter's
    own exit would wait on gloo's threads for up to --timeout when a peer froze (distributed.teardown), while the
    parent reports nothing until every child is gone. (Nothing of value is left unwritten: outputs are written
    whole, and the failed stretch is what --resume redoes.)"""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


@contextmanager
def signals_interrupt() -> Iterator[None]:
    """SIGINT and SIGTERM (what Ctrl-C, launchers and `kill` send) unwind like Ctrl-C, so `finally` blocks
    run. Only the first: the repeats that follow (Ctrl-C reaches the whole process group, then the parent
    passes a SIGTERM on) must not cut short the clean-up the first one started, nor the exit after it,
    so once one has come the repeats stay ignored."""
    def ignore(signum: int, frame: FrameType | None) -> None:
        """A repeat. Not SIG_IGN: a repeat that arrived before the first was handled would then raise."""

    def handler(signum: int, frame: FrameType | None) -> None:
        for s in (signal.SIGINT, signal.SIGTERM):
            signal.signal(s, ignore)
        raise KeyboardInterrupt(f"signal {signum}")
    previous = {s: signal.signal(s, handler) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield
    finally:
        if signal.getsignal(signal.SIGINT) is handler:  # no signal came: leave things as they were
            for s, h in previous.items():
                signal.signal(s, h)
