"""The gate process: drives candidates through the lifecycle, resumably (the online stage is `gating.canary_stage`).

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
4. A version in `canary`: `canary_step(version)`, the online stage (`gating.canary_stage.CanaryStage`).
5. A version `awaiting_approval`: nothing; a person approves or rejects (`approve` is the only way to
   `promoted`; the gate never promotes).

`gating.gate_process.run_gate(settings, stop_event, suite)` is the `flywheel gate` loop: the registry
at `settings.db_url`, a `ProcessEngine` per evaluation and `weight_store_loader` on the learner's
models folder by default, the whole process (and so its engine processes) at nice `cfg.nice`.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from core.service_metrics import ServiceMetrics
from feedback.bus import Consumer, EventBus, Record
from feedback.dead_letter import DEAD_LETTER_TOPIC, dead_letter
from feedback.events import TOPICS, SampleEvent
from gating.canary import CanaryConfig
from gating.canary_stage import CanaryStage, GateStep
from gating.evals import Guardrails, ModelScorer, OfflineResult, evaluate_offline, warm_samples
from gating.sample_cache import SampleCache
from gating.stats import DEFAULT_ALPHA, DEFAULT_MARGIN
from product.suites import EvalSuite
from registry.models import ModelVersionPublic, OfflineVerdict, Status
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
    lend_eval: bool = Field(
        False,
        description="Sample through the lending job queue, so lent replicas share the work (`gating.lent_eval`); "
        "the samples are the same either way.",
    )
    lease_beat_s: float = Field(
        5.0, gt=0, description="run_gate: beat of the gate's lease; gateways stop the canary after 3 missed."
    )
    lease_stuck_s: float = Field(
        300.0, gt=0, description="run_gate: a main loop that has not moved this long stops renewing the lease."
    )
    canary: CanaryConfig = Field(default_factory=CanaryConfig, description="The online canary stage.")


class Gate(CanaryStage):
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
        self.warm_failures = 0
        self.unreadable_samples = 0  # malformed sample records dead-lettered (stage "gate.decode")
        self._warmed: str | None = None  # the incumbent last sampled ahead of its candidates
        self._consumer: Consumer | None = None
        self.lease_s: float | None = None  # run_gate: lapsed lease time does not count toward a canary step
        self._arrivals: dict[str, float] = {}  # the users metered from the samples (CanaryStage.meter)

    def step(self) -> GateStep:
        """One step of the lifecycle (module docstring). Never promotes. New joined samples are read
        once per step and go to the canary and to the post-promotion watch; their bus positions are
        committed after both have recorded them."""
        promoted = self.registry.promoted()
        if promoted is None:
            return GateStep("no_incumbent", detail="nothing is promoted: bootstrap the base model first")
        batch = self._poll()
        self.meter(batch)
        self.watch(promoted, batch)
        done = self._lifecycle(batch)
        self._commit(batch)
        self.metrics.consume(TOPICS["sample"], len(batch))
        self.metrics.set_stats({"alerts": self.alerts, "dead_lettered_malformed": self.unreadable_samples})
        self.metrics.report()
        return done

    def _lifecycle(self, batch: list[Polled]) -> GateStep:
        v = self.registry.in_flight()
        if v is None:
            waiting = self.registry.list(Status.candidate)
            if not waiting:
                return self._warm()
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

    def _warm(self) -> GateStep:
        """Idle: sample the incumbent into the sample cache (once per incumbent), so that the next
        evaluation samples only its candidate. A failure is logged and counted; the evaluation will
        sample the incumbent itself."""
        inc = self.registry.promoted()
        if self.samples is None or inc is None or inc.artifact_sha256 is None or self._warmed == inc.id:
            return GateStep("idle")
        self._warmed = inc.id
        c = self.cfg
        try:
            src = self.load_version(inc)
            engine = self.engine_factory()
            try:
                if isinstance(src, tuple):
                    engine.add_version(inc.id, src[0], src[1])  # type: ignore[arg-type]  # embedded engines take models
                else:
                    engine.add_version(inc.id, src)
                sampled = warm_samples(
                    engine,
                    inc.id,
                    inc.artifact_sha256,
                    self.suite,
                    self.samples,
                    G=c.G,
                    seed=c.seed,
                    max_tokens=c.max_tokens,
                    temperature=c.temperature,
                )
            finally:
                engine.shutdown()
        except Exception as e:  # the evaluation samples it instead
            log.exception("gate: could not sample the incumbent %s ahead of its candidates", inc.id)
            self.warm_failures += 1
            self.metrics.set_stats({"warm_failures": self.warm_failures})
            return GateStep("idle", inc.id, detail=f"warm-up failed: {e!r}")
        if sampled:
            self.versions_sampled += 1
            log.info("gate: sampled the incumbent %s on %s ahead of its candidates", inc.id, self.suite.suite_version)
        return GateStep("idle", inc.id, detail="incumbent sampled" if sampled else "")

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
                except ValueError as e:  # set aside with where it came from (`feedback.dead_letter`), carry on
                    letter = dead_letter(self.bus, r, str(e), "gate.decode")
                    log.error(
                        "gate: malformed sample at %s/%d@%d dead-lettered (%s)",
                        r.topic,
                        r.partition,
                        r.offset,
                        letter.event_id,
                    )
                    self.unreadable_samples += 1
                    self.metrics.produce(DEAD_LETTER_TOPIC)
                    out.append((r, None))
        return out

    def _commit(self, batch: list[Polled]) -> None:
        if batch and self._consumer is not None:
            self._consumer.commit([r for r, _ in batch])

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


# -- loading versions the way the learner stores them -------------------------------------------------
