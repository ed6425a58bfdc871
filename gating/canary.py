"""The online canary stage: a pure state machine over the joined samples of one experiment.

`CanaryOutcomes` accumulates the joiner's `SampleEvent`s of the candidate and incumbent arms (never the
anonymous stratum, never eval traffic, never pooled), per ramp step, per arm, per user; it is persisted
compactly in `gate["canary"]["counts"]` so that a restarted gate resumes where it was.
`decide(progress, outcomes, cfg, now)` says what the gate does at this look (`Decision`):

- `abort_invalid`: sample ratio mismatch (users per arm vs the step's share), by the always-valid
  mixture e-value of `gating.sequential.srm_sequential` (valid at every look, unlike a chi-square
  p-value recomputed at each): the split itself is broken, so no comparison can be trusted.
- `abort_harm`: a guardrail (time to first token, time per output token, error rate: higher is worse;
  pass rate: lower is worse) shows significant harm with the always-valid interval, or the satisfaction
  interval lies wholly below -margin: stop at once.
- `next_step` / `awaiting_approval`: the step passes only when each arm has `min_users_per_arm` users,
  the step has run `min_step_s`, and the always-valid lower bound on satisfaction(candidate) -
  satisfaction(incumbent) is above -margin. Absence of detected harm never passes a step.
  Passing the last step is `awaiting_approval` (a person decides; the gate never promotes).
- `extend`: `max_step_s` of the step's time ran out without passing while the candidate is ahead
  (estimate > 0): the step gets another `max_step_s`, at most `extend_inconclusive` times, recorded
  as a decision (the gate writes it to the audit trail).
- `abort_inconclusive`: the step's time (with its extensions) ran out without passing; the numbers say
  `inconclusive` with whether the candidate was ahead, and the transition's reason says so.
- `wait`: otherwise.

**ρ, from the step's traffic.** Every interval of a step is the confidence sequence at mixing
parameter ρ = `gating.sequential.step_rho(users)`, tightest at the users (both arms) the step is
expected to reach by `max_step_s`: `cfg.rho` if set, else `cfg.expected_users`, else what the gate
measured before the step started (`gating.gate`). The gate stores ρ and the expected users with the
step (`progress.rho`, `progress.expected_users`), so a restarted gate and the dashboard use the same
one; ρ depends on user counts before the step, never on its outcomes. `decide` on a progress without
ρ uses `cfg` (`DEFAULT_RHO` when it says nothing).

**Time.** A step's time is `progress.active_s` when the gate keeps it (time with a live gate lease; a
lapse routes nobody to the candidate and does not count), else the wall time since the step started.

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
bench/gate_sim_canary.py): time to first token (`latency_ms["first_token"]`), time per output token
((total - first_token) / (output tokens - 1), completions of at least 2 tokens) and error rate (higher
is worse) from the completion events; a latency guardrail fires only when the candidate is slower by
more than `latency_tolerance` (half) of the incumbent's mean, significantly, because arms sharing
engines differ by scheduling (a CI demo run aborted a better candidate for +9 ms, +40%, of time to
first token). Whole-request latency is recorded (the dashboard shows it) but
is no guardrail: both arms run on the same engines, so it measures output length and machine noise. And
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
from gating.sequential import DEFAULT_SRM_ALPHA, DEFAULT_SRM_CONCENTRATION, srm_sequential, step_rho
from gating.stats import (
    DEFAULT_ALPHA,
    DEFAULT_MARGIN,
    DEFAULT_RHO,
    Direction,
    Interval,
    confidence_sequence,
    guardrail,
)
from registry.models import CanaryProgress

ARMS = ("candidate", "incumbent")
OK_FINISH = frozenset({"stop", "length"})
"""Finish reasons that are no error."""
COUNTS_FORMAT = 2
Action = Literal[
    "wait", "next_step", "awaiting_approval", "extend", "abort_invalid", "abort_harm", "abort_inconclusive"
]
GuardrailMetric = Literal["ttft_ms", "tpot_ms", "error_rate", "pass_rate"]
LATENCY_METRICS = ("ttft_ms", "tpot_ms")
"""Guardrails judged against `CanaryConfig.latency_tolerance` (the others: any significant harm)."""
LOWER_IS_WORSE = frozenset({"pass_rate"})
HISTORY_POINTS = 240
"""Looks kept in `progress.history` (older ones thinned to every other)."""

# Per-user record, one list of numbers (compact JSON): reward n, sum, sum of squares; whole-request
# latency n, sum; errors; verifier-scored completions n, sum of scores; TTFT n, sum; TPOT n, sum.
_N, _SUM, _SQ, _LAT_N, _LAT_SUM, _ERR, _PASS_N, _PASS_SUM, _TTFT_N, _TTFT_SUM, _TPOT_N, _TPOT_SUM = range(12)
_METRIC = {
    "latency_ms": (_LAT_SUM, _LAT_N),
    "ttft_ms": (_TTFT_SUM, _TTFT_N),
    "tpot_ms": (_TPOT_SUM, _TPOT_N),
    "pass_rate": (_PASS_SUM, _PASS_N),
}


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
    expected_users: float | None = Field(
        None,
        gt=0,
        description="Users (both arms) a step is expected to reach by max_step_s; ρ is tightest there. None: "
        "the gate measures it from the traffic before each step.",
    )
    rho: float | None = Field(
        None, gt=0, description="Mixing parameter of the confidence sequences (users); None: from the expected users."
    )
    srm_threshold: float = Field(
        DEFAULT_SRM_ALPHA,
        gt=0,
        lt=1,
        description="Level of the always-valid SRM test per step: mismatch when its e-value reaches 1 / this.",
    )
    srm_concentration: float = Field(
        DEFAULT_SRM_CONCENTRATION, gt=0, description="Dirichlet concentration of the SRM test's mixture."
    )
    extend_inconclusive: int = Field(
        1, ge=0, le=3, description="Extensions (max_step_s each) of a step that runs out with the candidate ahead."
    )
    guardrails: tuple[GuardrailMetric, ...] = Field(
        ("ttft_ms", "tpot_ms", "error_rate", "pass_rate"),
        description="Guardrail metrics, one-sided (pass_rate: lower is worse; the others: higher is worse).",
    )
    latency_tolerance: float = Field(
        0.5,
        ge=0,
        description="A latency guardrail (ttft_ms, tpot_ms) flags harm only when the candidate is slower than "
        "the incumbent by more than this share of the incumbent's mean, significantly: arms on shared engines "
        "differ by scheduling and load (the busier arm queues longer), which is no harm of the model.",
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
        rec = users.setdefault(c.user_id, [0, 0.0, 0.0, 0, 0.0, 0, 0, 0.0, 0, 0.0, 0, 0.0])
        r = float(sample.reward)
        rec[_N] += 1
        rec[_SUM] += r
        rec[_SQ] += r * r
        lat, first = c.latency_ms.get("total"), c.latency_ms.get("first_token")
        if lat is not None and math.isfinite(lat):
            rec[_LAT_N] += 1
            rec[_LAT_SUM] += float(lat)
        if first is not None and math.isfinite(first):
            rec[_TTFT_N] += 1
            rec[_TTFT_SUM] += float(first)
            if lat is not None and math.isfinite(lat) and len(c.output_ids) >= 2:
                rec[_TPOT_N] += 1
                rec[_TPOT_SUM] += (float(lat) - float(first)) / (len(c.output_ids) - 1)
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
        """One number per user of `arm` in `step`: mean reward, error rate, and the mean latency, TTFT,
        TPOT and pass rate of the users who have one."""
        out = []
        for rec in self.users(step, arm).values():
            if metric == "reward" and rec[_N]:
                out.append(rec[_SUM] / rec[_N])
            elif metric == "error_rate" and rec[_N]:
                out.append(rec[_ERR] / rec[_N])
            elif metric in _METRIC and rec[_METRIC[metric][1]]:
                total, n = _METRIC[metric]
                out.append(rec[total] / rec[n])
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


def step_rho_of(progress: CanaryProgress, cfg: CanaryConfig) -> float:
    """The ρ of `progress`'s step: stored with it, else `cfg.rho`, else from `cfg.expected_users`, else
    `DEFAULT_RHO`."""
    stored = (progress.model_extra or {}).get("rho")
    if stored is not None:
        return float(stored)
    if cfg.rho is not None:
        return cfg.rho
    return step_rho(cfg.expected_users, cfg.alpha) if cfg.expected_users is not None else DEFAULT_RHO


def step_extra(progress: CanaryProgress, key: str, default: float) -> float:
    """A number the gate keeps with the step (`active_s`, `extensions`, `rho`), or `default`."""
    v = (progress.model_extra or {}).get(key)
    return default if v is None else float(v)


def guardrails(
    outcomes: CanaryOutcomes,
    step: int,
    cfg: CanaryConfig,
    rho: float | None = None,
    metrics: tuple[str, ...] | None = None,
) -> tuple[dict[str, Any], list[str]]:
    """The guardrails of `cfg` (or those of them in `metrics`) on `step`'s users, candidate vs
    incumbent: (numbers, harms in words)."""
    numbers: dict[str, Any] = {}
    harms = []
    rho = rho if rho is not None else (cfg.rho or DEFAULT_RHO)
    for metric in (m for m in cfg.guardrails if metrics is None or m in metrics):
        cand, inc = (outcomes.per_user(step, a, metric) for a in ARMS)
        if min(len(cand), len(inc)) < 2:
            continue
        direction: Direction = "lower_is_worse" if metric in LOWER_IS_WORSE else "higher_is_worse"
        g = guardrail(metric, cand, inc, direction, cfg.harm_alpha, rho)
        allowed = cfg.latency_tolerance * (sum(inc) / len(inc)) if metric in LATENCY_METRICS else 0.0
        harmed = g.interval.lower > allowed if direction == "higher_is_worse" else g.harmed
        numbers[metric] = {**_interval(g.interval), "harmed": harmed, "direction": direction, "allowed": allowed}
        if harmed and direction == "higher_is_worse":
            harms.append(f"{metric} (+{g.interval.estimate:.4g}, lower bound {g.interval.lower:.4g} > {allowed:.4g})")
        elif harmed:
            harms.append(f"{metric} ({g.interval.estimate:+.4g}, upper bound {g.interval.upper:.4g} < 0)")
    return numbers, harms


def decide(progress: CanaryProgress, outcomes: CanaryOutcomes, cfg: CanaryConfig, now: datetime) -> Decision:
    """The decision at this look on the current step's users (module docstring for the rules)."""
    step, share = progress.step, progress.share
    elapsed = step_extra(progress, "active_s", (now - progress.started_at).total_seconds())
    extensions = int(step_extra(progress, "extensions", 0))
    limit = cfg.max_step_s * (1 + extensions)
    rho = step_rho_of(progress, cfg)
    n = {a: len(outcomes.users(step, a)) for a in ARMS}
    numbers: dict[str, Any] = {
        "step": step,
        "share": share,
        "last_step": step >= len(cfg.steps) - 1,
        "elapsed_s": elapsed,
        "limit_s": limit,
        "extensions": extensions,
        "users": n,
        "margin": cfg.margin,
        "alpha": cfg.alpha,
        "rho": rho,
    }

    def out(action: Action, reason: str) -> Decision:
        return Decision(action, {**numbers, "reason": reason})

    if sum(n.values()) > 0 and 0.0 < share < 1.0:
        srm = srm_sequential(
            n, {"candidate": share, "incumbent": 1.0 - share}, cfg.srm_threshold, cfg.srm_concentration
        )
        numbers["srm"] = {"log_e": srm.log_e, "p_value": srm.p_value, "threshold": srm.alpha, "always_valid": True}
        if not srm.srm_ok:
            why = f"sample ratio mismatch: users {n} at share {share} (always-valid p={srm.p_value:.3g})"
            return out("abort_invalid", why)

    reward: Interval | None = None
    if min(n.values()) >= 2:
        per = {a: outcomes.per_user(step, a, "reward") for a in ARMS}
        reward = confidence_sequence(per["candidate"], per["incumbent"], cfg.alpha, rho)
        numbers["reward"] = _interval(reward)
        numbers["means"] = {a: sum(v) / len(v) for a, v in per.items()}
    if min(n.values()) >= cfg.min_users_for_harm:
        numbers["guardrails"], harms = guardrails(outcomes, step, cfg, rho)
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
    if elapsed >= limit:
        ahead = reward is not None and reward.estimate > 0
        est = "no estimate" if reward is None else f"estimate {reward.estimate:+.4g}, lower bound {reward.lower:.4g}"
        if ahead and extensions < cfg.extend_inconclusive:
            why = (
                f"step {step} inconclusive after {elapsed:.0f} s with the candidate ahead ({est} vs -{cfg.margin}): "
                f"extended by {cfg.max_step_s:.0f} s ({extensions + 1} of {cfg.extend_inconclusive})"
            )
            return out("extend", why)
        numbers["inconclusive"] = {"ahead": ahead, "extensions": extensions}
        side = "ahead" if ahead else "not ahead"
        why = f"step {step} inconclusive: not passed within {elapsed:.0f} s, candidate {side} ({est} vs -{cfg.margin})"
        return out("abort_inconclusive", why)
    missing = [what for what, ok in (("users", enough_users), ("duration", long_enough)) if not ok] or [
        "the lower bound above -margin"
    ]
    return out("wait", "waiting for " + ", ".join(missing))


def history_point(d: Decision, t_s: float) -> dict[str, Any]:
    """One look for `progress.history` (the dashboard's plots): seconds since the canary started, step,
    share, users, the arms' mean satisfaction and the difference's interval at the step's ρ."""
    nums = d.numbers
    point: dict[str, Any] = {"t": round(t_s, 3), "step": nums["step"], "share": nums["share"], "users": nums["users"]}
    if "reward" in nums:
        r = nums["reward"]
        point["diff"] = [r["estimate"], r["lower"], r["upper"]]
        point["means"] = nums["means"]
    return point


def add_point(history: list[dict[str, Any]], point: dict[str, Any]) -> list[dict[str, Any]]:
    """`history` with `point` appended, its older half thinned to every other look past `HISTORY_POINTS`."""
    out = [*history, point]
    if len(out) > HISTORY_POINTS:
        half = len(out) // 2
        out = out[:half:2] + out[half:]
    return out
