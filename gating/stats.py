"""The statistics of the promotion gate, as pure functions over small frozen dataclasses.

No I/O, no torch: numpy and scipy only. Bad input is a `ValueError` that names the bad value.

Offline (a fixed eval set, candidate and incumbent scored on the same prompts):

- `paired_t_non_inferiority`: per-prompt differences d_i = cand_i - inc_i of group-mean pass rates;
  one-sided lower confidence bound mean(d) - t_{1-α, n-1} · se at level 1 - α. Non-inferior iff the bound
  is above -margin.
- `paired_bootstrap_non_inferiority`: the same question answered by resampling prompts (pairs kept
  together) with a seeded `numpy.random.Generator`; percentile lower bound.
- `holm`, `family_regressions`: one *harm* test per task family (is this family worse than -margin?),
  on a variance pooled over every family, with Holm's step-down correction so that an equally good
  candidate has some family flagged at most α of the time. Requiring every family to *show*
  non-inferiority instead would fail nearly every equal candidate at a few prompts per family.

Online (the canary, users split between candidate and incumbent):

- `srm_check`: sample ratio mismatch, Pearson's chi-square of user counts against the intended shares.
- `confidence_sequence`: an always-valid interval for mean(candidate) - mean(incumbent), valid under
  peeking after every batch (the normal-mixture boundary). A canary step passes iff lower > -margin.
- `guardrail`: harm detection on a metric where higher (latency) or lower (pass rate) is worse.
- `assign_arm`: sticky hash assignment; raising the share only ever adds users to the canary.

Deliberate simplifications:

- Prompts are the unit of analysis (prompt-clustered): the G samples of one prompt are averaged first,
  so their correlation never inflates n. The t test assumes the mean difference is close to normal
  (fine for a few dozen prompts or more); the bootstrap assumes prompts are exchangeable.
- With zero variance (every difference equal) the overall bound is the mean itself and the p-value is 0
  or 1: only an identical candidate gets there (common random numbers give d = 0 on every prompt).
- The confidence sequence plugs in the sample variances, so it is *asymptotically* valid (Waudby-Smith
  et al. 2024), not exact for a handful of users; its one-sided use for guardrails keeps the two-sided
  α, which is conservative. Users are assumed independent (one outcome per user, the mean of their
  requests), and the arms' variances are estimated afresh at every look.
- The chi-square SRM test is the usual large-sample one (expected counts of at least ~5 per arm).
"""

from __future__ import annotations

import hashlib
import json
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Literal

import numpy as np
import numpy.typing as npt
from scipy import special, stats

Arm = Literal["candidate", "incumbent", "anonymous"]
Direction = Literal["higher_is_worse", "lower_is_worse"]
Method = Literal["paired_t", "paired_bootstrap"]

DEFAULT_MARGIN = 0.03  # 3 points of pass rate
DEFAULT_ALPHA = 0.05
DEFAULT_SRM_THRESHOLD = 0.001
DEFAULT_RHO = 250.0  # tightest near ~2,000 users in total at α = 0.05 (rho_for(2000) ≈ 244)


# --- input checks ------------------------------------------------------------------------------------


def _check_alpha(alpha: float, name: str = "alpha") -> float:
    if not (isinstance(alpha, int | float) and 0.0 < alpha < 1.0):
        raise ValueError(f"{name} must be in (0, 1), got {alpha!r}")
    return float(alpha)


def _check_margin(margin: float) -> float:
    if not (isinstance(margin, int | float) and math.isfinite(margin) and margin >= 0.0):
        raise ValueError(f"margin must be a finite number >= 0, got {margin!r}")
    return float(margin)


def _check_share(share: float, name: str = "share") -> float:
    if not (isinstance(share, int | float) and 0.0 <= share <= 1.0):
        raise ValueError(f"{name} must be in [0, 1], got {share!r}")
    return float(share)


def _sample(name: str, values: npt.ArrayLike, min_size: int, unit: bool = False) -> npt.NDArray[np.float64]:
    """`values` as a 1-D float array of at least `min_size` finite numbers (in [0, 1] if `unit`)."""
    x = np.asarray(values, dtype=np.float64)
    if x.ndim != 1:
        raise ValueError(f"{name} must be one-dimensional, got shape {x.shape}")
    if x.size < min_size:
        raise ValueError(f"{name} has {x.size} value(s); need at least {min_size}")
    bad = np.flatnonzero(~np.isfinite(x) | ((x < 0.0) | (x > 1.0) if unit else False))
    if bad.size:
        i = int(bad[0])
        what = "a finite number in [0, 1]" if unit else "a finite number"
        raise ValueError(f"{name}[{i}] = {x[i]!r} is not {what}")
    return x


# --- 1. offline non-inferiority --------------------------------------------------------------------


@dataclass(frozen=True)
class NonInferiorityResult:
    """One offline non-inferiority test of candidate vs incumbent on the same prompts.

    `p_value` is one-sided, for H0: true mean difference <= -margin; `passed` iff lower_bound > -margin.
    """

    n_prompts: int
    mean_diff: float
    se: float
    lower_bound: float
    margin: float
    alpha: float
    method: Method
    passed: bool
    p_value: float


def _paired_differences(candidate: npt.ArrayLike, incumbent: npt.ArrayLike) -> npt.NDArray[np.float64]:
    cand = _sample("candidate", candidate, 2, unit=True)
    inc = _sample("incumbent", incumbent, 2, unit=True)
    if cand.size != inc.size:
        raise ValueError(f"candidate has {cand.size} prompts but incumbent has {inc.size}; they must be paired")
    return cand - inc


def _degenerate(d: npt.NDArray[np.float64], margin: float, alpha: float, method: Method) -> NonInferiorityResult:
    """All differences equal: no spread to estimate, so the bound is the mean itself."""
    mean = float(d[0])
    passed = mean > -margin
    return NonInferiorityResult(d.size, mean, 0.0, mean, margin, alpha, method, passed, 0.0 if passed else 1.0)


def paired_t_non_inferiority(
    candidate: npt.ArrayLike,
    incumbent: npt.ArrayLike,
    margin: float = DEFAULT_MARGIN,
    alpha: float = DEFAULT_ALPHA,
) -> NonInferiorityResult:
    """Paired, prompt-clustered t test that the candidate is at most `margin` worse than the incumbent.

    `candidate[i]` and `incumbent[i]` are the mean of G verifiable 0/1 rewards on prompt i. With
    d_i = candidate[i] - incumbent[i] and n prompts:

        mean = Σ d_i / n,   se = sd(d) / √n  (sd with n - 1),   lower = mean - t_{1-α, n-1} · se,
        p = 1 - T_{n-1}((mean + margin) / se).

    Non-inferior iff lower > -margin (equivalently p < α). Assumes prompts are independent draws from
    the eval distribution and the mean difference is approximately normal.
    """
    margin, alpha = _check_margin(margin), _check_alpha(alpha)
    d = _paired_differences(candidate, incumbent)
    if np.ptp(d) == 0.0:
        return _degenerate(d, margin, alpha, "paired_t")
    n = d.size
    mean = float(d.mean())
    se = float(d.std(ddof=1) / math.sqrt(n))
    lower = mean - float(stats.t.ppf(1.0 - alpha, n - 1)) * se
    p = float(stats.t.sf((mean + margin) / se, n - 1))
    return NonInferiorityResult(n, mean, se, lower, margin, alpha, "paired_t", lower > -margin, p)


def paired_bootstrap_non_inferiority(
    candidate: npt.ArrayLike,
    incumbent: npt.ArrayLike,
    margin: float = DEFAULT_MARGIN,
    alpha: float = DEFAULT_ALPHA,
    n_resamples: int = 10_000,
    seed: int = 0,
) -> NonInferiorityResult:
    """Paired bootstrap version of `paired_t_non_inferiority`.

    Resamples the n prompts with replacement (each prompt keeps its candidate and incumbent score, so
    the pairing survives), `n_resamples` times with `numpy.random.default_rng(seed)`, and takes the
    mean difference of each resample. lower = the α-quantile of those means (percentile bootstrap),
    se = their standard deviation, p = the fraction of them at or below -margin. Assumes prompts are
    exchangeable; no normality needed, but the percentile bound is optimistic for very few prompts.
    """
    margin, alpha = _check_margin(margin), _check_alpha(alpha)
    if not (isinstance(n_resamples, int) and n_resamples >= 100):
        raise ValueError(f"n_resamples must be an integer >= 100, got {n_resamples!r}")
    d = _paired_differences(candidate, incumbent)
    if np.ptp(d) == 0.0:
        return _degenerate(d, margin, alpha, "paired_bootstrap")
    rng = np.random.default_rng(seed)
    n, chunk = d.size, max(1, 2_000_000 // d.size)  # bounded memory: chunk x n indices at a time
    means = np.concatenate(
        [
            d[rng.integers(0, n, size=(min(chunk, n_resamples - start), n))].mean(axis=1)
            for start in range(0, n_resamples, chunk)
        ]
    )
    lower = float(np.quantile(means, alpha))
    p = float(np.mean(means <= -margin))
    return NonInferiorityResult(
        n, float(d.mean()), float(means.std(ddof=1)), lower, margin, alpha, "paired_bootstrap", lower > -margin, p
    )


# --- 2. several task families: Holm -----------------------------------------------------------------


def holm(pvalues: Mapping[str, float], alpha: float = DEFAULT_ALPHA) -> dict[str, bool]:
    """Holm's step-down procedure: which null hypotheses to reject (True) at family-wise level α.

    Sort the m p-values p_(1) <= ... <= p_(m); reject H_(k) while p_(k) <= α / (m - k + 1) and stop at
    the first that fails (everything after it is kept). Valid under any dependence between the tests.
    Ties are broken by name, so the answer never depends on the mapping's order.
    """
    alpha = _check_alpha(alpha)
    if not pvalues:
        raise ValueError("pvalues is empty; need at least one hypothesis")
    for name, p in pvalues.items():
        if not (isinstance(p, int | float) and 0.0 <= p <= 1.0):
            raise ValueError(f"p-value for {name!r} must be in [0, 1], got {p!r}")
    m = len(pvalues)
    rejected = dict.fromkeys(pvalues, False)
    for k, name in enumerate(sorted(pvalues, key=lambda key: (pvalues[key], key))):
        if pvalues[name] > alpha / (m - k):
            break
        rejected[name] = True
    return rejected


@dataclass(frozen=True)
class FamilyRegressions:
    """Per-family harm tests after Holm: `regressed[name]` iff that family is significantly worse than
    -margin (H0: diff >= -margin rejected); `passed[name]` is its negation. `mean_diff`, `se` and `n`
    per family, and the pooled test's degrees of freedom `df`, are the numbers behind each p-value."""

    p_values: dict[str, float]
    regressed: dict[str, bool]
    alpha: float
    mean_diff: dict[str, float]
    se: dict[str, float]
    n: dict[str, int]
    df: int
    margin: float

    @property
    def passed(self) -> dict[str, bool]:
        return {name: not r for name, r in self.regressed.items()}

    @property
    def all_passed(self) -> bool:
        return not any(self.regressed.values())

    def bounds(self, name: str) -> tuple[float, float]:
        """The family's two-sided (1 - 2α) interval for its mean difference, on the pooled se."""
        half = float(stats.t.ppf(1.0 - self.alpha, self.df)) * self.se[name]
        return self.mean_diff[name] - half, self.mean_diff[name] + half


def family_regressions(
    differences: npt.ArrayLike,
    families: Sequence[str],
    margin: float = DEFAULT_MARGIN,
    alpha: float = DEFAULT_ALPHA,
) -> FamilyRegressions:
    """Which families regressed beyond `margin`, from the per-prompt differences d_i = cand_i - inc_i
    and each prompt's family, corrected with Holm at level α.

    A pooled-variance t test (one-way ANOVA's error term): with N prompts in F families, family f's
    mean difference m_f over its n_f prompts, and the within-family residual variance pooled over every
    family, s² = Σ_i (d_i - m_f(i))² / (N - F),

        se_f = s / √n_f,   t_f = (m_f + margin) / se_f,   p_f = T_{N-F}(t_f)   (H0: diff_f >= -margin).

    Pooling gives a family of a few prompts the variance estimate of the whole suite (N - F degrees of
    freedom) instead of its own n_f - 1, so neither a handful of identical differences (zero spread,
    hence p = 0 under a per-family t) nor a family's own noisy spread decides. It assumes the families'
    spreads are alike; on the demo's measured pass rates, at the default suite (28 prompts per family)
    and G 8, an equally good candidate has some family flagged 0.4% of the time (1,000 replicates) and a
    family dropped by 25 points is flagged 95.5-100% of the time (200 each; tests/gating/
    test_family_power.py). s = 0 (every family's differences constant) gives
    t = ±inf: p = 0 for a family whose constant difference is below -margin, 1 otherwise (0/0, a
    constant difference of exactly -margin, is H0's boundary: p = 1). ValueError without a degree of
    freedom (every family a single prompt) or with differences outside [-1, 1].
    """
    margin, alpha = _check_margin(margin), _check_alpha(alpha)
    d = np.asarray(differences, dtype=np.float64)
    if d.ndim != 1 or d.size != len(families):
        raise ValueError(f"differences has shape {d.shape} for {len(families)} family labels; need one per prompt")
    bad = np.flatnonzero(~np.isfinite(d) | (np.abs(d) > 1.0))
    if bad.size:
        raise ValueError(f"differences[{int(bad[0])}] = {float(d[bad[0]])!r} is not a finite number in [-1, 1]")
    names = sorted(set(families))
    labels = np.array([names.index(f) for f in families])
    counts = np.bincount(labels, minlength=len(names))
    df = d.size - len(names)
    if df < 1:
        raise ValueError(f"{d.size} prompts in {len(names)} families leave no degree of freedom for the variance")
    means = np.bincount(labels, weights=d, minlength=len(names)) / counts
    s2 = float(((d - means[labels]) ** 2).sum() / df)
    se = np.sqrt(s2 / counts)
    num = means + margin
    with np.errstate(divide="ignore", invalid="ignore"):
        t = np.where(num == 0.0, np.inf, num / se)
    p = stats.t.cdf(t, df)
    p_values = {n: float(p[k]) for k, n in enumerate(names)}
    return FamilyRegressions(
        p_values,
        holm(p_values, alpha),
        alpha,
        {n: float(means[k]) for k, n in enumerate(names)},
        {n: float(se[k]) for k, n in enumerate(names)},
        {n: int(counts[k]) for k, n in enumerate(names)},
        df,
        margin,
    )


# --- 3. sample ratio mismatch ------------------------------------------------------------------------


@dataclass(frozen=True)
class SRMResult:
    """Chi-square goodness of fit of user counts per arm to the intended shares."""

    statistic: float
    p_value: float
    df: int
    threshold: float
    srm_ok: bool


def srm_check(
    observed: Mapping[str, int], expected_shares: Mapping[str, float], threshold: float = DEFAULT_SRM_THRESHOLD
) -> SRMResult:
    """Sample ratio mismatch: do the users per arm match the shares the assignment was meant to give?

    Pearson's statistic Σ (O_a - E_a)² / E_a with E_a = share_a · Σ O, on k - 1 degrees of freedom
    (`scipy.stats.chisquare`). `srm_ok` iff p >= threshold (default 0.001: SRM is checked at every look,
    so only a glaring mismatch should stop the canary). Shares must sum to 1; an arm with share 0 is
    left out unless it has users, which is a mismatch outright (statistic inf, p 0). Count *users*,
    not requests (requests of one user are not independent), and keep the anonymous stratum out.
    """
    threshold = _check_alpha(threshold, "threshold")
    if set(observed) != set(expected_shares):
        raise ValueError(f"observed arms {sorted(observed)} differ from expected arms {sorted(expected_shares)}")
    for arm, count in observed.items():
        if isinstance(count, bool) or not isinstance(count, int | np.integer) or count < 0:
            raise ValueError(f"count for arm {arm!r} must be a non-negative integer, got {count!r}")
    shares = {arm: _check_share(s, f"share of arm {arm!r}") for arm, s in expected_shares.items()}
    if not math.isclose(sum(shares.values()), 1.0, abs_tol=1e-9):
        raise ValueError(f"expected shares must sum to 1, got {sum(shares.values())!r}")
    total = sum(int(c) for c in observed.values())
    if total == 0:
        raise ValueError("observed has no users in any arm")
    arms = [arm for arm in shares if shares[arm] > 0.0]
    if len(arms) < 2:
        raise ValueError(f"need at least two arms with a positive share, got {shares}")
    df = len(arms) - 1
    if any(observed[arm] > 0 for arm in shares if shares[arm] == 0.0):
        return SRMResult(math.inf, 0.0, df, threshold, False)
    f_obs = np.array([observed[arm] for arm in arms], dtype=np.float64)
    f_exp = np.array([shares[arm] for arm in arms]) * total
    statistic, p = stats.chisquare(f_obs, f_exp)
    return SRMResult(float(statistic), float(p), df, threshold, float(p) >= threshold)


# --- 4. always-valid confidence sequence --------------------------------------------------------------


@dataclass(frozen=True)
class Interval:
    """An always-valid interval for mean(candidate) - mean(incumbent) at this look.

    `se` is the plain standard error of the difference; `radius` the always-valid half-width.
    """

    lower: float
    upper: float
    estimate: float
    se: float
    radius: float
    n_candidate: int
    n_incumbent: int
    alpha: float
    rho: float

    def excludes(self, value: float) -> bool:
        return not self.lower <= value <= self.upper

    def passes(self, margin: float) -> bool:
        """A canary step passes iff the candidate is at most `margin` worse: lower > -margin."""
        return self.lower > -_check_margin(margin)


def normal_mixture_radius(t: float, variance: float, rho: float, alpha: float = DEFAULT_ALPHA) -> float:
    """Half-width of the two-sided normal-mixture confidence sequence for a mean of t observations.

        radius = sqrt( 2 (σ² t + ρ) / t² · log( sqrt((σ² t + ρ) / ρ) / α ) )

    with σ² = `variance` per observation and ρ = `rho` > 0 (same units as σ² t). It comes from the
    mixture martingale ∫ exp(λ S_t - λ² σ² t / 2) dN(λ; 0, 1/ρ) = sqrt(ρ / (σ²t + ρ)) ·
    exp(S_t² / (2 (σ²t + ρ))) and Ville's inequality: P(∃ t: |x̄_t - μ| > radius_t) <= α (Robbins 1970;
    Howard, Ramdas, McAuliffe & Sekhon 2021, "Time-uniform, nonparametric, nonasymptotic confidence
    sequences", Ann. Statist.; it is the mSPRT of Johari, Koomen, Pekelis & Walsh 2017 inverted).
    """
    alpha = _check_alpha(alpha)
    if not (t > 0 and variance >= 0 and rho > 0):
        raise ValueError(f"need t > 0, variance >= 0, rho > 0; got t={t!r}, variance={variance!r}, rho={rho!r}")
    v = variance * t + rho
    return math.sqrt(2.0 * v / t**2 * math.log(math.sqrt(v / rho) / alpha))


def rho_for(n_total: float, alpha: float = DEFAULT_ALPHA) -> float:
    """The `rho` (in observations) that makes `confidence_sequence` tightest at n_total users in total.

    Minimising the radius over ρ at fixed t gives x - log(1 + x) = 2 log(1/α) for x = t/ρ, solved
    exactly by x = -W₋₁(-α²/e) - 1 (W₋₁ the lower branch of Lambert's W); for α = 0.05, x ≈ 8.21.
    """
    alpha = _check_alpha(alpha)
    if not n_total > 0:
        raise ValueError(f"n_total must be > 0, got {n_total!r}")
    x = -float(special.lambertw(-(alpha**2) / math.e, k=-1).real) - 1.0
    return float(n_total) / x


def confidence_sequence(
    candidate: npt.ArrayLike, incumbent: npt.ArrayLike, alpha: float = DEFAULT_ALPHA, rho: float = DEFAULT_RHO
) -> Interval:
    """Always-valid (1 - α) interval for mean(candidate) - mean(incumbent), safe to recompute after
    every batch and to stop on.

    `candidate` and `incumbent` are one outcome per user (everything each arm has seen so far). With
    W = s_c²/n_c + s_i²/n_i (the squared standard error of the difference of means), the difference is
    treated as the mean of t = n_c + n_i per-user contrasts of variance σ² = t · W (the inverse-
    propensity contrast of a randomised split, so unequal arms are handled), and the normal-mixture
    boundary of `normal_mixture_radius` is applied with ρ_abs = rho · σ²:

        radius = sqrt( W · 2 (1 + rho/t) · log( sqrt(1 + t/rho) / α ) ).

    This is the asymptotic confidence sequence of Waudby-Smith, Arbour, Sinha, Kennedy & Ramdas (2024,
    "Time-uniform central limit theory and asymptotic confidence sequences"), with their ρ² = 1/rho.

    `rho` (default 250) is the mixing parameter in units of users: the prior on the effect is
    N(0, 1/(rho σ²)). It tunes *when* the sequence is tightest, near t ≈ 8.2 · rho users in total at
    α = 0.05 (see `rho_for`); smaller rho is tighter early and looser late, larger the reverse. Any
    fixed rho keeps the guarantee; choose it before the experiment, never from its data.
    """
    alpha = _check_alpha(alpha)
    if not (isinstance(rho, int | float) and math.isfinite(rho) and rho > 0):
        raise ValueError(f"rho must be a finite number > 0, got {rho!r}")
    cand, inc = _sample("candidate", candidate, 2), _sample("incumbent", incumbent, 2)
    estimate = float(cand.mean() - inc.mean())
    w = float(cand.var(ddof=1) / cand.size + inc.var(ddof=1) / inc.size)
    t = cand.size + inc.size
    radius = normal_mixture_radius(t, t * w, rho * t * w, alpha) if w > 0 else 0.0
    return Interval(
        estimate - radius, estimate + radius, estimate, math.sqrt(w), radius, cand.size, inc.size, alpha, float(rho)
    )


# --- 5. guardrails --------------------------------------------------------------------------------------


@dataclass(frozen=True)
class GuardrailResult:
    """Harm detection on one metric: `harmed` iff the always-valid interval lies wholly on the bad side."""

    metric: str
    direction: Direction
    interval: Interval
    harmed: bool


def guardrail(
    metric: str,
    candidate: npt.ArrayLike,
    incumbent: npt.ArrayLike,
    direction: Direction,
    alpha: float = DEFAULT_ALPHA,
    rho: float = DEFAULT_RHO,
) -> GuardrailResult:
    """One-sided, always-valid test of "the candidate is worse than the incumbent by any amount".

    For `higher_is_worse` (latency, error rate) harm iff lower > 0; for `lower_is_worse` (pass rate)
    harm iff upper < 0, the interval being `confidence_sequence(candidate, incumbent, alpha, rho)`.
    Using the two-sided sequence one side at a time keeps the false-alarm rate under α (about α/2).
    """
    if not metric:
        raise ValueError("metric must be a non-empty name")
    if direction not in ("higher_is_worse", "lower_is_worse"):
        raise ValueError(f"direction must be 'higher_is_worse' or 'lower_is_worse', got {direction!r}")
    interval = confidence_sequence(candidate, incumbent, alpha, rho)
    harmed = interval.lower > 0.0 if direction == "higher_is_worse" else interval.upper < 0.0
    return GuardrailResult(metric, direction, interval, harmed)


# --- 6. sticky assignment -------------------------------------------------------------------------------


def assignment_unit(salt: str, tenant: str, user: str) -> float:
    """A uniform number in [0, 1) fixed by (salt, tenant, user).

    SHA-256 of the JSON array [salt, tenant, user] (unambiguous, whatever the strings contain); the
    first 53 bits of the digest over 2⁵³, so the result is exact in a float and never 1.0.
    """
    digest = hashlib.sha256(json.dumps([salt, tenant, user]).encode()).digest()
    return (int.from_bytes(digest[:8], "big") >> 11) / 2.0**53


def assign_arm(salt: str, tenant: str, user: str | None, share: float) -> Arm:
    """Sticky arm of one user: "candidate" iff `assignment_unit(salt, tenant, user)` < share.

    The unit never changes for a user, so ramping the share up (5% → 20% → 50%) keeps everyone already
    in the canary there and only adds users. A new salt (a new experiment) reshuffles everyone.
    Requests without a user (None or "") are "anonymous": their own stratum, never pooled with either
    arm, since they cannot be assigned stickily.
    """
    share = _check_share(share)
    if not user:
        return "anonymous"
    return "candidate" if assignment_unit(salt, tenant, user) < share else "incumbent"
