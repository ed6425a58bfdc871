"""The staleness mechanism end to end, small: bench/staleness.py's simulation (the real LearnerService,
embedded bus, SQLite registry, served completions, the gate's lifecycle on a compressed clock) with
the tiny checkpoint, a short gate cycle and small updates, so that each cycle holds several updates."""

from bench.staleness import Scenario, simulate
from gating.canary import CanaryConfig

SCENARIO = Scenario("ci", traffic_per_h=3600.0, eval_s=16.0, approval_s=16.0, window_s=1.0, tick_s=16.0, users=200)
CANARY = CanaryConfig(min_step_s=16.0, min_users_per_arm=2)
LEARNER = {"update_every_samples": 16, "min_samples": 4}


def run(tmp_path, ckpt, design):
    return simulate(ckpt, SCENARIO, design, 2, 0, tmp_path, canary=CANARY, learner_cfg=LEARNER, max_tokens=8)


def test_held_back_updates_keep_the_promoted_versions_samples(tmp_path, tiny_checkpoint):
    res = run(tmp_path / "hold_back", tiny_checkpoint, {})
    assert res["implied_updates_per_cycle"] > 4  # the regime where counting updates drops most samples
    total = res["total"]
    # None is stale in registered versions, and none beyond the lag bound: the learner waits at it.
    assert total["samples"] > 150 and total["dropped_stale"] == 0 and total["dropped_lag"] == 0
    assert total["updates"] > 2 * total["registered"] and total["held_back"] > 0
    assert [c["registered"] for c in res["cycles"]] == [1, 1]  # one candidate per cycle, the newest
    assert total["staleness_versions_max"] <= 2 < total["staleness_updates_max"]
    # the per-update mode: a candidate per update, staleness in updates (max 2): most samples dropped
    before = run(tmp_path / "per_update", tiny_checkpoint, {"hold_back": False, "staleness_unit": "updates"})
    assert before["total"]["dropped_share"] > 0.5 and before["candidates_waiting_at_end"]
