"""The exception types that end a run with one line instead of a traceback.

Everything that is the user's to fix (a bad flag, a missing or corrupt file, an
unusable environment) raises `UserError` with one clear sentence; the CLI prints
that sentence and exits with code 2. Failures of the job rather than of its input
subclass it with exit code 1. Anything else is a bug and keeps its traceback.
"""


class UserError(Exception):
    """Bad input: printed as one line by the CLI, exit code 2."""

    exit_code = 2


class WriteFailed(UserError):
    """An output of the run could not be written (a full disk, a quota): not bad input, so exit code 1."""

    exit_code = 1
