"""Mutation testing where the logic is pure: `make mutate` (not part of CI; docs/testing.md).

For each module whose logic decides bytes or safety and whose own tests are fast and run in one process, mutmut
changes the code one small way at a time (an operator, a number, a condition) and runs only those tests: a change
no test notices is a *surviving* mutant, a gap in the tests or a change that cannot matter (an equivalent mutant,
named in `EQUIVALENT` with the reason). Each module runs in a copy of the checkout (mutmut writes `mutants/`), so
the working tree is never changed. Prints a line per module and the survivors not known to be equivalent; the
score is (killed + timed out) / (all - equivalent).
"""

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
MUTMUT = shutil.which("mutmut") or str(Path(sys.executable).parent / "mutmut")

# module (a file name under src/mnist_ddp) -> its own tests, as pytest arguments (in-process only: a mutant is
# switched on in the pytest process, so a test that starts a fresh interpreter would run the unmutated code)
TARGETS: dict[str, list[str]] = {
    "inputfile.py": ["tests/test_inputfile.py"],
    "idx.py": ["tests/test_idx.py", "-k", "not cli"],
    "untrusted.py": ["tests/test_untrusted_values.py"],
    "schedule.py": ["tests/test_schedule.py"],
    "batches.py": ["tests/test_batches.py", "tests/test_sharding.py"],
    "checkpoint.py": ["tests/test_checkpoint.py"],
}
# mutant name, without its package ("module.function__mutmut_N") -> why no test can tell it from the original
_UNREACHABLE_KIND = "the default kind: every file type besides a regular file and a link (followed) is in _KINDS"
EQUIVALENT: dict[str, str] = {
    "inputfile.x_read__mutmut_24": "how much one os.read asks for: the bytes read are the same",
    "inputfile.x_read__mutmut_25": "how much one os.read asks for: the bytes read are the same",
    "inputfile.x_open_regular__mutmut_14": "os.open's OSError always has a strerror",
    "inputfile.x_read__mutmut_33": "os.read's OSError always has a strerror",
    "inputfile.x_open_regular__mutmut_22": _UNREACHABLE_KIND,
    "inputfile.x_open_regular__mutmut_24": _UNREACHABLE_KIND,
    "inputfile.x_open_regular__mutmut_26": _UNREACHABLE_KIND,
    "inputfile.x_open_regular__mutmut_27": _UNREACHABLE_KIND,
    "inputfile.x_open_regular__mutmut_34": "O_NONBLOCK does not change a regular file's reads (Linux)",
    "untrusted.x_text__mutmut_8": "bytes.decode's default codec is UTF-8",
    "untrusted.x_text__mutmut_13": "'UTF-8' and 'utf-8' name one codec",
    "untrusted.x_text__mutmut_11": "the cut only bounds the bytes decoded: printable cuts at `limit` anyway",
    "schedule.x_one_cycle__mutmut_1": "at done = WARMUP both branches give (peak, MOMENTUM_LOW)",
    "checkpoint.x_digest__mutmut_3": ".to(None) of a CPU tensor: the same tensor (only a GPU's would tell)",
    "checkpoint.x_digest__mutmut_19": "the values a weights-only load gives differ in repr wherever in type",
    "checkpoint.x_load_latest__mutmut_16": "strips what rstrip('.') does: no sentence ends in X",
    "checkpoint.x_load_latest__mutmut_29": "strips what rstrip('.') does: no sentence ends in X",
}


def short(mutant: str) -> str:
    """A mutant's name without its package: "mnist_ddp.common.idx.x_read__mutmut_3" -> "idx.x_read__mutmut_3"."""
    return ".".join(mutant.split(".")[-2:])


def run(module: str, tests: list[str], work: Path) -> dict:
    """mutmut over `module` with `tests`, in a copy of the checkout under `work`; its stats and its survivors."""
    tree = work / module.removesuffix(".py")
    source = next((REPO / "src").rglob(module)).relative_to(REPO)
    shutil.copytree(REPO / "src", tree / "src", ignore=shutil.ignore_patterns("__pycache__", "*.egg-info"))
    shutil.copytree(REPO / "tests", tree / "tests", ignore=shutil.ignore_patterns("__pycache__"))
    config = (REPO / "pyproject.toml").read_text() + f"""
[tool.mutmut]
source_paths = ["{source.as_posix()}"]
also_copy = ["src/mnist_ddp"]
pytest_add_cli_args_test_selection = {json.dumps(tests)}
pytest_add_cli_args = ["-p", "no:randomly", "-p", "no:cacheprovider", "-q"]
max_children = {os.cpu_count() or 1}
"""
    (tree / "pyproject.toml").write_text(config)
    env = os.environ | {"PYTHONPATH": "src"}  # inside mutants/: its src, whatever is installed
    subprocess.run([MUTMUT, "run"], cwd=tree, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    subprocess.run([MUTMUT, "export-cicd-stats"], cwd=tree, env=env, capture_output=True)
    stats = json.loads((tree / "mutants" / "mutmut-cicd-stats.json").read_text())
    listed = subprocess.run([MUTMUT, "results"], cwd=tree, env=env, capture_output=True, text=True).stdout
    stats["survivors"] = [m for m, status in re.findall(r"^\s*(\S+): (\w+)", listed, re.M) if status == "survived"]
    stats["diffs"] = {m: subprocess.run([MUTMUT, "show", m], cwd=tree, env=env, capture_output=True,
                                        text=True).stdout for m in stats["survivors"] if short(m) not in EQUIVALENT}
    return stats


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--only", default="", help="comma-separated modules (default: every one in TARGETS)")
    a = p.parse_args(argv)
    modules = [m for m in TARGETS if not a.only or m in a.only.split(",")]
    totals = {"total": 0, "caught": 0, "equivalent": 0}
    with tempfile.TemporaryDirectory(prefix="mutate-") as work:
        for module in modules:
            s = run(module, TARGETS[module], Path(work))
            caught = s["killed"] + s["timeout"] + s["segfault"]
            equivalent = sum(short(m) in EQUIVALENT for m in s["survivors"])
            score = caught / max(1, s["total"] - equivalent)
            print(f"{module:14s} {s['total']:4d} mutants: {caught} caught, {len(s['survivors'])} survived "
                  f"({equivalent} equivalent), {s['no_tests']} not reached by its tests; score {score:.1%}",
                  flush=True)
            for m, diff in s["diffs"].items():
                print(f"  survived: {m}\n" + "".join(f"    {line}\n" for line in diff.splitlines()[-12:]))
            totals["total"] += s["total"]
            totals["caught"] += caught
            totals["equivalent"] += equivalent
    score = totals["caught"] / max(1, totals["total"] - totals["equivalent"])
    print(f"mutate: {totals['total']} mutants over {len(modules)} modules, {totals['caught']} caught, "
          f"{totals['equivalent']} equivalent; score {score:.1%}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
