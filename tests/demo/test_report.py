"""The demo report's numbers from hand-made runs: paired gains in points, the t-interval over seeds,
the controls, and the markdown naming the command."""

from __future__ import annotations

import pytest

from demo.report import markdown, summarize


def run(seed: int, base: list[float], final: list[float], passed=(0, 1), adversarial=0.0, shuffled=False) -> dict:
    evals = {
        "base": {"per_task": {"satisfaction": base, "passed": [0, 0]}},
        "v0003": {"per_task": {"satisfaction": final, "passed": list(passed)}},
    }
    for e in evals.values():
        sat = e["per_task"]["satisfaction"]
        e.update(satisfaction=sum(sat) / 2, satisfaction_ci95=[0, 1], pass_rate=0.5, pass_rate_ci95=[0, 1], n=2)
    return {
        "config": {"seed": seed, "adversarial_share": adversarial, "shuffle_rewards": shuffled},
        "promotions": ["base", "v0003"],
        "evaluations": evals,
        "wall_s": 60.0,
        "traffic": {"completions": 10, "feedback": 5},
        "versions": [
            {
                "id": "base",
                "parent": None,
                "status": "superseded",
                "learner": {},
                "transitions": [{"to": "promoted", "at": "2026-12-01T16:00:00+00:00", "reason": "cold start"}],
            },
            {
                "id": "v0003",
                "parent": "base",
                "status": "promoted",
                "learner": {"ratio_mean": 0.99, "clip_frac": 0.01},
                "transitions": [
                    {"to": "candidate", "at": "2026-12-01T16:01:00+00:00", "reason": "learner update 8"},
                    {"to": "canary", "at": "2026-12-01T16:02:00+00:00", "reason": "offline passed: pass rate 0.6"},
                    {"to": "awaiting_approval", "at": "2026-12-01T16:03:00+00:00", "reason": "canary: step 1 passed"},
                    {"to": "promoted", "at": "2026-12-01T16:03:20+00:00", "reason": "approved"},
                ],
            },
        ],  # fmt: skip
        "logged_prompts": {"completions_logged": 10, "distinct_prompts": 9, "leaks": []},
    }


def test_gains_are_paired_per_prompt_and_averaged_over_seeds():
    seeds = [run(0, [0.2, 0.4], [0.5, 0.7]), run(1, [0.2, 0.4], [0.6, 0.8]), run(2, [0.2, 0.4], [0.4, 0.6])]
    s = summarize(seeds, shuffled=run(0, [0.2, 0.4], [0.2, 0.5], shuffled=True), adversarial=None)
    r = s["report_split"]
    assert [g["satisfaction"]["points"] for g in r["per_seed"]] == [30.0, 40.0, 20.0]
    assert r["satisfaction_gain_points"] == 30.0
    # sd of (30, 40, 20) is 10; t(0.975, 2) = 4.303: half-width 4.303 * 10 / sqrt(3) = 24.84
    assert r["satisfaction_gain_ci95"] == [5.16, 54.84]  # the report rounds to 2 decimals: exactly these
    assert r["pass_rate_gain_points"] == 50.0  # (0 + 1) / 2 - 0, in points
    assert s["shuffled_control"]["satisfaction_gain_points"] == 5.0
    assert "adversarial_5pct" not in s


def test_the_adversarial_cost_is_paired_against_seed_zero():
    clean = run(0, [0.2, 0.4], [0.6, 0.8])
    adv = run(0, [0.2, 0.4], [0.5, 0.6], adversarial=0.05)
    s = summarize([clean], shuffled=None, adversarial=adv)
    a = s["adversarial_5pct"]
    assert a["satisfaction_cost_points"] == 15.0 and a["share"] == 0.05  # ((0.6-0.5) + (0.8-0.6)) / 2
    assert s["report_split"]["satisfaction_gain_ci95"] is None  # one seed: no interval over seeds
    text = markdown(s, "flywheel demo --seeds 1")
    assert "`flywheel demo --seeds 1`" in text and "Cost of 5% adversarial users: 15.0 points" in text
    assert "| v0003 | promoted | 8 | offline passed: pass rate 0.6 | canary: step 1 passed | 200 s |" in text
    assert "leaks found: 0" in text and "| v0003 | 0.99 |" in text


def test_a_report_needs_a_run():
    with pytest.raises(ValueError, match="at least one"):
        summarize([], None, None)
