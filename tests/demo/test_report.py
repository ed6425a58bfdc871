"""The demo report's numbers from hand-made runs: paired gains in points, the t-interval over seeds,
the controls over seeds, the style split, collapses, and the markdown leading with the pass rate."""

from __future__ import annotations

import pytest

from demo.report import markdown, style_split, summarize


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
                "offline": {"candidate": 0.6, "incumbent": 0.5, "incumbent_id": "base"},
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
    shuffled = [run(k, [0.2, 0.4], [0.2, 0.5], shuffled=True) for k in range(3)]
    s = summarize(seeds, shuffled=shuffled)
    r = s["report_split"]
    assert [g["satisfaction"]["points"] for g in r["per_seed"]] == [30.0, 40.0, 20.0]
    assert r["satisfaction_gain_points"] == 30.0
    # sd of (30, 40, 20) is 10; t(0.975, 2) = 4.303: half-width 4.303 * 10 / sqrt(3) = 24.84
    assert r["satisfaction_gain_ci95"] == [5.16, 54.84]  # the report rounds to 2 decimals: exactly these
    assert r["pass_rate_gain_points"] == 50.0  # (0 + 1) / 2 - 0, in points
    sh = s["controls"]["shuffled"]
    assert (
        sh["seeds"] == 3 and sh["satisfaction_gain"]["points"] == 5.0 and sh["satisfaction_gain"]["ci95"] == [5.0, 5.0]
    )
    assert sh["promotions"] == 3 and sh["promotions_worse_than_base"] == 0
    assert "adversarial_5pct" not in s["controls"] and s["candidates"]["collapses"] == []


def test_a_promotion_worse_than_the_base_and_a_collapse_are_counted():
    bad = run(0, [0.2, 0.4], [0.2, 0.4], passed=(0, 0), shuffled=True)
    n = 40
    bad["evaluations"]["base"]["per_task"]["passed"] = [1] * n
    bad["evaluations"]["v0003"]["per_task"]["passed"] = [1] * (n // 2) + [0] * (n // 2)  # -50 points, CI < 0
    bad["versions"][1]["offline"] = {"candidate": 0.40, "incumbent": 0.50, "incumbent_id": "base"}  # 10 points down
    s = summarize([run(0, [0.2, 0.4], [0.5, 0.7])], shuffled=[bad])
    assert s["controls"]["shuffled"]["promotions_worse_than_base"] == 1
    # Counted apart from the seeds' runs: the shuffled control's learner follows noise by design
    assert s["candidates"]["collapses"] == []
    assert s["controls"]["shuffled"]["collapses"] == [{"seed": 0, "version": "v0003", "drop_points": 10.0}]
    md = markdown(s, "x")
    assert "in the seeds' runs: 0; in the shuffled-reward control: 1 (seed 0 v0003 −10.0)" in md
    clean = run(1, [0.2, 0.4], [0.5, 0.7])
    clean["versions"][1]["offline"] = {"candidate": 0.40, "incumbent": 0.50, "incumbent_id": "base"}
    assert summarize([clean])["candidates"]["collapses"] == [{"seed": 1, "version": "v0003", "drop_points": 10.0}]


def test_the_offline_evaluations_time_is_summarised_over_every_run():
    runs = [run(k, [0.2, 0.4], [0.5, 0.7], shuffled=k == 2) for k in range(3)]
    for r, secs in zip(runs, (70.0, 95.5, None), strict=True):
        r["versions"][1]["offline"]["seconds"] = secs  # None: a verdict without its timing is left out
    s = summarize(runs[:2], shuffled=runs[2:])
    assert s["candidates"]["offline_evaluation_s"] == {
        "evaluations": 2,
        "median": 82.8,  # (70.0 + 95.5) / 2 = 82.75, rounded half to even
        "min": 70.0,
        "max": 95.5,
        "within_90_s": 1,
    }
    assert "**Offline evaluations** of a candidate" in markdown(s, "x") and "1 of 2 within 90 s" in markdown(s, "x")
    assert summarize(runs[2:])["candidates"]["offline_evaluation_s"] == {"evaluations": 0}


def test_the_satisfaction_gain_splits_into_correctness_and_style():
    # Default users: 0.05 wrong, 0.3 right in another style, 0.9 right in house style: c1 0.25, c2 0.6.
    base = {"passed": [1, 1, 0, 0], "styled": [0, 0, 0, 0]}  # P 0.5, s 0: satisfaction 0.175
    final = {"passed": [1, 1, 1, 0], "styled": [1, 1, 1, 0]}  # P 0.75, s 1: satisfaction 0.7125
    sp = style_split(base, final)
    # correctness: 0.25 * (0.25 + 0.5 * 0.6) = 0.1375; style: 0.625 * 1 * 0.6 = 0.375; total 0.5125
    assert sp == {"correctness_points": 13.75, "style_points": 37.5, "style_share": round(37.5 / 51.25, 3)}
    sat = lambda pt: sum(0.05 + p * 0.25 + t * 0.6 for p, t in zip(pt["passed"], pt["styled"])) / 4  # noqa: E731
    assert round(100 * (sat(final) - sat(base)), 6) == round(sp["correctness_points"] + sp["style_points"], 6)


def test_the_adversarial_cost_is_paired_per_seed_and_the_headline_is_the_pass_rate():
    clean = run(0, [0.2, 0.4], [0.6, 0.8])
    adv = run(0, [0.2, 0.4], [0.5, 0.6], adversarial=0.05)
    s = summarize([clean], adversarial=[adv])
    a = s["controls"]["adversarial_5pct"]
    assert a["satisfaction_cost"]["points"] == 15.0 and a["share"] == 0.05  # ((0.6-0.5) + (0.8-0.6)) / 2
    assert s["report_split"]["satisfaction_gain_ci95"] is None  # one seed: no interval over seeds
    text = markdown(s, "flywheel demo --seeds 1")
    assert "`flywheel demo --seeds 1`" in text and "cost 15.0 points" in text
    assert "**Not run in this report**: the shuffled-reward control." in text
    assert text.index("**Pass rate: +50.0 points**") < text.index("Satisfaction:")
    assert "inconclusive (one seed)" in text
    assert "| v0003 | promoted | 8 | offline passed: pass rate 0.6 | canary: step 1 passed | 200 s |" in text
    assert "leaks found: 0" in text and "| v0003 | 0.99 |" in text
    with pytest.raises(ValueError, match="seed 3 has no clean run"):
        summarize([clean], adversarial=[run(3, [0.2, 0.4], [0.5, 0.6], adversarial=0.05)])


def test_a_report_needs_a_run():
    with pytest.raises(ValueError, match="at least one"):
        summarize([], None, None)


def test_the_poisoning_screen_is_scored_per_update_on_clean_and_adversarial_runs(tmp_path):
    import json

    from demo.system import DemoSystemConfig, poisoning_by_update
    from feedback.events import hash_user

    cfg = DemoSystemConfig(seed=4, users=40, adversarial_share=0.05)  # users 0 and 1 are adversarial
    adv, honest = hash_user("demo", "user-4-1"), hash_user("demo", "user-4-7")

    def update(*users: str) -> str:
        flags = [{"tenant": "demo", "user": u} for u in users]
        return json.dumps({"version": "v", "stats": {"poisoning": {"flags": flags}}})

    log = tmp_path / "updates.jsonl"
    log.write_text("\n".join([update(), update(adv), update(adv, honest), update(honest)]) + "\n")
    p = poisoning_by_update(log, cfg)
    assert p == {"updates": 4, "adversarial_users": 2, "updates_flagging_honest": 2, "updates_flagging_adversarial": 2}
    assert poisoning_by_update(tmp_path / "missing.jsonl", cfg)["updates"] == 0

    clean = run(4, [0.2, 0.4], [0.6, 0.8])
    clean["poisoning"] = {**p, "updates": 10, "updates_flagging_honest": 1}
    bad = run(4, [0.2, 0.4], [0.5, 0.6], adversarial=0.05)
    bad["poisoning"] = p
    s = summarize([clean], adversarial=[bad])["poisoning"]
    assert s["clean"]["share_without_honest_flags"] == 0.9 and s["adversarial"]["share_flagging_adversarial"] == 0.5
    text = markdown(summarize([clean], adversarial=[bad]), "flywheel demo")
    assert "9 of 10 updates of the clean runs flagged no honest user (90%)" in text
    assert "2 of 4 updates of the adversarial runs flagged an adversarial user (50%)" in text


def test_the_gain_on_prompts_of_no_split_is_paired_per_prompt_and_over_seeds():
    runs = [run(0, [0.1, 0.2], [0.3, 0.4]), run(1, [0.1, 0.2], [0.3, 0.4])]
    assert "unsplit_prompts" not in summarize(runs)  # evaluated without them: no section, no zeros
    for r, final in zip(runs, ([1, 1, 0, 1], [1, 0, 0, 1]), strict=True):
        r["evaluations"]["base"]["unsplit"] = {"pass_rate": 0.25, "n": 4, "per_task": {"passed": [1, 0, 0, 0]}}
        r["evaluations"]["v0003"]["unsplit"] = {"pass_rate": 0.5, "n": 4, "per_task": {"passed": final}}
    s = summarize(runs)
    u = s["unsplit_prompts"]
    assert [x["points"] for x in u["per_seed"]] == [50.0, 25.0] and u["pass_rate_gain_points"] == 37.5
    assert u["prompts"] == 4 and u["seeds"] == 2 and u["pass_rate_gain_ci95"][0] < 37.5 < u["pass_rate_gain_ci95"][1]
    assert "**Prompts of no split** (4 per evaluation" in markdown(s, "flywheel demo --report x")


def test_the_diurnal_traffic_runs_a_compressed_day():
    from demo.system import DemoSystemConfig

    day = DemoSystemConfig(concurrency=16, traffic_s=600, diurnal_trough=0.15)
    assert [day.active_clients(t) for t in (0, 150, 300, 450, 600, 900)] == [2, 9, 16, 9, 2, 2]
    assert DemoSystemConfig(concurrency=16).active_clients(0) == 16  # no diurnal: all of them, always


def test_the_lending_pair_is_reported_side_by_side():
    on, off = run(0, [0.1, 0.2], [0.3, 0.4]), run(0, [0.1, 0.2], [0.2, 0.3])
    for r, lending in ((on, True), (off, False)):
        r["config"] |= {"lending": lending, "diurnal_trough": 0.15, "traffic_s": 1800.0}
        r["traffic"]["errors"] = 0
        r["versions"][1]["transitions"].insert(1, {"to": "evaluating", "at": "2026-12-01T16:01:30+00:00", "reason": ""})
    on["lending"] = {"lends": 2.0, "lent_seconds": 95.0, "rollouts": 128.0, "learner_trained_offline": 64.0}
    s = summarize([run(0, [0.1, 0.2], [0.3, 0.4])], lending=(on, off))
    le = s["lending"]
    assert le["on"]["gate_cycles_per_hour"] == 2.0 and le["on"]["promotions_per_hour"] == 2.0  # 1 in half an hour
    assert le["on"]["lending"]["lent_seconds"] == 95.0 and le["off"]["lending"] == {}
    assert le["on"]["pass_rate_gain"]["points"] == 50.0 and le["seed"] == 0
    md = markdown(s, "flywheel demo --report x --controls lending")
    assert "**Lending** (seed 0, diurnal traffic from 15% of the peak" in md and "| on | 2.0 | 2.0 | 50.0" in md
    with pytest.raises(ValueError, match="lending on, then off"):
        summarize([on], lending=(off, on))
