"""The Python API: `train`, `evaluate` and `predict`, the command line's twins, with their results as data.

    from mnist_ddp import train
    run = train(epochs=2, processes=2, dataset="synthetic", out="runs/nb")

Each keyword is a flag of `mnist-ddp <command>` (underscores for dashes, `download=False` is `--no-download`,
`processes=` is `-g/--gpus`), written out as that command line for the command's own parser (`cli.configure`)
and launcher (`cli.run_train`). The caller's own: results as data (results.py), one exception whose traceback
stops at the call, Ctrl-C handlers put back. No torch at import (docs/python-and-notebooks.md).
"""

import argparse
import difflib
import functools
import inspect
import os
import signal
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any, TypeVar, cast

from . import cli
from .common.config import EvalConfig, PredictConfig, TrainConfig
from .common.errors import UserError
from .common.results import Evaluation, Prediction, Run

F = TypeVar("F", bound=Callable[..., Any])
RENAMED = {"gpus": "processes"}  # flag (dest) → keyword, where the flag's name misleads: CPUs have workers too


def keywords(command: str) -> dict[str, argparse.Action]:
    """Every option of `mnist-ddp COMMAND`, by its keyword."""
    return {RENAMED.get(a.dest, a.dest): a for a in cli.command_parser(command)._actions
            if a.option_strings and not isinstance(a, argparse._HelpAction)}


def _flags(keyword: str, action: argparse.Action, value: Any) -> list[str]:
    """One keyword's value as the command line says it; None says nothing (the flag's own default)."""
    if value is None:
        return []
    both_ways = isinstance(action, argparse.BooleanOptionalAction)  # --normalize / --no-normalize
    name = action.option_strings[0 if both_ways else -1]  # the long name: --gpus for -g
    if action.nargs == 0 or (action.nargs == "?" and isinstance(value, bool)):  # switches, and a bare --profile
        if not isinstance(value, bool):
            raise UserError(f"{keyword}= is True or False (the switch {name}), not {value!r}.")
        if both_ways:
            return [action.option_strings[0 if value else 1]]
        return [name] if value == (action.const if action.nargs == 0 else True) else []
    if isinstance(action, argparse._AppendAction):  # --mirror URL, repeatable: one value or several
        return [f"{name}={v}" for v in (value if isinstance(value, list | tuple) else [value])]
    return [f"{name}={value}"]  # one argument, even one that starts with a dash


def command_line(command: str, options: dict[str, Any], positionals: tuple[str, ...] = ()) -> list[str]:
    """The `mnist-ddp` arguments that say what the keywords `options` say."""
    known = keywords(command)
    argv = [command]
    for keyword, value in options.items():
        if keyword not in known:
            renamed = RENAMED.get(keyword)
            near = renamed if renamed in known else next(iter(difflib.get_close_matches(keyword, known, n=1)), None)
            raise UserError(f"{command}() has no keyword {keyword}=" + (f"; did you mean {near}=?" if near else "")
                            + f" (its keywords are the flags of `mnist-ddp {command} --help`, underscores for dashes"
                            + (", and processes= for -g/--gpus)." if command == "train" else ")."))
        argv += _flags(keyword, known[keyword], value)
    return [*argv, "--", *positionals] if positionals else argv


def _user_facing(fn: F) -> F:
    """A `UserError` raised anew from the call, its traceback and chain cut there: its sentence, the one the
    command prints, says what to fix, and the frames below would only hide it (in a notebook, under a page of
    them), and keep the run's objects alive in the kernel's last traceback."""
    @functools.wraps(fn)
    def call(*args: Any, **kwargs: Any) -> Any:
        try:
            return fn(*args, **kwargs)
        except UserError as e:
            error = e
        error.__cause__ = error.__context__ = None
        raise error.with_traceback(None)
    return call  # type: ignore[return-value]


@contextmanager
def _handlers_kept() -> Iterator[None]:
    """The caller's SIGINT and SIGTERM handlers, put back afterwards. The launcher ignores the repeats of a
    signal for good once one came (worker.signals_interrupt), right for a command, which exits next; a kernel
    goes on, and its next interrupt must work."""
    saved = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield
    finally:
        for s, handler in saved.items():
            if handler is not None:  # None: set outside Python, nothing Python can put back
                signal.signal(s, handler)


@_user_facing
def train(**options: Any) -> Run:
    """Train the ConvNet as `mnist-ddp train` does, and return the run: `Run.accuracy`, `.metrics` and `.steps`
    (metrics.jsonl and steps.jsonl), `.checkpoint`, `.best`, `.model` (model.safetensors), `.plots`;
    `.dataframe()`, `.show()`.

    Bad values raise `mnist_ddp.UserError`, and so does a failed worker (naming its rank). Ctrl-C, or a
    notebook's "interrupt kernel", stops every process and raises KeyboardInterrupt; the checkpoint stays."""
    began = time.time()  # the run's `time:` line counts from the call, not from the kernel's start
    cfg = cast(TrainConfig, cli.configure(command_line("train", options)))
    with _handlers_kept():
        try:
            cli.run_train(cfg, began)
            interrupted = False
        except KeyboardInterrupt:
            interrupted = True
    if interrupted:  # raised out here, with nothing of the run's frames attached
        kept = Path(cfg.out) / "checkpoint.pt"
        raise KeyboardInterrupt(f"training interrupted; {kept} keeps the last checkpoint (resume=True continues from "
                                f"it)" if kept.is_file() else "training interrupted before its first checkpoint")
    return Run.load(cfg.out, cfg)


@_user_facing
def evaluate(checkpoint: str | os.PathLike, **options: Any) -> Evaluation:
    """The test metrics of a checkpoint (any ConvNet's, also one saved under DDP), as `mnist-ddp evaluate`
    prints them."""
    cfg = cli.configure(command_line("evaluate", options, (str(checkpoint),)))
    assert isinstance(cfg, EvalConfig)
    from .outputs import infer

    return infer.evaluation(cfg)


@_user_facing
def predict(checkpoint: str | os.PathLike, inputs: Any, **options: Any) -> list[Prediction]:
    """The most likely classes of each image in `inputs`: a path (an image, a folder of them, an IDX file), a
    PIL image, a tensor of 28x28 images ((28, 28), (N, 28, 28) or (N, 1, 28, 28); uint8, or floats in [0, 1]),
    or a list of these. One `Prediction` per image, as `mnist-ddp predict` prints them."""
    import torch
    from PIL import Image

    from .data import images
    from .outputs import infer

    items = list(inputs) if isinstance(inputs, list | tuple) else [inputs]
    for i, item in enumerate(items):
        if not isinstance(item, str | os.PathLike | Image.Image | torch.Tensor):
            raise UserError(f"predict's input {i} is a {type(item).__name__}; it takes paths (an image, a folder, "
                            f"an IDX file), PIL images and tensors.")
    # The files are named as given; an image or tensor by its place among the inputs.
    names = [str(x) if isinstance(x, str | os.PathLike) else f"input {i}" for i, x in enumerate(items)]
    cfg = cli.configure(command_line("predict", options, (str(checkpoint), *names)))
    assert isinstance(cfg, PredictConfig)

    def sources() -> Iterator[tuple[str, torch.Tensor]]:
        for item, name in zip(items, names):
            if isinstance(item, Image.Image):
                yield name, images.from_pil(item)[None]
            elif isinstance(item, torch.Tensor):
                yield name, images.from_tensor(item, name)
            else:
                yield from infer.read_files((name,))
    return list(infer.predictions(cfg, sources()))


def _describe(fn: Callable[..., Any], command: str) -> None:
    """Give `fn` the command's keywords as its signature, and their help in its docstring, for help(), a
    notebook's `fn?` and its completions."""
    parser, actions = cli.command_parser(command), keywords(command)
    formatter = parser._get_formatter()
    leading = [p for p in inspect.signature(fn).parameters.values() if p.kind is not p.VAR_KEYWORD]
    shown = {k: a.default if isinstance(a.default, bool | int | float | str) else None for k, a in actions.items()}
    fn.__signature__ = inspect.signature(fn).replace(parameters=[  # type: ignore[attr-defined]
        *leading, *(inspect.Parameter(k, inspect.Parameter.KEYWORD_ONLY, default=v) for k, v in shown.items())])
    lines = []
    for keyword, a in actions.items():
        said = formatter._expand_help(a) if a.help else ""
        choices = f"one of {', '.join(map(str, a.choices))}" if a.choices else ""
        flags = ", ".join(a.option_strings)
        said_as = f"{keyword}={a.const} ({flags})" if a.nargs == 0 and a.const is not None else f"{keyword} ({flags})"
        lines.append(f"    {said_as}: " + "; ".join(filter(None, (said, choices))))
    fn.__doc__ = f"{fn.__doc__}\n\nKeywords, as `mnist-ddp {command} --help` has them:\n" + "\n".join(lines)


for _fn, _command in ((train, "train"), (evaluate, "evaluate"), (predict, "predict")):
    _describe(_fn, _command)
