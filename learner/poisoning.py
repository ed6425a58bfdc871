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
  user by rewards alone: the next rule is for them;
- **verified** (only when the learner has the product's verifier, `product.suites.Verifier`): the
  user's rewards run against correctness. A `Scout` reads every sample on the sample topic once, in
  its own consumer group, as it arrives, and has the verifier score it (pass: score ≥ 0.5; a prompt it
  cannot check, or a verifier that fails, is counted and left out): whether the learner will train on
  it, drop it for policy lag, or has not reached it yet, since what a user's rewards say about the user
  neither waits for the learner nor goes stale with the policy. Over every sample so far
  (`VerifiedTally`, kept with the learner's state), a user's mean reward on passing completions minus
  their mean reward on failing ones, Δ, has z = Δ / (σ √(1/n_pass + 1/n_fail)), σ everyone's reward
  deviation within each kind, pooled; flagged when z < -`verified_z_max` (2.0) with at least
  `verified_min_samples` (4) verified samples, one of each kind.
  Raw rewards, not the context residuals above: a context's mean tracks its pass rate, so residuals
  would push a user whose rewards ignore correctness below 0. One-sided on purpose: an honest user,
  however harsh or lenient, rewards passing code more than failing code (Δ > 0); a user whose rewards
  ignore correctness has Δ = 0 (2.3% per look below -2.0, though looks accumulate over a long run);
  only one who rewards against correctness drifts below.

A flagged user's samples keep their rewards but get a weight below 1: `max_share / share` for the
share rule, `z_max / |z|` for the deviation rule, `verified_z_max / |z|` for the verified one (the
smallest when several hold). The trainer multiplies
each sample's loss by its weight. Flags are returned as plain data, stored with the version's metrics
in the registry (`poisoning`) and counted in every update's statistics
(`poisoning_flagged_users`, `poisoning_flagged_samples`). Anonymous completions (no user) are one
stratum of their own and never flagged here: their reward is already capped as one user's.
What the scout scored and could not score is counted in every update's statistics
(`poisoning_verified_samples`, `poisoning_unverifiable_samples`).
Simulated against the demo's users in tests/learner/test_poisoning_sim.py.
"""

from __future__ import annotations

import logging
import math
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from feedback.bus import Consumer, Record
from feedback.events import SampleEvent
from feedback.spool import Deduper
from learner.baselines import baseline_key
from product.suites import Verifier

log = logging.getLogger(__name__)


class PoisoningConfig(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    enabled: bool = Field(True, description="Screen every update's samples.")
    max_share: float = Field(0.25, gt=0, le=1, description="Most of a batch's reward mass one user may hold.")
    min_users: int = Field(20, ge=2, description="Users a batch needs before the share rule applies.")
    z_max: float = Field(4.0, gt=0, description="A user's reward residuals more than this many σ/√n from 0: flagged.")
    min_samples: int = Field(8, ge=2, description="Samples a user needs in a batch before the deviation rule applies.")
    verified_z_max: float = Field(
        2.0,
        gt=0,
        description="With a verifier: a user rewarding failing over passing code by this many SE is flagged "
        "(chosen by simulation in the demo's shape, tests/learner/test_poisoning_sim.py, docs/learner.md).",
    )
    verified_min_samples: int = Field(
        4, ge=2, description="Verified samples (over all updates, one of each kind) before the verified rule applies."
    )


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


@dataclass
class VerifiedTally:
    """The verified rule's evidence over every sample scored so far: per user (tenant, user id), the
    count and reward sum of their passing and of their failing samples; over everyone, the count, sum
    and sum of squares of the rewards of each kind (for the pooled within-kind deviation σ); and per
    partition of the sample topic, the offset after the last record the `Scout` read, so that a
    redelivered record counts once. Plain data, so the learner keeps it with its optimizer state."""

    users: dict[tuple[str, str], list[float]] = field(default_factory=dict)
    """(tenant, user) -> [n_pass, sum_pass, n_fail, sum_fail]."""
    kinds: list[float] = field(default_factory=lambda: [0.0] * 6)
    """Everyone's [n_pass, sum_pass, sumsq_pass, n_fail, sum_fail, sumsq_fail]."""
    positions: dict[int, int] = field(default_factory=dict)
    """Sample-topic partition -> the offset of the next record the scout has not counted."""

    def add(self, user: tuple[str, str], passed: bool, reward: float) -> None:
        acc = self.users.setdefault(user, [0.0, 0.0, 0.0, 0.0])
        at = 0 if passed else 2
        acc[at] += 1
        acc[at + 1] += reward
        k = 0 if passed else 3
        self.kinds[k] += 1
        self.kinds[k + 1] += reward
        self.kinds[k + 2] += reward * reward

    def sigma(self) -> float:
        """The rewards' standard deviation within each kind, pooled (0 until both kinds have 2)."""
        n_p, s_p, q_p, n_f, s_f, q_f = self.kinds
        if n_p < 2 or n_f < 2:
            return 0.0
        within = (q_p - s_p * s_p / n_p) + (q_f - s_f * s_f / n_f)
        return math.sqrt(max(within, 0.0) / (n_p + n_f - 2))

    def z(self, user: tuple[str, str], min_samples: int) -> float | None:
        """The user's z (module docstring), or None while their evidence is short of the rule's minimum:
        `min_samples` verified samples, at least one passing and one failing."""
        n_p, s_p, n_f, s_f = self.users.get(user, (0.0, 0.0, 0.0, 0.0))
        sigma = self.sigma()
        if n_p < 1 or n_f < 1 or n_p + n_f < min_samples or sigma <= 0:
            return None
        return (s_p / n_p - s_f / n_f) / (sigma * math.sqrt(1 / n_p + 1 / n_f))


def verify_samples(verifier: Verifier, prompts: Sequence[str], texts: Sequence[str]) -> list[bool | None]:
    """Pass (score ≥ 0.5) or fail per completion; None where the verifier cannot check the prompt (its
    `ValueError`). A refused batch is split in halves until each part is scored or a lone prompt is
    refused: a few foreign prompts cost a few calls each, not one call per completion."""
    try:
        return [score >= 0.5 for score in verifier.verify(prompts, texts)]
    except ValueError:
        if len(prompts) == 1:
            return [None]
        mid = len(prompts) // 2
        head = verify_samples(verifier, prompts[:mid], texts[:mid])
        return head + verify_samples(verifier, prompts[mid:], texts[mid:])


def verdicts(
    verifier: Verifier, decode: Callable[[list[int]], str], samples: Sequence[SampleEvent]
) -> list[bool | None]:
    """`verify_samples` on the samples' prompts (their token ids decoded) and completions. A verifier
    that fails otherwise (a crashed sandbox, say) leaves the whole batch unverified: logged and counted
    as unverifiable, so that a broken plug-in does not stop the learner."""
    prompts = [decode(s.completion.prompt_ids) for s in samples]
    try:
        return verify_samples(verifier, prompts, [s.completion.text for s in samples])
    except Exception:
        log.exception("poisoning: the verifier failed on %d samples: the verified rule skips them", len(samples))
        return [None] * len(samples)


def screen(
    samples: Sequence[SampleEvent], cfg: PoisoningConfig | None = None, tally: VerifiedTally | None = None
) -> Screening:
    """Flag the users who dominate or skew `samples` and weigh their samples down (module docstring).
    `tally`: the verified rule's evidence (`Scout`), read, not changed; without it the rule is off."""
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
        vz = tally.z((tenant, user), cfg.verified_min_samples) if tally is not None else None
        if vz is not None and vz < -cfg.verified_z_max:
            assert tally is not None
            n_p, _, n_f, _ = tally.users[(tenant, user)]
            reasons.append(
                f"rewards against the verifier: z {vz:+.1f} < -{cfg.verified_z_max:g} "
                f"({int(n_p)} passing, {int(n_f)} failing completions so far)"
            )
            weight = min(weight, cfg.verified_z_max / abs(vz))
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


class Scout:
    """Feeds the verified rule's tally (module docstring) with every sample on the sample topic, once,
    as it arrives: it reads the topic in a consumer group of its own, ahead of the learner, and scores
    each sample with the verifier. Samples without a user, and those of `skip_tenants` (opted out of
    training: not used at all), are read and left out. A record below the tally's position for its
    partition was counted before (a redelivery after a restart) and is skipped; so is an event id seen
    among the last `remember` ones (a sample the joiner published twice). The group's offsets are
    committed by `commit`, which the learner calls once the tally holding them is durable: a crash in
    between redelivers records the tally's positions skip. A restart resumes the tally saved with the
    current version; after a rebase onto an older version, until the next update, that tally is older
    than the committed offsets, and a crash then leaves the samples in between uncounted (evidence
    lost, never counted twice)."""

    def __init__(
        self,
        consumer: Consumer,
        verifier: Verifier,
        decode: Callable[[list[int]], str],
        skip_tenants: frozenset[str] = frozenset(),
        remember: int = 100_000,
    ):
        self.consumer, self.verifier, self.decode = consumer, verifier, decode
        self.skip_tenants = skip_tenants
        self._recent = Deduper(remember)
        self._uncommitted: dict[int, Record] = {}  # partition -> the last record read
        self.since: Counter[str] = Counter()
        """Since the last `take`: `verified` and `unverifiable` samples, and those `skipped` (no user,
        an opted-out tenant, malformed, a redelivery or a duplicate id)."""

    def catch_up(self, tally: VerifiedTally, max_records: int = 2000, timeout_s: float = 0.0) -> int:
        """Read and score what has arrived, until a poll comes back empty or `max_records` were read
        (the first poll waits up to `timeout_s`); how many records were read."""
        read = 0
        while read < max_records:
            recs = self.consumer.poll(
                max_records=min(500, max_records - read), timeout_s=timeout_s if not read else 0.0
            )
            if not recs:
                break
            read += len(recs)
            self._score(tally, recs)
        return read

    def _score(self, tally: VerifiedTally, recs: list[Record]) -> None:
        events = []
        for r in recs:
            self._uncommitted[r.partition] = r
            if r.offset < tally.positions.get(r.partition, 0):
                self.since["skipped"] += 1
                continue
            tally.positions[r.partition] = r.offset + 1
            try:
                ev = SampleEvent.model_validate_json(r.value)
            except ValidationError:  # the learner's own consumer dead-letters it
                self.since["skipped"] += 1
                continue
            if not ev.completion.user_id or ev.tenant in self.skip_tenants or self._recent.seen(ev.event_id):
                self.since["skipped"] += 1
                continue
            events.append(ev)
        for ev, ok in zip(events, verdicts(self.verifier, self.decode, events) if events else [], strict=True):
            if ok is None:
                self.since["unverifiable"] += 1
            else:
                self.since["verified"] += 1
                tally.add((ev.tenant, ev.completion.user_id or ""), ok, ev.reward)  # users only: filtered above

    def take(self) -> Counter[str]:
        """The counts since the last call (`since`), and start again."""
        out, self.since = self.since, Counter()
        return out

    def commit(self) -> None:
        """Commit what was read so far: call once the tally that counted it is durable."""
        if self._uncommitted:
            self.consumer.commit(list(self._uncommitted.values()))
            self._uncommitted = {}

    def close(self) -> None:
        self.consumer.close()
