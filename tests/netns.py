"""Two "machines" on one box: two network namespaces joined by a veth pair, for the multi-node tests.

Each namespace has its own interfaces, addresses and ports, so what runs in the two meets only over the
virtual cable, as on real machines. Traffic goes only to the addresses the caller gives the namespaces.
"""

import os
import shutil
import subprocess
from collections.abc import Iterator
from contextlib import contextmanager

import pytest


def _ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True, text=True, timeout=30)


@contextmanager
def netns_pair(tag: str, addrs: tuple[str, str]) -> Iterator[tuple[str, str]]:
    """Namespaces `<tag>-0` and `<tag>-1` with addresses `addrs` (/24) on one veth pair; their names. Always
    deleted afterwards; skips the test, saying why, where they cannot be made (no iproute2, not root)."""
    if shutil.which("ip") is None:
        pytest.skip("the `ip` tool (iproute2) is needed to simulate machines with network namespaces")
    if os.geteuid() != 0:
        pytest.skip("creating network namespaces needs root (run the suite as root, e.g. in a container)")
    names, links = (f"{tag}-0", f"{tag}-1"), (f"{tag}a", f"{tag}b")
    made: list[str] = []
    try:
        for name in names:
            _ip("netns", "add", name)
            made.append(name)
        _ip("link", "add", links[0], "type", "veth", "peer", "name", links[1])
        for name, link, addr in zip(names, links, addrs):
            _ip("link", "set", link, "netns", name)
            _ip("-n", name, "addr", "add", f"{addr}/24", "dev", link)
            _ip("-n", name, "link", "set", "lo", "up")
            _ip("-n", name, "link", "set", link, "up")
    except subprocess.CalledProcessError as e:
        for name in made:
            subprocess.run(["ip", "netns", "del", name], capture_output=True)
        subprocess.run(["ip", "link", "del", links[0]], capture_output=True)
        pytest.skip(f"cannot build network namespaces here: {e.stderr.strip()}")
    try:
        yield names
    finally:  # deleting a namespace also deletes the veth end inside it, and with it the pair
        for name in made:
            subprocess.run(["ip", "netns", "del", name], capture_output=True)
