"""Poisoning defences: a user who dominates or skews the reward behind a version is flagged, counted and down-weighted.

The per-user caps of `feedback.rewards` bound how much one user moves one completion's reward and how many
completions a user may reward per window. This is the second line, over the samples of one update
(the data behind one version). A user (tenant + hashed user id) is flagged when either rule holds:

- **share**: the user's reward mass (sum of |reward| over their samples) is more than `max_share`
  (25%) of the batch's, once the batch has at least `min_users` users. A heavy user is not suspect
  in itself: product traffic is heavy-tailed (the demo draws activity from a Pareto(1.5), whose top
  user of 500 holds up to ~18% of the traffic), so the bound is on one user holding a quarter of an
  update, where no honest population of 20 or more users puts anyone;
- **deviation**: the user's rewards differ systematically from what the batch's other users give
  in the same contexts. Each sample's residual is its reward minus the mean reward of its baseline
  key (`learner.baselines.baseline_key`, no key: one group) over the batch's other users'
  samples (a heavy user does not set their own yardstick); σ is the residuals'
  pooled standard deviation; a user with n ≥ `min_samples` samples and residual sum S has
  z = S / (σ √n), flagged when |z| > `z_max` (4: about 6e-5 two-sided per user under the null, so
  with ~150 users an update flags an honest user with probability under 1% unless their own taste
  is far from everyone's). Users who reward what others punish (and the reverse) show up here once
  they have enough samples; a light adversary, one sample per update, cannot be told from an honest
  user by rewards alone (the product's verifier would be needed).

A flagged user's samples keep their rewards but get a weight below 1: `max_share / share` for the
share rule, `z_max / |z|` for the deviation rule (the smaller when both hold). The trainer multiplies
each sample's loss by its weight. Flags are returned as plain data, stored with the version's metrics
in the registry (`poisoning`) and counted in every update's statistics
(`poisoning_flagged_users`, `poisoning_flagged_samples`). Anonymous completions (no user) are one
stratum of their own and never flagged here: their reward is already capped as one user's.
Simulated against the demo's users in tests/learner/test_poisoning_sim.py.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from feedback.events import SampleEvent
from learner.baselines import baseline_key


class PoisoningConfig(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    enabled: bool = Field(True, description="Screen every update's samples.")
    max_share: float = Field(0.25, gt=0, le=1, description="Most of a batch's reward mass one user may hold.")
    min_users: int = Field(20, ge=2, description="Users a batch needs before the share rule applies.")
    z_max: float = Field(4.0, gt=0, description="A user's reward residuals more than this many σ/√n from 0: flagged.")
    min_samples: int = Field(8, ge=2, description="Samples a user needs in a batch before the deviation rule applies.")


@dataclass(frozen=True)
class Flag:
    tenant: str
    user: str
    samples: int
    reward_share: float
    reasons: tuple[str, ...]
    weight: float

    def as_dict(self) -> dict[str, Any]:
        return {
            "tenant": self.tenant,
            "user": self.user,
            "samples": self.samples,
            "reward_share": round(self.reward_share, 6),
            "reasons": list(self.reasons),
            "weight": round(self.weight, 6),
        }


@dataclass
class Screening:
    weights: list[float]
    """One per sample, in input order: 1.0, or a flagged user's weight."""
    flags: list[Flag] = field(default_factory=list)
    users: int = 0

    def summary(self) -> dict[str, Any]:
        """What the registry stores with the version (`metrics["poisoning"]`)."""
        flagged = sum(f.samples for f in self.flags)
        return {
            "users": self.users,
            "flagged_users": len(self.flags),
            "flagged_samples": flagged,
            "flagged_reward_share": round(sum(f.reward_share for f in self.flags), 6),
            "flags": [f.as_dict() for f in self.flags],
        }


def screen(samples: Sequence[SampleEvent], cfg: PoisoningConfig | None = None) -> Screening:
    """Flag the users who dominate or skew `samples` and weigh their samples down (module docstring)."""
    cfg = cfg or PoisoningConfig()
    weights = [1.0] * len(samples)
    by_user: dict[tuple[str, str], list[int]] = {}
    for i, s in enumerate(samples):
        if s.completion.user_id:
            by_user.setdefault((s.tenant, s.completion.user_id), []).append(i)
    out = Screening(weights, users=len(by_user))
    if not cfg.enabled or not by_user:
        return out
    total = sum(abs(s.reward) for s in samples)
    residual = _residuals(samples)
    sigma = math.sqrt(sum(r * r for r in residual) / max(len(samples) - 1, 1))
    for (tenant, user), ix in sorted(by_user.items()):
        share = sum(abs(samples[i].reward) for i in ix) / total if total > 0 else 0.0
        reasons, weight = [], 1.0
        if len(by_user) >= cfg.min_users and share > cfg.max_share:
            reasons.append(f"share {share:.1%} of the reward > {cfg.max_share:.1%}")
            weight = min(weight, cfg.max_share / share)
        if len(ix) >= cfg.min_samples and sigma > 0:
            z = sum(residual[i] for i in ix) / (sigma * math.sqrt(len(ix)))
            if abs(z) > cfg.z_max:
                reasons.append(f"rewards {z:+.1f} σ/√n from their contexts' ({len(ix)} samples) > {cfg.z_max:g}")
                weight = min(weight, cfg.z_max / abs(z))
        if reasons:
            out.flags.append(Flag(tenant, user, len(ix), share, tuple(reasons), weight))
            for i in ix:
                weights[i] = weight
    return out


def _residuals(samples: Sequence[SampleEvent]) -> list[float]:
    """Each sample's reward minus the mean reward of its baseline key over the batch's *other* users'
    samples (the user's own samples never set their yardstick; 0 where nobody else had that key)."""
    keys = [(baseline_key(s), s.tenant, s.completion.user_id) for s in samples]
    by_key: dict[str | None, list[float]] = {}
    by_key_user: dict[tuple, list[float]] = {}
    for (k, t, u), s in zip(keys, samples):
        for acc in (by_key.setdefault(k, [0.0, 0.0]), by_key_user.setdefault((k, t, u), [0.0, 0.0])):
            acc[0] += s.reward
            acc[1] += 1
    out = []
    for (k, t, u), s in zip(keys, samples):
        total, mine = by_key[k], by_key_user[(k, t, u)] if u else [s.reward, 1.0]
        n = total[1] - mine[1]
        out.append(s.reward - (total[0] - mine[0]) / n if n > 0 else 0.0)
    return out
