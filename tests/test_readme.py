"""The README stays a short tour, and its map of the code stays true.

Every relative link in README.md and docs/ must lead to a file that exists (and, for a link into a Markdown file, to
a heading there); every link to a line of a .py file (`file.py#L42`) must land on the `def` or `class` of the symbol
its label names in backticks, e.g. [`distributed.join`](src/mnist_ddp/core/distributed.py#L42) must point at `def
join` at distributed.py's top level (`Trainer.run`: the `def run` in `class Trainer`), and a label that is code,
e.g. [`DDP(model, device_ids=…)`](src/mnist_ddp/core/ddp.py#L30), on a line holding that code up to its first `…`.
So a commit that moves code without moving the links fails here.
"""

import re
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
README = REPO / "README.md"
PAGES = [README, *sorted((REPO / "docs").rglob("*.md"))]
MAX_README_LINES = 300

# [label](target) and ![alt](target); the label may hold one level of brackets, the target no spaces.
LINK = re.compile(r"!?\[((?:[^\[\]]|\[[^\]]*\])*)\]\(([^()\s]+)(?:\s+\"[^\"]*\")?\)")
LINE_ANCHOR = re.compile(r"L(\d+)(?:-L\d+)?")
IDENTIFIER = re.compile(r"[A-Za-z_][\w.]*(\(\))?")  # `mod.name`: its def or class, or a line calling it; else code
EXTERNAL = re.compile(r"^[a-z][a-z0-9+.-]*:", re.I)  # https:, mailto:, …


def _prose(text: str) -> str:
    """The text outside fenced code blocks (links inside them are code, not links)."""
    kept, fenced = [], False
    for line in text.splitlines():
        if line.lstrip().startswith(("```", "~~~")):
            fenced = not fenced
            continue
        kept.append("" if fenced else line)
    return "\n".join(kept)


def links(page: Path) -> list[tuple[str, str]]:
    """(label, target) of every relative link in `page`."""
    return [(m.group(1), m.group(2)) for m in LINK.finditer(_prose(page.read_text()))
            if not EXTERNAL.match(m.group(2))]


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: the rendered text lower-cased, punctuation dropped, spaces to hyphens."""
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading)  # a link renders as its text
    text = text.replace("`", "").replace("*", "").strip().lower()
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


def anchors(page: Path) -> set[str]:
    """Every heading anchor of a Markdown file, with GitHub's -1, -2, … for repeated headings."""
    seen: dict[str, int] = {}
    found = set()
    for line in _prose(page.read_text()).splitlines():
        heading = re.match(r"#{1,6}\s+(.*?)\s*#*\s*$", line)
        if heading:
            base = slug(heading.group(1))
            n = seen.get(base, 0)
            seen[base] = n + 1
            found.add(base if n == 0 else f"{base}-{n}")
    return found


def wrong_owner(lines: list[str], n: int, symbol: str, stem: str) -> str:
    """Why the def or class on line n is not the one `symbol` names by its qualifier ('' where it is): `Class.name`
    must sit in `class Class`, and `module.name`, where `module` is the file's name, at the file's top level."""
    parts = symbol.removesuffix("()").split(".")
    if len(parts) < 2:
        return ""
    owner, line = parts[-2], lines[n - 1]
    indent = len(line) - len(line.lstrip())
    if owner[:1].isupper():
        enclosing = next((m.group(1) for above in reversed(lines[:n - 1]) if (m := re.match(r"class\s+(\w+)", above))
                          and len(above) - len(above.lstrip()) < indent), None) if indent else None
        return "" if enclosing == owner else f"it is not in class {owner}"
    return "" if owner != stem or indent == 0 else f"it is not at {stem}.py's top level"


def _where(path: Path) -> str:
    return str(path.relative_to(REPO)) if path.is_relative_to(REPO) else str(path)


def _all_links() -> list[tuple[Path, str, str]]:
    return [(page, label, target) for page in PAGES for label, target in links(page)]


def test_the_readme_is_a_short_tour() -> None:
    lines = len(README.read_text().splitlines())
    assert lines <= MAX_README_LINES, f"README.md has {lines} lines (at most {MAX_README_LINES}): depth goes in docs/"


@pytest.mark.parametrize("page", PAGES, ids=_where)
def test_every_relative_link_leads_somewhere(page: Path) -> None:
    broken = []
    for label, target in links(page):
        path, _, anchor = target.partition("#")
        file = (page.parent / path).resolve() if path else page
        if not file.exists():
            broken.append(f"[{label}]({target}): no file {_where(file)}")
        elif anchor and file.suffix == ".md" and anchor not in anchors(file):
            broken.append(f"[{label}]({target}): no heading #{anchor} in {_where(file)}")
    assert not broken, f"{_where(page)}:\n  " + "\n  ".join(broken)


def test_every_line_link_lands_on_its_symbol() -> None:
    """[`mod.name`](src/…/mod.py#Ln): line n of that file defines `name` (a def or class, at any indent)."""
    wrong = []
    for page, label, target in _all_links():
        path, _, anchor = target.partition("#")
        line_no = LINE_ANCHOR.fullmatch(anchor)
        if not path.endswith(".py") or not line_no:
            continue
        where = f"{_where(page)}: [{label}]({target})"
        symbol = re.search(r"`([^`]+)`", label)
        if not symbol:
            wrong.append(f"{where}: the label names no symbol in backticks")
            continue
        name = symbol.group(1).removesuffix("()").split(".")[-1]
        file = (page.parent / path).resolve()
        if not file.exists():
            continue  # reported by test_every_relative_link_leads_somewhere
        lines = file.read_text().splitlines()
        n = int(line_no.group(1))
        found = lines[n - 1] if 1 <= n <= len(lines) else "(past the end of the file)"
        code = symbol.group(1).split("…")[0]  # a label that is code: the line holds it, up to its first …
        if not IDENTIFIER.fullmatch(symbol.group(1)) or (code in found and not found.lstrip().startswith("#")):
            if code not in found:
                wrong.append(f"{where}: line {n} is {found.strip()!r}, which does not hold {code!r}")
            continue
        defines = re.compile(rf"\s*(?:async\s+)?(?:def|class)\s+{re.escape(name)}\b")
        if not defines.match(found):
            defined = ", ".join(str(i) for i, line in enumerate(lines, 1) if defines.match(line))
            hint = f"; `{name}` is defined on line {defined}" if defined else f"; no `{name}` in it"
            wrong.append(f"{where}: line {n} is {found.strip()!r}{hint}")
        elif why := wrong_owner(lines, n, symbol.group(1), file.stem):
            wrong.append(f"{where}: line {n} is {found.strip()!r}, but {why}")
    assert not wrong, "links to code that point at the wrong line:\n  " + "\n  ".join(wrong)


def test_the_checks_themselves() -> None:
    """The link parser, the slugs and the symbol rule on known cases, so the tests above cannot pass vacuously."""
    text = "[`distributed.join`](src/a.py#L3), ![x](docs/t.png) [web](https://x.org)\n```\n[no](code.md)\n```"
    found = [(m.group(1), m.group(2)) for m in LINK.finditer(_prose(text))]
    assert found == [("`distributed.join`", "src/a.py#L3"), ("x", "docs/t.png"), ("web", "https://x.org")]
    assert slug("`scaling.py`: how it scales") == "scalingpy-how-it-scales"
    assert slug("Start-up (`startup.py`)") == "start-up-startuppy"
    assert slug("Where DDP lives") == "where-ddp-lives"
    assert IDENTIFIER.fullmatch("distributed.join") and IDENTIFIER.fullmatch("steps.train_step()")
    assert not IDENTIFIER.fullmatch("DDP(model, device_ids=…)") and not IDENTIFIER.fullmatch("if rank == 0:")
    module = ["def run():", "    pass", "class Trainer:", "    def run(self):", "        pass"]
    assert wrong_owner(module, 1, "trainer.run", "trainer") == ""
    assert wrong_owner(module, 4, "Trainer.run", "trainer") == ""
    assert wrong_owner(module, 4, "trainer.run", "trainer")  # the method, where the module's function was named
    assert wrong_owner(module, 1, "Trainer.run", "trainer")  # the function, where the method was named
    assert wrong_owner(module, 4, "self.run", "trainer") == ""  # neither a class nor this module: not checked
    to_code = [t for label, t in links(README) if t.partition("#")[0].endswith(".py") and "#L" in t]
    assert len(to_code) >= 6, f"README.md's map of the DDP essentials links to {len(to_code)} lines of code"
