"""--recover's successor to a lost store (successor.py), tried by strangers: survivors take a standby store only
once its host answered their challenge with the job's secret. One process hosts six stores on loopback, as six
different hosts would: two of the job's standbys (one for each test that takes one over, so that no test depends
on another's), a stranger's with another secret, another run's with the same secret, a
plain TCPStore that answers nothing, and a socket that speaks no TCPStore; the survivor's side is this process.
The whole run (node 0's launcher lost, node 1's taking over) is in test_recovery.py."""

import json
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import suppress
from datetime import timedelta

import pytest
import torch.distributed as dist

from conftest import cli_env
from mnist_ddp.core.distributed import PeerFailure
from mnist_ddp.joining import membership, rendezvous
from mnist_ddp.joining.identity import Identity
from mnist_ddp.recovery import successor
from procfs import free_port

SECRET, RUN = b"the job's secret", {"seed": "3", "world": "2"}
HOSTS = """
import json, socket, sys
from datetime import timedelta
import torch.distributed as dist
from mnist_ddp.recovery import successor
from mnist_ddp.joining.membership import Credentials
secret, run, timeout = sys.argv[1].encode(), json.loads(sys.argv[2]), timedelta(seconds=60)
standbys = {"the job's launcher": successor.Standby("127.0.0.1", 2, Credentials(secret, run), timeout),
            "the job's other launcher": successor.Standby("127.0.0.1", 2, Credentials(secret, run), timeout),
            "a stranger with another secret": successor.Standby("127.0.0.1", 2, Credentials(b"a guess", run), timeout),
            "another run with the same secret": successor.Standby("127.0.0.1", 2, Credentials(secret, {"seed": "4"}),
                                                                  timeout)}
plain = dist.TCPStore("127.0.0.1", 0, 2, is_master=True, wait_for_workers=False)
raw = socket.create_server(("127.0.0.1", 0))
ports = {name: s.where[1] for name, s in standbys.items()}
print(json.dumps({**ports, "a TCPStore that answers nothing": plain.port, "no TCPStore": raw.getsockname()[1]}),
      flush=True)
sys.stdin.read()
for s in standbys.values():
    s.close()
"""


@pytest.fixture(scope="module")
def hosts() -> Iterator[dict[str, int]]:
    """The six stores' ports, while their process runs: each test that takes a job's standby over takes its own."""
    p = subprocess.Popen([sys.executable, "-c", HOSTS, SECRET.decode(), json.dumps(RUN)], stdin=subprocess.PIPE,
                         stdout=subprocess.PIPE, env=cli_env())
    try:
        assert p.stdout is not None
        yield json.loads(p.stdout.readline())
    finally:
        p.communicate(timeout=30)


def _survivor(line: list[successor.Seat]) -> successor.Succession:
    """Rank 3 (node 3) of a four-node job whose store (node 0's) is gone, with `line` as its line of succession."""
    ident = Identity(rank=3, world_size=4, store_host="parent", master_addr="127.0.0.1", master_port=free_port())
    s = successor.Succession(ident, membership.Credentials(SECRET, RUN), timeout=60, patience=0.5)
    s.line = line
    return s


def test_the_job_s_standby_is_taken_and_holds_its_port(hosts: dict[str, int]) -> None:
    """The standby that answers with the job's secret is the successor; its port was taken at launch, so no
    stranger can bind it meanwhile (not even asking the kernel to share it)."""
    port = hosts["the job's launcher"]
    s = _survivor([(1, "127.0.0.1", port)])
    with socket.socket() as stranger, pytest.raises(OSError, match="Address already in use"):
        stranger.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        stranger.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        stranger.bind(("127.0.0.1", port))
    store, where, said = s.take_over(time.monotonic() + 10)
    assert where == ("127.0.0.1", port) and s.host == 1 and s.ended == {0}
    assert said == f"node 0's launcher, which held the rendezvous store, is gone: node 1's (127.0.0.1:{port}) holds " \
                   f"it now"
    store.set("mnist_ddp/successor/at/3", "{}")  # the store the survivor goes on with


@pytest.mark.parametrize("host", ["a stranger with another secret", "another run with the same secret",
                                  "a TCPStore that answers nothing", "no TCPStore"])
def test_a_store_whose_host_cannot_prove_the_secret_is_refused(hosts: dict[str, int], host: str) -> None:
    """A stranger on the successor's port (it could be there only after the launcher ended) is refused in one
    sentence, and the survivors stop rather than skip it for the next in line: others might not have."""
    port = hosts[host]
    s = _survivor([(1, "127.0.0.1", port), (2, "127.0.0.1", hosts["the job's launcher"])])
    with pytest.raises(PeerFailure) as refused:
        s.take_over(time.monotonic() + 1.5)
    assert str(refused.value).startswith(f"rank 3 refused the store at 127.0.0.1:{port} as node 1's successor to the "
                                         f"lost rendezvous store: its host did not prove that it holds the job's "
                                         f"secret"), refused.value
    assert s.host == 0


def _silent() -> tuple[socket.socket, list[socket.socket]]:
    """A port that answers nothing, as a machine that is down or cut off: its listen queue is full, so the kernel
    drops further connection requests instead of refusing them."""
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(0)
    queued = []
    for _ in range(2):
        c = socket.socket()
        c.settimeout(0.3)
        with suppress(TimeoutError):
            c.connect(server.getsockname())
        queued.append(c)
    return server, queued


def test_an_ended_launcher_is_skipped_and_a_silent_store_stops_the_job(hosts: dict[str, int]) -> None:
    """A standby whose port refuses connections (its launcher ended too) is passed over for the next; a store that
    does not answer at all may be behind a cut cable, so the job stops; with nobody left in line, too."""
    s = _survivor([(1, "127.0.0.1", free_port()), (2, "127.0.0.1", hosts["the job's other launcher"])])
    _, where, said = s.take_over(time.monotonic() + 10)
    assert where[1] == hosts["the job's other launcher"] and s.ended == {0, 1} and "node 2's" in said
    server, queued = _silent()
    try:
        with pytest.raises(PeerFailure, match=r"found the rendezvous store at 127\.0\.0\.1:\d+ silent .* so the job "
                                              r"stops"):
            s.gone(server.getsockname())
    finally:
        for sock in (server, *queued):
            sock.close()
    with pytest.raises(PeerFailure, match="no other node's launcher is left to take it over"):
        _survivor([(1, "127.0.0.1", free_port())]).take_over(time.monotonic() + 10)


def test_a_retired_standby_leaves_no_successor_to_a_rank_that_wakes_late() -> None:
    """Once a rank of its node finished the run, the launcher retires its standby: a rank presumed lost that wakes
    after the store's host ended must find the port refused (the node's launcher counts as ended, and the rank
    stops), not a store at which to re-form alone. The control: the same standby answers before it is retired."""
    standby = successor.Standby("127.0.0.1", 2, membership.Credentials(SECRET, RUN), timedelta(seconds=30))
    where = standby.where
    assert rendezvous.reached(*where, 5.0) is True
    standby.retire()
    assert rendezvous.reached(*where, 5.0) is False
    standby.retire()  # a child finishing the run seen by a second wait: nothing left to do
    standby.close()  # what the launcher's `finally` then calls: nothing left to do


def test_a_standby_told_the_run_finished_stops_a_rank_that_wakes_late() -> None:
    """With -g 1 no rank of a frozen rank's node finishes, so its launcher cannot retire the standby: rank 0 tells
    every standby the run finished (`Succession.finish`), and a rank that wakes later stops there in one sentence.
    The control: a word of a finish not signed with the job's secret is ignored, and that standby is taken over."""
    creds = membership.Credentials(SECRET, RUN)
    told, forged = (successor.Standby("127.0.0.1", 2, creds, timedelta(seconds=30)) for _ in range(2))
    try:
        rank0 = _survivor([(1, *told.where)])
        rank0.finish()
        stranger = dist.TCPStore(*forged.where, is_master=False, timeout=timedelta(seconds=5))
        stranger.set(successor.FINISHED, successor.finish_mark(membership.Credentials(b"a guess", RUN), forged.where))
        with pytest.raises(PeerFailure, match=r"^rank 3 was presumed lost, and the run finished without it"):
            _survivor([(1, *told.where)]).take_over(time.monotonic() + 10)
        _, where, _ = _survivor([(1, *forged.where)]).take_over(time.monotonic() + 10)
        assert where == forged.where
    finally:
        told.close()
        forged.close()
