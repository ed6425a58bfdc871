"""gating.stats against hand computations, closed forms and seeded simulations."""

from __future__ import annotations

import hashlib
import json
import math
import re

import numpy as np
import pytest
from scipy import stats as sps

from gating.stats import (
    DEFAULT_RHO,
    assign_arm,
    assignment_unit,
    confidence_sequence,
    family_regressions,
    guardrail,
    holm,
    normal_mixture_radius,
    paired_bootstrap_non_inferiority,
    paired_t_non_inferiority,
    rho_for,
    srm_check,
)
from tests.conftest import approx_ulps

# Group means of G = 4 rewards on six prompts; d = [.25, 0, .25, -.25, .5, 0].
CAND = [1.0, 0.75, 0.5, 0.25, 1.0, 0.5]
INC = [0.75, 0.75, 0.25, 0.5, 0.5, 0.5]
T_95_DF5 = 2.015048373  # t quantile 0.95 with 5 degrees of freedom, from a table (9 decimals)


def f64(x: float):
    """A float64 result against the same closed form computed by other operations (another order, the
    log of a quotient instead of a difference of logs): 64 ulps."""
    return approx_ulps(x, 64)


# --- offline non-inferiority ------------------------------------------------------------------------


def test_paired_t_matches_hand_computation():
    d = [c - i for c, i in zip(CAND, INC, strict=True)]
    n = len(d)
    mean = sum(d) / n  # 0.125
    sd = math.sqrt(sum((x - mean) ** 2 for x in d) / (n - 1))
    se = sd / math.sqrt(n)
    r = paired_t_non_inferiority(CAND, INC, margin=0.03, alpha=0.05)
    assert (r.n_prompts, r.method, r.margin, r.alpha) == (6, "paired_t", 0.03, 0.05)
    assert r.mean_diff == f64(0.125)
    assert r.se == f64(se)
    assert r.lower_bound == pytest.approx(mean - T_95_DF5 * se, abs=5e-10 * se)  # the table's last decimal
    assert r.lower_bound == pytest.approx(-0.0907, abs=5e-5)  # 4 decimals; so: not non-inferior at a 3-point margin
    assert not r.passed
    assert r.p_value == f64(1 - sps.t.cdf((mean + 0.03) / se, n - 1))
    assert r.p_value > 0.05
    # A 15-point margin is generous enough.
    wide = paired_t_non_inferiority(CAND, INC, margin=0.15)
    assert wide.passed and wide.p_value < 0.05


def test_paired_t_passes_a_clear_improvement_and_fails_a_clear_regression():
    rng = np.random.default_rng(1)
    inc = rng.integers(0, 9, size=400) / 8
    better = np.clip(inc + rng.choice([0, 0.125], size=400), 0, 1)
    worse = np.clip(inc - rng.choice([0, 0.125, 0.25], size=400), 0, 1)
    assert paired_t_non_inferiority(better, inc).passed
    regression = paired_t_non_inferiority(worse, inc)
    assert not regression.passed and regression.mean_diff < -0.1


def test_zero_variance_bound_is_the_mean():
    inc = [0.5, 0.25, 0.75, 0.5]
    for method in (paired_t_non_inferiority, paired_bootstrap_non_inferiority):
        same = method(inc, inc)
        assert (same.mean_diff, same.se, same.lower_bound, same.passed, same.p_value) == (0.0, 0.0, 0.0, True, 0.0)
        worse = method([x - 0.25 for x in inc], inc)
        assert worse.lower_bound == worse.mean_diff == -0.25
        assert not worse.passed and worse.p_value == 1.0


def test_bootstrap_two_prompts_closed_form():
    # d = [-0.5, 0.5]: a resampled mean is -0.5, 0 or 0.5 with probabilities 1/4, 1/2, 1/4.
    r = paired_bootstrap_non_inferiority([0.25, 0.75], [0.75, 0.25], margin=0.03, alpha=0.05, seed=3)
    assert r.method == "paired_bootstrap" and r.mean_diff == 0.0
    assert r.lower_bound == -0.5  # the 5% quantile sits in the lowest atom
    assert not r.passed
    # Seeded Monte Carlo over 10 000 resamples: its sd is 0.0043 for the p-value, 0.0025 for the se.
    assert r.p_value == pytest.approx(0.25, abs=0.02)  # P(mean <= -0.03) = 1/4
    assert r.se == pytest.approx(math.sqrt(0.125), abs=0.01)  # sd of {-.5, 0, .5} w.p. 1/4, 1/2, 1/4


def test_bootstrap_keeps_pairs_and_is_seeded():
    rng = np.random.default_rng(7)
    inc = rng.integers(0, 9, size=300) / 8
    cand = np.clip(inc + rng.choice([-0.125, 0, 0.125], size=300, p=[0.2, 0.5, 0.3]), 0, 1)
    t_res = paired_t_non_inferiority(cand, inc)
    b_res = paired_bootstrap_non_inferiority(cand, inc, seed=11)
    unpaired_se = math.sqrt(np.var(cand, ddof=1) / 300 + np.var(inc, ddof=1) / 300)
    # Two estimators of one quantity on 300 prompts: statistical agreement, not rounding.
    assert b_res.se == pytest.approx(t_res.se, rel=0.1)
    assert b_res.se < unpaired_se / 3  # resampling arms separately would give roughly unpaired_se
    assert b_res.lower_bound == pytest.approx(t_res.lower_bound, abs=0.005)
    assert paired_bootstrap_non_inferiority(cand, inc, seed=11) == b_res
    assert paired_bootstrap_non_inferiority(cand, inc, seed=12).lower_bound != b_res.lower_bound


@pytest.mark.parametrize(
    ("call", "names"),
    [
        (lambda: paired_t_non_inferiority([], []), "0 value"),
        (lambda: paired_t_non_inferiority([0.5], [0.5]), "1 value"),
        (lambda: paired_t_non_inferiority([0.5, 0.5, 1.0], [0.5, 0.5]), "3 prompts"),
        (lambda: paired_t_non_inferiority([0.5, 1.5], [0.5, 0.5]), "1.5"),
        (lambda: paired_t_non_inferiority([0.5, float("nan")], [0.5, 0.5]), "nan"),
        (lambda: paired_t_non_inferiority(CAND, INC, alpha=0.0), "0.0"),
        (lambda: paired_t_non_inferiority(CAND, INC, alpha=1.0), "1.0"),
        (lambda: paired_t_non_inferiority(CAND, INC, margin=-0.01), "-0.01"),
        (lambda: paired_bootstrap_non_inferiority(CAND, INC, n_resamples=10), "10"),
        (lambda: holm({}), "empty"),
        (lambda: holm({"a": 1.2}), "1.2"),
        (lambda: holm({"a": 0.01}, alpha=2), "2"),
        (lambda: srm_check({"c": 10, "i": 10}, {"c": 1.5, "i": -0.5}), "1.5"),
        (lambda: srm_check({"c": 10, "i": 10}, {"c": 0.4, "i": 0.4}), "0.8"),
        (lambda: srm_check({"c": 10, "x": 10}, {"c": 0.5, "i": 0.5}), "'x'"),
        (lambda: srm_check({"c": -1, "i": 10}, {"c": 0.5, "i": 0.5}), "-1"),
        (lambda: confidence_sequence([1.0], [1.0, 2.0]), "1 value"),
        (lambda: confidence_sequence([1.0, 2.0], [1.0, 2.0], rho=0), "0"),
        (lambda: confidence_sequence([1.0, np.inf], [1.0, 2.0]), "inf"),
        (lambda: guardrail("latency", [1.0, 2.0], [1.0, 2.0], "sideways"), "sideways"),  # type: ignore[arg-type]
        (lambda: assign_arm("s", "t", "u", 1.5), "1.5"),
        (lambda: assign_arm("s", "t", "u", -0.1), "-0.1"),
    ],
)
def test_bad_input_is_a_value_error_naming_the_value(call, names):
    with pytest.raises(ValueError, match=names.replace(".", r"\.").replace("[", r"\[")):
        call()


# --- Holm ---------------------------------------------------------------------------------------------


def test_holm_hand_examples():
    # m = 4, thresholds .0125, .0167, .025, .05: d and a pass, c (.03 > .025) stops the procedure,
    # so b is kept although .04 <= .05 (a step-up procedure would reject all four).
    assert holm({"a": 0.01, "b": 0.04, "c": 0.03, "d": 0.005}, alpha=0.05) == {
        "a": True,
        "b": False,
        "c": False,
        "d": True,
    }
    # m = 3: .01 <= .0167, .02 <= .025, .04 <= .05, so all three (Bonferroni would reject only a).
    assert holm({"a": 0.01, "b": 0.02, "c": 0.04}) == {"a": True, "b": True, "c": True}
    assert holm({"a": 0.05}) == {"a": True} and holm({"a": 0.0501}) == {"a": False}


def test_family_regressions_pool_the_variance_over_every_family():
    # add: 4 prompts, mean -0.2; mul: 4 prompts, mean 0; residuals ±0.1 in both, so
    # s² = 8 · 0.01 / (8 - 2) and se = s / 2 for each family, on 6 df.
    d = [-0.1, -0.3, -0.1, -0.3, 0.1, -0.1, 0.1, -0.1]
    fams = ["add"] * 4 + ["mul"] * 4
    r = family_regressions(d, fams, margin=0.03)
    se = math.sqrt(8 * 0.01 / 6) / 2
    assert r.df == 6 and r.n == {"add": 4, "mul": 4}
    assert r.se["add"] == approx_ulps(se, 8) and r.mean_diff["add"] == approx_ulps(-0.2, 8)
    assert r.p_values["add"] == approx_ulps(float(sps.t.cdf((-0.2 + 0.03) / se, 6)), 64)
    assert r.p_values["mul"] == approx_ulps(float(sps.t.cdf(0.03 / se, 6)), 64)
    assert r.regressed == {"add": True, "mul": False} and not r.all_passed and r.passed["mul"]
    lo, hi = r.bounds("add")
    assert lo < -0.2 < hi and hi - (-0.2) == approx_ulps(float(sps.t.ppf(0.95, 6)) * se, 64)


def test_family_regressions_a_few_identical_differences_are_no_proof():
    # Two prompts of "repeat" both 0.5 worse (a per-family t would have se 0 and p 0); pooled over the
    # suite's spread, two prompts are weak evidence and Holm over 18 families does not flag them.
    rng = np.random.default_rng(3)
    d = list(np.clip(rng.normal(0.0, 0.3, 34), -1, 1)) + [-0.5, -0.5]
    fams = [f"f{k % 17}" for k in range(34)] + ["repeat", "repeat"]
    r = family_regressions(d, fams)
    assert 0.0 < r.p_values["repeat"] < 0.2 and not r.regressed["repeat"]


def test_family_regressions_zero_spread_follows_the_sign():
    # Every family's differences constant: t = ±inf, so the decision is the sign of mean + margin.
    r = family_regressions([-0.25, -0.25, 0.0, 0.0, -0.03, -0.03], ["a", "a", "b", "b", "c", "c"], margin=0.03)
    assert r.p_values == {"a": 0.0, "b": 1.0, "c": 1.0} and r.regressed == {"a": True, "b": False, "c": False}


@pytest.mark.parametrize(
    "d, fams, what",
    [
        ([0.1, 0.2], ["a"], "for 1 family labels"),
        ([0.1, 0.2], ["a", "b"], "no degree of freedom"),
        ([0.1, 1.5, 0.0], ["a", "a", "b"], "differences[1] = 1.5"),
        ([0.1, float("nan"), 0.0], ["a", "a", "b"], "differences[1] = nan"),
    ],
)
def test_family_regressions_bad_input_names_it(d, fams, what):
    with pytest.raises(ValueError, match=re.escape(what)):
        family_regressions(d, fams)


# --- SRM --------------------------------------------------------------------------------------------------


def test_srm_hand_example():
    # 50/50 expected of 1000 users: E = 500 each, X² = 20²/500 + 20²/500 = 1.6 on 1 df,
    # p = P(χ²₁ > 1.6) = erfc(sqrt(1.6 / 2)).
    r = srm_check({"candidate": 520, "incumbent": 480}, {"candidate": 0.5, "incumbent": 0.5})
    assert r.statistic == f64(1.6)
    assert r.p_value == f64(math.erfc(math.sqrt(0.8)))
    assert r.df == 1 and r.srm_ok
    bad = srm_check({"candidate": 5500, "incumbent": 4500}, {"candidate": 0.5, "incumbent": 0.5})
    assert bad.statistic == f64(100.0) and not bad.srm_ok


def test_srm_unequal_shares_near_the_threshold():
    # 10% canary of 10,000: E = 1000 / 9000, X² = 100²/1000 + 100²/9000 = 11.11, p ≈ 8.6e-4 < 0.001.
    r = srm_check({"candidate": 900, "incumbent": 9100}, {"candidate": 0.1, "incumbent": 0.9})
    assert r.statistic == f64(100**2 / 1000 + 100**2 / 9000)
    assert r.p_value == f64(math.erfc(math.sqrt(r.statistic / 2)))
    assert not r.srm_ok
    assert srm_check({"candidate": 900, "incumbent": 9100}, {"candidate": 0.1, "incumbent": 0.9}, 1e-4).srm_ok


def test_srm_zero_share_arm():
    shares = {"candidate": 0.2, "incumbent": 0.8, "holdout": 0.0}
    assert srm_check({"candidate": 200, "incumbent": 800, "holdout": 0}, shares).statistic == f64(0.0)
    leaked = srm_check({"candidate": 200, "incumbent": 800, "holdout": 3}, shares)
    assert leaked.statistic == math.inf and not leaked.srm_ok


# --- confidence sequence ------------------------------------------------------------------------------------


def test_normal_mixture_radius_formula():
    t, var, rho, alpha = 400, 2.0, 50.0, 0.1
    v = var * t + rho
    expected = math.sqrt(2 * v / t**2 * math.log(math.sqrt(v / rho) / alpha))
    assert normal_mixture_radius(t, var, rho, alpha) == f64(expected)


def test_confidence_sequence_hand_example():
    cand, inc = [1.0, 2.0, 3.0, 6.0], [0.0, 2.0, 1.0]
    # means 3 and 1; sample variances 14/3 and 1; W = (14/3)/4 + 1/3 = 1.5; t = 7.
    w, t, rho, alpha = 14 / 3 / 4 + 1 / 3, 7, 10.0, 0.05
    radius = math.sqrt(w * 2 * (1 + rho / t) * math.log(math.sqrt(1 + t / rho) / alpha))
    iv = confidence_sequence(cand, inc, alpha=alpha, rho=rho)
    assert iv.estimate == f64(2.0) and iv.se == f64(math.sqrt(w))
    assert iv.radius == f64(radius)
    assert (iv.lower, iv.upper) == (f64(2 - radius), f64(2 + radius))
    assert (iv.n_candidate, iv.n_incumbent, iv.alpha, iv.rho) == (4, 3, 0.05, 10.0)
    # Same thing through the general boundary with σ² = t W and ρ_abs = rho σ².
    assert iv.radius == f64(normal_mixture_radius(t, t * w, rho * t * w, alpha))


def test_confidence_sequence_covers_under_peeking():
    """A/A: 300 replicates, a look after every 20 users per arm up to 1000. The always-valid interval
    may exclude 0 at some look in at most about α of them; a fixed-n 95% interval checked at every
    look does so far more often (which shows the simulation has the power to catch an invalid one)."""
    rng = np.random.default_rng(2024)
    alpha, reps, batch, n_max = 0.05, 300, 20, 1000
    ever, naive_ever = 0, 0
    for _ in range(reps):
        cand = (rng.random(n_max) < 0.3).astype(float)
        inc = (rng.random(n_max) < 0.3).astype(float)
        crossed = naive = False
        for n in range(batch, n_max + 1, batch):
            iv = confidence_sequence(cand[:n], inc[:n], alpha=alpha)
            crossed = crossed or iv.excludes(0.0)
            naive = naive or abs(iv.estimate) > 1.96 * iv.se
        ever += crossed
        naive_ever += naive
    assert ever / reps <= alpha + 0.01
    assert naive_ever / reps > 0.15


def test_confidence_sequence_shrinks_as_n_grows():
    rng = np.random.default_rng(3)
    cand, inc = rng.normal(0.0, 1.0, 20_000), rng.normal(0.0, 1.0, 20_000)
    widths = [confidence_sequence(cand[:n], inc[:n]).radius for n in (20, 50, 100, 300, 1000, 3000, 20_000)]
    assert all(a > b for a, b in zip(widths, widths[1:], strict=False))
    radii = [normal_mixture_radius(t, 1.0, DEFAULT_RHO) for t in (10, 100, 1000, 10_000, 100_000)]
    assert all(a > b for a, b in zip(radii, radii[1:], strict=False))
    assert widths[-1] < 0.1


def test_confidence_sequence_detects_a_large_difference():
    rng = np.random.default_rng(4)
    better = confidence_sequence((rng.random(1000) < 0.6).astype(float), (rng.random(1000) < 0.4).astype(float))
    assert better.lower > 0.05 and better.excludes(0.0) and better.passes(0.03)
    worse = confidence_sequence((rng.random(1000) < 0.3).astype(float), (rng.random(1000) < 0.45).astype(float))
    assert worse.upper < 0 and not worse.passes(0.03)


def test_rho_for_minimises_the_radius_at_its_target():
    rho = rho_for(2000, 0.05)
    assert rho == pytest.approx(2000 / 8.212, rel=1e-4)  # 8.212 to its 3 decimals (6e-5 of it)
    best = normal_mixture_radius(2000, 1.0, rho)
    assert best < normal_mixture_radius(2000, 1.0, rho * 0.8) and best < normal_mixture_radius(2000, 1.0, rho * 1.25)


# --- guardrails -------------------------------------------------------------------------------------------


def test_guardrail_flags_harm_only_on_the_harmful_side():
    rng = np.random.default_rng(6)
    inc_latency = rng.normal(800.0, 100.0, 2000)
    slower = guardrail("latency_ms", rng.normal(850.0, 100.0, 2000), inc_latency, "higher_is_worse")
    assert slower.harmed and slower.metric == "latency_ms" and slower.direction == "higher_is_worse"
    assert slower.interval.lower > 0
    faster = guardrail("latency_ms", rng.normal(750.0, 100.0, 2000), inc_latency, "higher_is_worse")
    assert not faster.harmed and faster.interval.upper < 0  # clearly different, but better
    same = guardrail("latency_ms", rng.normal(800.0, 100.0, 2000), inc_latency, "higher_is_worse")
    assert not same.harmed
    inc_pass = (rng.random(2000) < 0.5).astype(float)
    dropped = guardrail("pass_rate", (rng.random(2000) < 0.4).astype(float), inc_pass, "lower_is_worse")
    assert dropped.harmed and dropped.interval.upper < 0
    assert not guardrail("pass_rate", (rng.random(2000) < 0.6).astype(float), inc_pass, "lower_is_worse").harmed


# --- sticky assignment ----------------------------------------------------------------------------------


USERS = [f"user-{i}" for i in range(10_000)]


def test_assignment_unit_is_the_documented_hash():
    digest = hashlib.sha256(json.dumps(["exp-7", "acme", "user-42"]).encode()).digest()
    expected = (int.from_bytes(digest[:8], "big") >> 11) / 2**53
    assert assignment_unit("exp-7", "acme", "user-42") == expected
    assert all(0.0 <= assignment_unit("exp-7", "acme", u) < 1.0 for u in USERS[:1000])


def test_ramping_up_keeps_everyone_in():
    at_5 = {u for u in USERS if assign_arm("exp-7", "acme", u, 0.05) == "candidate"}
    at_20 = {u for u in USERS if assign_arm("exp-7", "acme", u, 0.20) == "candidate"}
    assert at_5 and at_5 < at_20
    assert not any(assign_arm("exp-7", "acme", u, 0.0) == "candidate" for u in USERS)
    assert all(assign_arm("exp-7", "acme", u, 1.0) == "candidate" for u in USERS)


@pytest.mark.parametrize("share", [0.05, 0.2, 0.5])
def test_share_of_users_matches(share):
    fraction = sum(assign_arm("exp-7", "acme", u, share) == "candidate" for u in USERS) / len(USERS)
    assert abs(fraction - share) < 0.02


def test_anonymous_is_its_own_stratum():
    assert assign_arm("exp-7", "acme", None, 0.5) == "anonymous"
    assert assign_arm("exp-7", "acme", "", 1.0) == "anonymous"
    assert {assign_arm("exp-7", "acme", u, 0.5) for u in USERS[:200]} == {"candidate", "incumbent"}


def test_salt_and_tenant_change_the_assignment():
    base = [assign_arm("exp-7", "acme", u, 0.5) for u in USERS[:2000]]
    assert base == [assign_arm("exp-7", "acme", u, 0.5) for u in USERS[:2000]]  # sticky
    for other in (
        [assign_arm("exp-8", "acme", u, 0.5) for u in USERS[:2000]],
        [assign_arm("exp-7", "globex", u, 0.5) for u in USERS[:2000]],
    ):
        moved = sum(a != b for a, b in zip(base, other, strict=True)) / len(base)
        assert 0.4 < moved < 0.6  # independent halves: about half the users change arm
