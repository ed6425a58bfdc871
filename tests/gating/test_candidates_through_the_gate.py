"""Trained candidates through the real offline gate: a one-family regression is rejected, naming the
family, a candidate trained with half its users adversarial is rejected, and a better candidate passes.

Both are trained from the demo base (`small_trained_checkpoint`, a copy of the shipped one) with the demo's own loop
(`demo.loop.run_demo_loop`: served completions, simulated users' signals, the joiner, policy-gradient
updates) on three families, `add`, `mul` and `max_default`, on the same budget: the better one with honest
users, the regression with `max_default`'s rewards negated (`bench.damaged_candidates.invert_family`). Each is
registered as the learner registers a version (weight-store delta on the published base) and goes through
one `Gate.step` (embedded engine, `weight_store_loader`, the gate split on those families: 48 prompts,
G = 8). Everything is seeded: the loop, the engine's samples and the gate's samples; the base is the
shipped one. The better one's loop also shows the twin's bookkeeping: every served completion is joined
and trained on, and the trainer replays the served log-probabilities bit for bit.
(bench/damaged_candidates.py does the same on the whole suite, with shuffled rewards and adversarial
users too.)
"""

from __future__ import annotations

import pytest

from bench.damaged_candidates import gate_one, half_adversarial, invert_family
from demo.loop import DemoLoopConfig, run_demo_loop
from demo.split import split_tasks
from demo.suite import demo_suite
from gating.gate import GateConfig
from learner.trainer import TrainerConfig

pytestmark = [pytest.mark.slow, pytest.mark.long]  # trains candidates: about 47 s

FAMILIES = ("add", "mul", "max_default")
BROKEN = "max_default"
LOOP = DemoLoopConfig(
    rounds=8, samples_per_round=64, eval_tasks=8, eval_every=8, families=FAMILIES, trainer=TrainerConfig(lr=5e-4)
)
GATE = GateConfig(G=8, n_resamples=200, max_tokens=32)
SUITE = demo_suite(split_tasks("gate", 16 * len(FAMILIES), FAMILIES))


@pytest.fixture(scope="module")
def verdicts(small_trained_checkpoint, tmp_path_factory):
    """One gate step on each candidate, each in a registry of its own."""
    root = tmp_path_factory.mktemp("candidates")
    gate = GATE.model_copy(update={"sample_cache_dir": root / "samples"})  # the base is sampled once, for all three
    out = {}
    adversarial = half_adversarial(LOOP.users, LOOP.seed)
    for name, rewards, users in (
        ("better", None, None),
        ("regression", invert_family(BROKEN), None),
        ("adversarial", None, adversarial),
    ):
        folder = root / name
        out[f"{name}_loop"] = run_demo_loop(
            small_trained_checkpoint, LOOP, rewards=rewards, users=users, save_to=folder
        )
        work = root / f"gate-{name}"
        work.mkdir()
        out[name] = gate_one(small_trained_checkpoint, folder, f"cand-{name}", SUITE, gate, work)
    return out


def test_a_one_family_regression_is_rejected_by_its_family(verdicts):
    step, recorded = verdicts["regression"]
    assert step.action == "rejected" and step.result is not None
    assert (recorded.action, recorded.to_status) == ("reject", "rejected") and "families" in recorded.reason
    assert "families" in recorded.details["failed"], recorded.details["checks"]
    fams = recorded.details["families"]  # the numbers stored with the rejection: the family is named there
    assert not fams[BROKEN]["passed"] and fams[BROKEN]["mean_diff"] < -0.15, fams[BROKEN]
    assert fams[BROKEN]["p_regression"] < 0.05 / len(FAMILIES), fams[BROKEN]  # shown worse, not merely unproven
    assert all(fams[f]["passed"] and fams[f]["mean_diff"] > 0 for f in FAMILIES if f != BROKEN), fams


def test_a_better_candidate_passes_offline(verdicts):
    step, recorded = verdicts["better"]
    assert step.action == "passed" and step.result is not None, recorded.reason
    assert (recorded.action, recorded.to_status) == ("transition", "canary")
    n = step.result.numbers
    assert n["non_inferiority"]["lower_bound"] > 0.0  # better, not merely non-inferior
    assert all(f["passed"] and f["mean_diff"] > 0 for f in n["families"].values()), n["families"]


def test_a_candidate_trained_with_half_its_users_adversarial_is_rejected(verdicts):
    step, recorded = verdicts["adversarial"]
    assert step.action == "rejected" and recorded.to_status == "rejected", recorded.reason
    assert "non_inferiority" in recorded.details["failed"], recorded.details["checks"]


def test_the_loop_trains_on_every_served_completion_and_replays_it_exactly(verdicts):
    report = verdicts["better_loop"]
    rounds = [h for h in report["history"] if h["round"] > 0]
    assert all(h["samples"] == LOOP.samples_per_round for h in rounds)  # every served completion joined and trained
    # Router replay at the behaviour version, batch-invariant numerics in the engine and the trainer (the
    # defaults): the trainer reproduces the served log-probs bit for bit.
    assert max(h["abs_dlogp_max"] for h in rounds) == 0.0
    assert report["joiner"]["late"] == 0 and report["joiner"]["samples"] == LOOP.rounds * LOOP.samples_per_round
