"""The lending benchmark's simulated fleet (`bench/lending.py`) on a short day: the same traffic both
ways, lending puts idle replica-time to use, no rollout lost or counted twice, reclaims within one
engine step, and lending off lends nothing."""

from __future__ import annotations

from bench.lending import simulate
from serving.lending import LendingConfig

P = {
    "replicas": 4,
    "max_batch": 64,
    "a": 0.03,
    "c": 0.002,
    "tokens_mean": 24,
    "peak_load": 0.7,
    "trough": 0.1,
    "timeout_s": 60.0,
    "day_s": 1800.0,  # a half-hour "day": the policy's clocks shortened to match
}
CFG = LendingConfig(enabled=True, target_concurrency=8, lend_after_s=30, reclaim_after_s=2, max_rollout_concurrency=16)


def test_a_short_day_lends_idle_replicas_and_loses_nothing():
    off = simulate(CFG, False, P, seed=3)
    on = simulate(CFG, True, P, seed=3)
    assert on["arrivals"] == off["arrivals"] > 1000  # the same traffic
    assert off["rollouts_done"] == 0 and off["lent_replica_s"] == 0
    assert on["counters"]["lends"] > 0 and on["rollouts_done"] > 0
    # Some idle time put to use, and rollouts ran only on lent replicas. (How much is the benchmark's
    # figure, on a full day at fleet scale; a half-hour day of 4 replicas is mostly ramps.)
    assert 0.1 < on["idle_use"] <= 1.0
    assert on["rollout_busy_replica_s"] <= on["lent_replica_s"] + 1e-6
    assert on["rollouts_lost"] == on["rollouts_counted_twice"] == 0
    assert on["failed_live"] == off["failed_live"] == 0
    step_max = P["a"] + P["c"] * P["max_batch"]
    assert on["reclaims"] > 0 and on["reclaim_p99_s"] <= step_max
    tl = on["timeline"]  # the plot's data: at the first tick, then every 300 s, the live load and replicas away
    assert tl["hour"] == [round(t / 3600, 4) for t in (1, 300, 600, 900, 1200, 1500, 1800)]
    assert len(tl["live"]) == len(tl["lent"]) == 7 and max(tl["lent"]) >= 1
    assert off["timeline"]["lent"] == [0] * 7


def test_the_plot_of_the_day_is_drawn(tmp_path):
    from bench.lending import plot

    day = {**P, "day_s": 600.0}
    result = {"params": day, "on": simulate(CFG, True, day, seed=1)}
    plot(result, tmp_path / "lending.png")
    assert (tmp_path / "lending.png").stat().st_size > 10_000


def test_co_serving_uses_the_daytime_slack_too_and_loses_nothing():
    on = simulate(CFG, True, P, seed=3)
    co = simulate(CFG.model_copy(update={"co_serve": True}), True, P, seed=3)
    off = simulate(CFG, False, P, seed=3)
    assert co["arrivals"] == on["arrivals"]
    assert co["idle_use"] > on["idle_use"] + 0.1 and co["idle_use"] <= 1.0
    assert co["rollout_used_replica_s"] > co["lent_replica_s"]  # rollouts ran on serving replicas too
    assert co["rollouts_cut_for_live"] > 0 and on["rollouts_cut_for_live"] == 0
    assert co["rollouts_lost"] == co["rollouts_counted_twice"] == 0 and co["failed_live"] == 0
    assert co["p99_latency_s"] <= 1.25 * off["p99_latency_s"]  # the benchmark's day holds it to 10%
