"""Stray traffic at a running job, for test_trust.py: `python tests/stray.py HOST PORT MARK [options]`.

What reaches a port on a network now and then, all bounded in count and time, aimed only at HOST: PORT (the
job's rendezvous store) and at the other ports the job's own processes listen on (found in /proc through the
MARK they carry in their environment; `--sweep` also knocks on every port of HOST, for a HOST inside a test's
own network namespace):
  - idle connections, `--idle` of them, held open to the end;
  - a request sent halfway (a store SET whose value never comes), held open;
  - a port scan: connect and close, and random bytes, to every port the job listens on;
  - 8 MiB values written into the job's well-known keys, again and again, as a TCPStore client, and check-ins
    that are none (random bytes, JSON nested ten thousand deep), listed where rank 0 reads them.
Runs until the store is gone, `--seconds` pass or it is killed; prints a line per kind of traffic, for the test.
"""

import argparse
import os
import random
import resource
import socket
import sys
import time
from datetime import timedelta
from pathlib import Path

import torch.distributed as dist

# The keys any reader of mnist-ddp's source knows: the world size, the check-in's nonce, list and progress,
# and the heartbeats of ranks 0 and 1.
KEYS = ("mnist_ddp/world_size", "mnist_ddp/nonce", "mnist_ddp/checkins", "mnist_ddp/admitted",
        "mnist_ddp/heartbeat/0", "mnist_ddp/heartbeat/1")
BIG = 8 << 20  # TCPStore's largest value
VALIDATE, SET = bytes([0]) + 0x3C85F7CE.to_bytes(4, "little"), 1  # from torch's c10d/TCPStoreBackend.hpp


def job_ports(mark: str) -> set[int]:
    """The TCP ports on which processes carrying `mark` listen (in their own network namespace)."""
    needle, ports = f"MNIST_DDP_TEST_MARK={mark}".encode(), set()
    for entry in Path("/proc").iterdir():
        try:
            if not entry.name.isdigit() or needle not in (entry / "environ").read_bytes().split(b"\0"):
                continue
            held = {int(os.readlink(fd)[8:-1]) for fd in (entry / "fd").iterdir()
                    if os.readlink(fd).startswith("socket:[")}
            for table in ("tcp", "tcp6"):
                for line in (entry / "net" / table).read_text().splitlines()[1:]:
                    f = line.split()
                    if f[3] == "0A" and int(f[9]) in held:
                        ports.add(int(f[1].rsplit(":", 1)[1], 16))
        except OSError:  # gone, or not ours to read
            continue
    return ports


def knock(host: str, port: int, payload: bytes = b"") -> bool:
    try:
        with socket.create_connection((host, port), timeout=1) as s:
            if payload:
                s.sendall(payload)
        return True
    except OSError:
        return False


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("host")
    p.add_argument("port", type=int)
    p.add_argument("mark")
    p.add_argument("--idle", type=int, default=1000)
    p.add_argument("--seconds", type=float, default=90)
    p.add_argument("--sweep", action="store_true")
    a = p.parse_args()
    end, rng = time.monotonic() + a.seconds, random.Random(0)
    hard = resource.getrlimit(resource.RLIMIT_NOFILE)[1]
    resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))  # our end of the idle connections
    while not knock(a.host, a.port):
        if time.monotonic() > end:
            sys.exit(f"stray: nothing listened at {a.host}:{a.port}")
        time.sleep(0.005)
    held = []
    for _ in range(a.idle):
        held.append(socket.create_connection((a.host, a.port), timeout=5))
    half = socket.create_connection((a.host, a.port), timeout=5)  # TCPStore's wire: VALIDATE, then a SET cut short
    key = b"mnist_ddp/nonce"
    half.sendall(VALIDATE + bytes([SET]) + len(key).to_bytes(8, "little") + key + (1 << 20).to_bytes(8, "little")
                 + b"x" * 100)
    held.append(half)
    print(f"stray: {a.idle} idle connections and a request sent halfway, held open", flush=True)
    rounds, scanned = 0, set()
    try:
        client = dist.TCPStore(a.host, a.port, None, is_master=False, timeout=timedelta(seconds=30))
        while time.monotonic() < end:
            for key in KEYS:
                client.set(key, rng.randbytes(BIG) if rounds % 2 else b"\0" * BIG)
            token = rng.randbytes(16).hex()  # and a check-in of its own that is none: bytes, or JSON nested deep
            client.set(f"mnist_ddp/checkin/{token}", rng.randbytes(4096) if rounds % 2 else b"[" * 10000)
            client.append("mnist_ddp/checkins", f"{token}\n")
            for port in job_ports(a.mark) | {a.port}:
                knock(a.host, port)
                knock(a.host, port, rng.randbytes(rng.randint(1, 65536)))
                scanned.add(port)
            rounds += 1
            if rounds == 1:
                print("stray: 8 MiB values written into the job's keys; knocking, and sending random bytes",
                      flush=True)
            if rounds == 2 and a.sweep:
                found = [port for port in range(1, 65536) if knock(a.host, port)]
                print(f"stray: swept every port of {a.host}: {len(found)} open", flush=True)
            time.sleep(0.3)
    except (RuntimeError, OSError):  # the job is over, and its store with it
        print("stray: the job's store is gone", flush=True)
    print(f"stray: {rounds} rounds, at ports {sorted(scanned)}", flush=True)


if __name__ == "__main__":
    main()
