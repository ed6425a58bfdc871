"""Poisoning defences: a user who dominates the reward behind a version is flagged, counted and down-weighted.

The per-user caps of `feedback.rewards` bound how much one user moves one completion's reward and how many
completions a user may reward per window. This is the second line, over the samples of one update
(the data behind one version). A user (tenant + hashed user id) *dominates* when either rule holds:

- **share**: the user's reward mass (sum of |reward| over their samples) is more than `max_share` of
  the batch's, once the batch has at least `min_users` users (with three users, a third each is normal);
- **rate**: the user's sample count is more than `mad_k` median absolute deviations above the median
  user's (the MAD floored at 1 sample, so a batch of one-sample users does not flag a user with two).

A flagged user's samples keep their rewards but get a weight below 1, chosen so that the user ends at
the rule's threshold: `max_share / share` for the share rule, `threshold / count` for the rate rule
(the smaller when both hold). The trainer multiplies each sample's loss by its weight. Flags are
returned as plain data, stored with the version's metrics in the registry (`poisoning`), so the
dashboard shows who was flagged, why and with what weight. Anonymous completions (no user) are one
stratum of their own and never flagged here: their reward is already capped as one user's.
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from feedback.events import SampleEvent


class PoisoningConfig(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    enabled: bool = Field(True, description="Screen every update's samples.")
    max_share: float = Field(0.05, gt=0, le=1, description="Most of a batch's reward mass one user may hold.")
    min_users: int = Field(20, ge=2, description="Users a batch needs before the share rule applies.")
    mad_k: float = Field(5.0, gt=0, description="Samples more than this many MADs above the median user: flagged.")


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
    rate_threshold: float = 0.0

    def summary(self) -> dict[str, Any]:
        """What the registry stores with the version (`metrics["poisoning"]`)."""
        flagged = sum(f.samples for f in self.flags)
        return {
            "users": self.users,
            "flagged_users": len(self.flags),
            "flagged_samples": flagged,
            "flagged_reward_share": round(sum(f.reward_share for f in self.flags), 6),
            "rate_threshold": round(self.rate_threshold, 3),
            "flags": [f.as_dict() for f in self.flags],
        }


def screen(samples: Sequence[SampleEvent], cfg: PoisoningConfig | None = None) -> Screening:
    """Flag the users who dominate `samples` and weigh their samples down (module docstring)."""
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
    counts = [len(ix) for ix in by_user.values()]
    median = statistics.median(counts)
    mad = max(1.0, statistics.median(abs(c - median) for c in counts))
    out.rate_threshold = median + cfg.mad_k * mad
    for (tenant, user), ix in sorted(by_user.items()):
        share = sum(abs(samples[i].reward) for i in ix) / total if total > 0 else 0.0
        reasons, weight = [], 1.0
        if len(by_user) >= cfg.min_users and share > cfg.max_share:
            reasons.append(f"share {share:.1%} of the reward > {cfg.max_share:.1%}")
            weight = min(weight, cfg.max_share / share)
        if len(ix) > out.rate_threshold:
            reasons.append(f"{len(ix)} samples > median {median:g} + {cfg.mad_k:g} x MAD {mad:g}")
            weight = min(weight, out.rate_threshold / len(ix))
        if reasons:
            out.flags.append(Flag(tenant, user, len(ix), share, tuple(reasons), weight))
            for i in ix:
                weights[i] = weight
    return out
