"""The optional packages (pyproject.toml's extras), looked for without importing them: a flag that needs a missing
one is refused at once, in one sentence, before any process starts or torch loads."""

import importlib.util

from .errors import UserError


def require(what: str, packages: tuple[str, ...], extra: str) -> None:
    """Refuse `what` unless every one of `packages` is installed; the sentence names `extra`, which brings them."""
    missing = [p for p in packages if importlib.util.find_spec(p) is None]
    if missing:
        said = f"the {missing[0]} package" if len(missing) == 1 else f"the packages {', '.join(missing)}"
        raise UserError(f"{what} needs {said}: pip install {' '.join(missing)} (or pip install "
                        f"'mnist-ddp[{extra}]').")
