"""Tests only: where a rank of a --recover run is lost on purpose (`LOSE_VAR`), so that a test can land the loss at
an exact point of the loop rather than at a moment in time.

`LOSE_VAR` holds "R:S[:POINT][:SIGNAL][:launcher]" items, comma-separated: the process that was rank R of the first
world sends SIGNAL (SIGKILL unless named) to itself, or to its launcher (the store's host, for node 0's ranks), at
POINT once S optimizer steps of the run are done. The points (extended.py), in the order an epoch's end passes them:
"fold" (the fold after step S begins: after an epoch's last step), "folded" (its all-reduce done, before rank 0
writes the steps it added up), "evaluation", "save" (before rank 0's checkpoint and best.pt; with --checkpoint-every,
before each of its saves too), "saved" (before the all-reduce that ends an epoch under --recover), and "step" (where
step S + 1 begins: the default; after an epoch's last step, the next epoch's first).
"""

import multiprocessing
import os
import signal
from collections.abc import Mapping
from dataclasses import dataclass

LOSE_VAR = "MNIST_DDP_TEST_LOSE"
POINTS = ("step", "fold", "folded", "evaluation", "save", "saved")


@dataclass(frozen=True)
class Loss:
    point: str
    step: int
    pid: int
    signal: signal.Signals


def planned(env: Mapping[str, str], rank: int) -> list[Loss]:
    """This rank's losses in `env` (malformed items are a test's error: they raise ValueError)."""
    launcher = multiprocessing.parent_process()
    found = []
    for item in (item.strip() for item in env.get(LOSE_VAR, "").split(",")):
        if not item:
            continue
        r, step, *rest = item.split(":")
        unknown = set(rest) - set(POINTS) - {"launcher"} - set(signal.Signals.__members__)
        if unknown:
            raise ValueError(f"{LOSE_VAR}: {item!r} names {sorted(unknown)}")
        if int(r) != rank:
            continue
        point = next((word for word in rest if word in POINTS), "step")
        sig = next((signal.Signals[word] for word in rest if word in signal.Signals.__members__), signal.SIGKILL)
        pid = (launcher.pid if "launcher" in rest and launcher else None) or os.getpid()
        found.append(Loss(point, int(step), pid, sig))
    return found


class LossPlan:
    """The losses planned for this rank; `reached` sends each one's signal where its point and step come."""

    def __init__(self, env: Mapping[str, str], rank: int) -> None:
        self.losses = planned(env, rank)

    def reached(self, point: str, steps_done: int) -> None:
        for loss in self.losses:
            if (loss.point, loss.step) == (point, steps_done):
                self.losses.remove(loss)  # once: a SIGTERM unwinds, it is not sent again where the run goes back
                os.kill(loss.pid, loss.signal)
                return
