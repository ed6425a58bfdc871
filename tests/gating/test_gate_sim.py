"""The gate's error rates, reduced: `bench/gate_sim_offline.py` and `bench/gate_sim_canary.py` (their
docstrings have the design) at 200 replicates.

Offline on a synthetic pool shaped like the real demo suite (the gate split: 512 prompts, 18
families; pass rates spread over [0.25, 0.65] as the demo base model's are, 64 samples per prompt);
online in a small world (3,000 active users, one 50% step of at most 30 minutes, a look every 5
simulated minutes) with the default statistics. Every bound is checked against a binomial tolerance: a
count that a rate exactly at the bound reaches with probability below 1e-6, so a failure means the gate is
wrong, not unlucky. A test of "rarely passes" is paired with one of "does pass", so neither holds vacuously.
About 8 s of CPU (13 s wall on the shared 2-core VM)."""

from __future__ import annotations

import numpy as np
import pytest
from scipy import stats

from bench.common import binomial_ceiling, binomial_floor
from bench.gate_sim_canary import Traffic, check_equivalence, simulate_online
from bench.gate_sim_offline import Pool, proportional_flip, simulate_offline, uniform_flip
from demo.suite import demo_suite
from gating.canary import CanaryConfig
from gating.gate import GateConfig
from gating.stats import DEFAULT_ALPHA, DEFAULT_MARGIN

REPS = 200
CEILING = binomial_ceiling(REPS, DEFAULT_ALPHA)  # "at most alpha", with a 1e-6 chance of a false failure


def synthetic_pool(seed: int = 0, m: int = 64) -> Pool:
    rng = np.random.default_rng(seed)
    families = tuple(it.family for it in demo_suite().items)
    n = len(families)
    rates = rng.uniform(0.25, 0.65, n)
    passed = (rng.random((n, m)) < rates[:, None]).astype(np.float64)
    malformed = (rng.random((n, m)) < 0.01) * (1.0 - passed)
    return Pool(passed, malformed, np.zeros((n, m)), rng.poisson(15, (n, m)) + 1.0, families)


POOL = synthetic_pool()


def test_binomial_tolerance_is_one_in_a_million():
    k = binomial_ceiling(REPS, DEFAULT_ALPHA)
    assert stats.binom.sf(k - 1, REPS, DEFAULT_ALPHA) <= 1e-6 < stats.binom.sf(k - 2, REPS, DEFAULT_ALPHA)
    j = binomial_floor(REPS, 0.8)
    assert stats.binom.cdf(j, REPS, 0.8) <= 1e-6 < stats.binom.cdf(j + 1, REPS, 0.8)


@pytest.mark.parametrize("flip", [uniform_flip, proportional_flip])
def test_a_candidate_worse_by_the_margin_rarely_passes_offline(flip):
    k = flip(POOL.rates, DEFAULT_MARGIN)
    assert (POOL.rates * k).mean() == pytest.approx(DEFAULT_MARGIN, abs=1e-12)  # exactly the margin worse
    r = simulate_offline(POOL, k, GateConfig().G, REPS, np.random.default_rng(1))["passed"]
    assert r["non_inferiority"] <= CEILING and r["verdict"] <= CEILING, r


def test_the_non_inferiority_test_has_power_when_samples_suffice():
    """At G = 64 an equally good candidate clears the overall test; so the bound above is not vacuous."""
    r = simulate_offline(POOL, None, 64, REPS, np.random.default_rng(2))["passed"]
    assert r["non_inferiority"] >= binomial_floor(REPS, 0.8), r


def test_an_equally_good_candidate_passes_offline_at_the_default_size():
    """At G 8 the gate split's 512 prompts bring the overall test's power above 80% (bench/gate_sim_offline.py)."""
    r = simulate_offline(POOL, None, GateConfig().G, REPS, np.random.default_rng(3))["passed"]
    assert r["verdict"] >= binomial_floor(REPS, 0.8), r


def test_the_canary_rarely_passes_a_worse_candidate_nor_aborts_a_good_one():
    cfg = CanaryConfig(steps=(0.5,), max_step_s=1800.0)
    traffic = Traffic(users=3000, median_rate_h=30.0, batch_s=300.0)
    runs = simulate_online({"aa": (0.0, cfg), "worse": (DEFAULT_MARGIN, cfg)}, traffic, 0.25, REPS, seed=7)
    aa = [r.action for r in runs["aa"]]
    worse = [r.action for r in runs["worse"]]
    assert worse.count("awaiting_approval") <= CEILING, worse
    # False alarms, peeking every batch: SRM and harm. (Inconclusive is a matter of traffic; the bench has it.)
    assert aa.count("abort_invalid") + aa.count("abort_harm") <= CEILING, aa
    assert aa.count("awaiting_approval") >= binomial_floor(REPS, 0.5), aa  # it does pass good candidates


@pytest.mark.parametrize(("factor", "cfg", "ends"), [
    (1.0, CanaryConfig(margin=0.15, min_users_per_arm=10, min_step_s=300, max_step_s=3600), "awaiting_approval"),
    (0.5, CanaryConfig(max_step_s=3600), "abort_harm"),
])  # fmt: skip
def test_the_simulation_container_decides_as_the_real_one(factor, cfg, ends):
    """Every look of a small world through `SimOutcomes` and through the real `CanaryOutcomes.add`."""
    got = check_equivalence(0.25, factor, seed=0, cfg=cfg)
    assert got["agree"] and got["action"] == ends, got
