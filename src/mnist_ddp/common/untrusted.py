"""What another process wrote is input, not data we made: read it as such.

Whoever reaches a job's rendezvous store can set any key in it (the TCPStore has no authentication), and a
process that reaches a rank could pose as its peer. So every value we read from the store is parsed here
— JSON or a number, of the shape we wrote, of a size we could have written — and any text of it is made
printable before it can reach a terminal: a stranger's escape sequences must not repaint a user's screen or
forge a line of our output. A value that fails is *unreadable*, said as such; it never raises anything but
ValueError, so a reader (the heartbeat thread) never dies of it. Nothing here unpickles: see distributed.py
for how ranks share what rank 0 read, as bytes.
"""

import json
import unicodedata
from collections.abc import Mapping
from typing import Any

MAX_VALUE = 64 * 1024  # bytes: far more than any value of ours in the store (a beat is ~200)
_HIDDEN = ("Cc", "Cf", "Zl", "Zp")  # control and format characters: escape sequences, bidi overrides, line breaks


def printable(text: str, limit: int = 300) -> str:
    """`text` with every control or format character written as an escape (ESC as \\x1b), cut to `limit`."""
    shown = "".join(ascii(c)[1:-1] if unicodedata.category(c) in _HIDDEN else c for c in text[:limit])
    return shown + ("…" if len(text) > limit else "")


def text(raw: bytes, limit: int = 300) -> str:
    """Bytes from elsewhere as printable text: UTF-8 where it is, escapes (\\x80) for the bytes that are not."""
    return printable(raw[:limit * 4].decode("utf-8", errors="backslashreplace"), limit)


def parse(raw: bytes) -> Any:
    """`raw` as JSON. Raises ValueError saying it is not, quoting its start, printably."""
    try:
        return json.loads(raw)
    except ValueError:  # JSONDecodeError, and UnicodeDecodeError for bytes that are not UTF-8
        raise ValueError(f"not JSON: '{text(raw, 40)}'") from None
    except RecursionError:  # [[[[…: json's parser recurses once per level
        raise ValueError("JSON nested deeper than Python can read") from None


def record(raw: bytes, fields: Mapping[str, type | tuple[type, ...]], limit: int = 300,
           most: int = MAX_VALUE) -> dict[str, Any]:
    """`raw` (at `most` so many bytes) as a JSON object holding at least `fields`, each of its type; its text
    fields made printable and cut to `limit`. Raises ValueError saying what is wrong with it, in a few words."""
    if len(raw) > most:
        raise ValueError(f"{len(raw):,} bytes, more than any value of ours")
    obj = parse(raw)
    if not isinstance(obj, dict):
        raise ValueError(f"JSON {type(obj).__name__}, not an object")
    for name, kind in fields.items():
        if name not in obj:
            raise ValueError(f"no {name!r}")
        value = obj[name]
        if not isinstance(value, kind) or (isinstance(value, bool) and bool not in _types(kind)):
            raise ValueError(f"{name!r} is a {type(value).__name__}")
    return {k: printable(v, limit) if isinstance(v, str) else v for k, v in obj.items()}


def _types(kind: type | tuple[type, ...]) -> tuple[type, ...]:
    return kind if isinstance(kind, tuple) else (kind,)


def count(raw: bytes, what: str) -> int:
    """`raw` as a non-negative decimal integer (`what` it is, for the error)."""
    if not (raw.isdigit() and len(raw) <= 9):  # bytes.isdigit: ASCII digits only
        raise ValueError(f"{what} is unreadable: '{text(raw, 40)}' is not a number of ours")
    return int(raw)
