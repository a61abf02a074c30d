"""Where a run's lines and progress bar are shown: a process alone, or a rank torchrun/srun/mpirun started, shows
its own; `-g G`'s children send theirs over one pipe (`attach`) to the launcher (`relay`), which shows them, so
they reach a notebook cell too, the bar as a tqdm.auto widget (docs/python-and-notebooks.md). No torch."""

import io
import json
import select
import sys
import threading
import time
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from multiprocessing.connection import Connection, Pipe
from typing import Any, TextIO, TypeVar

T = TypeVar("T")
TICK_S = 0.5  # how often rank 0 reports its bar's position (tqdm's own redraw interval)
STOP_S = 10.0  # after the children are gone, the most the launcher waits for the last of their output
# One message of at most PIPE_BUF bytes is one write(), which the children's writes can never interleave
# with (less Connection's 4-byte length prefix): longer text goes in several.
ATOMIC = select.PIPE_BUF - 4

_launcher: Connection | None = None  # in a child whose output the launcher shows: the pipe's write end


def _progress_bar(**kwargs: Any) -> Any:
    from tqdm.auto import tqdm  # decides once, at its import: a notebook widget or text

    return tqdm(leave=False, dynamic_ncols=True, mininterval=TICK_S, file=sys.stderr, **kwargs)


def bar(items: Iterable[T], total: int, desc: str, initial: int = 0) -> Iterator[T]:
    """`items`, with a progress bar: drawn here, or in a child by its launcher."""
    if _launcher is None:
        yield from _progress_bar(iterable=items, total=total, desc=desc, initial=initial)
        return
    _send(["bar", desc, total, initial])
    done, told = initial, 0.0
    try:
        for item in items:
            yield item
            done += 1
            if time.monotonic() - told >= TICK_S or done == total:
                _send(["tick", done])
                told = time.monotonic()
    finally:
        _send(["end"])


class _ToLauncher(io.TextIOBase):
    """A child's sys.stdout or sys.stderr: its text sent to the launcher line by line, and on every flush (the
    interpreter flushes both on its way out; launch's os._exit does first)."""

    def __init__(self, kind: str, own: TextIO) -> None:
        self.kind, self.own, self.pending = kind, own, ""

    def write(self, text: str) -> int:
        lines, newline, self.pending = (self.pending + text).rpartition("\n")
        if newline:
            _send([self.kind, lines + newline])
        return len(text)

    def flush(self) -> None:
        if self.pending:
            text, self.pending = self.pending, ""
            _send([self.kind, text])

    def fileno(self) -> int:  # for code that writes to the file itself (faulthandler)
        return self.own.fileno()

    @property
    def encoding(self) -> str:  # type: ignore[override]
        return "utf-8"


def attach(launcher: Connection) -> None:
    """In a `-g` child, first thing: from now on the launcher shows what this process prints, and its bar."""
    global _launcher
    _launcher = launcher
    sys.stdout, sys.stderr = _ToLauncher("out", sys.stdout), _ToLauncher("err", sys.stderr)


def _send(message: list[Any]) -> None:
    global _launcher
    data = json.dumps(message).encode()
    if len(data) > ATOMIC and message[0] in ("out", "err") and len(message[1]) > 1:
        half = len(message[1]) // 2
        _send([message[0], message[1][:half]])
        _send([message[0], message[1][half:]])
        return
    if _launcher is not None:
        try:
            _launcher.send_bytes(data)
            return
        except OSError:  # the launcher is gone (forkserver.die_with_launcher is stopping this process)
            _launcher = None
            sys.stdout, sys.stderr = sys.__stdout__, sys.__stderr__
    if message[0] in ("out", "err"):  # what was meant for the launcher goes to this process's own files
        stream = sys.__stdout__ if message[0] == "out" else sys.__stderr__
        if stream is not None:  # None: Python started without it
            stream.write(message[1])


@contextmanager
def relay() -> Iterator[Connection]:
    """In a launcher: the write end of a pipe to hand each child (for `attach`), and a thread here that shows
    what comes through it until the last child has closed its end (exited)."""
    reader, writer = Pipe(duplex=False)
    shower = threading.Thread(target=_show, args=(reader,), name="mnist-ddp-relay", daemon=True)
    shower.start()
    try:
        yield writer
    finally:
        writer.close()  # this process's copy; each child holds its own until it exits
        shower.join(STOP_S)


def _show(reader: Connection) -> None:
    """Print the children's text as it comes, and draw rank 0's bar from its reports."""
    shown = None
    with reader:
        while True:
            try:
                kind, *rest = json.loads(reader.recv_bytes())
            except (EOFError, OSError):  # every child has gone
                break
            if kind in ("out", "err"):
                stream = sys.stdout if kind == "out" else sys.stderr
                stream.write(rest[0])
                stream.flush()
            elif kind == "bar":
                if shown is not None:
                    shown.close()
                desc, total, initial = rest
                shown = _progress_bar(total=total, desc=desc, initial=initial)
            elif kind == "tick" and shown is not None:
                shown.update(rest[0] - shown.n)
            elif kind == "end" and shown is not None:
                shown.close()
                shown = None
    if shown is not None:  # rank 0 died with its bar open
        shown.close()
