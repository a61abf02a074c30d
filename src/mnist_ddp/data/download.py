"""Fetch a file over HTTP(S) so that a failure can never leave a bad file behind: MD5-checked in a temporary file,
then renamed into place; a file lock lets only one of many processes download (docs/design/data-sources.md)."""

import contextlib
import fcntl
import hashlib
import http.client
import os
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path

MOST_BYTES = 64 << 20  # a download: the published files are 10-30 MB; a mirror that sends more is not one


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
    """Download `url` to `dest`, verifying `md5`; `dest` is untouched on any failure."""
    tmp = dest.with_name(f".{dest.name}.part-{os.getpid()}")
    digest = hashlib.md5()
    try:
        with urllib.request.urlopen(url, timeout=timeout) as response, open(tmp, "wb") as out:
            expected_size = response.headers.get("Content-Length")
            size = 0
            while chunk := response.read(1 << 16):
                digest.update(chunk)
                out.write(chunk)
                size += len(chunk)
                if size > MOST_BYTES:
                    raise DownloadError(f"{url}: sent more than {MOST_BYTES:,} bytes, more than the file has")
            out.flush()
            os.fsync(out.fileno())
        if expected_size is not None and size != int(expected_size):
            raise DownloadError(f"{url}: got {size} of {expected_size} bytes (connection cut short)")
        if digest.hexdigest() != md5:
            raise DownloadError(f"{url}: MD5 {digest.hexdigest()} does not match the expected {md5}")
        os.replace(tmp, dest)
    except urllib.error.HTTPError as e:
        raise DownloadError(f"{url}: HTTP {e.code} {e.reason}") from e
    except (urllib.error.URLError, http.client.HTTPException, OSError, ValueError) as e:
        reason = getattr(e, "reason", e)  # urlopen wraps connection errors in a URLError
        if isinstance(reason, TimeoutError):
            reason = f"no answer within --download-timeout {timeout:g} s"
        raise DownloadError(f"{url}: {reason}") from e
    finally:
        tmp.unlink(missing_ok=True)
