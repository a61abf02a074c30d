"""Where the processes of a job meet: node 0's rendezvous store, listening only where the ranks can be, and the
network gloo and NCCL use; every wait is bounded by --timeout (docs/design/rendezvous.md)."""

import errno
import ipaddress
import re
import socket
import struct
import sys
import time
from collections.abc import Mapping
from contextlib import suppress
from datetime import timedelta

import torch.distributed as dist

from ..common import untrusted
from ..common.errors import UserError
from .identity import Identity

WORLD_KEY = "mnist_ddp/world_size"  # the store's host writes the world size here; every joiner compares
# The interfaces gloo and NCCL open their sockets on; set here only where the user has not set them.
SOCKET_IFNAMES = ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME")


def host_store(addr: str, port: int, world_size: int, timeout: timedelta, one_node: bool = True) -> dist.TCPStore:
    """Open the job's rendezvous store on node 0 (port 0: any free port), listening on `listen_address` only.
    Listening fails at once when the port is taken, the clearest moment to say so; the world size is left in
    it for every joiner to check."""
    ip = listen_address(addr, one_node)
    try:
        bound = _bound(ip, port) if ip else None
    except OSError as e:
        if e.errno == errno.EADDRINUSE:
            raise UserError(f"port {port} is already in use on this machine (another job or program listens "
                            f"there); choose another --master-port (or MASTER_PORT).") from None
        if e.errno != errno.EADDRNOTAVAIL:
            raise UserError(f"cannot listen on port {port} of {addr} for the other processes ({e.strerror}); "
                            f"choose another --master-port (or MASTER_PORT).") from None
        bound = None  # not an address of this machine (a public address in front of it): every interface
    _allow_many_connections()
    try:  # TCPStore takes the bound socket over, and closes it with the store
        store = dist.TCPStore(ip if bound and ip else addr, bound.getsockname()[1] if bound else port, world_size,
                              is_master=True, timeout=timeout, wait_for_workers=False,
                              master_listen_fd=bound.detach() if bound else None)
    except (RuntimeError, OSError) as e:
        if "EADDRINUSE" in str(e):
            raise UserError(f"port {port} is already in use on this machine (another job or program listens "
                            f"there); choose another --master-port (or MASTER_PORT).") from e
        raise UserError(f"cannot listen on port {port} of {addr} for the other processes ({error_summary(e)}); "
                        f"choose another --master-port (or MASTER_PORT).") from e
    store.set(WORLD_KEY, str(world_size))
    return store


def listen_address(addr: str, one_node: bool) -> str | None:
    """The address node 0's store listens on: the master address as this machine resolves it; None (every
    interface) for several nodes whose master address is a name that resolves to loopback only here."""
    ip = resolve(addr)
    return None if not one_node and _loopback_by_name(addr, ip) else ip


def _loopback_by_name(addr: str, ip: str) -> bool:
    """Whether `addr` is a host name (not an address written out) that resolves to the loopback address `ip`
    here, as Debian's 127.0.1.1 for the host's own name."""
    try:
        ipaddress.ip_address(addr)
        return False
    except ValueError:
        return ipaddress.ip_address(ip).is_loopback


def open_to_network(ident: Identity) -> bool:
    """Whether processes on other machines can reach this job's store (it spans several, and its master address
    is not a loopback one): there, only the job's secret tells its ranks from strangers."""
    ip = listen_address(ident.master_addr, ident.one_node)
    return not ident.one_node and (ip is None or not ipaddress.ip_address(ip).is_loopback)


def _bound(ip: str, port: int) -> socket.socket:
    """A TCP socket bound to `ip`:`port`, for TCPStore to listen on (it would bind every interface itself)."""
    s = socket.socket(socket.AF_INET6 if ":" in ip else socket.AF_INET, socket.SOCK_STREAM)
    try:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as TCPStore does: a closed job's TIME_WAITs
        s.bind((ip, port))
    except OSError:
        s.close()
        raise
    return s


def _allow_many_connections() -> None:
    """Raise this process's open-file limit to the hard limit, as the store takes one descriptor per connection."""
    if sys.platform == "win32":
        return
    import resource  # POSIX only

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    want = hard if hard != resource.RLIM_INFINITY else max(soft, 1 << 16)
    if soft != resource.RLIM_INFINITY and soft < want:
        with suppress(ValueError, OSError):  # not allowed here: the store works within the soft limit
            resource.setrlimit(resource.RLIMIT_NOFILE, (want, hard))


def resolve(addr: str) -> str:
    """`addr` as an IP address; a name that does not resolve is the user's to fix, said at once on every rank."""
    try:
        return str(socket.getaddrinfo(addr, None, type=socket.SOCK_STREAM)[0][4][0])
    except socket.gaierror as e:
        raise UserError(f"the master address {addr!r} is not a host name this machine can resolve ({e}).") from None


def wait_for_listener(ident: Identity, timeout: timedelta) -> None:
    """Wait until node 0's store accepts connections, polled here (not inside TCPStore) so the wait ends by
    --timeout and names its cause."""
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


def reached(addr: str, port: int, patience: float) -> bool | None:
    """Whether a process listens at `addr`:`port`: True; False when its machine refuses the connection (nobody holds
    the port: the process that held it is gone); None when nothing answers within `patience` seconds (its machine
    is down, frozen or cut off). A plain connect: a TCPStore client would retry for its whole timeout."""
    deadline = time.monotonic() + patience
    while True:
        try:
            with socket.create_connection((addr, port), timeout=max(0.1, min(2.0, deadline - time.monotonic()))):
                return True
        except ConnectionRefusedError:
            return False
        except OSError:
            if time.monotonic() >= deadline:
                return None
            time.sleep(0.2)


def connect(ident: Identity, timeout: timedelta, joining: bool = True) -> dist.Store:
    """A client connection of our own to the job's store, in this attempt's namespace where torchrun's agent hosts
    it. `joining`: counted as one of the world's processes (TCPStore's worker count), as a rank joins once."""
    store = dist.TCPStore(ident.master_addr, ident.master_port, ident.world_size if joining else None,
                          is_master=False, timeout=timeout)
    return dist.PrefixStore(f"mnist_ddp/attempt_{ident.attempt}", store) if ident.store_host == "agent" else store


def joined_store(ident: Identity, timeout: timedelta) -> dist.Store:
    """The rendezvous store: opened here when this is rank 0 and rank 0 hosts it, else joined as a client
    of node 0's (the spawning parent's, rank 0's, or torchrun's agent's)."""
    if ident.store_host == "agent":
        return connect(ident, timeout)
    if ident.store_host == "rank0" and ident.rank == 0:
        return host_store(ident.master_addr, ident.master_port, ident.world_size, timeout, ident.one_node)
    wait_for_listener(ident, timeout)
    store = connect(ident, timeout)
    try:  # anyone who reaches the store can write it; the check-in compares the world size again (membership.py)
        expected = untrusted.count(store.get(WORLD_KEY), "the world size in the store")
    except ValueError:
        expected = ident.world_size
    if expected != ident.world_size:
        raise UserError(f"node 0 started a job of {expected} processes, but this one was told the job has "
                        f"{ident.world_size}; give every node the same -n and -g (or the same number of tasks).")
    return store


def socket_interfaces(ident: Identity, env: Mapping[str, str]) -> dict[str, str]:
    """What to set of GLOO_SOCKET_IFNAME and NCCL_SOCKET_IFNAME (those the user left unset): the interface that
    leads to the master, loopback for a job on one machine."""
    if ident.one_node:
        name = interface_to("127.0.0.1")
    else:
        ip = resolve(ident.master_addr)
        name = None if _loopback_by_name(ident.master_addr, ip) else interface_to(ip)
    if name is None:
        return {}
    # NCCL takes a prefix ("eth" = eth0, eth1, …); "=" asks for exactly this one.
    return {var: value for var, value in zip(SOCKET_IFNAMES, (name, f"={name}")) if var not in env}


def interface_to(addr: str) -> str | None:
    """The network interface (e.g. 'eth0', 'lo') this machine reaches `addr` through; None where that cannot be
    told (not Linux, no route, a name that does not resolve)."""
    if sys.platform != "linux":
        return None
    import fcntl  # POSIX only

    siocgifaddr = 0x8915  # Linux ioctl: the IPv4 address of an interface
    try:
        ip = socket.getaddrinfo(addr, None, socket.AF_INET)[0][4][0]
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


def error_summary(e: BaseException) -> str:
    """A c10d/gloo error's first sentence, without the C++ source location."""
    lines = [line for line in str(e).splitlines() if line.strip()]
    # A collective that fails inside a comm hook's future (reduction.py) comes wrapped in torch's callback error.
    first = re.sub(r"^Got the following error when running the callback: \w+: ", "", lines[0].strip()) if lines else ""
    first = re.sub(r"^\[[^\]]*\]\s*", "", first).split(". ")[0] if lines else type(e).__name__
    return first if len(first) <= 200 else first[:197] + "..."
