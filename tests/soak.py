"""Run the test modules that start real processes over and over, to find the races a single run misses.

`make soak` (not part of CI; `SOAK=N` rounds, `SOAK_MODULES="faults stops"` a subset). Each round runs each
module in its own pytest, bounded by `--limit` seconds: past it the run is a hang, killed with every process it
started. The output of every failed or hung run is kept in one folder, printed at the end with one summary line.
(Not `test_soak.py`: that one is a test, 20 back-to-back runs inside one pair of processes.)
"""

import argparse
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
import uuid
from collections import Counter
from contextlib import suppress
from pathlib import Path

TESTS = Path(__file__).resolve().parent
# Every module whose tests start processes that talk to each other (or a kernel, or a fresh install).
MODULES = ("faults", "stops", "resume", "trust", "heartbeat", "multinode", "launch_paths", "real_slurm", "real_mpi",
           "notebook", "base_install", "bitwise", "accumulate", "recovery", "graphstep")
RUN_VAR = "MNIST_DDP_SOAK_RUN"  # every process one module run starts inherits it: what a hang's kill looks for
SETTLE_S = 10.0  # after pytest returns, how long what it started gets to end before it counts as left behind


def run_pids(run: str) -> list[int]:
    """Live processes (any session, any namespace this machine's /proc shows) started by soak run `run`."""
    needle = f"{RUN_VAR}={run}".encode()
    found = []
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        try:
            if needle in Path(entry.path, "environ").read_bytes().split(b"\0") and \
                    Path(entry.path, "stat").read_text().rsplit(")", 1)[1].split()[0] != "Z":
                found.append(int(entry.name))
        except OSError:  # gone, or not ours to read
            continue
    return found


def kill_run(run: str) -> list[int]:
    """SIGKILL every process of `run`; the pids that were there."""
    pids = run_pids(run)
    for pid in pids:
        with suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    return pids


def skipped(log: Path) -> int:
    """How many tests pytest's last line in `log` says it skipped (a skip proves nothing: the summary counts them)."""
    found = re.findall(r"(\d+) skipped", log.read_text(errors="replace").rstrip().rsplit("\n", 1)[-1])
    return int(found[0]) if found else 0


def run_module(module: str, limit: float, log: Path) -> str:
    """One pytest of tests/test_<module>.py, output to `log`: 'passed', 'failed' or 'hung'."""
    run = uuid.uuid4().hex
    with open(log, "wb") as out:
        proc = subprocess.Popen([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                                 str(TESTS / f"test_{module}.py")], cwd=TESTS.parent, stdout=out,
                                stderr=subprocess.STDOUT, env=os.environ | {RUN_VAR: run}, start_new_session=True)
        try:
            rc = proc.wait(limit)
        except subprocess.TimeoutExpired:
            rc = None
        deadline = time.monotonic() + SETTLE_S
        while rc is not None and run_pids(run) and time.monotonic() < deadline:
            time.sleep(0.2)
        left = kill_run(run)
        proc.wait()
    with open(log, "a") as out:
        if rc is None:
            out.write(f"\nsoak: hung: still running after {limit:g} s; killed {len(left)} processes\n")
        elif left:
            out.write(f"\nsoak: {len(left)} processes still there {SETTLE_S:g} s after pytest returned: {left}\n")
    text = log.read_text(errors="replace")
    if rc is None or "Timeout (>" in text:  # the soak's bound, or pytest-timeout's per-test one
        return "hung"
    return "passed" if rc == 0 and not left else "failed"


def main(argv: list[str] | None = None) -> int:
    """Run the soak; exit 0 when every run passed, 1 otherwise, 2 for an unknown module."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=3, help="how many times each module runs (default: 3)")
    parser.add_argument("--modules", default="", help="names without test_, space-separated (default: all of "
                        f"{' '.join(MODULES)})")
    parser.add_argument("--limit", type=float, default=1800, help="seconds one module's run may take before it "
                        "counts as a hang and is killed (default: 1800)")
    parser.add_argument("--keep", type=Path, help="where failed runs' output goes (default: a new temp folder)")
    args = parser.parse_args(argv)
    modules = args.modules.split() or list(MODULES)
    unknown = [m for m in modules if not (TESTS / f"test_{m}.py").is_file()]
    if unknown or args.rounds < 1:
        print(f"soak: error: {'no test module ' + ', '.join(unknown) if unknown else '--rounds must be at least 1'} "
              f"(modules: {' '.join(MODULES)}).", file=sys.stderr)
        return 2
    keep = args.keep or Path(tempfile.mkdtemp(prefix="mnist-ddp-soak-"))
    keep.mkdir(parents=True, exist_ok=True)
    tally: dict[str, Counter] = {m: Counter() for m in modules}
    for round_ in range(1, args.rounds + 1):
        for module in modules:
            log = keep / f"{module}-round{round_}.log"
            started = time.monotonic()
            outcome = run_module(module, args.limit, log)
            tally[module][outcome] += 1
            tally[module]["skipped"] += (skips := skipped(log))
            print(f"soak: round {round_}/{args.rounds} test_{module}: {outcome} ({time.monotonic() - started:.0f} s"
                  f"{f', {skips} skipped' if skips else ''}){f', output in {log}' if outcome != 'passed' else ''}",
                  flush=True)
            if outcome == "passed":
                log.unlink()
    failed, hung, skips = (sum(t[k] for t in tally.values()) for k in ("failed", "hung", "skipped"))
    detail = ", ".join(f"{m} {t['failed']}/{t['hung']}" for m, t in tally.items())
    print(f"soak: {len(modules)} modules x {args.rounds} rounds: {failed} failed, {hung} hung, {skips} tests skipped "
          f"(failed/hung per module: {detail}); failed runs' output in {keep}")
    return 0 if failed + hung == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
