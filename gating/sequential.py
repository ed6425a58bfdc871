"""Online statistics valid under continuous monitoring, beside `gating.stats`.

- `srm_sequential`: an always-valid sample-ratio-mismatch test, the Dirichlet-multinomial mixture
  e-value of Lindon & Malek ("Anytime-valid inference for multinomial count data", NeurIPS 2022).
  Each new user is an independent draw from the intended shares p under the null, so the ratio of
  the mixture likelihood (a Dirichlet(κ p) prior on the shares) to the null likelihood,

      E_n = Γ(κ) / Γ(κ + n) · Π_a Γ(κ p_a + x_a) / Γ(κ p_a) / Π_a p_a^{x_a},

  is a non-negative martingale with mean 1 under the null (the marginal of any order of the same
  counts is the same, so it depends on the counts alone). By Ville's inequality
  P(∃ n: E_n ≥ 1/α) ≤ α: a test that rejects as soon as E_n ≥ 1/α, looked at after every user or
  any subset of them, has false-alarm probability at most α over the whole step. 1/E_n (kept as
  its running minimum by stopping at the first rejection) is the always-valid p-value.
  κ (`concentration`) sets which mismatches the mixture is tuned to: the prior sd of a share is
  sqrt(p (1 - p) / (κ + 1)), so the default κ = 100 aims at deviations of a few points, the size an
  assignment bug or a lossy pipeline produces; any fixed κ keeps the guarantee.
- `log_srm_evalue`: the same, vectorised over replicates (simulations).
- `step_rho`: the confidence sequence's mixing parameter for a step expecting `users` users.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt
from scipy import special

from gating.stats import DEFAULT_ALPHA, rho_for

DEFAULT_SRM_ALPHA = 0.001
"""Level of the always-valid SRM test per step: a broken split is glaring, a false abort costs a canary."""
DEFAULT_SRM_CONCENTRATION = 100.0


def _check_level(x: float, name: str) -> float:
    if not (isinstance(x, int | float) and 0.0 < x < 1.0):
        raise ValueError(f"{name} must be in (0, 1), got {x!r}")
    return float(x)


def log_srm_evalue(
    counts: npt.ArrayLike, shares: npt.ArrayLike, concentration: float = DEFAULT_SRM_CONCENTRATION
) -> npt.NDArray[np.float64]:
    """log E_n of the module docstring for counts[..., k] (last axis: arms) against shares[k] > 0."""
    if not (math.isfinite(concentration) and concentration > 0):
        raise ValueError(f"concentration must be a finite number > 0, got {concentration!r}")
    x = np.asarray(counts, dtype=np.float64)
    p = np.asarray(shares, dtype=np.float64)
    if p.ndim != 1 or p.size < 2 or np.any(p <= 0) or not math.isclose(float(p.sum()), 1.0, abs_tol=1e-9):
        raise ValueError(f"shares must be >= 2 positive numbers summing to 1, got {p.tolist()}")
    if x.shape[-1] != p.size or np.any(x < 0):
        raise ValueError(f"counts must be non-negative with {p.size} arms on the last axis, got shape {x.shape}")
    a = concentration * p
    n = x.sum(axis=-1)
    log_mix = special.gammaln(concentration) - special.gammaln(concentration + n)
    log_mix = log_mix + (special.gammaln(a + x) - special.gammaln(a)).sum(axis=-1)
    log_null = (x * np.log(p)).sum(axis=-1)
    return np.asarray(log_mix - log_null, dtype=np.float64)


@dataclass(frozen=True)
class SequentialSRM:
    """The always-valid SRM test at one look: mismatch iff e_value >= 1 / alpha (p_value < alpha)."""

    log_e: float
    p_value: float  # min(1, 1 / E_n): always valid
    alpha: float
    concentration: float
    srm_ok: bool

    @property
    def e_value(self) -> float:
        return math.exp(min(self.log_e, 700.0))


def srm_sequential(
    observed: Mapping[str, int],
    expected_shares: Mapping[str, float],
    alpha: float = DEFAULT_SRM_ALPHA,
    concentration: float = DEFAULT_SRM_CONCENTRATION,
) -> SequentialSRM:
    """The always-valid SRM test on users per arm (module docstring). Arms with share 0 must have no
    users (one that has is a mismatch outright); at least two arms need a positive share."""
    alpha = _check_level(alpha, "alpha")
    if set(observed) != set(expected_shares):
        raise ValueError(f"observed arms {sorted(observed)} differ from expected arms {sorted(expected_shares)}")
    for arm, c in observed.items():
        if isinstance(c, bool) or not isinstance(c, int | np.integer) or c < 0:
            raise ValueError(f"count for arm {arm!r} must be a non-negative integer, got {c!r}")
    for arm, s in expected_shares.items():
        if not (isinstance(s, int | float) and 0.0 <= s <= 1.0):
            raise ValueError(f"share of arm {arm!r} must be in [0, 1], got {s!r}")
    live = [a for a in expected_shares if expected_shares[a] > 0]
    if len(live) < 2:
        raise ValueError(f"need at least two arms with a positive share, got {dict(expected_shares)}")
    if any(observed[a] > 0 for a in expected_shares if expected_shares[a] == 0):
        return SequentialSRM(math.inf, 0.0, alpha, float(concentration), False)
    log_e = float(log_srm_evalue([observed[a] for a in live], [expected_shares[a] for a in live], concentration))
    p = min(1.0, math.exp(-log_e)) if log_e > -700 else 1.0
    return SequentialSRM(log_e, p, alpha, float(concentration), log_e < math.log(1.0 / alpha))


def step_rho(users: float, alpha: float = DEFAULT_ALPHA) -> float:
    """The mixing parameter (users) that makes the confidence sequence tightest at `users` users in
    both arms (`gating.stats.rho_for`), with at least 1 user."""
    return rho_for(max(1.0, float(users)), alpha)
