"""A static reading of src/: where collectives are called, and whether every tensor they get is made on the device.

NCCL takes only CUDA tensors on the rank's own GPU; gloo takes CPU tensors too, so a CPU tensor handed to a
collective passes every CPU test and fails on the first GPU. The rule, checked without running anything:

1. torch.distributed's collectives are named (called, or taken as a value) only in HOMES: Dist's methods
   (distributed.py), teardown's barrier, the comm hook's reduction (reduction.py) and the gather of every rank's
   parts (parts.py); everything else goes through Dist (d.all_sum, d.all_gather, d.broadcast, d.gather,
   d.from_main). Code outside any function names none.
2. Every tensor handed to `all_sum` or `Dist.all_gather`, and the `like` that parts.py's `gather`/`all_parts` make
   their rows like, is made on the device. An expression is made on the device when it is
   - a tensor factory call (torch.tensor, torch.zeros, …) with `device=` a `….device` or `device`;
   - the model's own tensors: `.parameters()`, `.buffers()`, `running_stats(…)` (the model was moved to
     d.device when it was built: Trainer), and a DDP gradient bucket's `.buffer()` (DDP keeps it there);
   - the loss of the model's output: `F.cross_entropy(…)` (where the model and its batch are);
   - an operation on such tensors: torch.stack/cat of them, a method of one (`.float()`, `.sum()`, …; not
     `.cpu()`, `.numpy()`, `.tolist()`, `.item()`, and `.to(…)` only to a `….device`), arithmetic with them,
     an element of one, either branch of a conditional;
   - a name or attribute whose every assignment (and every `.append`) is made on the device, a parameter whose
     every caller passes one, or a call of a function or method whose every `return` is;
   - a field of tensors of a dataclass of src/ (`s.loss_sum`: `Stretch`'s) that every construction, assignment
     and `.append` gives one (a list field's tuples: their element at that place; a construction that copies the
     field itself adds nothing).
   Anything else — a literal, a value from outside src/, a path the reading cannot follow — fails, fail-closed.
"""

import ast
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

COLLECTIVES = {"all_reduce", "broadcast", "all_gather", "gather", "reduce_scatter", "reduce", "all_to_all", "scatter",
               "barrier", "monitored_barrier", "all_gather_into_tensor", "reduce_scatter_tensor", "all_to_all_single",
               "send", "recv", "isend", "irecv", "broadcast_object_list", "gather_object", "all_gather_object",
               "scatter_object_list", "batch_isend_irecv", "all_gather_single", "reduce_scatter_single",
               "gather_single", "gather_into_tensor"}
# (module, function) -> why the tensors a collective gets there are on the rank's device
HOMES = {
    ("distributed", "Dist.all_sum"): "it reduces the tensor its caller made: rule 2 checks every call of all_sum",
    ("distributed", "Dist.all_gather"): "it gathers the tensor its caller made into tensors made like it: rule 2 "
                                        "checks every call of Dist.all_gather",
    ("distributed", "Dist.broadcast"): "its tensors are made on self._wire: the rank's GPU under nccl",
    ("distributed", "Dist.gather"): "its tensors are made on self._wire: the rank's GPU under nccl",
    ("distributed", "Dist.barrier"): "barrier() allocates on the GPU the group is bound to (setup's device_id)",
    ("lesson", "train"): "lesson 0's barrier, the textbook's: on nccl it runs on the GPU the process set (set_device)",
    ("lesson", "evaluate"): "lesson 0's all_reduce, the textbook's: its counts are made with device=device",
    ("distributed", "teardown"): "barrier() allocates on the GPU the group is bound to (setup's device_id)",
    ("reduction", "MeanReduction.reduce"): "DDP's gradient bucket lives on the model's device",
    ("parts", "gather"): "its rows are made like `like` (new_zeros, new_empty): a gradient bucket or the "
                             "model's BatchNorm statistics, on the model's device",
}
FACTORIES = {"tensor", "zeros", "ones", "empty", "full", "arange", "as_tensor", "randn", "rand", "randint", "randperm",
             "linspace", "eye", "frombuffer", "from_numpy", "zeros_like", "ones_like", "empty_like", "full_like"}
OFF_DEVICE = {"cpu", "numpy", "tolist", "item"}
MODEL_STATE = {"parameters", "buffers", "running_stats", "buffer", "cross_entropy"}
ROWS_LIKE = {"gather": 2, "all_parts": 2}  # parts.py's functions -> the argument their tensors are made like
HOW = ("make it on the rank's device (device=d.device, or from the model's tensors); a collective of its own goes "
       "into a Dist method in distributed.py, added to tests/collectives.py's HOMES with the reason its tensors are "
       "on the device")


@dataclass(frozen=True)
class Fn:
    module: str
    qualname: str  # "Class.method" or "function"
    node: ast.FunctionDef


class Source:
    """Every function of the package, for following names, parameters, attributes and calls across them."""

    def __init__(self, files: dict[str, str]) -> None:
        self.fns: list[Fn] = []
        self.trees = {m: ast.parse(text) for m, text in files.items()}
        for module, tree in self.trees.items():
            for node in tree.body:
                if isinstance(node, ast.FunctionDef):
                    self.fns.append(Fn(module, node.name, node))
                elif isinstance(node, ast.ClassDef):
                    self.fns += [Fn(module, f"{node.name}.{f.name}", f) for f in node.body
                                 if isinstance(f, ast.FunctionDef)]

    def named(self, name: str) -> list[Fn]:
        return [f for f in self.fns if f.qualname.split(".")[-1] == name]

    def calls(self) -> list[tuple[Fn, ast.Call]]:
        return [(f, n) for f in self.fns for n in ast.walk(f.node) if isinstance(n, ast.Call)]


def _attr(call: ast.Call) -> str | None:
    return call.func.attr if isinstance(call.func, ast.Attribute) else None


def _is_name(node: ast.expr | None, name: str) -> bool:
    return isinstance(node, ast.Name) and node.id == name


def misplaced_collectives(src: Source) -> list[str]:
    """Rule 1: `dist.<collective>` (called, or taken as a value: an alias would hide a call) outside HOMES."""
    def named(tree: ast.AST) -> list[ast.Attribute]:
        return [n for n in ast.walk(tree) if isinstance(n, ast.Attribute) and n.attr in COLLECTIVES
                and _is_name(n.value, "dist")]
    inside = [(f, n) for f in src.fns for n in named(f.node)]
    seen = {id(n) for _, n in inside}
    outside = [(m, n) for m, tree in src.trees.items() for n in named(tree) if id(n) not in seen]
    return ([f"{f.module}.py:{n.lineno} ({f.qualname}) calls dist.{n.attr}: go through Dist instead, or {HOW}"
             for f, n in inside if (f.module, f.qualname) not in HOMES] +
            [f"{m}.py:{n.lineno} names dist.{n.attr} outside any function: {HOW}" for m, n in outside])


class Reader:
    """Rule 2's reading of one expression; `why` says where it left the device (None: on the device)."""

    def __init__(self, src: Source) -> None:
        self.src, self.seen = src, set()

    def why(self, e: ast.expr, fn: Fn, bound: dict[str, list[tuple[Fn, ast.expr]]] | None = None) -> str | None:
        """None when `e`, read in `fn` (with comprehension variables `bound` to what they run over), is made on
        the device; else where it left it."""
        bound = bound or {}
        where = f"{fn.module}.py:{getattr(e, 'lineno', '?')}"
        key = (fn.qualname, ast.dump(e))
        if key in self.seen:  # followed already (or being followed: a cycle adds nothing)
            return None
        self.seen.add(key)
        if isinstance(e, ast.Call):
            return self._call(e, fn, bound, where)
        if isinstance(e, ast.Name):
            return self._name(e.id, fn, bound, where)
        if isinstance(e, ast.Attribute) and isinstance(e.value, ast.Name) and e.value.id == "self":
            return self._values(self._self_values(fn, e.attr) or self._field(e.attr) or [], fn, where,
                                f"self.{e.attr}")
        if isinstance(e, ast.Attribute) and (values := self._field(e.attr)) is not None:
            return self._values(values, fn, where, f"….{e.attr}")
        if isinstance(e, ast.Subscript | ast.Starred):
            return self.why(e.value, fn, bound)
        if isinstance(e, ast.UnaryOp):
            return self.why(e.operand, fn, bound)
        if isinstance(e, ast.BinOp):
            parts = [p for p in (e.left, e.right) if not isinstance(p, ast.Constant)]
            return next((w for p in parts if (w := self.why(p, fn, bound))), None)
        if isinstance(e, ast.IfExp):
            return self.why(e.body, fn, bound) or self.why(e.orelse, fn, bound)
        if isinstance(e, ast.List | ast.Tuple | ast.Dict):  # containers of tensors (an empty one holds none)
            return next((w for x in (e.values if isinstance(e, ast.Dict) else e.elts)
                         if (w := self.why(x, fn, bound))), None)
        if isinstance(e, ast.ListComp | ast.GeneratorExp | ast.DictComp):
            return self._comprehension(e, fn, bound)
        return f"{where}: {ast.unparse(e)} is not a tensor made on the device"

    def _call(self, e: ast.Call, fn: Fn, bound: dict[str, list[tuple[Fn, ast.expr]]], where: str) -> str | None:
        name = _attr(e) or (e.func.id if isinstance(e.func, ast.Name) else None)
        on_torch = isinstance(e.func, ast.Attribute) and _is_name(e.func.value, "torch")
        if name in MODEL_STATE:
            return None
        if name == "all_sum":  # Dist.all_sum returns the tensor it reduced, in place
            return self.why(e.args[0], fn, bound)
        if on_torch and name in FACTORIES:
            device = next((k.value for k in e.keywords if k.arg == "device"), None)
            ok = (isinstance(device, ast.Attribute) and device.attr == "device") or _is_name(device, "device")
            return None if ok else f"{where}: torch.{name}(…) without device=… makes a CPU tensor"
        if on_torch and name in ("stack", "cat"):
            return self.why(e.args[0], fn, bound)
        if name == "list" and isinstance(e.func, ast.Name):
            return self.why(e.args[0], fn, bound)
        if name in OFF_DEVICE:
            return f"{where}: .{name}() takes the tensor off the device"
        if name == "to":
            target = e.args[0] if e.args else next((k.value for k in e.keywords if k.arg == "device"), None)
            ok = isinstance(target, ast.Attribute) and target.attr == "device"
            return None if ok else f"{where}: .to({ast.unparse(target) if target else ''}) may leave the device"
        if isinstance(e.func, ast.Attribute) and not (isinstance(e.func.value, ast.Name) and e.func.value.id == "self"):
            return self.why(e.func.value, fn, bound)  # a method of a tensor: where the tensor is
        targets = self._methods(fn, name) if isinstance(e.func, ast.Attribute) else self.src.named(name or "")
        returns = [(t, r.value) for t in targets for r in ast.walk(t.node) if isinstance(r, ast.Return) and r.value]
        if not returns:
            return f"{where}: {ast.unparse(e)} returns nothing this reading can follow"
        return next((w for t, r in returns if (w := self.why(r, t))), None)

    def _methods(self, fn: Fn, name: str | None) -> list[Fn]:
        cls = fn.qualname.split(".")[0]
        return [f for f in self.src.fns if f.module == fn.module and f.qualname == f"{cls}.{name}"]

    def _name(self, name: str, fn: Fn, bound: dict[str, list[tuple[Fn, ast.expr]]], where: str) -> str | None:
        if name in bound:  # what the comprehension runs over: one place it is made, or several
            return next((w for owner, expr in bound[name] if (w := self.why(
                expr, owner, {k: v for k, v in bound.items() if k != name} if owner is fn else {}))), None)
        values = [v for node in ast.walk(fn.node)
                  for v in _assigned(node, lambda t: isinstance(t, ast.Name) and t.id == name)]
        if values:
            return self._values(values, fn, where, name)
        params = [a.arg for a in fn.node.args.args]
        if name not in params:
            return f"{where}: {name} comes from outside {fn.qualname}"
        return self._callers(fn, params.index(name), name, where)

    def _callers(self, fn: Fn, index: int, name: str, where: str) -> str | None:
        """A parameter: what every caller in src/ passes for it."""
        method = "." in fn.qualname
        short = fn.qualname.split(".")[-1]
        passed = []
        for caller, call in self.src.calls():
            called = _attr(call) if method else (call.func.id if isinstance(call.func, ast.Name) else None)
            if called != short:
                continue
            position = index - 1 if method else index  # `self` is not passed
            given = next((k.value for k in call.keywords if k.arg == name), None)
            passed.append((caller, given if given is not None else
                           call.args[position] if position < len(call.args) else None))
        if not passed:
            return f"{where}: nothing in src/ calls {fn.qualname}, so where {name} is made is unknown"
        for caller, value in passed:
            if value is None:
                return f"{where}: a caller of {fn.qualname} leaves {name} to its default"
            if why := self.why(value, caller):
                return why
        return None

    def _self_values(self, fn: Fn, attr: str) -> list[tuple[Fn, ast.expr]]:
        """What the class of `fn` assigns to (or appends to) self.<attr>, in any of its methods."""
        cls = fn.qualname.split(".")[0]

        def is_attr(t: ast.expr) -> bool:  # self.<attr>, or self.<attr>[key]
            t = t.value if isinstance(t, ast.Subscript) else t
            return isinstance(t, ast.Attribute) and isinstance(t.value, ast.Name) and t.value.id == "self" \
                and t.attr == attr
        found = []
        for f in self.src.fns:
            if f.module != fn.module or not f.qualname.startswith(cls + "."):
                continue
            for node in ast.walk(f.node):
                found += [(f, v) for v in _assigned(node, is_attr)]
                if isinstance(node, ast.Call) and _attr(node) == "append" and is_attr(node.func.value):
                    found.append((f, node.args[0]))
        return found

    def _field(self, attr: str) -> list[tuple[Fn, ast.expr]] | None:
        """What every construction of the one dataclass of src/ whose field `attr` holds tensors passes for it, and
        every `….attr = v` and `….attr.append(v)` (None: no such field; a copy of the field itself adds nothing)."""
        owners = [c for tree in self.src.trees.values() for c in tree.body if isinstance(c, ast.ClassDef)
                  and any(isinstance(x, ast.AnnAssign) and _is_name(x.target, attr)
                          and "Tensor" in ast.unparse(x.annotation) for x in c.body)]
        if len(owners) != 1:
            return None
        fields = [x for x in owners[0].body if isinstance(x, ast.AnnAssign) and isinstance(x.target, ast.Name)]
        index = next(i for i, x in enumerate(fields) if x.target.id == attr)
        empty = isinstance(fields[index].value, ast.Call) and ast.unparse(fields[index].value) == \
            "field(default_factory=list)"
        found = []

        def other(f: Fn, target: ast.expr) -> bool:  # self.<attr> of another class is that class's own
            return _is_name(target, "self") and f.qualname.split(".")[0] != owners[0].name
        for f, call in self.src.calls():
            if _is_name(call.func, owners[0].name):
                given = next((k.value for k in call.keywords if k.arg == attr), None)
                given = given if given is not None else call.args[index] if index < len(call.args) else None
                if given is None and not empty:
                    found.append((f, ast.Name(f"<{owners[0].name}'s default {attr}>")))
                elif given is not None and not _copies(given, attr):
                    found.append((f, given))
            elif _attr(call) == "append" and isinstance(call.func.value, ast.Attribute) and \
                    call.func.value.attr == attr and not other(f, call.func.value.value):
                found.append((f, call.args[0]))
        for f in self.src.fns:
            for node in ast.walk(f.node):
                found += [(f, v) for v in _assigned(node, lambda t, f=f: isinstance(t, ast.Attribute)
                                                     and t.attr == attr and not other(f, t.value))]
        return found

    def _values(self, values: list, fn: Fn, where: str, what: str) -> str | None:
        if not values:
            return f"{where}: nothing in src/ assigns {what}"
        for v in values:
            owner, expr = v if isinstance(v, tuple) else (fn, v)
            if why := self.why(expr, owner):
                return why
        return None

    def _comprehension(self, e: ast.ListComp | ast.GeneratorExp | ast.DictComp, fn: Fn,
                       bound: dict[str, list[tuple[Fn, ast.expr]]]) -> str | None:
        inner = dict(bound)
        for gen in e.generators:
            if isinstance(gen.target, ast.Name):  # an element of what it runs over
                inner[gen.target.id] = [(fn, ast.Subscript(gen.iter, ast.Constant(0)))]
            elif isinstance(gen.target, ast.Tuple):
                for i, t in enumerate(gen.target.elts):
                    if isinstance(t, ast.Name) and t.id != "_":
                        inner[t.id] = _element(gen.iter, i, self, fn)
        return self.why(e.value if isinstance(e, ast.DictComp) else e.elt, fn, inner)


def _assigned(node: ast.AST, matches: Callable[[ast.expr], bool]) -> list[ast.expr]:
    """The values that statement `node` assigns to a target `matches` accepts (`a, b = x, y` pairs them)."""
    if isinstance(node, ast.Assign):
        pairs = []
        for t in node.targets:
            if isinstance(t, ast.Tuple) and isinstance(node.value, ast.Tuple) and len(t.elts) == len(node.value.elts):
                pairs += zip(t.elts, node.value.elts)
            else:
                pairs.append((t, node.value))
        return [v for t, v in pairs if matches(t)]
    if isinstance(node, ast.AnnAssign) and node.value is not None and matches(node.target):
        return [node.value]
    return []


def _copies(e: ast.expr, attr: str) -> bool:
    """Whether `e` is field `attr` itself, or `list(….attr)`: a copy adds no value the field did not hold."""
    e = e.args[0] if isinstance(e, ast.Call) and _is_name(e.func, "list") and e.args else e
    return isinstance(e, ast.Attribute) and e.attr == attr


def _element(seq: ast.expr, i: int, reader: Reader, fn: Fn) -> list[tuple[Fn, ast.expr]]:
    """Element `i` of the tuples that `seq` (….<attr>) holds, read where they are made: tuples, or lists made of
    tuples (`[(a, b) for …]`: its elements at `i`, the whole list read); `zip(…)`'s: an element of its `i`-th
    argument; else an element of `seq`."""
    if isinstance(seq, ast.Call) and _is_name(seq.func, "zip") and len(seq.args) > i:
        return [(fn, ast.Subscript(seq.args[i], ast.Constant(0)))]
    if isinstance(seq, ast.Attribute):
        made = (reader._self_values(fn, seq.attr) if _is_name(seq.value, "self") else []) or \
            reader._field(seq.attr) or []
        picked = [(f, v.elts[i] if isinstance(v, ast.Tuple) else ast.ListComp(v.elt.elts[i], v.generators))
                  for f, v in made if (isinstance(v, ast.Tuple) and len(v.elts) > i) or
                  (isinstance(v, ast.ListComp) and isinstance(v.elt, ast.Tuple) and len(v.elt.elts) > i)]
        if picked and len(picked) == len(made):
            return picked
    return [(fn, ast.Subscript(seq, ast.Constant(i)))]


def off_device_sums(src: Source) -> list[str]:
    """Rule 2: every `….all_sum(x)` and `….all_gather(x)` call's x (Dist's), and every parts.gather/all_parts call's
    `like`, read back to where it was made."""
    reader = Reader(src)
    found: dict[str, str] = {}  # where a tensor left the device -> the first collective call it reached
    for f, call in src.calls():
        plain = call.func.id if isinstance(call.func, ast.Name) else None
        ours = isinstance(call.func, ast.Attribute) and not _is_name(call.func.value, "dist")  # not torch's own
        at = 0 if ours and _attr(call) in ("all_sum", "all_gather") else ROWS_LIKE.get(plain or "")
        if at is not None and len(call.args) > at:
            reader.seen.clear()
            if (why := reader.why(call.args[at], f)) and why not in found:
                found[why] = (f"{f.module}.py:{call.lineno} ({f.qualname}) reduces a tensor that is not on the "
                              f"device ({why}): {HOW}")
    return list(found.values())


def package(root: Path) -> Source:
    return Source({p.stem: p.read_text() for p in sorted(root.rglob("*.py")) if p.stem != "__init__"})
