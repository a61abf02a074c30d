"""Where the processes of a job meet: the rendezvous store, and the network gloo uses.

Every multi-process launch starts at a TCP key-value store on node 0 (rank 0's machine):
node 0's spawning parent or rank 0 hosts it, torchrun's agent may host it for us, and every
other process connects to it, finds the others' addresses there and then talks to them
directly. The helpers here make the failure modes of that first contact clear and bounded
by --timeout: a port in use, nobody listening, nodes that disagree on the world size, and
a hostname that resolves to loopback.
"""

import ipaddress
import re
import socket
import struct
import sys
import time
from datetime import timedelta

import torch.distributed as dist

from . import untrusted
from .errors import UserError
from .identity import Identity

WORLD_KEY = "mnist_ddp/world_size"  # the store's host writes the world size here; every joiner compares
ARRIVED = "mnist_ddp/arrived"  # each rank checks in under ARRIVED/<rank> before the process group is made


def host_store(addr: str, port: int, world_size: int, timeout: timedelta) -> dist.TCPStore:
    """Open the job's rendezvous store on node 0 (port 0: any free port). Listening fails at once when the
    port is taken, the clearest moment to say so; the world size is left in it for every joiner to check."""
    resolve(addr)  # else TCPStore's own client would retry the name for minutes, deaf to Ctrl-C
    try:
        store = dist.TCPStore(addr, port, world_size, is_master=True, timeout=timeout, wait_for_workers=False)
    except (RuntimeError, OSError) as e:
        if "EADDRINUSE" in str(e):
            raise UserError(f"port {port} is already in use on this machine (another job or program listens "
                            f"there); choose another --master-port (or MASTER_PORT).") from e
        raise UserError(f"cannot listen on port {port} of {addr} for the other processes ({gist(e)}); "
                        f"choose another --master-port (or MASTER_PORT).") from e
    store.set(WORLD_KEY, str(world_size))
    return store


def resolve(addr: str) -> str:
    """`addr` as an IP address; a name that does not resolve is the user's to fix, said at once on every rank."""
    try:
        return socket.getaddrinfo(addr, None, type=socket.SOCK_STREAM)[0][4][0]
    except socket.gaierror as e:
        raise UserError(f"the master address {addr!r} is not a host name this machine can resolve ({e}).") from None


def wait_for_listener(ident: Identity, timeout: timedelta) -> None:
    """Wait until node 0's store accepts connections. Polling here, not inside TCPStore (whose client
    retries past its own timeout, logging C++ traces), keeps the wait within --timeout and names the cause."""
    addr, port, deadline = ident.master_addr, ident.master_port, time.monotonic() + timeout.total_seconds()
    resolve(addr)
    while True:
        try:
            with socket.create_connection((addr, port), timeout=max(0.1, min(2.0, deadline - time.monotonic()))):
                return
        except OSError:
            if time.monotonic() >= deadline:
                raise UserError(
                    f"rank {ident.rank} found nobody listening at {addr}:{port} within {timeout.total_seconds():g} s "
                    f"(--timeout); start node 0 (the one with rank 0) as well, and give every node the same "
                    f"--master-addr and --master-port."
                ) from None
            time.sleep(0.2)


def connect(ident: Identity, timeout: timedelta, joining: bool = True) -> dist.Store:
    """A client connection of our own to the job's store, in this attempt's namespace: torchrun's agent keeps
    one store for all restarts, so a restarted worker would read the addresses its dead predecessors left
    there and fail to connect (pytorch/pytorch#135712); each attempt gets a namespace of its own.
    `joining`: counted as one of the world's processes (TCPStore's worker count), as a rank joins once."""
    store = dist.TCPStore(ident.master_addr, ident.master_port, ident.world_size if joining else None,
                          is_master=False, timeout=timeout)
    return dist.PrefixStore(f"mnist_ddp/attempt_{ident.attempt}", store) if ident.store_host == "agent" else store


def joined_store(ident: Identity, timeout: timedelta) -> dist.Store:
    """The rendezvous store: opened here when this is rank 0 and rank 0 hosts it, else joined as a client
    of node 0's (the spawning parent's, rank 0's, or torchrun's agent's)."""
    if ident.store_host == "agent":
        return connect(ident, timeout)
    if ident.store_host == "rank0" and ident.rank == 0:
        return host_store(ident.master_addr, ident.master_port, ident.world_size, timeout)
    wait_for_listener(ident, timeout)
    store = connect(ident, timeout)
    expected = untrusted.count(store.get(WORLD_KEY), "the world size in the store")  # anyone can write it
    if expected != ident.world_size:
        raise UserError(f"node 0 started a job of {expected} processes, but this one was told the job has "
                        f"{ident.world_size}; give every node the same -n and -g (or the same number of tasks).")
    return store


def meet(store: dist.Store, ident: Identity, timeout: timedelta) -> None:
    """Wait until every rank has checked in at the store. init_process_group waits for its peers inside C++,
    where Ctrl-C and SIGTERM are not seen until it gives up; polling here keeps a process that waits for
    peers stoppable, and the timeout can say which ranks never came."""
    store.set(f"{ARRIVED}/{ident.rank}", "1")
    keys = [f"{ARRIVED}/{r}" for r in range(ident.world_size)]
    deadline, pause = time.monotonic() + timeout.total_seconds(), 0.01
    while not store.check(keys):
        if time.monotonic() >= deadline:
            missing = [r for r, key in enumerate(keys) if not store.check([key])]
            shown = ", ".join(map(str, missing[:8])) + (" …" if len(missing) > 8 else "")
            raise TimeoutError(f"rank{'s' if len(missing) > 1 else ''} {shown} never arrived")
        time.sleep(pause)
        pause = min(1.0, pause * 1.5)  # a thousand ranks polling node 0's store stay a light load


def gloo_interface(addr: str) -> str | None:
    """The network interface (e.g. 'eth0') this machine reaches `addr` through; None for loopback or unknown.

    Left alone, gloo listens on the address the hostname resolves to, and on many machines (Debian's
    127.0.1.1, containers, network namespaces) that is a loopback address that other nodes cannot reach.
    """
    if sys.platform != "linux":
        return None
    import fcntl  # POSIX only

    siocgifaddr = 0x8915  # Linux ioctl: the IPv4 address of an interface
    try:
        ip = socket.getaddrinfo(addr, None, socket.AF_INET)[0][4][0]
        if ipaddress.ip_address(ip).is_loopback:
            return None
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            s.connect((ip, 9))  # a UDP connect sends nothing: the kernel only picks the route and our address
            local = s.getsockname()[0]
            for _, name in socket.if_nameindex():
                try:
                    answer = fcntl.ioctl(s.fileno(), siocgifaddr, struct.pack("256s", name.encode()[:15]))
                except OSError:  # an interface without an IPv4 address
                    continue
                if socket.inet_ntoa(answer[20:24]) == local:
                    return name
    except OSError:
        pass
    return None


def gist(e: BaseException) -> str:
    """The gist of a c10d/gloo error: its first sentence, without the C++ source location."""
    lines = [line for line in str(e).splitlines() if line.strip()]
    first = re.sub(r"^\[[^\]]*\]\s*", "", lines[0].strip()).split(". ")[0] if lines else type(e).__name__
    return first if len(first) <= 200 else first[:197] + "..."
