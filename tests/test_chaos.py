"""A fixed sample of the fault campaign (tests/chaos.py, `make chaos`), so that CI runs each kind of fault at least
once: a worker killed, frozen a while and interrupted as it starts; Ctrl-C and a damaged checkpoint before the
resume; a full disk; the store's host stopped; on two machines (network namespaces) a node's launcher killed and
the cable cut a while. Each must keep its contract, land while the run trains (a fault that came after the run's
end is tried once more, its timing measured again), and end as its case says; and the judge is fed made-up broken
jobs and must call each broken."""

import json
import os
import re
import shutil
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest

import chaos
from chaos import Fault, Trial, World
from procfs import marked_env, needs_proc

pytestmark = needs_proc

WORLD = World(1, 2, recover=True, bitwise=True)  # one undisturbed run (world 2) serves most trials
PLAIN = World(1, 2, recover=False, bitwise=True)  # and one without --recover, where a lost store host stops the job
NODES = replace(WORLD, nodes=2, gpus=1)
# Each kind of fault at least once, and how the first run must end: finished as undisturbed (True), stopped
# (False), or either (None: a fault before the first step may stop the run or not).
TRIALS = {
    "a worker killed": (Trial(0, 0, WORLD, (Fault("worker", "SIGKILL", at=0.3, which=1),)), True),
    "Ctrl-C, then checkpoint.pt damaged": (Trial(0, 1, WORLD, (Fault("checkpoint.pt", "flipped", at=0.5),)), False),
    "the disk full": (Trial(0, 2, WORLD, (Fault("disk", at=0.3),)), False),
    "node 1's launcher killed": (Trial(0, 3, NODES, (Fault("launcher", "SIGKILL", at=0.3),)), True),
    "the store's host stopped (SIGTERM)": (Trial(0, 4, PLAIN, (Fault("store host", "SIGTERM", at=0.4),)), False),
    "a worker frozen a while": (Trial(0, 5, WORLD, (Fault("worker", "SIGSTOP", at=0.3, lasts=0.3, which=1),)), True),
    "a worker interrupted as it starts": (Trial(0, 6, WORLD, (Fault("worker", "SIGINT", at=0.5, start_up=True),)),
                                          None),
    "the cable cut a while": (Trial(0, 7, NODES, (Fault("link", at=0.3, lasts=0.3),)), True),
}


@pytest.fixture(scope="module")
def campaign(tmp_path_factory: pytest.TempPathFactory) -> chaos.Campaign:
    """Trials keep their folders here, also when they kept their contract (the control reads one)."""
    if os.geteuid() != 0 or not chaos.can_make_namespaces():
        pytest.skip("the trials mount a tmpfs and make network namespaces, which needs root and iproute2")
    where = tmp_path_factory.mktemp("chaos")
    return chaos.Campaign(where, refs=where / "refs.json", keep_all=True)


@pytest.mark.parametrize("name", list(TRIALS))
def test_a_trial_keeps_its_contract(campaign: chaos.Campaign, name: str) -> None:
    trial, finishes = TRIALS[name]
    result = campaign.run(trial)
    if result.outcome == "ok" and trial.faults[0].kind in result.missed:  # once: the undisturbed run timed again
        print(f"{trial} -> {result.story}; the undisturbed run's times are stale, trying once more")
        campaign.retime(trial.world)
        result = campaign.run(trial)
    print(f"{trial} -> {result.story}")
    assert result.outcome == "ok", f"{trial}: {result.story}"
    # the fault must land while the run trains (or starts): a Ctrl-C after the last save would find nothing to stop
    assert trial.faults[0].kind not in result.missed, f"{trial}: it came after the run's last save: {result.story}"
    assert "to damage" not in result.story, result.story  # a damaged-file trial found its file
    assert finishes is None or result.finished == finishes, result.story


def test_the_check_can_fail(campaign: chaos.Campaign) -> None:
    """Control: the output of the first trial against its undisturbed run, and against one with other bytes."""
    out = campaign.keep / "trial-0" / "run" / "out"
    if not out.is_dir():
        campaign.run(TRIALS["a worker killed"][0])
    ref = campaign.ref(WORLD)
    assert chaos.differs(out, True, ref) == ""
    assert "saved other weights" in chaos.differs(out, True, replace(ref, digest="0" * 64))
    assert "ended at" in chaos.differs(out, True, replace(ref, progress={"epoch": 3, "consumed": 0}))
    twice = ref.steps[:67] + ref.steps[66:]  # epoch 1's last step trained again
    assert "trained other steps (" in chaos.differs(out, True, replace(ref, steps=twice))
    other = [dict(line, train_samples=line["train_samples"] + 18) for line in ref.record]
    said = chaos.differs(out, True, replace(ref, record=other, digest="0" * 64))  # all that differs, not the first
    assert "wrote another metrics record (epoch 1: " in said and "epoch 2: " in said and "saved other weights" in said


def _made_up(campaign: chaos.Campaign, tmp_path: Path, log: str, codes: list[int]) -> chaos.Job:
    """A job that never ran: trial 0's kept output, with the words `log` and the exit `codes` given here."""
    out = campaign.keep / "trial-0" / "run" / "out"
    if not out.is_dir():
        campaign.run(TRIALS["a worker killed"][0])
    job = chaos.Job(TRIALS["a worker killed"][0], tmp_path, out, {}, ())
    job.procs, job.codes = [None], codes  # type: ignore[list-item]  (said() counts the nodes, nothing more)
    job.log(0).write_text(log)
    return job


KILLED = "recover: rank 1 (pid 7) was lost at epoch 1, step 9; 1 process re-formed as generation 1 in 0.2 s\n"
BROKEN_JOBS = {
    "a traceback": (KILLED + "Traceback (most recent call last):\n  File x\nValueError: y\n", [0], None),
    "two error lines": ("mnist-ddp: error: one.\nmnist-ddp: error: two.\n", [1], None),
    "exit 0 with other bytes": (KILLED, [0], "0" * 64),
    "no recover: line": ("final: test accuracy 50.00%\n", [0], None),
}


@pytest.mark.parametrize("kind", ["kept", *BROKEN_JOBS])
def test_the_judge_calls_each_broken_job_broken(campaign: chaos.Campaign, tmp_path: Path, kind: str) -> None:
    """The judge of a trial's first run, fed made-up jobs: trial 0's (a worker killed under --recover, finished)
    as it was is kept; with a traceback, two error lines, other bytes at exit 0, or no `recover:` line, broken."""
    log, codes, digest = BROKEN_JOBS.get(kind, (KILLED, [0], None))
    job = _made_up(campaign, tmp_path, log, codes)
    trial = job.trial
    ref = campaign.ref(WORLD)
    landed = [chaos.Landed(trial.faults[0], [7], {1})]
    verdict = campaign._judge(trial, job, chaos.contract(trial, landed), landed,
                              replace(ref, digest=digest) if digest else ref)
    assert (verdict is None) == (kind == "kept"), verdict
    assert verdict is None or verdict[0] == chaos.BROKEN


def test_no_recover_line_is_owed_where_no_rank_was_gone_from_the_run(campaign: chaos.Campaign,
                                                                     tmp_path: Path) -> None:
    """A rank whose launcher was killed as the run ended may finish its part before it notices: the record shows
    every epoch trained by the whole world, and no `recover:` line is owed. The same job whose record shows the
    world shrunk (trial 0's, as it was) is broken without the line (test above)."""
    job = _made_up(campaign, tmp_path, "final: test accuracy 50.00%\n", [0])
    whole = tmp_path / "out"
    shutil.copytree(job.out, whole)
    lines = [json.loads(line) for line in (whole / "metrics.jsonl").read_text().splitlines()]
    assert any(m["world_size"] < WORLD.size for m in lines)  # trial 0's run went on without its lost rank
    (whole / "metrics.jsonl").write_text("".join(json.dumps(m | {"world_size": WORLD.size}) + "\n" for m in lines))
    job.out = whole
    landed = [chaos.Landed(job.trial.faults[0], [7], {1})]
    assert campaign._judge(job.trial, job, chaos.contract(job.trial, landed), landed, campaign.ref(WORLD)) is None


def test_a_process_left_behind_is_found(tmp_path: Path) -> None:
    """What the judge asks after a job ends: a process that carries the job's marker, still there after the
    settling time, is found (and one that ended is not)."""
    env, _ = marked_env()
    gone = subprocess.Popen(["true"], env=env)
    gone.wait()
    # Popen returns at exec's point of no return, before /proc shows the new environment: wait for a word
    stays = subprocess.Popen([sys.executable, "-c", "import time; print('ready', flush=True); time.sleep(60)"],
                             env=env, stdout=subprocess.PIPE, text=True)
    try:
        assert stays.stdout is not None and stays.stdout.readline() == "ready\n"
        assert chaos._left_behind(env) == [stays.pid]
    finally:
        stays.kill()
        stays.wait()
    assert chaos._left_behind(env) == []


@pytest.mark.parametrize("how", ["SIGINT", "SIGKILL"])
def test_every_node_interrupted_may_say_so(how: str) -> None:
    """-n 2 -g 1 --recover, node 0's launcher (the store's host) and then node 1's both sent `how`: nobody is left
    to go on, and each launcher's one line may say it was interrupted where the signal was an interrupt (seed
    2803331399, trial 22), not where it was SIGKILL (the control)."""
    trial = Trial(0, 0, NODES, (Fault("store host", how, at=0.1), Fault("launcher", how, at=0.9)))
    landed = [chaos.Landed(f, [7], {0} if f.target == "store host" else {1}) for f in trial.faults]
    expect = chaos.contract(trial, landed)
    says = "|".join(s.says for s in expect.stops if s.says)
    assert bool(re.search(says, "mnist-ddp: interrupted.")) == (how == "SIGINT"), says
    assert re.search(says, "mnist-ddp: error: rank 1 lost contact with the other processes (x); y."), says
