"""A rank's admission to the job, around `distributed.join`'s `init_process_group`: the check-in with the job's secret
(membership.py), the heartbeat (heartbeat.py), a `--recover` replacement's place in the running job, and every failure
of joining said in one sentence. Every run of several processes is admitted; a reader of DDP can skip how."""

import time
from dataclasses import replace
from datetime import timedelta

import torch
import torch.distributed as dist

from ..common.errors import UserError
from . import membership, rendezvous
from .heartbeat import BEAT_WAIT_S, BEATS_PREFIX, LOST_CONTACT, Heartbeat, beats_prefix
from .identity import Identity
from .membership import Credentials


class Admission:
    """`distributed.join`'s extras, which a reader of the textbook can skip: the check-in that proves a rank is one of
    the job's, the heartbeat, a replacement's place in a running job; and every failure of joining turned into one
    sentence (the context it makes around joining)."""

    def __init__(self, ident: Identity, device: torch.device, timeout: timedelta) -> None:
        self.ident, self.device, self.timeout = ident, device, timeout
        self.deadline = time.monotonic() + timeout.total_seconds()
        self.beat: Heartbeat | None = None
        self.entry: membership.Entry | None = None

    def admit(self, store: dist.Store, creds: Credentials, heartbeat_s: float) -> tuple[int, int, dist.Store]:
        """Check in, start beating, wait for every rank; this rank's place: its rank, the world and the store to form
        the group on (a replacement: the running job's generation)."""
        ident = self.ident
        self.entry = membership.check_in(store, ident, creds, self.deadline)
        if heartbeat_s:  # once this rank is in (a stranger never beats under a rank's name)
            beats = rendezvous.connect(ident, timedelta(seconds=BEAT_WAIT_S), joining=False)
            self.beat = Heartbeat(dist.PrefixStore(BEATS_PREFIX, beats), ident.rank, ident.world_size, heartbeat_s,
                                  store_host=0 if ident.store_host == "rank0" else None)
        membership.wait_for_all(store, ident, creds, self.entry, self.deadline)
        where = membership.placement(store, creds, self.entry)
        if not where:
            return ident.rank, ident.world_size, store
        self.entry = replace(self.entry, placed=where)
        if self.beat:
            self.beat.stop("joined the running job's generation", culprit=False)
            self.beat = Heartbeat(dist.PrefixStore(beats_prefix(where.generation), beats), where.rank,
                                  len(where.members), heartbeat_s, store_host=None)
        return where.rank, len(where.members), dist.PrefixStore(f"mnist_ddp/generation{where.generation}", store)

    def __enter__(self) -> "Admission":
        return self

    def __exit__(self, kind: type[BaseException] | None, e: BaseException | None, tb: object) -> None:
        beat, ident = self.beat, self.ident
        if e is None:
            if beat:
                beat.set_phase("setting up (data, model, checkpoint)")
            return
        if not isinstance(e, RuntimeError | ValueError | OSError):  # interrupted: leave no thread talking to the store
            if beat:
                beat.stop("interrupted", culprit=False)
            return
        who = beat.diagnose() if beat else ""  # DistStoreError and DistNetworkError are RuntimeErrors
        if beat:
            beat.stop(LOST_CONTACT, culprit=False)
        if "Duplicate GPU detected" in str(e):  # NCCL's own check, made when the communicator is (device_id)
            raise UserError(_shared_gpu(ident, self.device)) from e
        others = ident.world_size - 1
        raise UserError(
            f"rank {ident.rank} could not join the {others} other process{'es' if others > 1 else ''} at "
            f"{ident.master_addr}:{ident.master_port} within {self.timeout.total_seconds():g} s "
            f"({rendezvous.error_summary(e)}{f': {who}' if who else ''}); check that every node was started with the "
            f"same --master-addr/--master-port and world size, and that they can reach each other (GLOO_SOCKET_IFNAME "
            f"names the network interface gloo should use)."
        ) from e


def _shared_gpu(ident: Identity, device: torch.device | None) -> str:
    return (f"rank {ident.rank} and another process of this job use the same GPU ({device}; NCCL: \"Duplicate GPU "
            f"detected\"); give each process its own GPU (srun --gpus-per-task 1, or CUDA_VISIBLE_DEVICES set per "
            f"process), or start at most as many processes per machine as it has GPUs.")
