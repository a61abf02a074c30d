"""The package's shape, which readers rely on: imports run one way, and each DDP essential sits in one place."""

import ast
import re
from pathlib import Path

import mnist_ddp

PACKAGE = Path(mnist_ddp.__file__).parent
BASELINE = {"tutorial", "lesson"}  # the tutorial's pipeline (bench's baseline) and lesson 0: their own DDP on purpose


def _imports() -> dict[str, set[str]]:
    """module -> the package's modules it imports (at any depth of the file)."""
    graph: dict[str, set[str]] = {}
    modules = {p.stem for p in PACKAGE.rglob("*.py")}
    for path in PACKAGE.rglob("*.py"):
        found = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.level:
                named = node.module.split(".") if node.module else []
                found |= {named[-1]} if named and named[-1] in modules else {a.name for a in node.names}
        graph.setdefault(path.stem, set()).update(found & modules - {"__init__"})
    return graph


def test_imports_form_no_cycle() -> None:
    graph, done, path = _imports(), set(), []

    def visit(module: str) -> None:
        assert module not in path, "import cycle: " + " -> ".join([*path[path.index(module):], module])
        if module in done:
            return
        path.append(module)
        for imported in graph.get(module, ()):
            visit(imported)
        path.pop()
        done.add(module)

    for module in graph:
        visit(module)


def test_each_ddp_essential_is_written_once() -> None:
    sources = {p.stem: p.read_text() for p in PACKAGE.rglob("*.py") if p.stem not in BASELINE}
    # set_epoch: torch's own, on the DistributedSampler (the trainer reaches it through ShardedBatches.set_epoch)
    for call in (r"\binit_process_group\(", r"\bDDP\(", r"\bdestroy_process_group\(", r"\bsampler\.set_epoch\(",
                 r"\bDistributedSampler\(", r"\bno_sync\("):
        where = [f"{name}:{text[:m.start()].count(chr(10)) + 1}" for name, text in sources.items()
                 for m in re.finditer(call, text) if not text[:m.start()].rstrip().endswith("def")]
        assert len(where) == 1, (call, where)
