"""The gate process: drives candidates through the offline part of the lifecycle, resumably.

`Gate(registry, engine_factory, load_version, suite, cfg).step()` does one thing and returns what it did
(`GateStep`):

1. Nothing promoted: nothing to compare with, so nothing is evaluated (`no_incumbent`).
2. Nothing in flight: the oldest `candidate` moves to `evaluating` (`idle` when there is none, or when
   another writer got there first).
3. A version `evaluating` (just moved, or left there by a gate that was killed): its offline verdict is
   reached, recorded and acted on. If a verdict on its current artifact, against the current incumbent
   and on this suite is recorded already (a gate killed between recording and moving it), it is acted on
   without evaluating again. Otherwise the evaluation runs (again) from the start: it is seeded
   throughout, so a re-run reaches the same numbers. Before each attempt the gate records
   `gate["offline_run"]` (attempt, start, incumbent, suite, artifact; the error of a failed attempt); after
   `cfg.max_attempts` failed attempts (a version that cannot be loaded, say) the version is rejected,
   naming the error.
   An evaluation: `load_version(version)` gives a checkpoint folder (or a model and its tokenizer) for
   the candidate and for the incumbent; `engine_factory()` makes the gate's own engine (never a live
   replica); both are loaded into it under their version ids; `gating.evals.evaluate_offline` compares
   them, scoring the candidate's samples under the incumbent in this process (`ModelScorer`); the engine
   is shut down. The verdict (`OfflineResult.verdict`: passed, incumbent id, the artifact SHA-256 from the
   registry, `suite.suite_version`, every number) is stored with `record_gate(version, "offline", ...)`;
   then the version moves to `canary` if it passed, else `reject` with the numbers.
4. A version in `canary`: `canary_step(version)`, the hook of the online stage (not built; see there).
5. A version `awaiting_approval`: nothing; a person approves or rejects (`approve` is the only way to
   `promoted`; the gate never promotes).

`gating.gate_process.run_gate(settings, stop_event, suite)` is the `flywheel gate` loop: the registry
at `settings.db_url`, a `ProcessEngine` per evaluation and `weight_store_loader` on the learner's
models folder by default, the whole process (and so its engine processes) at nice `cfg.nice`.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from core.service_metrics import ServiceMetrics
from feedback.bus import Consumer, EventBus, Record
from feedback.events import TOPICS, SampleEvent
from gating.canary import CanaryConfig, CanaryOutcomes, Decision, decide, guardrails
from gating.evals import Guardrails, ModelScorer, OfflineResult, evaluate_offline
from gating.sample_cache import SampleCache
from gating.stats import DEFAULT_ALPHA, DEFAULT_MARGIN
from product.suites import EvalSuite
from registry.gate_evidence import WATCH_KEY
from registry.models import CanaryProgress, ModelVersionPublic, OfflineVerdict, Status
from registry.registry import Registry, RegistryConflict
from serving.interface import Engine
from serving.model import Transformer
from serving.tokenizer import Tokenizer

log = logging.getLogger(__name__)

LoadedVersion = str | Path | tuple[Transformer, Tokenizer]
"""What `load_version` gives: a checkpoint folder, or a model with its tokenizer (embedded engines only)."""
VersionLoader = Callable[[ModelVersionPublic], LoadedVersion]
EngineFactory = Callable[[], Engine]
SampleScorer = Callable[[list[SampleEvent]], list[float | None]]
"""The verifier's score of each sample's completion (None: it cannot check that prompt)."""
Polled = tuple[Record, SampleEvent | None]
RUN_KEY = "offline_run"
"""`gate[RUN_KEY]`: the current offline attempt (free-form gate record)."""


class GateConfig(BaseModel):
    """The offline gate's settings: the eval's sampling and statistics, retries, the loop."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    G: int = Field(8, ge=1, description="Samples per prompt and version.")
    margin: float = Field(DEFAULT_MARGIN, ge=0, description="Non-inferiority margin (pass-rate points).")
    alpha: float = Field(DEFAULT_ALPHA, gt=0, lt=1, description="One-sided level of every test.")
    seed: int = Field(0, description="Seeds every sample and the bootstrap.")
    max_tokens: int = Field(48, ge=1, description="Completion length limit.")
    temperature: float = Field(1.0, gt=0, le=2, description="Sampling temperature (as the product serves).")
    n_resamples: int = Field(2000, ge=100, description="Bootstrap resamples (the cross-check).")
    guardrails: Guardrails = Field(default_factory=Guardrails)
    anchor: bool = Field(
        True,
        description="Also require non-inferiority (same margin) to the best version promoted so far, so that "
        "promotions each within the margin of their incumbent cannot add up to a slide.",
    )
    sample_cache_dir: Path | None = Field(
        None,
        description="Keep each version's gate samples here (gating.sample_cache) so a cycle samples only the "
        "candidate; run_gate sets <home>/gate/samples. None: sample every version every cycle.",
    )
    max_attempts: int = Field(3, ge=1, description="Failed evaluations of one version before it is rejected.")
    poll_s: float = Field(5.0, gt=0, description="run_gate: wait between steps while there is nothing to do.")
    actor: str = Field("gate", min_length=1, description="Actor of the gate's registry writes.")
    nice: int = Field(10, ge=0, le=19, description="run_gate: niceness of the gate process and its engines.")
    lease_beat_s: float = Field(
        5.0, gt=0, description="run_gate: beat of the gate's lease; gateways stop the canary after 3 missed."
    )
    lease_stuck_s: float = Field(
        300.0, gt=0, description="run_gate: a main loop that has not moved this long stops renewing the lease."
    )
    canary: CanaryConfig = Field(default_factory=CanaryConfig, description="The online canary stage.")


@dataclass(frozen=True)
class GateStep:
    """What one `Gate.step()` did. `action`: no_incumbent, idle, canary (waiting in the canary),
    next_step (the canary ramped up), abort_invalid / abort_harm / abort_inconclusive (the canary aborted
    the version), awaiting_approval, error (an
    attempt failed; retried next step), passed / rejected (a verdict acted on; `resumed`: recorded by an
    earlier gate), lost (the version left `evaluating` meanwhile, e.g. superseded)."""

    action: str
    version_id: str | None = None
    result: OfflineResult | None = None
    detail: str = ""
    resumed: bool = False


class Gate:
    def __init__(
        self,
        registry: Registry,
        engine_factory: EngineFactory,
        load_version: VersionLoader,
        suite: EvalSuite,
        cfg: GateConfig | None = None,
        bus: EventBus | None = None,
        clock: Callable[[], datetime] | None = None,
        score: SampleScorer | None = None,
        metrics: ServiceMetrics | None = None,
    ):
        self.registry, self.engine_factory, self.load_version = registry, engine_factory, load_version
        self.suite, self.cfg = suite, cfg or GateConfig()
        self.bus, self.clock = bus, clock or (lambda: datetime.now(UTC))
        self.score = score
        self.alerts = 0  # post-promotion guardrail alerts raised by this gate
        self.metrics = metrics or ServiceMetrics("gate")
        self.samples = None if self.cfg.sample_cache_dir is None else SampleCache(self.cfg.sample_cache_dir)
        self.versions_sampled = 0  # offline evaluations' versions sampled afresh / read from the sample cache
        self.versions_from_cache = 0
        self._consumer: Consumer | None = None

    def step(self) -> GateStep:
        """One step of the lifecycle (module docstring). Never promotes. New joined samples are read
        once per step and go to the canary and to the post-promotion watch; their bus positions are
        committed after both have recorded them."""
        promoted = self.registry.promoted()
        if promoted is None:
            return GateStep("no_incumbent", detail="nothing is promoted: bootstrap the base model first")
        batch = self._poll()
        self.watch(promoted, batch)
        done = self._lifecycle(batch)
        self._commit(batch)
        self.metrics.consume(TOPICS["sample"], len(batch))
        self.metrics.set_stats({"alerts": self.alerts, "unreadable_samples": sum(s is None for _, s in batch)})
        self.metrics.report()
        return done

    def _lifecycle(self, batch: list[Polled]) -> GateStep:
        v = self.registry.in_flight()
        if v is None:
            waiting = self.registry.list(Status.candidate)
            if not waiting:
                return GateStep("idle")
            try:
                v = self.registry.transition(
                    waiting[0].id,
                    Status.evaluating,
                    self.cfg.actor,
                    f"offline evaluation on {self.suite.suite_version}",
                )
            except (RegistryConflict, ValueError) as e:  # another writer moved first: look again next step
                return GateStep("idle", waiting[0].id, detail=str(e))
        if v.status is Status.evaluating:
            return self._evaluate(v)
        if v.status is Status.canary:
            return self.canary_step(v, batch)
        return GateStep("awaiting_approval", v.id)

    def canary_step(self, version: ModelVersionPublic, batch: list[Polled] | None = None) -> GateStep:
        """The online stage, called by `step()` on every step while `version` is in `canary`.

        Progress lives in `gate["canary"]` (`CanaryProgress`: ramp step, share, start, and the
        `gating.canary.CanaryOutcomes` as `counts`, with the bus positions already counted), written with
        `record_gate`, so a restarted gate resumes the ramp and never counts a sample twice. The gateway
        assigns users with `assign_arm` salted by the candidate's id at `gate["canary"]["share"]`.

        1. No `gate["canary"]`: the canary starts at step 0, share `cfg.canary.steps[0]`, now.
        2. New samples (`batch`, read by `step()`; read here when called on its own) from
           `TOPICS["sample"]` in the group `cfg.canary.consumer_group`: those of the candidate arm
           served by the candidate and of the incumbent arm served by the incumbent, for completions
           served since the step started (and reported shown, counting exposures), are counted, each
           with its verifier score (`score`) for the pass-rate guardrail; the counts are recorded,
           then the records committed. Without a bus (`bus=None`) the version waits.
        3. `gating.canary.decide` at this look, acted on: `next_step` records the next share and a new
           start (users already in stay in: `assign_arm` is monotone in share); `awaiting_approval`
           and `abort_*` first record share 0, then `transition` to `awaiting_approval` / `aborted`
           with the numbers. It never promotes.

        While awaiting approval the candidate serves nobody (share 0, and the gateway routes only a
        version in `canary`): no user sees an unapproved version while a person decides, and nothing
        unguarded runs meanwhile. Once a person approves it, `watch` keeps its guardrails running."""
        if self.bus is None:
            return GateStep("canary", version.id, detail="no event bus: the canary waits")
        own = batch is None
        if batch is None:
            batch = self._poll()
        c, now = self.cfg.canary, self.clock()
        raw = version.gate.get("canary")
        if raw is None:
            progress = CanaryProgress(step=0, share=c.steps[0], started_at=now, counts=CanaryOutcomes().to_dict())
            self._record_canary(version.id, progress, f"canary started at {c.steps[0]:.0%}")
        else:
            progress = CanaryProgress.model_validate(raw)
        outcomes = CanaryOutcomes.from_dict(progress.counts)
        incumbent = self.registry.incumbent().id
        since = progress.started_at.timestamp() + self.cfg.canary.route_lag_s  # routed at this step's share
        counted = self._count(batch, outcomes, since, progress.step, version.id, incumbent)
        progress = progress.model_copy(update={"counts": outcomes.to_dict()})
        if counted:
            self._record_canary(version.id, progress, f"canary step {progress.step}: {counted} new samples")
        if own:
            self._commit(batch)
        d = decide(progress, outcomes, c, now)
        return self._act_canary(version, progress, d, now)

    def _poll(self, max_polls: int = 100) -> list[Polled]:
        """New records of the sample topic (at most `max_polls` batches), each with its sample (None:
        unreadable, skipped). Empty without a bus."""
        if self.bus is None:
            return []
        if self._consumer is None:
            self._consumer = self.bus.consumer(TOPICS["sample"], self.cfg.canary.consumer_group)
        out: list[Polled] = []
        for _ in range(max_polls):
            batch = self._consumer.poll(500, timeout_s=0.0)
            if not batch:
                break
            for r in batch:
                try:
                    out.append((r, SampleEvent.model_validate_json(r.value)))
                except ValueError:
                    log.warning("gate: unreadable sample at %s/%d@%d skipped", r.topic, r.partition, r.offset)
                    out.append((r, None))
        return out

    def _commit(self, batch: list[Polled]) -> None:
        if batch and self._consumer is not None:
            self._consumer.commit([r for r, _ in batch])

    def _count(
        self,
        batch: list[Polled],
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

    def watch(self, promoted: ModelVersionPublic, batch: list[Polled]) -> dict[str, Any] | None:
        """Keep the canary's guardrails running on the promoted version for `cfg.canary.watch_s` after
        its promotion; returns the watch record (None when there is nothing to watch).

        The comparison: the promoted version's users since promotion (the candidate arm) against the
        incumbent arm of the canary's last step (the previous version's users, just before). It is not
        concurrent, so it only alerts: a harmed guardrail is logged at ERROR, appended to `alerts`
        (once per metric) and counted in `self.alerts`; a person decides whether to roll back. A
        version promoted without a canary (the bootstrap, a rollback target) has no baseline and is
        not watched."""
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
        changed, why = counted > 0, f"watch: {counted} new samples"
        if min(n.values()) >= c.min_users_for_harm:
            numbers, harms = guardrails(outcomes, 0, c)
            raw["guardrails"], raw["users"] = numbers, n
            alerted = {a["metric"] for a in raw["alerts"]}
            for metric, g in numbers.items():
                if g["harmed"] and metric not in alerted:
                    alert = {"metric": metric, "at": now.isoformat(), **g, "users": n}
                    raw["alerts"] = [*raw["alerts"], alert]
                    self.alerts += 1
                    changed, why = True, f"ALERT: {metric} harmed after promotion: " + "; ".join(harms)
                    log.error("gate: ALERT on promoted %s: %s harmed since promotion (%s)", promoted.id, metric, g)
        if (now - promoted_at).total_seconds() >= c.watch_s:
            raw["done"], changed, why = True, True, f"watch over after {c.watch_s:.0f} s"
        if changed:
            self._record_watch(promoted.id, raw, why)
        return raw

    def _promoted_at(self, version_id: str) -> datetime:
        audit = self.registry.audit(version_id)
        steps = [a for a in audit if a.to_status is Status.promoted and a.from_status is not Status.promoted]
        return steps[-1].at if steps else self.clock()

    def _record_watch(self, vid: str, record: dict[str, Any], reason: str) -> None:
        try:
            self.registry.record_gate(vid, WATCH_KEY, record, self.cfg.actor, reason)
        except ValueError as e:  # rolled back meanwhile: nothing left to watch
            log.info("gate: watch of %s not recorded: %s", vid, e)

    def _record_canary(self, vid: str, progress: CanaryProgress, reason: str) -> None:
        self.registry.record_gate(vid, "canary", progress.model_dump(mode="json"), self.cfg.actor, reason)

    def _act_canary(self, v: ModelVersionPublic, progress: CanaryProgress, d: Decision, now: datetime) -> GateStep:
        c = self.cfg.canary
        if d.action == "wait":
            return GateStep("canary", v.id, detail=d.reason)
        if d.action == "next_step":
            nxt = progress.step + 1
            share = c.steps[nxt]
            self._record_canary(
                v.id,
                progress.model_copy(update={"step": nxt, "share": share, "started_at": now}),
                f"{d.reason}; ramp to {share:.0%}",
            )
            return GateStep("next_step", v.id, detail=d.reason)
        self._record_canary(v.id, progress.model_copy(update={"share": 0.0}), f"{d.reason}; share 0")
        to = Status.awaiting_approval if d.action == "awaiting_approval" else Status.aborted
        try:
            self.registry.transition(v.id, to, self.cfg.actor, f"canary: {d.reason}", d.numbers)
        except ValueError as e:
            return self._lost(v, e)
        return GateStep("awaiting_approval" if to is Status.awaiting_approval else d.action, v.id, detail=d.reason)

    # -- the offline stage ----------------------------------------------------------------------

    def _evaluate(self, v: ModelVersionPublic) -> GateStep:
        inc = self.registry.incumbent()
        sha = v.artifact_sha256
        if sha is None:
            return self._act(v, False, {"error": "no artifact"}, "offline: the version has no artifact to evaluate")
        recorded = v.gate.get("offline")
        if recorded is not None:
            old = OfflineVerdict.model_validate(recorded)
            if (old.incumbent_id, old.artifact_sha256, old.suite_version) == (inc.id, sha, self.suite.suite_version):
                why = f"offline verdict recorded by an earlier gate ({'passed' if old.passed else 'failed'})"
                return self._act(v, old.passed, old.numbers, why, resumed=True)
        run = v.gate.get(RUN_KEY, {})
        attempt = int(run.get("attempt", 0)) + 1
        if attempt > self.cfg.max_attempts:
            why = f"offline evaluation failed {attempt - 1} times; last error: {run.get('error')}"
            return self._act(v, False, {"attempts": attempt - 1, "error": run.get("error")}, why)
        record = {
            "attempt": attempt,
            "started_at": datetime.now(UTC).isoformat(),
            "incumbent_id": inc.id,
            "artifact_sha256": sha,
            "suite_version": self.suite.suite_version,
            "seed": self.cfg.seed,
            "error": None,
        }
        try:
            self.registry.record_gate(
                v.id, RUN_KEY, record, self.cfg.actor, f"offline evaluation attempt {attempt} against {inc.id}"
            )
            result = self._run(v, inc, self._anchor(inc))
        except Exception as e:  # reported, counted, retried at the next step
            log.exception("gate: offline evaluation of %s failed", v.id)
            return self._failed_attempt(v, record, e)
        try:
            self.registry.record_gate(v.id, "offline", result.verdict(sha, inc.id), self.cfg.actor, result.summary())
        except ValueError as e:
            return self._lost(v, e)
        return self._act(v, result.passed, result.numbers, result.summary(), result=result)

    def _run(
        self, v: ModelVersionPublic, inc: ModelVersionPublic, anchor: ModelVersionPublic | None = None
    ) -> OfflineResult:
        versions = [v, inc] + ([anchor] if anchor is not None else [])
        sources = {x.id: self.load_version(x) for x in versions}
        engine = self.engine_factory()
        try:
            for name, src in sources.items():
                if isinstance(src, tuple):
                    model, tok = src
                    engine.add_version(name, model, tok)  # type: ignore[arg-type]  # embedded engines take models
                else:
                    engine.add_version(name, src)
            inc_src = sources[inc.id]
            scorer = ModelScorer(
                {inc.id: inc_src[0] if isinstance(inc_src, tuple) else inc_src},
                batch_invariant=getattr(engine, "batch_invariant", True),
            )
            c = self.cfg
            result = evaluate_offline(
                engine,
                v.id,
                inc.id,
                self.suite,
                scorer=scorer,
                G=c.G,
                margin=c.margin,
                alpha=c.alpha,
                seed=c.seed,
                max_tokens=c.max_tokens,
                temperature=c.temperature,
                guardrails=c.guardrails,
                n_resamples=c.n_resamples,
                anchor=None if anchor is None else anchor.id,
                cache=self.samples,
                artifacts={x.id: x.artifact_sha256 for x in versions if x.artifact_sha256},
            )
        finally:
            engine.shutdown()
        sampled = [x.id for x in versions if x.id not in result.numbers["sampling"]["from_cache"]]
        self.versions_sampled += len(sampled)
        self.versions_from_cache += len(versions) - len(sampled)
        self.metrics.set_stats(
            {"versions_sampled": self.versions_sampled, "versions_from_cache": self.versions_from_cache}
        )
        if self.samples is not None and any(x.id != v.id for x in versions if x.id in sampled):
            log.info("gate: sampled %s afresh (not in the sample cache)", ", ".join(x for x in sampled if x != v.id))
        return result

    def _anchor(self, inc: ModelVersionPublic) -> ModelVersionPublic | None:
        """The best version promoted so far on this suite, by the pass rate its offline verdicts recorded
        (as candidate, or as the incumbent of a later verdict, at the gate's sampling settings), if that is
        not the incumbent itself; None with `anchor` off. Rolled-back versions are no anchor."""
        if not self.cfg.anchor:
            return None
        c = self.cfg
        settings = {"G": c.G, "seed": c.seed, "max_tokens": c.max_tokens, "temperature": c.temperature}
        versions = self.registry.list()
        ever = {x.id: x for x in versions if x.status in (Status.promoted, Status.superseded)}
        rates: dict[str, float] = {}
        for x in versions:
            rec = x.gate.get("offline")
            if not rec or rec.get("suite_version") != self.suite.suite_version:
                continue
            n = rec.get("numbers") or {}
            if {k: (n.get("sampling") or {}).get(k) for k in settings} != settings or "reward" not in n:
                continue
            rates.setdefault(x.id, n["reward"]["candidate"])
            rates.setdefault(rec["incumbent_id"], n["reward"]["incumbent"])
        scored = [(rates[i], -ever[i].created_at.timestamp(), i) for i in ever if i in rates]
        if not scored:
            return None
        best = max(scored)[2]
        return None if best == inc.id else ever[best]

    def _failed_attempt(self, v: ModelVersionPublic, record: dict[str, Any], e: Exception) -> GateStep:
        try:
            self.registry.record_gate(
                v.id, RUN_KEY, {**record, "error": repr(e)}, self.cfg.actor, f"offline attempt failed: {e!r}"
            )
        except Exception:  # the registry itself is down: the attempt counted anyway, the step reports it
            log.exception("gate: could not record the failed attempt on %s", v.id)
        return GateStep("error", v.id, detail=repr(e))

    def _act(
        self,
        v: ModelVersionPublic,
        passed: bool,
        numbers: dict[str, Any],
        reason: str,
        result: OfflineResult | None = None,
        resumed: bool = False,
    ) -> GateStep:
        """evaluating → canary (passed) or rejected (with the numbers)."""
        try:
            if passed:
                summary: dict[str, Any] = {
                    k: numbers[k] for k in ("non_inferiority", "checks", "in_distribution") if k in numbers
                }
                self.registry.transition(v.id, Status.canary, self.cfg.actor, reason, summary)
            else:
                self.registry.reject(v.id, self.cfg.actor, reason, numbers)
        except ValueError as e:
            return self._lost(v, e)
        return GateStep("passed" if passed else "rejected", v.id, result, reason, resumed)

    def _lost(self, v: ModelVersionPublic, e: Exception) -> GateStep:
        now = self.registry.get(v.id).status
        if now is Status.evaluating:
            raise e
        return GateStep("lost", v.id, detail=f"{v.id} is {now.value} now: {e}")


# -- loading versions the way the learner stores them -------------------------------------------------
