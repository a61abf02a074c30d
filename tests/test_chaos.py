"""A fixed sample of the fault campaign (tests/chaos.py, `make chaos`), so that CI runs each kind of trial: a rank
lost under --recover, a full disk and then a damaged checkpoint before the resume, a node lost on two machines
(network namespaces). Each must keep its contract; and the check of a contract must be able to fail (a control)."""

import os
from dataclasses import replace

import pytest

import chaos
from chaos import Fault, Trial, World
from procfs import needs_proc

pytestmark = needs_proc

WORLD = World(1, 2, recover=True, bitwise=True)  # one undisturbed run (world 2) serves every trial
TRIALS = {
    "a worker killed": Trial(0, 0, WORLD, (Fault("worker", "SIGKILL", at=0.3, which=1),)),
    "the disk full, then checkpoint.pt damaged": Trial(0, 1, WORLD, (Fault("disk", at=0.3),
                                                                    Fault("checkpoint.pt", "flipped", at=0.9))),
    "node 1's launcher killed": Trial(0, 2, replace(WORLD, nodes=2, gpus=1), (Fault("launcher", "SIGKILL", at=0.3),)),
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
    trial = TRIALS[name]
    result = campaign.run(trial)
    print(f"{trial} -> {result.story}")
    assert result.outcome == "ok", f"{trial}: {result.story}"
    # the first fault must land while the run trains (a Ctrl-C to stop it before a damaged file may find it stopped)
    assert trial.faults[0].kind not in result.missed, f"{trial}: it came after the run's last save: {result.story}"
    assert result.finished == (trial.faults[0].target != "disk"), result.story  # only the full disk stops it


def test_the_check_can_fail(campaign: chaos.Campaign) -> None:
    """Control: the output of the first trial against its undisturbed run, and against one with other bytes."""
    out = campaign.keep / "trial-0" / "run" / "out"
    if not out.is_dir():
        campaign.run(TRIALS["a worker killed"])
    ref = campaign.ref(WORLD)
    assert chaos.differs(out, True, ref) == ""
    assert "saved other weights" in chaos.differs(out, True, replace(ref, digest="0" * 64))
    assert "ended at" in chaos.differs(out, True, replace(ref, progress={"epoch": 3, "consumed": 0}))
