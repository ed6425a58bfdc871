"""The gate's online stage: the canary of the version in flight and the watch after promotion.

`CanaryStage` is mixed into `gating.gate.Gate` (it uses the gate's registry, config, bus, clock,
scorer and metrics). State lives on the version, never in the audit trail:

- `gate["canary"]` (`CanaryProgress` plus what this stage keeps with it): the ramp step, share and
  start; the step's ρ and the users it was sized for (`rho`, `expected_users`, `expected_from`); its
  time with a live lease (`active_s`), the time lapsed (`lapsed_s`), the last look (`looked_at`), the
  extensions granted (`extensions`); the per-user counts with the bus positions (`counts`); and
  `history`, one point per look (`gating.canary.history_point`), which the dashboard plots.
  Looks are stored with `record_gate(..., audit=False)`: no audit row. The audit trail gets the
  decisions: the canary's start, each ramp, each extension, and the end (share 0, then the transition),
  each with its reason, numbers and actor.
- `gate["watch"]` on the promoted version: the same, for the post-promotion guardrails; its start,
  each alert and its end are audited, its looks are not.

**Users per step, and ρ.** The gate meters the users of the fleet from every sample it reads, whether
or not a canary runs (`meter`: each user's latest completion, eval traffic and anonymous requests left
out, exposures only when counting exposures). When a step starts, its expected users are
`cfg.canary.expected_users` if set, else the users the meter saw in the last `max_step_s` of traffic
(fewer when the meter has seen less: a smaller ρ costs little late, a larger one much early), and at
least the users the step needs to pass at its share (`min_users_per_arm / min(share, 1 - share)`). ρ is
`cfg.canary.rho` if set, else `gating.sequential.step_rho(expected users)`. Both are fixed for the step
and stored with it; they depend on user counts before the step, never on its outcomes.

**Time with a lapsed lease does not count.** Gateways route nobody to a canary without a live gate
lease (`api.fleet`). Under `run_gate` (`lease_s` set) a look adds to `active_s` the time since the last
look, at most `lease_s` (a gate that was down for longer had its lease lapse after `lease_s`), and
nothing while the registry shows no live lease; the rest goes to `lapsed_s`. `decide` times the step on
`active_s`, so a gate killed and restarted resumes its step with the time it had.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime
from typing import TYPE_CHECKING, Any

from feedback.events import SampleEvent
from gating.canary import (
    LATENCY_METRICS,
    CanaryOutcomes,
    Decision,
    add_point,
    decide,
    guardrails,
    history_point,
    step_extra,
    step_rho_of,
)
from gating.sequential import step_rho
from registry.gate_evidence import WATCH_KEY
from registry.models import CanaryProgress, ModelVersionPublic, Status

if TYPE_CHECKING:
    from core.service_metrics import ServiceMetrics
    from feedback.bus import EventBus, Record
    from gating.gate import GateConfig
    from registry.registry import Registry

log = logging.getLogger(__name__)
STORE_EVERY_S = 10.0
"""A look with no new samples is stored at most this often (its time and history point)."""


@dataclass(frozen=True)
class GateStep:
    """What one `Gate.step()` did. `action`: no_incumbent, idle, canary (waiting in the canary),
    next_step (the canary ramped up), extend (a step ran out with the candidate ahead and got more time),
    abort_invalid / abort_harm / abort_inconclusive (the canary aborted the version), awaiting_approval,
    error (an attempt failed; retried next step), passed / rejected (a verdict acted on; `resumed`:
    recorded by an earlier gate), lost (the version left `evaluating` meanwhile, e.g. superseded)."""

    action: str
    version_id: str | None = None
    result: Any = None  # gating.evals.OfflineResult of an offline verdict
    detail: str = ""
    resumed: bool = False


class CanaryStage:
    registry: Registry
    cfg: GateConfig
    bus: EventBus | None
    clock: Callable[[], datetime]
    score: Callable[[list[SampleEvent]], list[float | None]] | None
    alerts: int
    metrics: ServiceMetrics
    lease_s: float | None
    """Set by `run_gate` (the gate's lease): lapsed time does not count toward a step."""
    _arrivals: dict[str, float]

    def _poll(self, max_polls: int = 100) -> list[tuple[Record, SampleEvent | None]]:
        raise NotImplementedError

    def _commit(self, batch: list[tuple[Record, SampleEvent | None]]) -> None:
        raise NotImplementedError

    # -- users per step ------------------------------------------------------------------------------

    def meter(self, batch: list[tuple[Record, SampleEvent | None]]) -> None:
        """Note each user's latest completion in `batch` (module docstring); forget users older than a
        step with its extensions."""
        c = self.cfg.canary
        for _, sample in batch:
            if sample is None or not sample.completion.user_id or sample.completion.arm == "eval":
                continue
            if c.denominator == "exposures" and not sample.exposed:
                continue
            key = f"{sample.completion.tenant}:{sample.completion.user_id}"
            self._arrivals[key] = max(self._arrivals.get(key, 0.0), sample.completion.ts)
        if self._arrivals:
            keep = max(self._arrivals.values()) - c.max_step_s * (1 + c.extend_inconclusive)
            self._arrivals = {u: t for u, t in self._arrivals.items() if t >= keep}

    def step_plan(self, share: float) -> dict[str, Any]:
        """ρ and the expected users of a step starting now at `share` (module docstring)."""
        c = self.cfg.canary
        need = math.ceil(c.min_users_per_arm / min(share, 1.0 - share))
        if c.expected_users is not None:
            users, source = c.expected_users, "config"
        else:
            last = max(self._arrivals.values(), default=0.0)
            users = float(sum(t >= last - c.max_step_s for t in self._arrivals.values()))
            source = "measured"
        if users < need:
            users, source = float(need), "the users the step needs"
        rho = c.rho if c.rho is not None else step_rho(users, c.alpha)
        return {"rho": rho, "expected_users": users, "expected_from": source}

    def _new_step(self, progress: CanaryProgress, now: datetime) -> CanaryProgress:
        fresh = {"active_s": 0.0, "lapsed_s": 0.0, "looked_at": now.isoformat(), "extensions": 0}
        return progress.model_copy(update={**fresh, **self.step_plan(progress.share)})

    def _tick(self, progress: CanaryProgress, now: datetime) -> CanaryProgress:
        """Add the time since the last look to the step's live time (module docstring)."""
        extra = progress.model_extra or {}
        looked = datetime.fromisoformat(extra["looked_at"]) if "looked_at" in extra else progress.started_at
        gap = max(0.0, (now - looked).total_seconds())
        live = gap
        if self.lease_s is not None:
            live = 0.0 if self.registry.gate_lease(now) is None else min(gap, self.lease_s)
        active = step_extra(progress, "active_s", (looked - progress.started_at).total_seconds())
        lapsed = step_extra(progress, "lapsed_s", 0.0)
        if gap - live > 1e-9:
            log.warning("gate: %.1f s of canary step %d had no live lease; not counted", gap - live, progress.step)
        return progress.model_copy(
            update={"active_s": active + live, "lapsed_s": lapsed + gap - live, "looked_at": now.isoformat()}
        )

    # -- the canary ----------------------------------------------------------------------------------

    def canary_step(
        self, version: ModelVersionPublic, batch: list[tuple[Record, SampleEvent | None]] | None = None
    ) -> GateStep:
        """The online stage, called by `step()` on every step while `version` is in `canary`.

        1. No `gate["canary"]`: the canary starts at step 0, share `cfg.canary.steps[0]`, now, with the
           step's ρ (module docstring); audited.
        2. New samples (`batch`, read by `step()`; read here when called on its own) from
           `TOPICS["sample"]` in the group `cfg.canary.consumer_group`: those of the candidate arm
           served by the candidate and of the incumbent arm served by the incumbent, for completions
           served since the step started (plus `route_lag_s`; reported shown, counting exposures), are
           counted, each with its verifier score (`score`) for the pass-rate guardrail. The progress
           (counts with their bus positions, time, a history point) is stored without an audit row,
           then the records committed, so a restarted gate never counts a sample twice. Without a bus
           (`bus=None`) the version waits.
        3. `gating.canary.decide` at this look, acted on: `next_step` starts the next share with a new
           start and ρ (users already in stay in: `assign_arm` is monotone in share); `extend` grants
           the step `max_step_s` more; `awaiting_approval` and `abort_*` record share 0, then
           `transition` to `awaiting_approval` / `aborted` with the numbers; each audited. It never
           promotes.

        While awaiting approval the candidate serves nobody (share 0, and the gateway routes only a
        version in `canary`). Once a person approves it, `watch` keeps its guardrails running."""
        if self.bus is None:
            return GateStep("canary", version.id, detail="no event bus: the canary waits")
        own = batch is None
        if batch is None:
            batch = self._poll()
            self.meter(batch)
        c, now = self.cfg.canary, self.clock()
        raw = version.gate.get("canary")
        if raw is None:
            start = CanaryProgress(step=0, share=c.steps[0], started_at=now, counts=CanaryOutcomes().to_dict())
            progress = self._new_step(start.model_copy(update={"canary_started_at": now.isoformat()}), now)
            self._record_canary(version.id, progress, f"canary started at {c.steps[0]:.0%}; {_plan(progress)}")
            stored = now
        else:
            progress = CanaryProgress.model_validate(raw)
            stored = datetime.fromisoformat((progress.model_extra or {}).get("looked_at", now.isoformat()))
        progress = self._tick(progress, now)
        outcomes = CanaryOutcomes.from_dict(progress.counts)
        incumbent = self.registry.incumbent().id
        since = progress.started_at.timestamp() + c.route_lag_s  # routed at this step's share
        counted = self._count(batch, outcomes, since, progress.step, version.id, incumbent)
        progress = progress.model_copy(update={"counts": outcomes.to_dict()})
        d = decide(progress, outcomes, c, now)
        began = datetime.fromisoformat(str((progress.model_extra or {}).get("canary_started_at", now.isoformat())))
        history = list((progress.model_extra or {}).get("history", []))
        progress = progress.model_copy(
            update={"history": add_point(history, history_point(d, (now - began).total_seconds()))}
        )
        if d.action == "wait" and (counted or (now - stored).total_seconds() >= STORE_EVERY_S):
            self._record_canary(version.id, progress, "canary look", audit=False)
        if own:
            self._commit(batch)
        return self._act_canary(version, progress, d, now)

    def _act_canary(self, v: ModelVersionPublic, progress: CanaryProgress, d: Decision, now: datetime) -> GateStep:
        c = self.cfg.canary
        if d.action == "wait":
            return GateStep("canary", v.id, detail=d.reason)
        if d.action == "next_step":
            nxt = progress.step + 1
            share = c.steps[nxt]
            ramped = self._new_step(progress.model_copy(update={"step": nxt, "share": share, "started_at": now}), now)
            self._record_canary(v.id, ramped, f"{d.reason}; ramp to {share:.0%}; {_plan(ramped)}")
            return GateStep("next_step", v.id, detail=d.reason)
        if d.action == "extend":
            more = progress.model_copy(update={"extensions": int(step_extra(progress, "extensions", 0)) + 1})
            self._record_canary(v.id, more, d.reason)
            return GateStep("extend", v.id, detail=d.reason)
        self._record_canary(v.id, progress.model_copy(update={"share": 0.0}), f"{d.reason}; share 0")
        to = Status.awaiting_approval if d.action == "awaiting_approval" else Status.aborted
        try:
            self.registry.transition(v.id, to, self.cfg.actor, f"canary: {d.reason}", d.numbers)
        except ValueError as e:
            return self._lost(v, e)
        return GateStep("awaiting_approval" if to is Status.awaiting_approval else d.action, v.id, detail=d.reason)

    def _record_canary(self, vid: str, progress: CanaryProgress, reason: str, audit: bool = True) -> None:
        payload = progress.model_dump(mode="json")
        self.registry.record_gate(vid, "canary", payload, self.cfg.actor, reason, audit=audit)

    def _lost(self, v: ModelVersionPublic, e: Exception) -> GateStep:
        now = self.registry.get(v.id).status
        if now is Status.evaluating:
            raise e
        return GateStep("lost", v.id, detail=f"{v.id} is {now.value} now: {e}")

    def _count(
        self,
        batch: list[tuple[Record, SampleEvent | None]],
        outcomes: CanaryOutcomes,
        since: float,
        step: int,
        candidate: str,
        incumbent: str | None,
    ) -> int:
        """Count `batch`'s samples served since `since` into `outcomes` at `step`; returns how many
        counted. With `incumbent`, the canary's two arms; without, the watch: every non-eval sample of
        `candidate` (the promoted version) counts for the candidate arm."""
        new = []
        for r, sample in batch:
            if sample is None or outcomes.seen(r.topic, r.partition, r.offset) or sample.completion.ts < since:
                continue
            c = sample.completion
            arms = (("candidate", candidate), ("incumbent", incumbent))
            if incumbent is not None and (c.arm, c.model_version) in arms:
                new.append(sample)
            elif incumbent is None and c.model_version == candidate and c.arm != "eval":
                new.append(sample)
        scores = self._scores(new)
        denominator, counted = self.cfg.canary.denominator, 0
        for sample, score in zip(new, scores, strict=True):
            arm = sample.completion.arm if incumbent is not None else "candidate"
            counted += outcomes.count(step, str(arm), sample, score, denominator)
        return counted

    def _scores(self, samples: list[SampleEvent]) -> list[float | None]:
        if self.score is None or not samples:
            return [None] * len(samples)
        try:
            return list(self.score(samples))
        except Exception:  # the guardrail loses these scores; the canary goes on
            log.exception("gate: scoring %d canary samples failed", len(samples))
            return [None] * len(samples)

    # -- the post-promotion watch ----------------------------------------------------------------

    def watch(
        self, promoted: ModelVersionPublic, batch: list[tuple[Record, SampleEvent | None]]
    ) -> dict[str, Any] | None:
        """Keep the canary's guardrails running on the promoted version for `cfg.canary.watch_s` after
        its promotion; returns the watch record (None when there is nothing to watch).

        The comparison: the promoted version's users since promotion (the candidate arm) against the
        incumbent arm of the canary's last step (the previous version's users, just before), at the
        canary's last ρ. It is not concurrent, so it only alerts: a harmed guardrail is logged at ERROR,
        appended to `alerts` (once per metric) and counted in `self.alerts`; a person decides whether to
        roll back. Latency (`LATENCY_METRICS`) is left out: before and after are different minutes of
        the machine's load, so the comparison would measure the load (the canary compares latency
        concurrently; after promotion it is the fleet's monitoring, not the gate's). A version promoted
        without a canary (the bootstrap, a rollback target) has no baseline and is not watched. Its
        start, alerts and end are audited; its looks are not."""
        c = self.cfg.canary
        canary = CanaryProgress.model_validate(promoted.gate["canary"]) if "canary" in promoted.gate else None
        if c.watch_s <= 0 or canary is None:
            return None
        promoted_at = self._promoted_at(promoted.id)
        now = self.clock()
        raw = promoted.gate.get(WATCH_KEY)
        if raw is None or raw.get("promoted_at") != promoted_at.isoformat():
            if (now - promoted_at).total_seconds() >= c.watch_s:
                return None
            base = CanaryOutcomes.from_dict(canary.counts)
            before = dict(base.users(canary.step, "incumbent"))
            watched = CanaryOutcomes(steps={0: {"candidate": {}, "incumbent": before}})
            raw = {"promoted_at": promoted_at.isoformat(), "done": False, "alerts": [], "counts": watched.to_dict()}
            self._record_watch(promoted.id, raw, f"watching the guardrails for {c.watch_s:.0f} s after promotion")
        if raw["done"]:
            return raw
        outcomes = CanaryOutcomes.from_dict(raw["counts"])
        counted = self._count(batch, outcomes, promoted_at.timestamp(), 0, promoted.id, None)
        raw = {**raw, "counts": outcomes.to_dict()}
        n = {a: len(outcomes.users(0, a)) for a in ("candidate", "incumbent")}
        audit, why = False, "watch look"
        if min(n.values()) >= c.min_users_for_harm:
            watched_metrics = tuple(m for m in c.guardrails if m not in LATENCY_METRICS)
            numbers, harms = guardrails(outcomes, 0, c, step_rho_of(canary, c), watched_metrics)
            raw["guardrails"], raw["users"] = numbers, n
            alerted = {a["metric"] for a in raw["alerts"]}
            for metric, g in numbers.items():
                if g["harmed"] and metric not in alerted:
                    alert = {"metric": metric, "at": now.isoformat(), **g, "users": n}
                    raw["alerts"] = [*raw["alerts"], alert]
                    self.alerts += 1
                    audit, why = True, f"ALERT: {metric} harmed after promotion: " + "; ".join(harms)
                    log.error("gate: ALERT on promoted %s: %s harmed since promotion (%s)", promoted.id, metric, g)
        if (now - promoted_at).total_seconds() >= c.watch_s:
            raw["done"], audit, why = True, True, f"watch over after {c.watch_s:.0f} s"
        if audit or counted:
            self._record_watch(promoted.id, raw, why, audit=audit)
        return raw

    def _promoted_at(self, version_id: str) -> datetime:
        audit = self.registry.audit(version_id)
        steps = [a for a in audit if a.to_status is Status.promoted and a.from_status is not Status.promoted]
        return steps[-1].at if steps else self.clock()

    def _record_watch(self, vid: str, record: dict[str, Any], reason: str, audit: bool = True) -> None:
        try:
            self.registry.record_gate(vid, WATCH_KEY, record, self.cfg.actor, reason, audit=audit)
        except ValueError as e:  # rolled back meanwhile: nothing left to watch
            log.info("gate: watch of %s not recorded: %s", vid, e)


def _plan(progress: CanaryProgress) -> str:
    extra = progress.model_extra or {}
    return f"ρ {float(extra['rho']):.1f} for {float(extra['expected_users']):.0f} users ({extra['expected_from']})"
