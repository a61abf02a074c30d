"""The heartbeat's reading of a job, on a real TCPStore in this process: ranks here are Heartbeat objects that
beat over connections of their own. (Silent ranks — killed or frozen processes — are in test_faults.py.)"""

from collections.abc import Iterator
from datetime import timedelta

import pytest
import torch.distributed as dist

from mnist_ddp.heartbeat import LOST_CONTACT, Heartbeat

BEAT = 0.05  # seconds: a diagnosis takes 2.5 beats


@pytest.fixture
def store() -> Iterator[dist.TCPStore]:
    server = dist.TCPStore("127.0.0.1", 0, None, True, timedelta(seconds=10), wait_for_workers=False)
    yield server


def _ranks(server: dist.TCPStore, world: int, present: int) -> list[Heartbeat]:
    return [Heartbeat(dist.TCPStore("127.0.0.1", server.port, None, False, timedelta(seconds=10)), rank, world,
                      BEAT, store_host=None) for rank in range(present)]


def test_rank_doing_something_else_is_named_when_none_is_silent(store: dist.TCPStore) -> None:
    ranks = _ranks(store, 3, 3)
    for beat in ranks:
        beat.at("training", 2, 14)
    ranks[1].at("saving checkpoint.pt")
    said = ranks[0].diagnose()
    assert said.startswith("every rank still answers, but rank 1 (") and "was still saving checkpoint.pt while " \
        "the others were training (epoch 2, step 14)" in said, said
    for beat in ranks:
        beat.stop("finished", culprit=False)


def test_rank_that_failed_on_its_own_is_named_with_why_and_survivors_are_not(store: dist.TCPStore) -> None:
    ranks = _ranks(store, 3, 3)
    ranks[2].stop("no space left on device writing checkpoint.pt", culprit=True)
    ranks[1].stop(LOST_CONTACT, culprit=False)  # a survivor that already gave up
    said = ranks[0].diagnose()
    assert said.startswith("rank 2 (") and said.endswith("failed: no space left on device writing checkpoint.pt"), said
    assert "rank 1" not in said
    ranks[0].stop(LOST_CONTACT, culprit=False)


def test_ranks_that_never_came_are_named(store: dist.TCPStore) -> None:
    ranks = _ranks(store, 4, 2)
    assert ranks[1].diagnose() == "ranks 2, 3 never reached the rendezvous store"
    for beat in ranks:
        beat.stop(LOST_CONTACT, culprit=False)
