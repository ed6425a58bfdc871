"""The lending policy (`serving.lending.FleetManager`) on scripted load: lend only after sustained low
load and one replica at a time, never below `min_serving`; a draining replica is lent once its live
requests end; reclaim on sustained high utilisation or slow first tokens, one per `reclaim_after_s`;
panic reclaims every replica at once; lent replica-seconds add up."""

from __future__ import annotations

import pytest

from serving.lending import FleetManager, LendingConfig

CFG = LendingConfig(
    enabled=True, target_concurrency=10, headroom=0.5, min_serving=1, lend_after_s=60, reclaim_after_s=5
)
IDLE = {"r0": 0, "r1": 0, "r2": 0}


def run(m: FleetManager, t0: float, t1: float, concurrency: float, step: float = 1.0, **kw) -> list:
    """Samples every `step` seconds in [t0, t1) at `concurrency`; every decision taken."""
    out, t = [], t0
    while t < t1:
        m.observe(t, concurrency, kw.get("in_flight", IDLE), kw.get("ttft"))
        out += [(t, d.action, d.replica) for d in m.decide(t)]
        t += step
    return out


def test_low_load_lends_one_replica_per_stretch_and_keeps_min_serving():
    m = FleetManager(CFG, ["r0", "r1", "r2"])
    got = run(m, 0, 200, concurrency=2)  # fits in one replica with half its capacity free
    # Lent at the next look: its in-flight count then is from after live routing left it.
    assert [(t, a) for t, a, _ in got] == [(60, "lend"), (61, "lent"), (120, "lend"), (121, "lent")]
    assert m.states == {"r0": "serving", "r1": "lent", "r2": "lent"}  # min_serving 1 stops the third
    assert m.counters["lends"] == 2


def test_a_load_above_what_one_fewer_replica_holds_restarts_the_idle_clock():
    m = FleetManager(CFG, ["r0", "r1"])
    assert run(m, 0, 50, concurrency=2) == []
    assert run(m, 50, 51, concurrency=6) == []  # 6 > (1 - 0.5) x 1 x 10: one replica fewer would not keep headroom
    got = run(m, 51, 200, concurrency=2)
    assert got[0][:2] == (111, "lend")  # 60 s after the spike, not 60 s after the start


def test_a_draining_replica_is_lent_only_once_its_live_requests_end():
    m = FleetManager(CFG, ["r0", "r1"])
    busy = {"r0": 0, "r1": 3}
    got = run(m, 0, 70, concurrency=3, in_flight=busy)
    assert [(t, a, r) for t, a, r in got] == [(60, "lend", "r1")] and m.states["r1"] == "draining"
    got = run(m, 70, 72, concurrency=0, in_flight={"r0": 0, "r1": 0})
    assert got == [(70, "lent", "r1")]


def test_high_utilisation_reclaims_one_replica_per_reclaim_window():
    m = FleetManager(CFG, ["r0", "r1", "r2"])
    run(m, 0, 130, concurrency=1)
    assert m.serving() == ["r0"]
    got = run(m, 130, 150, concurrency=18)  # 1.8 replicas' worth: under the panic line (2x), over the watermark
    reclaims = [(t, r) for t, a, r in got if a == "reclaim"]
    # The 5 s average crosses 0.8 of one replica at 132; two replicas at 0.9 reclaim the third 5 s later.
    assert reclaims == [(132, "r2"), (137, "r1")]
    assert m.states == {"r0": "serving", "r1": "serving", "r2": "serving"}


def test_slow_first_tokens_reclaim_even_at_low_concurrency():
    m = FleetManager(CFG, ["r0", "r1"])
    run(m, 0, 62, concurrency=1)
    assert m.states["r1"] == "lent"
    got = run(m, 62, 64, concurrency=1, ttft=[2.0, 3.0])
    assert [(a, r) for _, a, r in got] == [("reclaim", "r1")]
    # the latency-objective violations are counted: 2 per sample, the first sample's while r1 was lent
    assert (m.counters["slow_first_tokens"], m.counters["slow_first_tokens_lent"]) == (4, 2)
    run(m, 64, 65, concurrency=1, ttft=[0.5, 1.5])
    assert (m.counters["slow_first_tokens"], m.counters["slow_first_tokens_lent"]) == (5, 2)


def test_panic_reclaims_every_replica_at_once_and_lent_time_adds_up():
    m = FleetManager(CFG, ["r0", "r1", "r2"])
    run(m, 0, 130, concurrency=1)
    lent_before = m.lent_seconds
    assert lent_before == pytest.approx(68 + 8)  # r1 lent from 61, r2 from 121, sampled every second to 129
    got = run(m, 130, 131, concurrency=25)  # 2.5x the one serving replica's capacity
    assert sorted((a, r) for _, a, r in got) == [("reclaim", "r1"), ("reclaim", "r2")]
    assert m.counters["panics"] == 1 and m.serving() == ["r0", "r1", "r2"]


def test_bad_settings_and_samples_are_refused_by_name():
    with pytest.raises(ValueError, match=r"reclaim_after_s \(60.0\) must be shorter than lend_after_s \(30.0\)"):
        LendingConfig(lend_after_s=30, reclaim_after_s=60)
    with pytest.raises(ValueError, match="distinct"):
        FleetManager(CFG, ["r0", "r0"])
    m = FleetManager(CFG, ["r0"])
    m.observe(5, 0, {"r0": 0})
    with pytest.raises(ValueError, match="time order: 4 after 5"):
        m.observe(4, 0, {"r0": 0})


def test_co_serving_slots_are_what_live_traffic_leaves_and_none_when_the_fleet_is_short():
    co = CFG.model_copy(update={"co_serve": True, "co_serve_fill": 0.5})  # target 10: start up to 5, keep up to 10
    m = FleetManager(co, ["r0", "r1"])
    m.observe(0, 3, {"r0": 3, "r1": 0})
    assert m.co_serve_slots("r0", 3) == (2, 7) and m.co_serve_slots("r1", 0) == (5, 10)
    assert m.co_serve_slots("r0", 7) == (0, 3)  # past the fill: start none, but cut only beyond the target
    assert m.co_serve_slots("r0", 15) == (0, 0)
    assert FleetManager(CFG, ["r0"]).co_serve_slots("r0", 0) == (0, 0)  # co_serve off
    m.observe(1, co.high_watermark * 2 * co.target_concurrency, {"r0": 1, "r1": 1})  # utilisation at the mark
    assert m.co_serve_slots("r1", 1) == (0, 0)
    m.states["r1"] = "lent"  # a lent replica's work is the lent worker's, not co-serving's
    m.observe(2, 0, {"r0": 0, "r1": 0})
    assert m.co_serve_slots("r1", 0) == (0, 0) and m.co_serve_slots("r0", 0) == (5, 10)
    with pytest.raises(ValueError, match="co_serve_fill"):
        LendingConfig(co_serve_fill=1.5)


def test_co_serving_yields_to_a_live_request_in_the_tail():
    co = CFG.model_copy(update={"co_serve": True, "co_serve_fill": 0.5, "co_serve_yield_s": 20.0})
    m = FleetManager(co, ["r0", "r1"])
    m.observe(0, 2, {"r0": 2, "r1": 0})
    assert m.co_serve_slots("r0", 2, oldest_live_s=19.9) == (3, 8)
    assert m.co_serve_slots("r0", 2, oldest_live_s=20.0) == (0, 0)  # cut every lent sequence, start none
    assert m.co_serve_slots("r1", 0) == (5, 10)  # the other replica's slots are its own
    never = FleetManager(co.model_copy(update={"co_serve_yield_s": None}), ["r0"])
    assert never.co_serve_slots("r0", 2, oldest_live_s=1e6) == (3, 8)
    with pytest.raises(ValueError, match="co_serve_yield_s"):
        LendingConfig(co_serve_yield_s=0)
