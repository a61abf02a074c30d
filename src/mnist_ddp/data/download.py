"""Fetch a file over HTTP(S) so that a failure can never leave a bad file behind: MD5-checked in a temporary file,
then renamed into place; a file lock lets only one of many processes download (docs/design/data-sources.md)."""

import contextlib
import fcntl
import hashlib
import http.client
import os
import socket
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from types import TracebackType

MOST_BYTES = 64 << 20  # a download: the published files are 10-30 MB; a mirror that sends more is not one
LEAST_RATE = 16 << 10  # bytes a second on average, once twice --download-timeout has passed: a slower mirror is left


class DownloadError(Exception):
    """A download that did not produce a verified file; the message says why."""


@contextlib.contextmanager
def file_lock(path: Path) -> Iterator[None]:
    """Hold an exclusive advisory lock on `path` (created if missing) for the block."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def fetch(url: str, dest: Path, md5: str, timeout: float) -> None:
    """Download `url` to `dest`, verifying `md5`; `dest` is untouched on any failure. Each read waits up to `timeout`,
    and the whole answer, headers included, must keep up LEAST_RATE once `2 × timeout` has passed (`Pace`)."""
    tmp = dest.with_name(f".{dest.name}.part-{os.getpid()}")
    digest = hashlib.md5()
    pace = Pace(timeout)
    try:
        with pace, OPENER.open(url, timeout=timeout) as response, open(tmp, "wb") as out:
            expected_size = response.headers.get("Content-Length")
            while chunk := response.read(1 << 16):
                digest.update(chunk)
                out.write(chunk)
                pace.received += len(chunk)
                if pace.received > MOST_BYTES:
                    raise DownloadError(f"{url}: sent more than {MOST_BYTES:,} bytes, more than the file has")
            out.flush()
            os.fsync(out.fileno())
        pace.check(url)
        if expected_size is not None and pace.received != int(expected_size):
            raise DownloadError(f"{url}: got {pace.received} of {expected_size} bytes (connection cut short)")
        if digest.hexdigest() != md5:
            raise DownloadError(f"{url}: MD5 {digest.hexdigest()} does not match the expected {md5}")
        os.replace(tmp, dest)
    except urllib.error.HTTPError as e:
        raise DownloadError(f"{url}: HTTP {e.code} {e.reason}") from e
    except (urllib.error.URLError, http.client.HTTPException, OSError, ValueError) as e:
        pace.check(url)
        reason = getattr(e, "reason", e)  # urlopen wraps connection errors in a URLError
        if isinstance(reason, TimeoutError):
            reason = f"no answer within --download-timeout {timeout:g} s"
        raise DownloadError(f"{url}: {reason}") from e
    finally:
        tmp.unlink(missing_ok=True)


class Pace:
    """One download's clock: past its first `2 × timeout` seconds (a silent server's read times out first) it must
    have received LEAST_RATE bytes a second on average since `timeout`, or a watcher thread shuts its connections, the
    headers' included: a mirror that drips its answer a byte at a time never lets a read time out. The connections
    are those `OPENER` makes in this thread."""

    def __init__(self, timeout: float) -> None:
        self.timeout, self.received, self.late = timeout, 0, False
        self.connections: list[socket.socket] = []
        self.done = threading.Event()
        self.start = time.monotonic()

    def __enter__(self) -> "Pace":
        _watching.pace = self
        threading.Thread(target=self._watch, name="download pace", daemon=True).start()
        return self

    def __exit__(self, kind: type[BaseException] | None, e: BaseException | None, tb: TracebackType | None) -> None:
        self.done.set()
        _watching.pace = None

    def _watch(self) -> None:
        while not self.done.wait(0.1):
            took = time.monotonic() - self.start
            if took > 2 * self.timeout and self.received < LEAST_RATE * (took - self.timeout):
                self.late = True
                for connection in self.connections:
                    with contextlib.suppress(OSError):
                        connection.shutdown(socket.SHUT_RDWR)  # the blocked read returns now
                return

    def check(self, url: str) -> None:
        """DownloadError if the watcher shut the download for being too slow."""
        if self.late:
            raise DownloadError(f"{url}: sent {self.received:,} bytes in {time.monotonic() - self.start:.1f} s, "
                                f"slower than {LEAST_RATE >> 10} KiB/s once twice --download-timeout "
                                f"{self.timeout:g} s had passed")


_watching = threading.local()  # .pace: the download this thread is making


class _Watched(http.client.HTTPConnection):
    """A connection whose socket its thread's `Pace` may shut."""

    def connect(self) -> None:
        super().connect()
        if pace := getattr(_watching, "pace", None):
            pace.connections.append(self.sock)


class _WatchedSecure(_Watched, http.client.HTTPSConnection):
    """The same over TLS (the context: Python's default, certificates verified)."""


class _Handler(urllib.request.HTTPHandler, urllib.request.HTTPSHandler):
    def http_open(self, req: urllib.request.Request) -> http.client.HTTPResponse:
        return self.do_open(_Watched, req)

    def https_open(self, req: urllib.request.Request) -> http.client.HTTPResponse:
        return self.do_open(_WatchedSecure, req)


OPENER = urllib.request.build_opener(_Handler)
