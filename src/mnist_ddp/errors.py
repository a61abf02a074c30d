"""The one exception type that means "the user asked for something we cannot do".

Everything that is the user's to fix (a bad flag, a missing or corrupt file, an
unusable environment) raises `UserError` with one clear sentence; the CLI prints
that sentence and exits with code 2. Anything else is a bug and keeps its traceback.
"""


class UserError(Exception):
    """Bad input: printed as one line by the CLI, exit code 2."""

    exit_code = 2
