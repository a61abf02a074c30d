"""The heartbeat's reading of a job, on a real TCPStore in this process: ranks here are Heartbeat objects that
beat over connections of their own. (Silent ranks — killed or frozen processes — are in test_faults.py.)"""

import json
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


# --- whoever reaches the store can write the beats: a value that is no beat of ours is said to be one ---------

GARBAGE = {  # what a stranger (or a bug) could leave under a rank's key -> what the diagnosis says of it
    "not JSON": (b"\x80\x04\x95\x1b[2J", "not JSON: '"),
    "a JSON list": (b"[1, 2, 3]", "JSON list, not an object"),
    "a JSON number": (b"42", "JSON int, not an object"),
    "a record without our fields": (b'{"host": "h"}', "no 'pid'"),
    "a field of the wrong type": (json.dumps({"host": "h", "pid": "7", "node": "", "start": "", "seq": 1,
                                              "doing": "", "left": None, "culprit": False}).encode(), "'pid' is a str"),
    "a bool for a number": (json.dumps({"host": "h", "pid": True, "node": "", "start": "", "seq": 1, "doing": "",
                                        "left": None, "culprit": False}).encode(), "'pid' is a bool"),
    "nested 60,000 deep": (b"[" * 60000, "JSON nested deeper than Python can read"),
    "8 MiB": (b"{" * (8 << 20), "8,388,608 bytes, more than any value of ours"),
}


@pytest.mark.parametrize("case", GARBAGE)
def test_unreadable_beat_is_named_and_the_heartbeat_lives_on(store: dist.TCPStore, case: str) -> None:
    """Rank 2 never beats, and a stranger's client writes `case` under its key, and under a live rank's (which
    its next beat repairs): the diagnosis names rank 2's beat as unreadable (not "the store does not answer"),
    says nothing of rank 1, and every heartbeat thread still runs."""
    value, said_of_it = GARBAGE[case]
    ranks = _ranks(store, 3, 2)
    stranger = dist.TCPStore("127.0.0.1", store.port, None, False, timedelta(seconds=10))
    stranger.set("2", value)
    stranger.set("1", value)
    said = ranks[0].diagnose()
    assert said.startswith(f"unreadable beat from rank 2 ({said_of_it}"), said
    assert "rank 1" not in said and "\x1b" not in said, said
    assert not ranks[0].store_silent
    assert all(beat.thread.is_alive() for beat in ranks)
    for beat in ranks:
        beat.stop("finished", culprit=False)


def test_text_from_the_store_is_printed_escaped(store: dist.TCPStore) -> None:
    """A record of the right shape whose host and `doing` hold terminal escape sequences (clear the screen, set
    the window title) is quoted with them escaped: no control character of it reaches the message."""
    ranks = _ranks(store, 3, 2)
    forged = {**ranks[0].me, "host": "\x1b]0;owned\x07node9", "seq": 1, "doing": "\x1b[2J\x1b[31mtraining\u202e",
              "left": None, "culprit": False}
    dist.TCPStore("127.0.0.1", store.port, None, False, timedelta(seconds=10)).set("2", json.dumps(forged))
    said = ranks[0].diagnose()
    assert said.startswith("rank 2 (\\x1b]0;owned\\x07node9, pid "), said
    assert said.endswith("its last beat said it was \\x1b[2J\\x1b[31mtraining\\u202e"), said
    assert not any(ord(c) < 32 or c == "\u202e" for c in said), said
    for beat in ranks:
        beat.stop("finished", culprit=False)
