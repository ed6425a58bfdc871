"""The online canary stage: a pure state machine over the joined samples of one experiment.

`CanaryOutcomes` accumulates the joiner's `SampleEvent`s of the candidate and incumbent arms (never the
anonymous stratum, never eval traffic, never pooled), per ramp step, per arm, per user; it is persisted
compactly in `gate["canary"]["counts"]` so that a restarted gate resumes where it was.
`decide(progress, outcomes, cfg, now)` says what the gate does at this look (`Decision`):

- `abort_invalid`: sample ratio mismatch (users per arm vs the step's share, `srm_check`): the split
  itself is broken, so no comparison can be trusted.
- `abort_harm`: a guardrail (latency, error rate; higher is worse) shows significant harm with the
  always-valid interval, or the satisfaction interval lies wholly below -margin: stop at once.
- `next_step` / `awaiting_approval`: the step passes only when each arm has `min_users_per_arm` users,
  the step has run `min_step_s`, and the always-valid lower bound on satisfaction(candidate) -
  satisfaction(incumbent) is above -margin. Absence of detected harm never passes a step.
  Passing the last step is `awaiting_approval` (a person decides; the gate never promotes).
- `abort_inconclusive`: `max_step_s` reached without passing.
- `wait`: otherwise.

The unit of analysis is the user: each user's mean reward (latency, error rate, pass rate) in the
step is one number, so a chatty user does not weigh more nor inflate n. Steps are stratified: only
samples of completions served since the current step started count towards it (the share changed at
that time). The denominators are exposures (`denominator="exposures"`, the default): only samples of
completions the product reported `shown` count, and the joiner emits one for every shown completion
(silence included, `feedback.rewards`), so a candidate that users ignore scores as ignored instead of
dropping out of its own metric. `denominator="feedback"` counts every joined sample, for a product that
does not report exposure (then only completions someone reacted to are compared: say so).

Guardrails are one-sided, each at `harm_alpha` (α split over guardrails and steps: peeking at three
guardrails in three steps at α each aborted 3.7% of equally good candidates for some guardrail in
bench/gate_sim_canary.py): latency and error rate (higher is worse) from the completion events, and
`pass_rate` (lower is worse), a metric the learner does not optimise: the product's verifier
(`product.suites.Verifier`) run by the gate on each counted completion it can check (`add(...,
passed=score)`; completions it cannot check carry no score).

`PostPromotionWatch` keeps the guardrails running after a person approves: the promoted version's users
since promotion against the incumbent arm's users of the canary's last step, the same one-sided tests;
harm raises an alert (recorded on the version, logged, counted), it never acts on its own.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

from feedback.events import SampleEvent
from gating.stats import (
    DEFAULT_ALPHA,
    DEFAULT_MARGIN,
    DEFAULT_RHO,
    DEFAULT_SRM_THRESHOLD,
    Direction,
    Interval,
    confidence_sequence,
    guardrail,
    srm_check,
)
from registry.models import CanaryProgress

ARMS = ("candidate", "incumbent")
OK_FINISH = frozenset({"stop", "length"})
"""Finish reasons that are no error."""
COUNTS_FORMAT = 1
Action = Literal["wait", "next_step", "awaiting_approval", "abort_invalid", "abort_harm", "abort_inconclusive"]
GuardrailMetric = Literal["latency_ms", "error_rate", "pass_rate"]
LOWER_IS_WORSE = frozenset({"pass_rate"})

# Per-user record, one list of numbers (compact JSON): reward n, sum, sum of squares; latency n, sum;
# errors; verifier-scored completions n, sum of scores.
_N, _SUM, _SQ, _LAT_N, _LAT_SUM, _ERR, _PASS_N, _PASS_SUM = range(8)


class CanaryConfig(BaseModel):
    """The canary's ramp and statistics."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    steps: tuple[float, ...] = Field(
        (0.05, 0.20, 0.50), description="Shares of users on the candidate, one per ramp step, increasing in (0, 1)."
    )
    min_users_per_arm: int = Field(30, ge=2, description="Users each arm needs in a step before it can pass.")
    min_step_s: float = Field(
        600.0, ge=0, description="Shortest step, seconds: at least one attribution window of the joiner."
    )
    max_step_s: float = Field(6 * 3600.0, gt=0, description="Longest step: not passed by then, inconclusive.")
    margin: float = Field(DEFAULT_MARGIN, ge=0, description="Non-inferiority margin of satisfaction (reward scale).")
    alpha: float = Field(DEFAULT_ALPHA, gt=0, lt=1, description="Level of every always-valid interval.")
    rho: float = Field(DEFAULT_RHO, gt=0, description="Mixing parameter of the confidence sequences (users).")
    srm_threshold: float = Field(
        DEFAULT_SRM_THRESHOLD, gt=0, lt=1, description="Sample ratio mismatch when the SRM p-value is below it."
    )
    guardrails: tuple[GuardrailMetric, ...] = Field(
        ("latency_ms", "error_rate", "pass_rate"),
        description="Guardrail metrics, one-sided (pass_rate: lower is worse; the others: higher is worse).",
    )
    guardrail_alpha: float | None = Field(
        None,
        gt=0,
        lt=1,
        description="Level of each guardrail's harm test at each step; None: alpha / (guardrails x steps), so "
        "that an equally good candidate is aborted for some guardrail at most about alpha of the time.",
    )
    denominator: Literal["exposures", "feedback"] = Field(
        "exposures", description="Count samples of completions reported shown (exposures), or every joined sample."
    )
    watch_s: float = Field(
        24 * 3600.0, ge=0, description="After promotion, how long the guardrails keep watching (0: not at all)."
    )
    min_users_for_harm: int = Field(
        10, ge=2, description="Users each arm needs before harm is judged (the variances are estimated)."
    )
    route_lag_s: float = Field(
        3.0,
        ge=0,
        description="Completions that end within this long after a step starts are not counted in it: gateways "
        "cache the share (api.fleet.CANARY_TTL_S, 1 s) and a request runs a while, so they may have been routed "
        "at the previous share, and counting them skews the split toward the old one (a false SRM abort).",
    )
    consumer_group: str = Field("gate.canary", min_length=1, description="The gate's group on the sample topic.")

    @property
    def harm_alpha(self) -> float:
        """The level of one guardrail's harm test at one step (Bonferroni over guardrails and steps)."""
        return self.guardrail_alpha or self.alpha / max(1, len(self.guardrails) * len(self.steps))

    @field_validator("steps")
    @classmethod
    def _ramp(cls, v: tuple[float, ...]) -> tuple[float, ...]:
        if not v or any(not 0.0 < s < 1.0 for s in v) or any(b <= a for a, b in zip(v, v[1:], strict=False)):
            raise ValueError(f"steps must be a non-empty, increasing list of shares in (0, 1), got {list(v)}")
        return v

    @field_validator("max_step_s")
    @classmethod
    def _after_min(cls, v: float, info: Any) -> float:
        if v < info.data.get("min_step_s", 0.0):
            raise ValueError(f"max_step_s {v!r} is below min_step_s {info.data['min_step_s']!r}")
        return v


@dataclass
class CanaryOutcomes:
    """Joined samples of one experiment: `steps[step][arm][user] = [n, sum, sumsq, lat_n, lat_sum, errors]`,
    plus `positions` (next bus offset per topic partition already counted, so a replay counts nothing twice)."""

    steps: dict[int, dict[str, dict[str, list[float]]]] = field(default_factory=dict)
    positions: dict[str, int] = field(default_factory=dict)

    def add(
        self,
        step: int,
        sample: SampleEvent,
        candidate_id: str,
        incumbent_id: str,
        passed: float | None = None,
        denominator: str = "exposures",
    ) -> bool:
        """Count one sample in `step`; False (ignored) unless it is a candidate-arm completion of the
        candidate or an incumbent-arm completion of the incumbent, with a user (and, counting
        exposures, reported shown). `passed`: the verifier's score of the completion, if it has one."""
        c = sample.completion
        want = {"candidate": candidate_id, "incumbent": incumbent_id}
        if c.arm not in want or c.model_version != want[c.arm]:
            return False
        return self.count(step, c.arm, sample, passed, denominator)

    def count(
        self, step: int, arm: str, sample: SampleEvent, passed: float | None = None, denominator: str = "exposures"
    ) -> bool:
        """Count one sample for `arm` in `step` (no arm check: `PostPromotionWatch` counts by version)."""
        c = sample.completion
        if not c.user_id or not math.isfinite(sample.reward) or (denominator == "exposures" and not sample.exposed):
            return False
        users = self.steps.setdefault(step, {a: {} for a in ARMS})[arm]
        rec = users.setdefault(c.user_id, [0, 0.0, 0.0, 0, 0.0, 0, 0, 0.0])
        r = float(sample.reward)
        rec[_N] += 1
        rec[_SUM] += r
        rec[_SQ] += r * r
        lat = c.latency_ms.get("total")
        if lat is not None and math.isfinite(lat):
            rec[_LAT_N] += 1
            rec[_LAT_SUM] += float(lat)
        rec[_ERR] += int(c.finish_reason not in OK_FINISH)
        if passed is not None and math.isfinite(passed):
            rec[_PASS_N] += 1
            rec[_PASS_SUM] += float(passed)
        return True

    def seen(self, topic: str, partition: int, offset: int) -> bool:
        """Whether this bus record was counted already (and marks it counted otherwise)."""
        key = f"{topic}:{partition}"
        if offset < self.positions.get(key, 0):
            return True
        self.positions[key] = offset + 1
        return False

    def users(self, step: int, arm: str) -> dict[str, list[float]]:
        return self.steps.get(step, {}).get(arm, {})

    def per_user(self, step: int, arm: str, metric: str) -> list[float]:
        """One number per user of `arm` in `step`: mean reward, mean latency (users with one), error
        rate, pass rate (users with a scored completion)."""
        out = []
        for rec in self.users(step, arm).values():
            if metric == "reward" and rec[_N]:
                out.append(rec[_SUM] / rec[_N])
            elif metric == "latency_ms" and rec[_LAT_N]:
                out.append(rec[_LAT_SUM] / rec[_LAT_N])
            elif metric == "error_rate" and rec[_N]:
                out.append(rec[_ERR] / rec[_N])
            elif metric == "pass_rate" and rec[_PASS_N]:
                out.append(rec[_PASS_SUM] / rec[_PASS_N])
        return out

    def to_dict(self) -> dict[str, Any]:
        steps = {
            str(k): {a: {u: list(r) for u, r in arms.get(a, {}).items()} for a in ARMS}
            for k, arms in self.steps.items()
        }
        return {"format": COUNTS_FORMAT, "steps": steps, "positions": dict(self.positions)}

    @classmethod
    def from_dict(cls, d: dict[str, Any] | None) -> CanaryOutcomes:
        if not d:
            return cls()
        if d.get("format") != COUNTS_FORMAT:
            raise ValueError(f"canary counts format {d.get('format')!r} is not the {COUNTS_FORMAT} this build reads")
        steps = {
            int(k): {a: {u: [float(x) for x in r] for u, r in arms.get(a, {}).items()} for a in ARMS}
            for k, arms in d.get("steps", {}).items()
        }
        return cls(steps, {str(k): int(v) for k, v in d.get("positions", {}).items()})


@dataclass(frozen=True)
class Decision:
    """What the gate does at this look, and the numbers behind it (JSON-serialisable)."""

    action: Action
    numbers: dict[str, Any]

    @property
    def reason(self) -> str:
        return str(self.numbers.get("reason", self.action))


def _interval(iv: Interval) -> dict[str, float]:
    return {"lower": iv.lower, "upper": iv.upper, "estimate": iv.estimate, "se": iv.se, "radius": iv.radius}


def guardrails(outcomes: CanaryOutcomes, step: int, cfg: CanaryConfig) -> tuple[dict[str, Any], list[str]]:
    """Every guardrail of `cfg` on `step`'s users, candidate vs incumbent: (numbers, harms in words)."""
    numbers: dict[str, Any] = {}
    harms = []
    for metric in cfg.guardrails:
        cand, inc = (outcomes.per_user(step, a, metric) for a in ARMS)
        if min(len(cand), len(inc)) < 2:
            continue
        direction: Direction = "lower_is_worse" if metric in LOWER_IS_WORSE else "higher_is_worse"
        g = guardrail(metric, cand, inc, direction, cfg.harm_alpha, cfg.rho)
        numbers[metric] = {**_interval(g.interval), "harmed": g.harmed, "direction": direction}
        if g.harmed and direction == "higher_is_worse":
            harms.append(f"{metric} (+{g.interval.estimate:.4g}, lower bound {g.interval.lower:.4g} > 0)")
        elif g.harmed:
            harms.append(f"{metric} ({g.interval.estimate:+.4g}, upper bound {g.interval.upper:.4g} < 0)")
    return numbers, harms


def decide(progress: CanaryProgress, outcomes: CanaryOutcomes, cfg: CanaryConfig, now: datetime) -> Decision:
    """The decision at this look on the current step's users (module docstring for the rules)."""
    step, share = progress.step, progress.share
    elapsed = (now - progress.started_at).total_seconds()
    n = {a: len(outcomes.users(step, a)) for a in ARMS}
    numbers: dict[str, Any] = {
        "step": step,
        "share": share,
        "last_step": step >= len(cfg.steps) - 1,
        "elapsed_s": elapsed,
        "users": n,
        "margin": cfg.margin,
        "alpha": cfg.alpha,
    }

    def out(action: Action, reason: str) -> Decision:
        return Decision(action, {**numbers, "reason": reason})

    if sum(n.values()) > 0 and 0.0 < share < 1.0:
        srm = srm_check(n, {"candidate": share, "incumbent": 1.0 - share}, cfg.srm_threshold)
        numbers["srm"] = {"statistic": srm.statistic, "p_value": srm.p_value, "threshold": srm.threshold}
        if not srm.srm_ok:
            return out("abort_invalid", f"sample ratio mismatch: users {n} at share {share} (p={srm.p_value:.3g})")

    reward: Interval | None = None
    if min(n.values()) >= 2:
        reward = confidence_sequence(
            outcomes.per_user(step, "candidate", "reward"),
            outcomes.per_user(step, "incumbent", "reward"),
            cfg.alpha,
            cfg.rho,
        )
        numbers["reward"] = _interval(reward)
    if min(n.values()) >= cfg.min_users_for_harm:
        numbers["guardrails"], harms = guardrails(outcomes, step, cfg)
        if harms:
            return out("abort_harm", "guardrail harm: " + ", ".join(harms))
        if reward is not None and reward.upper < -cfg.margin:
            return out("abort_harm", f"satisfaction worse by more than the margin (upper bound {reward.upper:.4g})")

    enough_users = min(n.values()) >= cfg.min_users_per_arm
    long_enough = elapsed >= cfg.min_step_s
    passed = enough_users and long_enough and reward is not None and reward.passes(cfg.margin)
    numbers["passed"] = passed
    if passed:
        assert reward is not None
        why = f"step {step} at {share:.0%} passed: lower bound {reward.lower:.4g} > -{cfg.margin}"
        return out("awaiting_approval" if numbers["last_step"] else "next_step", why)
    if elapsed >= cfg.max_step_s:
        return out("abort_inconclusive", f"step {step} did not pass within {cfg.max_step_s:.0f} s")
    missing = [what for what, ok in (("users", enough_users), ("duration", long_enough)) if not ok] or [
        "the lower bound above -margin"
    ]
    return out("wait", "waiting for " + ", ".join(missing))
