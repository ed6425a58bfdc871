"""The canary sized to its traffic (`bench/canary_sizing.py` at fewer replicates, fixed seeds): the
demo's margins have 80% power at its users per step, A/A aborts stay under α, the simulation decides
as `gating.canary.decide` does; and the always-valid SRM test (`gating.sequential`)."""

from __future__ import annotations

import math
from dataclasses import replace

import numpy as np
import pytest

from bench.canary_sizing import FULL, QUICK, QUICK_STEP, Step, check_decide, power
from bench.common import binomial_ceiling, binomial_floor
from demo.system import DemoSystemConfig
from gating.sequential import log_srm_evalue, srm_sequential
from tests.conftest import approx_ulps

REPS = 300
TAIL = 1e-4  # each rate's tolerance: one in ten thousand under its bound
FULL_CFG, QUICK_CFG = DemoSystemConfig(), DemoSystemConfig.quick()


def _full(share: float) -> Step:
    c = FULL_CFG
    return Step(share, c.canary_margin, c.canary_max_step_s, min_users=c.canary_min_users,
                min_users_for_harm=max(2, c.canary_min_users // 2), harm_alpha=0.05 / (4 * len(c.canary_steps)))  # fmt: skip


def _quick() -> Step:
    c = QUICK_CFG
    return replace(QUICK_STEP, margin=c.canary_margin, max_step_s=c.canary_max_step_s, min_users=c.canary_min_users)


@pytest.mark.parametrize(
    ("name", "traffic", "step", "seed"),
    [("full 20%", FULL, _full(0.2), 10), ("full 50%", FULL, _full(0.5), 20), ("quick 50%", QUICK, _quick(), 30)],
)
def test_the_demo_margin_has_the_power_its_docs_claim(name, traffic, step, seed):
    """At the demo's margin, on its measured traffic: an equal candidate passes within the step's max time,
    one worse by twice the margin is aborted for harm, each at least 80% of the time; an A/A with the
    latency guardrails on is aborted (harm or SRM) at most α of the time."""
    assert len(FULL_CFG.canary_steps) == 2 and step.share in (*FULL_CFG.canary_steps, *QUICK_CFG.canary_steps)
    r = power(traffic, step, REPS, seed)
    assert r["equal_passed_in_time"] * REPS >= binomial_floor(REPS, 0.8, TAIL), (name, r)
    assert r["worse_aborted_harm"] * REPS >= binomial_floor(REPS, 0.8, TAIL), (name, r)
    assert r["aa_false_aborts"] * REPS <= binomial_ceiling(REPS, 0.05, TAIL), (name, r)


@pytest.mark.parametrize(("effect", "latency", "share"), [(0.0, True, 0.5), (-0.2, False, 0.2), (0.05, False, 0.2)])
def test_the_simulation_decides_as_decide_does(effect, latency, share):
    for seed in range(3):
        got = check_decide(FULL, replace(_full(share), max_step_s=40.0), effect, seed, latency=latency)
        assert got["agree"], got


def test_the_sequential_srm_test_keeps_its_level_under_a_look_after_every_user():
    rng = np.random.default_rng(5)
    reps, users, alpha = 1000, 4000, 0.05
    for share in (0.2, 0.5):
        x = (rng.random((reps, users)) < share).cumsum(axis=1)
        n = np.arange(1, users + 1)
        log_e = log_srm_evalue(np.stack([x, n - x], -1), [share, 1 - share])
        alarms = int((log_e >= math.log(1 / alpha)).any(axis=1).sum())
        assert alarms <= binomial_ceiling(reps, alpha, TAIL), (share, alarms)


def test_the_sequential_srm_test_catches_a_45_55_split_at_50_percent():
    rng = np.random.default_rng(6)
    reps, users = 500, 6000
    x = (rng.random((reps, users)) < 0.45).cumsum(axis=1)
    n = np.arange(1, users + 1)
    log_e = log_srm_evalue(np.stack([x, n - x], -1), [0.5, 0.5])
    caught = (log_e >= math.log(1000)).any(axis=1)  # at the canary's default level, 0.001
    assert caught.sum() >= binomial_floor(reps, 0.99, TAIL), caught.mean()


def test_srm_sequential_on_counts():
    ok = srm_sequential({"candidate": 52, "incumbent": 48}, {"candidate": 0.5, "incumbent": 0.5})
    assert ok.srm_ok and ok.p_value == 1.0 and ok.log_e < 0  # near the share: the mixture is below the null
    bad = srm_sequential({"candidate": 100, "incumbent": 300}, {"candidate": 0.5, "incumbent": 0.5})
    assert not bad.srm_ok and bad.p_value < 1e-6 and bad.e_value > 1e6
    # the same float64 function on the same counts, reached another way: a few ulps
    assert bad.log_e == approx_ulps(float(log_srm_evalue([100, 300], [0.5, 0.5])), ulps=16)
    none_there = srm_sequential({"a": 3, "b": 5, "c": 1}, {"a": 0.5, "b": 0.5, "c": 0.0})
    assert not none_there.srm_ok and none_there.p_value == 0.0
    with pytest.raises(ValueError, match="differ"):
        srm_sequential({"a": 1}, {"a": 0.5, "b": 0.5})
    with pytest.raises(ValueError, match="alpha"):
        srm_sequential({"a": 1, "b": 1}, {"a": 0.5, "b": 0.5}, alpha=1.5)
    with pytest.raises(ValueError, match="concentration"):
        log_srm_evalue([1, 1], [0.5, 0.5], concentration=0.0)
