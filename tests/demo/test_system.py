"""The short variant of `flywheel demo`: the whole system (gateway with 2 replicas, joiner, learner,
gate, simulated users over HTTP and the SDK) learns from its users, on prompts it never saw.

Seeded (users, traffic, sampling, the gate) and sized with margin, so that timing alone cannot
flip it: it asserts that at least one version went through the gate (offline and canary) and was
promoted, that satisfaction on 200 report prompts rose by at least 10 points with the lower 95% bound
above 0, that pass rate did not fall, and that no logged completion holds anything of the gate or
report splits.
"""

from __future__ import annotations

import pytest

from demo.report import run_gain
from demo.system import DemoSystemConfig, run_system


@pytest.fixture(scope="module")
def run(small_trained_checkpoint, tmp_path_factory):
    cfg = DemoSystemConfig.quick()
    return run_system(cfg, tmp_path_factory.mktemp("demo") / "home", small_trained_checkpoint, on_line=print)


def _story(run) -> str:
    """Each version's status and the reason of its last transition: what a failure message needs."""
    rows = [
        f"{v['id']} {v['status']}: {v['transitions'][-1]['reason'] if v['transitions'] else ''}"
        for v in run["versions"]
    ]
    return "\n".join(rows)


@pytest.mark.slow
def test_the_loop_promotes_through_the_gate(run):
    assert len(run["promotions"]) >= 2, _story(run)  # the base, then at least one trained version
    promoted = [v for v in run["versions"] if v["id"] in run["promotions"][1:]]
    for v in promoted:
        steps = [t["to"] for t in v["transitions"]]
        assert steps[:2] == ["candidate", "evaluating"] and "canary" in steps and "awaiting_approval" in steps, steps
        assert v["offline_passed"] is True
        approvals = [t for t in v["transitions"] if t["to"] == "promoted"]
        assert approvals and approvals[0]["actor"].startswith("key:"), approvals  # through the admin API
    assert run["traffic"]["errors"] == 0 and run["traffic"]["feedback"] > 0


@pytest.mark.slow
def test_users_are_more_satisfied_on_the_report_split(run):
    gain = run_gain(run)
    assert gain["satisfaction"]["n"] >= 200
    assert gain["satisfaction"]["points"] >= 10.0 and gain["satisfaction"]["ci95"][0] > 0, (gain, _story(run))
    assert gain["pass_rate"]["ci95"][1] > 0, gain  # not worse


@pytest.mark.slow
def test_nothing_of_gate_or_report_was_ever_served(run):
    logged = run["logged_prompts"]
    assert logged["completions_logged"] == run["traffic"]["completions"] > 0
    assert logged["leaks"] == []
