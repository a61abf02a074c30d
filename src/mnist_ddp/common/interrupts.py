"""Ctrl-C and SIGTERM held over code that would lose them, and delivered when it ends.

A signal's Python handler runs wherever the main thread's Python code happens to be, and raises its
KeyboardInterrupt there. Inside a bare `except:` the exception is swallowed and the signal is gone: the
process carries on as if nobody had asked it to stop. torch.save's pickler runs such code on every save
(copyreg._slotnames, for each tensor's OrderedDict of hooks: `try: cls.__slotnames__ = names` / `except:
pass`), so now and then a Ctrl-C during a checkpoint save would be lost. `held()` records a signal that
arrives inside it and delivers it, to the handler it would have met, once the block has ended.
"""

import signal
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from types import FrameType

SIGNALS = (signal.SIGINT, signal.SIGTERM)


@contextmanager
def held() -> Iterator[None]:
    """Hold SIGINT and SIGTERM for the block; the first that came is raised again when it ends, however it ends.

    Only signals with a Python handler are held (the default action and SIG_IGN never run Python code), and only
    in the main thread, the one thread whose code a handler interrupts (elsewhere handlers cannot be changed)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    came: list[int] = []
    ended = False
    before: dict[int, Callable[[int, FrameType | None], object]] = {}

    def hold(signum: int, frame: FrameType | None) -> None:
        if ended:  # a block that ended while putting the handlers back: the signal is its handler's at once
            before[signum](signum, frame)
        else:
            came.append(signum)
    for s in SIGNALS:
        handler = signal.getsignal(s)
        if callable(handler):
            before[s] = handler
            signal.signal(s, hold)
    try:
        yield
    finally:
        ended = True
        for signum, handler in before.items():
            signal.signal(signum, handler)
        if came:
            signal.raise_signal(came[0])
