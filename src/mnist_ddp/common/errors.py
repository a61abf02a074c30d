"""The exception types that end a run with one line instead of a traceback.

Everything that is the user's to fix (a bad flag, a missing or corrupt file, an
unusable environment) raises `UserError` with one clear sentence; the CLI prints
that sentence and exits with code 2. Failures of the job rather than of its input
subclass it with exit code 1. Anything else is a bug and keeps its traceback.
An error that another process of the job must raise too travels as JSON (`relay`), never pickled.
"""

import json

from . import untrusted

LINE = 2000  # characters of an error message shown at most


class UserError(Exception):
    """Bad input: printed as one line by the CLI, exit code 2."""

    exit_code = 2


class WriteFailed(UserError):
    """An output of the run could not be written (a full disk, a quota): not bad input, so exit code 1."""

    exit_code = 1


def last_word(e: UserError | KeyboardInterrupt) -> tuple[str, int]:
    """What the command says on stderr when `e` ends it, and its exit code."""
    if isinstance(e, KeyboardInterrupt):
        return "mnist-ddp: interrupted.", 130
    # One line whatever the message quotes (a file name, a header field, a peer's words): every control
    # character escaped, so nothing from elsewhere can break the line or repaint the terminal.
    return f"mnist-ddp: error: {untrusted.printable(str(e), limit=LINE)}", e.exit_code


def relay(e: UserError, echo: bool = False) -> bytes:
    """`e` as JSON bytes, for another process of the job to raise again (`relayed`): never a pickled exception,
    which the receiver would have to unpickle. `echo`: it only repeats another process's failure."""
    return json.dumps({"message": str(e), "exit_code": e.exit_code, "echo": echo}).encode()


def relayed(raw: bytes) -> tuple[UserError, bool]:
    """`relay`'s bytes as the error to raise here, with its message (made printable) and exit code, and its echo
    flag. ValueError when the bytes are not such an error."""
    said = untrusted.record(raw, {"message": str, "exit_code": int, "echo": bool}, limit=100_000, most=1 << 20)
    if said["exit_code"] not in (1, 2):
        raise ValueError(f"exit code {said['exit_code']}, not one of ours")
    e = UserError(said["message"])
    e.exit_code = said["exit_code"]
    return e, said["echo"]
