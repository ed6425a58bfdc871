"""`flywheel demo`: the demo product driven through the whole running system, on a compressed clock.

The run is `flywheel up` on a config file of its own (`<home>/flywheel.toml`, written from
`DemoSystemConfig` by `demo_config`): the gateway (with `replicas` engines following the registry,
serving the completion endpoint, the feedback API, the admin API and the dashboard), the joiner
(attribution window `window_s`), the learner (an update every `learner_every_samples`) and the gate
(the demo's offline suite, `demo.suite:demo_suite`, then a short canary ramp), each a process, on
embedded defaults under the run's `FLYWHEEL_HOME`. There is no second copy of the service wiring.

This process plays the product's users (`demo.traffic.drive_users`). Each of `users` simulated users
(`demo.users.SimulatedUser`,
heterogeneous: their own accept probabilities, activity drawn from a heavy-tailed distribution, an
`adversarial_share` of them rewarding wrong completions) asks for completions of training-split
tasks through the `openai` client, sees them (`shown`, through the feedback SDK) and reacts sparsely:
an implicit signal on most completions, explicit ones on a minority, each at a delay spread over the
attribution window, silence otherwise. A candidate that reaches `awaiting_approval` is approved through
the admin API with an admin key, as the dashboard would, when `auto_approve` is set (the demo's flag;
otherwise it waits for a person on the dashboard).

At the end every promoted version, and the base, is evaluated on the report split (never seen by
pre-training, traffic or the gate) in this process, and the run's numbers are returned: satisfaction
and pass rate per version, the canary decisions, samples and wall time per promotion, and the
learner's off-policy statistics. `demo.report` turns runs into `docs/demo/report.{md,json}`.
"""

from __future__ import annotations

import asyncio
import json
import logging
import math
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, Literal

import httpx
from pydantic import BaseModel, ConfigDict, Field, model_validator

from demo.suite import GATE_PROMPTS
from demo.traffic import Traffic, drive_users

log = logging.getLogger(__name__)


class DemoSystemConfig(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    seed: int = Field(0, description="Seeds the users, their traffic and the services' sampling.")
    users: int = Field(500, ge=1, description="Simulated users.")
    adversarial_share: float = Field(0.0, ge=0, le=1, description="Share of users who reward wrong completions.")
    shuffle_rewards: bool = Field(
        False,
        description="Control: each reaction is about another completion (its text and outcome), so it says nothing.",
    )
    traffic_s: float = Field(600.0, gt=0, description="Seconds of user traffic (wall clock).")
    stop_after_promotions: int | None = Field(
        None,
        ge=1,
        description="End the traffic early, once this many trained versions are promoted (None: all of traffic_s).",
    )
    concurrency: int = Field(16, ge=1, description="Completions in flight at once.")
    window_s: float = Field(4.0, gt=0, description="The joiner's attribution window (the compressed clock).")
    p_implicit: float = Field(0.8, ge=0, le=1, description="Share of completions that get an implicit signal.")
    p_explicit: float = Field(0.25, ge=0, le=1, description="Share of explicit signals (thumbs, ratings) kept.")
    replicas: int = Field(2, ge=1, description="Engines of the gateway.")
    learner_every_samples: int = Field(
        128,
        ge=1,
        description="Samples per learner update: 8 updates of 128 passed the gate split as 8 of 256 did (0.660 vs "
        "0.681, base 0.417) in half the traffic, so a gate cycle is shorter (docs/demo.md).",
    )
    lr: float = Field(3e-4, gt=0, description="The learner's learning rate.")
    kl_coef: float = Field(
        0.2,
        ge=0,
        description="The learner's KL penalty to the promoted version (`learner.objective`): the largest size "
        "tried whose gate-split pass rate was no lower than KL off's (bench/kl_size.py, docs/demo.md).",
    )
    kl_estimator: Literal["k2", "exact"] = Field(
        "k2",
        description="How the learner's KL penalty is estimated (`LossConfig.kl_estimator`): k2 on the sampled "
        "tokens, or the exact KL over the vocabulary at every visited state (docs/learner.md). Over three "
        "seeds neither gave fewer rejected candidates (docs/demo.md).",
    )
    updates_per_candidate: int = Field(
        8, ge=1, description="Updates a candidate holds beyond its parent (min_updates_per_candidate)."
    )
    max_lag_updates: int = Field(
        8,
        ge=1,
        description="The learner's policy-lag bound in updates (`LearnerConfig.max_lag_updates`): at 8, the "
        "candidate's size, the learner waits while the gate works; at 16 it trains the next candidate meanwhile, "
        "on samples one candidate staler (docs/demo.md).",
    )
    serving_nice: int = Field(
        10,
        ge=0,
        le=19,
        description="Niceness of the serving engines (`[gateway] engine_nice`): above 0 the learner and the gate, "
        "which set the pace of the loop, get the 2 cores first, as their own machines would give them in "
        "production (docs/demo.md).",
    )
    gate_G: int = Field(8, ge=1, description="Offline samples per prompt and version.")
    gate_kl_samples: int = Field(
        1,
        ge=1,
        description="Candidate samples per prompt the gate's KL guardrail scores under the incumbent "
        "(`Guardrails.kl_samples_per_prompt`, default 2): 1 still scores about 10,000 tokens against its 0.5-nat "
        "bound, and halves the scoring, 24 of 81.5 s of an offline evaluation here (docs/gate.md).",
    )
    gate_prompts: int = Field(
        GATE_PROMPTS, ge=4, description="Prompts of the offline suite (a multiple of 18 is stratified by family)."
    )
    canary_steps: tuple[float, ...] = Field((0.2, 0.5), description="Canary shares.")
    canary_min_users: int = Field(20, ge=2, description="Users per arm a canary step needs.")
    canary_max_step_s: float = Field(120.0, gt=0, description="A canary step not passed by then is inconclusive.")
    canary_margin: float = Field(
        0.13,
        ge=0,
        description="The canary's non-inferiority margin (reward scale): the smallest with 80% power at the demo's "
        "~470 users per 120 s step at 20% (bench/canary_sizing.py, docs/gate.md); production's default is 0.03.",
    )
    shape: Literal["embedded", "kafka-postgres"] = Field(
        "embedded",
        description="What the run runs on (`demo.stack`): the embedded bus and SQLite, or the production shape: "
        "a Kafka-protocol broker and a PostgreSQL database made for the run, with `gateways` gateways.",
    )
    gateways: int = Field(1, ge=1, description="Gateways the users are spread over (more than 1: kafka-postgres).")
    postgres_server: str = Field(
        "postgresql://postgres@127.0.0.1:5432", description="kafka-postgres: where the run's database is made."
    )
    diurnal_trough: float | None = Field(
        None,
        gt=0,
        le=1,
        description="Users come and go over one compressed day, the run: the clients in flight follow a cosine "
        "from this share of `concurrency` (night, at the start and end) to all of it (midday); None: all, always.",
    )
    lending: bool = Field(
        False,
        description="Lend idle replicas (`[lending]`, thresholds scaled to the run): the gate's eval sampling and "
        "the learner's group rollouts (the demo's offline prompts) run on them (docs/lending.md).",
    )
    auto_approve: bool = Field(True, description="Approve through the admin API as soon as a version awaits it.")
    report_prompts: int = Field(1000, ge=10, description="Report-split prompts per evaluation.")
    max_tokens: int = Field(48, ge=1)

    @model_validator(mode="after")
    def _gateways_share_a_bus(self) -> DemoSystemConfig:
        if self.gateways > 1 and self.shape != "kafka-postgres":
            raise ValueError(f"gateways={self.gateways} needs shape 'kafka-postgres' (a bus and database they share)")
        if self.lending and self.replicas < 2:
            raise ValueError(f"lending needs at least 2 replicas per gateway (one always serves), got {self.replicas}")
        if self.max_lag_updates < self.updates_per_candidate:
            raise ValueError(
                f"max_lag_updates={self.max_lag_updates} is below updates_per_candidate={self.updates_per_candidate}: "
                "the learner would wait at the bound before a candidate is ready"
            )
        return self

    def active_clients(self, elapsed_s: float) -> int:
        """Clients in flight `elapsed_s` into the traffic: all of `concurrency`, or with `diurnal_trough`
        the day's cosine, from the trough at the start and end to all of them halfway (at least one)."""
        if self.diurnal_trough is None:
            return self.concurrency
        day = min(max(elapsed_s / self.traffic_s, 0.0), 1.0)
        level = self.diurnal_trough + (1 - self.diurnal_trough) * (1 - math.cos(2 * math.pi * day)) / 2
        return max(1, round(self.concurrency * level))

    @classmethod
    def quick(cls) -> DemoSystemConfig:
        """The short variant CI runs: fewer users and minutes, the same system."""
        return cls(
            users=150,
            traffic_s=1500.0,  # at most: the traffic ends at the first trained promotion (144 s to 800+ s in, by VM)
            stop_after_promotions=1,
            report_prompts=200,
            gate_prompts=36,  # 2 per family at G 4: the overall test decides, the family test has no power
            gate_G=4,
            canary_steps=(0.5,),
            canary_min_users=10,
            canary_margin=0.11,  # 80% power with its 150 users in one 120 s step at 50% (bench/canary_sizing.py)
        )


# ---- the run -------------------------------------------------------------------------------------


class Approver:
    """Approves, through the admin API, every version that awaits approval (the demo's auto-approve)."""

    def __init__(self, url: str, token: str):
        self.url, self.headers = url, {"Authorization": f"Bearer {token}"}
        self.approved: list[str] = []

    def step(self) -> None:
        r = httpx.get(self.url + "/admin/versions", headers=self.headers, timeout=10)
        r.raise_for_status()
        for v in r.json():
            if v["status"] == "awaiting_approval" and v["id"] not in self.approved:
                reason = {"reason": "demo auto-approve: offline gate and canary passed"}
                a = httpx.post(f"{self.url}/admin/versions/{v['id']}/approve", json=reason, headers=self.headers)
                if a.status_code == 200:
                    self.approved.append(v["id"])
                    log.info("demo: approved %s", v["id"])
                else:
                    log.warning("demo: approving %s: %s %s", v["id"], a.status_code, a.text[:200])


def run_system(
    cfg: DemoSystemConfig,
    home: Path,
    base: Path,
    on_line: Callable[[str], None] = print,
    *,
    keep_serving: Callable[[str, str], None] | None = None,
) -> dict:
    """One run (module docstring); returns its numbers. `base` is the base checkpoint. With
    `keep_serving`, the gateway (and its dashboard) stays up after the run until
    `keep_serving(url, admin_token)` returns."""
    from demo import stack as shapes
    from registry.keys import KeyStore
    from registry.registry import Registry

    home.mkdir(parents=True, exist_ok=True)
    t0 = time.monotonic()
    stack = shapes.start(cfg, home, base)
    services, url = stack.supervisor, stack.urls[0]
    keep = ("tansu",)  # the broker outlives the services: the leak check reads the run's completions from it
    served = False
    try:
        registry = Registry(stack.db_url)
    except BaseException:
        services.stop()
        raise
    bar = _progress(cfg.traffic_s, "users")
    try:
        with KeyStore(stack.db_url) as keys:
            token, _ = keys.create(["admin"], label="demo auto-approve")
        stack.wait_ready()
        on_line(
            f"[{time.monotonic() - t0:6.0f}s] "
            + ", ".join(f"gateway up at {u}" for u in stack.urls)
            + f" ({cfg.replicas} replicas each, {cfg.shape}); dashboard {url}/dashboard"
            + ("" if cfg.auto_approve else f" (sign in with the admin key {token} to approve)")
        )
        approver = Approver(url, token)
        seen: dict[str, str] = {}
        trained: set[str] = set()  # trained versions seen promoted
        start = time.monotonic()

        def watch(traffic: Traffic) -> None:
            services.check()
            if cfg.auto_approve:
                approver.step()
            for v in registry.list():
                if v.status.value in ("candidate", "evaluating", "canary", "awaiting_approval"):
                    continue
                if seen.get(v.id) != v.status.value:
                    seen[v.id] = v.status.value
                    if v.parent_id is not None:
                        bar.write(_version_line(v, time.monotonic() - t0, traffic), on_line)
                if v.parent_id is not None and v.status.value == "promoted":
                    trained.add(v.id)
            if cfg.stop_after_promotions is not None and len(trained) >= cfg.stop_after_promotions:
                traffic.ended_early = True
            bar.update(min(cfg.traffic_s, time.monotonic() - start), traffic)

        deadline = time.monotonic() + cfg.traffic_s
        traffic = asyncio.run(drive_users(cfg, stack.urls, deadline, throttled(watch, 2.0)))
        watch(traffic)
        lending = lending_numbers([httpx.get(u + "/metrics", timeout=30).text for u in stack.urls])
        bar.close()
        wall = time.monotonic() - t0
        versions = registry.list()
        audit = registry.audit()
        fleet = _fleet(registry)
        db_url = stack.db_url
        served = True
    finally:
        bar.close()
        # after a failure nothing is kept: the exception leaves this function (the broker with it)
        services.stop(keep=(*keep, *(("up",) if keep_serving else ())) if served else ())
        registry.close()
    try:
        promoted = list(dict.fromkeys(a.version_id for a in audit if a.to_status.value == "promoted"))
        on_line(
            f"[{time.monotonic() - t0:6.0f}s] traffic over"
            + (f" at the {cfg.stop_after_promotions} trained promotion(s) asked for" if traffic.ended_early else "")
            + f"; evaluating {len(promoted)} versions on the report split"
        )
        evals = evaluate_versions(home, base, promoted, cfg, db_url)
        leaks = logged_prompt_leaks(stack.settings, base)
        result = {
            "config": cfg.model_dump(mode="json"),
            "wall_s": round(wall, 1),
            "evaluation_s": round(time.monotonic() - t0 - wall, 1),
            "traffic": {
                "completions": traffic.completions,
                "errors": traffic.errors,
                "feedback": traffic.feedback,
                "ended_early": traffic.ended_early,
                "served": traffic.served,
                "by_gateway": traffic.by_gateway,
                "pass_rate_served": {k: sum(v) / len(v) for k, v in traffic.passed.items() if v},
            },
            "versions": [_version_record(v, audit) for v in versions],
            "promotions": promoted,
            "evaluations": {vid: evals[vid] for vid in promoted},
            "logged_prompts": leaks,
            "poisoning": poisoning_by_update(home / "models" / "learner" / "updates.jsonl", cfg),
            "fleet": fleet,
            "lending": lending,
            "registry_url": db_url,
        }
        if keep_serving is not None:
            keep_serving(url, token)
    finally:
        services.stop()
    return result


class _progress:
    """A tqdm bar over the traffic's seconds (what the users did as its postfix); lines printed above it."""

    def __init__(self, total_s: float, what: str):
        from tqdm import tqdm

        self.bar = tqdm(total=round(total_s), desc=what, unit="s", dynamic_ncols=True, leave=False)
        self.done = 0

    def update(self, elapsed_s: float, traffic: Traffic) -> None:
        step = int(elapsed_s) - self.done
        if step > 0:
            self.bar.update(step)
            self.done += step
        self.bar.set_postfix(completions=traffic.completions, feedback=traffic.feedback, refresh=False)

    def write(self, line: str, on_line: Callable[[str], None]) -> None:
        with self.bar.external_write_mode():
            on_line(line)

    def close(self) -> None:
        self.bar.close()


def throttled(fn: Callable[[Traffic], None], every_s: float) -> Callable[[Traffic], None]:
    """`fn`, called at most once every `every_s` seconds (the others are dropped): a progress callback."""
    last = [0.0]

    def call(t: Traffic) -> None:
        if time.monotonic() - last[0] >= every_s:
            last[0] = time.monotonic()
            fn(t)

    return call


def _version_line(v: Any, elapsed: float, traffic: Traffic) -> str:
    offline = (v.gate.get("offline") or {}).get("numbers", {})
    diff = offline.get("difference") or offline.get("overall", {})
    what = json.dumps(diff)[:80] if diff else ""
    return f"[{elapsed:6.0f}s] {v.id} {v.status.value:<12} parent {v.parent_id} {what} ({traffic.completions} served)"


LEARNER_KEYS = (
    "samples",
    "samples_since_parent",
    "held_back_updates",
    "reward_mean",
    "ratio_mean",
    "ratio_max",
    "abs_log_ratio_mean",
    "clip_frac",
    "staleness_versions_mean",
    "staleness_updates_mean",
    "dropped",
    "kl_k3",
    "entropy",
    "poisoning",
    "lag_updates_max",
    "dropped_lag",
    "masked_frac",
    "truncated_frac",
    "clip_frac_step2",
    "missing_routing_sequences",
    "replay_off_micro_batches",
    "poisoning_flagged_users",
    "since_parent",
)
"""The learner's numbers of a version that a run's record keeps (the off-policy ones among them)."""


LENT_STATS = ("trained_offline", "offline_groups", "rollout_versions", "offline_errors")
"""The learner's counts of its lent rollouts that a run records (`flywheel_service_stat`)."""


def lending_numbers(metrics_texts: list[str]) -> dict[str, float]:
    """From each gateway's `/metrics` at the end of the traffic: the lending totals summed over the
    gateways (`flywheel_lending_total`: lends, reclaims, panics, lent_seconds, rollouts, ...) and the
    learner's lent-rollout counts (`LENT_STATS`, read once: every gateway shows the same services)."""
    from prometheus_client.parser import text_string_to_metric_families

    out: dict[str, float] = {}
    for i, text in enumerate(metrics_texts):
        for family in text_string_to_metric_families(text):
            for sample in family.samples:
                if sample.name == "flywheel_lending_total":
                    key = sample.labels["what"]
                    out[key] = out.get(key, 0.0) + sample.value
                elif (
                    i == 0
                    and sample.name == "flywheel_service_stat"
                    and sample.labels.get("service") == "learner"
                    and sample.labels.get("name") in LENT_STATS
                ):
                    out[f"learner_{sample.labels['name']}"] = sample.value
    return out


def version_records(db_url: str) -> list[dict]:
    """Every version of a run's registry (at `db_url`), as `run_system` records it (also for a finished run)."""
    from registry.registry import Registry

    registry = Registry(db_url)
    try:
        audit = registry.audit()
        return [_version_record(v, audit) for v in registry.list()]
    finally:
        registry.close()


def poisoning_by_update(log_path: Path, cfg: DemoSystemConfig) -> dict:
    """What the poisoning screen flagged in each update of the run (the learner's `updates.jsonl`):
    updates that flagged an honest user, and updates that flagged at least one adversarial user
    (the first `round(users * adversarial_share)` users, `demo.traffic`)."""
    from feedback.events import hash_user

    n_adv = round(cfg.users * cfg.adversarial_share)
    updates = [json.loads(line) for line in log_path.read_text().splitlines()] if log_path.is_file() else []
    honest = adversarial = 0
    for u in updates:
        flags = (u["stats"].get("poisoning") or {}).get("flags", [])
        adv = {hash_user(f["tenant"], f"user-{cfg.seed}-{i}") for f in flags[:1] for i in range(n_adv)}
        honest += any(f["user"] not in adv for f in flags)
        adversarial += any(f["user"] in adv for f in flags)
    return {
        "updates": len(updates),
        "adversarial_users": n_adv,
        "updates_flagging_honest": honest,
        "updates_flagging_adversarial": adversarial,
    }


def _version_record(v: Any, audit: list) -> dict:
    steps = [a for a in audit if a.version_id == v.id and a.from_status != a.to_status]
    return {
        "id": v.id,
        "parent": v.parent_id,
        "status": v.status.value,
        "created_at": v.created_at.isoformat(),
        "transitions": [
            {"to": a.to_status.value, "at": a.at.isoformat(), "actor": a.actor, "reason": a.reason[:300]} for a in steps
        ],
        "learner": {k: v.metrics.get(k) for k in LEARNER_KEYS if k in v.metrics},
        "offline_passed": (v.gate.get("offline") or {}).get("passed"),
        "offline": _offline_rates(v.gate.get("offline")),
        "canary": {k: (v.gate.get("canary") or {}).get(k) for k in ("step", "share")},
    }


def _offline_rates(verdict: dict | None) -> dict | None:
    """The offline verdict's pass rates (candidate, incumbent and which), if checked the anchor's, and
    how long the evaluation took (`seconds`: sampling, verifying and the KL guardrail's scoring)."""
    if not verdict or "reward" not in (verdict.get("numbers") or {}):
        return None
    n = verdict["numbers"]
    anchor = n.get("anchor") or {}
    return {
        "candidate": n["reward"]["candidate"],
        "incumbent": n["reward"]["incumbent"],
        "incumbent_id": verdict.get("incumbent_id"),
        "anchor_id": anchor.get("id"),
        "anchor": anchor.get("pass_rate"),
        "seconds": round(n["timing_s"]["total"], 1) if "timing_s" in n else None,
    }


def _fleet(registry: Any, timeout_s: float = 60.0) -> dict:
    """At the end of traffic: every gateway's replicas up and whether each holds the promoted version,
    once the fleet serves it or `timeout_s` has passed (`waited_s`: how long that took)."""
    t0 = time.monotonic()
    f = registry.fleet(interval_s=1.0)
    while not f.complete and f.up and time.monotonic() - t0 < timeout_s:  # no replica up: nothing to wait for
        time.sleep(0.5)
        f = registry.fleet(interval_s=1.0)
    up = [b for b in f.replicas if b.replica_id in f.up]
    sha = registry.get(f.promoted_id).artifact_sha256 if f.promoted_id else None
    return {
        "promoted": f.promoted_id,
        "complete": f.complete,
        "gateways": sorted({b.gateway_id for b in up}),
        "replicas_up": len(up),
        "replicas_on_promoted": sum(b.holds.get(f.promoted_id) == sha for b in up) if sha else 0,
        "waited_s": round(time.monotonic() - t0, 1),
    }


def logged_prompt_leaks(settings: Any, base: Path) -> dict:
    """Every completion event the run logged (on its bus: `settings`), its prompt decoded, checked for
    gate or report content."""
    from demo.split import find_leaks
    from feedback.connect import open_bus
    from feedback.events import TOPICS, CompletionEvent
    from serving.tokenizer import Tokenizer

    tok = Tokenizer.from_file(base)
    bus = open_bus(settings, "demo")
    consumer = bus.consumer(TOPICS["completion"], group="demo-leak-check")
    prompts: list[str] = []
    deadline = time.monotonic() + 60.0  # a Kafka consumer first joins its group (seconds), then reads
    try:
        while True:
            records = consumer.poll(max_records=2000, timeout_s=1.0)
            prompts += [tok.decode(CompletionEvent.model_validate_json(r.value).prompt_ids) for r in records]
            if not records and (consumer.assignment() or time.monotonic() > deadline):
                break
    finally:
        consumer.close()
        bus.close()
    leaks = find_leaks(prompts)
    return {"completions_logged": len(prompts), "distinct_prompts": len(set(prompts)), "leaks": leaks[:20]}


def evaluate_versions(
    home: Path, base: Path, version_ids: list[str], cfg: DemoSystemConfig, db_url: str | None = None
) -> dict:
    """Satisfaction and pass rate of each version on the report split, with 95% CIs (this process).

    Each version is the artifact replicas serve: rebuilt from the weight store and checked against the
    registry's SHA-256 (`gating.gate_process.weight_store_loader`), recorded as `artifact_sha256`. A
    version whose artifact is missing or does not match is a ValueError, never replaced by another
    model. `base` is unused: the base is served from its own weight-store snapshot like any version.
    `db_url`: the run's registry (None: the SQLite file in `home`)."""
    from tqdm import tqdm

    from demo.evaluation import evaluate
    from demo.split import split_tasks, unsplit_tasks
    from gating.gate_process import weight_store_loader
    from registry.registry import Registry
    from serving.engine import EmbeddedEngine

    tasks = split_tasks("report", cfg.report_prompts)
    unsplit = unsplit_tasks(cfg.report_prompts // 2)
    load = weight_store_loader(home / "models" / "learner", home / "report" / "versions", keep=2)
    registry = Registry(db_url or f"sqlite:///{home / 'registry.db'}")
    out = {}
    try:
        for vid in tqdm(version_ids, desc="report split", unit="version", dynamic_ncols=True, leave=False):
            version = registry.get(vid)
            folder = load(version)
            assert isinstance(folder, Path)  # the weight-store loader returns a folder
            engine = EmbeddedEngine(max_batch=64, max_model_len=256)
            try:
                engine.add_version(vid, folder, default=True)
                r = evaluate(engine, vid, tasks, seed=REPORT_SEED, max_tokens=cfg.max_tokens)
                u = evaluate(engine, vid, unsplit, seed=UNSPLIT_SEED, max_tokens=cfg.max_tokens)
            finally:
                engine.shutdown()
            out[vid] = {
                "artifact_sha256": version.artifact_sha256,
                "satisfaction": r["satisfaction"],
                "satisfaction_ci95": mean_ci(r["per_task"]["satisfaction"]),
                "pass_rate": r["pass_rate"],
                "pass_rate_ci95": mean_ci(r["per_task"]["passed"]),
                "satisfaction_ceiling": r["satisfaction_ceiling"],
                "n": r["n"],
                "per_task": r["per_task"],
                "unsplit": {"pass_rate": u["pass_rate"], "n": u["n"], "per_task": {"passed": u["per_task"]["passed"]}},
            }
    finally:
        registry.close()
    return out


REPORT_SEED = 424_242
UNSPLIT_SEED = 434_343


def mean_ci(xs: list[float]) -> list[float]:
    """Normal 95% interval of the mean of `xs` (paired differences: pass the differences)."""
    n = len(xs)
    mean = sum(xs) / n
    sd = math.sqrt(sum((x - mean) ** 2 for x in xs) / (n - 1)) if n > 1 else 0.0
    half = 1.96 * sd / math.sqrt(n)
    return [round(mean - half, 4), round(mean + half, 4)]
