"""Staleness over 5 gate cycles: what the learner drops as stale and clips, at the default cadence.

**The question.** Over 5 candidate cycles at the default cadence, at most 20% of the samples may be
dropped as stale, and at most 10% of the trained tokens may be PPO-clipped (`clip_frac`) or
log-ratio-clamped (`clamp_frac`), the two together.

**The gate's pace.** The fleet serves the promoted version P to everyone and the in-flight candidate
to a canary share (5% → 20% → 50%, then 0 while a person decides). The gate takes one candidate at a
time, the oldest waiting one, through an offline eval, three canary steps of at least `min_step_s` =
600 s and `min_users_per_arm` = 30 users per arm each, and a person's approval: hours. At the default
cadence (an update every 512 samples or 4 h) the learner makes K updates per gate cycle.

**Two designs on the same traffic** (`DESIGNS`; in brackets, the run's name in the JSON and for
`--design`):
- Per-update candidates, staleness in updates ("per_update": `hold_back=False, staleness_unit="updates"`).
  The learner registers a candidate every update and counts staleness in its own updates
  (`max_staleness` = 2). Worked out from the defaults: once the learner is 3 updates past P, every
  sample P serves (50-100% of the traffic) is dropped; only canary samples train it, and they go
  stale too once it is 3 past the canary. The learner stalls 3 updates ahead of P and trains on the
  canary share alone, and the gate, taking the oldest candidate, evaluates one update per cycle
  while candidates pile up. Any K ≥ 3 drops most samples; K = 2 keeps them for a cycle or two,
  until the backlog grows the gap.
- Hold back while the gate is busy, staleness in registered versions ("hold_back": the `LearnerConfig`
  defaults; `learner.service`, `learner.lineage`). While a version is in flight the learner keeps
  training its lineage but registers no candidate (`hold_back`). The tip is registered as soon as
  the gate is free, so the gate always evaluates the newest weights and sees one candidate of the
  lineage per cycle. Staleness counts registered versions (`staleness_unit="versions"`): P's samples
  are 1 behind (the in-flight candidate was registered after P), the canary's 0, and
  `max_staleness` = 2 keeps samples served up to about two gate cycles ago. The cost is policy lag
  in updates, bounded by `max_lag_updates` = 8 (samples beyond it are dropped and counted with the
  stale ones); the clipped, clamped, masked and capped shares show how much of it the objective cuts.

**The simulation.** The real `LearnerService` (default `LearnerConfig`: 512 samples / 4 h, lr 1e-4,
the default objective of docs/learner.md: decoupled PPO, `estimator="ppo"`, 2 optimizer steps per
update, clip ε 0.2 on π_θ/π_prox, behaviour weight min(π_prox/μ, 2) with the behaviour mask,
|log ratio| clamped at 20) on an embedded bus and a SQLite registry, the demo base model
(`models/demo-base`, `demo.bootstrap.SHIPPED_BASE`: the shipped `flywheel bootstrap` recipe; made
if missing) served by the embedded engine to whatever the registry says the fleet serves: the
promoted version, and the in-flight candidate to users `gating.stats.assign_arm` puts in the canary
at the recorded share. Demo tasks, simulated users (`demo.users`) and the real joiner core
(`feedback.joiner.JoinerCore`, default reward spec, 600 s window) make the samples. Time is a
compressed clock: each tick serves the requests of `tick_s` simulated seconds at the scenario's
traffic; the learner's time trigger and the joiner's window run on it. The gate is simulated on the
registry with its own transitions (`transition`, `record_gate`, `approve`), taking the oldest
candidate as `gating.gate.Gate` does; every candidate passes. A phase lasts: offline eval `eval_s`;
canary step k the attribution window plus max(`min_step_s`, `min_users_per_arm` / (share_k × users
per second)), counting every request as a new user (a floor: the real step also waits for its
confidence bound); approval `approval_s`. Scenarios: "defaults" — the traffic at which the learner's
two triggers agree (512 samples per 4 h: 128 per hour), where the canary's 30 users at 5% take
~4.7 h; "busy" — 1 sample per second, where the steps take their time floor.

**Measured**, per cycle (from one promotion to the next; the first from the start) and in total:
- samples: those the learner consumed, trained or dropped (as stale in `staleness_unit`, beyond the lag
  bound in updates, for an unknown version, empty or greedy: the service's counters);
- dropped (JSON `dropped_share`): samples dropped as stale (`dropped_stale`, in `dropped_stale_share`)
  or beyond the lag bound (`dropped_lag`, in `dropped_lag_share`), over samples;
- clipped (JSON `clipped_share`): the updates' `clipped_tokens` over their `tokens`, i.e. the
  learner's `clip_frac`: kept tokens where the PPO clip on π_θ/π_prox is active, averaged over the
  update's passes (the first pass cannot clip);
- clamped (JSON `truncated_share`): `clamped_tokens` over `tokens`, i.e. the learner's `clamp_frac`:
  tokens whose |log π_θ/μ| exceeds `max_log_ratio` = 20;
- masked (JSON `masked_share`): `masked_tokens` over `tokens`: tokens given no gradient because their
  behaviour ratio is extreme or the DPPO divergence mask holds (the learner's `masked_frac`);
- capped (JSON `capped_share`): `truncated_tokens` over `tokens`: tokens whose behaviour weight
  π_prox/μ was capped (the learner's `truncated_frac`);
- updates, candidates registered, updates held back, and the staleness of the trained samples in
  registered versions and in updates (the updates' `staleness_versions_*` and `staleness_updates_*`).
A run meets the floors (`floors_met`) when dropped_share ≤ 20% and clipped_share + truncated_share ≤
10% (JSON `floors.clipped_or_truncated`). The peer, in the same run: per-update candidates on the
same traffic.
"""

from __future__ import annotations

import json
import random
import tempfile
import time
from collections import Counter
from dataclasses import asdict, dataclass, field
from datetime import UTC, datetime
from pathlib import Path

import torch

from bench import common
from demo.bootstrap import SHIPPED_BASE
from demo.checker import check_batch
from demo.split import sample_tasks
from demo.users import SimulatedUser
from feedback.bus_embedded import EmbeddedBus
from feedback.events import TOPICS, CompletionEvent, FeedbackEvent
from feedback.joiner import JoinerCore
from feedback.rewards import RewardSpec
from gating.canary import CanaryConfig
from gating.stats import assign_arm
from learner.service import LearnerConfig, LearnerService
from registry.registry import Registry
from serving.engine import EmbeddedEngine
from serving.sampling import SamplingParams

NAME = "staleness"
TENANT = "demo"
MAX_TOKENS = 48
FLOOR_DROPPED, FLOOR_CLIPPED = 0.20, 0.10
DESIGNS: dict[str, dict] = {
    "hold_back": {},  # LearnerConfig defaults: hold back while in flight, staleness in registered versions
    "per_update": {"hold_back": False, "staleness_unit": "updates"},  # a candidate per update, staleness in updates
}
LEARNER_COUNTERS = (
    "trained",
    "dropped_stale",
    "dropped_lag",
    "dropped_unknown_version",
    "dropped_empty",
    "dropped_greedy",
)


@dataclass(frozen=True)
class Scenario:
    name: str
    traffic_per_h: float  # joined samples (requests) per hour
    eval_s: float = 900.0  # the gate's offline evaluation
    approval_s: float = 3600.0  # a person approving
    window_s: float = 600.0  # the joiner's attribution window (`flywheel joiner` default)
    tick_s: float = 300.0  # simulated seconds per tick (fewer if that would be over 64 requests)
    users: int = 2000


SCENARIOS = {
    "defaults": Scenario("defaults", traffic_per_h=512 / 4),
    "busy": Scenario("busy", traffic_per_h=3600.0),
}


def step_seconds(scn: Scenario, canary: CanaryConfig, k: int) -> float:
    """How long canary step k lasts (a floor; see the docstring)."""
    users_per_s = scn.traffic_per_h / 3600
    return scn.window_s + max(canary.min_step_s, canary.min_users_per_arm / (canary.steps[k] * users_per_s))


def cycle_seconds(scn: Scenario, canary: CanaryConfig) -> float:
    return scn.eval_s + sum(step_seconds(scn, canary, k) for k in range(len(canary.steps))) + scn.approval_s


class GateSim:
    """The gate's lifecycle on the registry, on the simulated clock; every candidate passes."""

    def __init__(self, reg: Registry, scn: Scenario, canary: CanaryConfig):
        self.reg, self.scn, self.canary = reg, scn, canary
        self.phase: str | None = None
        self.vid: str | None = None
        self.step_k, self.until = 0, 0.0
        self.promotions: list[dict] = []

    def _canary(self, now: float, share: float) -> None:
        assert self.vid is not None
        record = {"step": self.step_k, "share": share, "started_at": datetime.fromtimestamp(now, UTC).isoformat()}
        self.reg.record_gate(self.vid, "canary", record, "gate-sim")

    def step(self, now: float) -> None:
        if self.phase is None:
            waiting = self.reg.list("candidate")
            if not waiting:
                return
            self.vid, self.phase, self.until = waiting[0].id, "evaluating", now + self.scn.eval_s
            self.reg.transition(self.vid, "evaluating", "gate-sim", "offline evaluation (simulated)")
            verdict = {
                "passed": True,
                "incumbent_id": self.reg.incumbent().id,
                "artifact_sha256": self.reg.get(self.vid).artifact_sha256,
                "suite_version": "simulated",
            }
            self.reg.record_gate(self.vid, "offline", verdict, "gate-sim")
            self.started = now
            return
        if now < self.until:
            return
        assert self.vid is not None
        if self.phase == "evaluating":
            self.reg.transition(self.vid, "canary", "gate-sim", "offline passed (simulated)")
            self.phase, self.step_k = "canary", 0
            self._canary(now, self.canary.steps[0])
            self.until = now + step_seconds(self.scn, self.canary, 0)
        elif self.phase == "canary" and self.step_k + 1 < len(self.canary.steps):
            self.step_k += 1
            self._canary(now, self.canary.steps[self.step_k])
            self.until = now + step_seconds(self.scn, self.canary, self.step_k)
        elif self.phase == "canary":
            self._canary(now, 0.0)
            self.reg.transition(self.vid, "awaiting_approval", "gate-sim", "canary passed (simulated)")
            self.phase, self.until = "awaiting", now + self.scn.approval_s
        else:
            self.reg.approve(self.vid, "person-sim", "approved (simulated)")
            self.promotions.append({"version": self.vid, "evaluation_started": self.started, "promoted": now})
            self.phase, self.vid = None, None

    def served(self) -> tuple[str, str | None, float]:
        """(promoted, candidate in canary or None, its share), as the fleet reads the registry."""
        promoted = self.reg.incumbent().id
        v = self.reg.in_flight()
        if v is None or str(v.status) != "canary":
            return promoted, None, 0.0
        return promoted, v.id, float(v.gate.get("canary", {}).get("share", 0.0))


@dataclass
class CycleStats:
    samples: int = 0
    dropped_stale: int = 0
    dropped_lag: int = 0
    tokens: float = 0.0
    clipped_tokens: float = 0.0
    clamped_tokens: float = 0.0
    masked_tokens: float = 0.0
    capped_tokens: float = 0.0
    updates: int = 0
    registered: int = 0
    held_back: int = 0
    served_by: Counter = field(default_factory=Counter)  # "promoted" / "canary" requests
    staleness_versions: list = field(default_factory=list)  # (mean, max, samples) per update
    staleness_updates: list = field(default_factory=list)

    def row(self) -> dict:
        def weighted(rows):
            n = sum(r[2] for r in rows)
            return (sum(r[0] * r[2] for r in rows) / n if n else 0.0), max((r[1] for r in rows), default=0.0)

        sv, su = weighted(self.staleness_versions), weighted(self.staleness_updates)
        return {
            "samples": self.samples,
            "dropped_stale": self.dropped_stale,
            "dropped_lag": self.dropped_lag,
            "dropped_share": (self.dropped_stale + self.dropped_lag) / self.samples if self.samples else 0.0,
            "dropped_stale_share": self.dropped_stale / self.samples if self.samples else 0.0,
            "dropped_lag_share": self.dropped_lag / self.samples if self.samples else 0.0,
            "tokens": self.tokens,
            "masked_share": self.masked_tokens / self.tokens if self.tokens else 0.0,
            "capped_share": self.capped_tokens / self.tokens if self.tokens else 0.0,
            "clipped_share": self.clipped_tokens / self.tokens if self.tokens else 0.0,
            "truncated_share": self.clamped_tokens / self.tokens if self.tokens else 0.0,
            "updates": self.updates,
            "registered": self.registered,
            "held_back": self.held_back,
            "served_by": dict(self.served_by),
            "staleness_versions_mean": sv[0],
            "staleness_versions_max": sv[1],
            "staleness_updates_mean": su[0],
            "staleness_updates_max": su[1],
        }


def simulate(
    model_dir: Path,
    scn: Scenario,
    design: dict,
    cycles: int,
    seed: int,
    work: Path,
    canary: CanaryConfig | None = None,
    learner_cfg: dict | None = None,
    max_tokens: int = MAX_TOKENS,
) -> dict:
    """Drive the learner through `cycles` promotions; per-cycle and total numbers. `design` (and, for
    tests, `learner_cfg`) override `LearnerConfig`'s defaults; `canary` the gate's."""
    rng = random.Random(seed)
    t_wall = time.perf_counter()
    start_time = 1_700_000_000.0
    now = [start_time]
    bus = EmbeddedBus(work / "bus", fsync=False)
    reg = Registry(f"sqlite:///{work}/registry.db")
    cfg = LearnerConfig(**{**(learner_cfg or {}), **design})
    learner = LearnerService(bus, reg, work / "models", model_dir, cfg, clock=lambda: now[0])
    canary = canary or CanaryConfig()
    gate = GateSim(reg, scn, canary)
    joiner = JoinerCore(RewardSpec(), scn.window_s, clock=lambda: now[0])
    users: dict[str, SimulatedUser] = {}
    engine = EmbeddedEngine(max_batch=64, max_model_len=learner.model.args.max_seq_len, seed=seed)
    tok = learner.tokenizer
    loaded: set[str] = set()
    per_cycle: list[CycleStats] = [CycleStats()]
    seen = Counter({k: learner.counters[k] for k in LEARNER_COUNTERS})
    n_req = 0
    per_tick = max(1, min(64, round(scn.traffic_per_h / 3600 * scn.tick_s)))
    dt = per_tick / (scn.traffic_per_h / 3600)
    try:
        while len(gate.promotions) < cycles:
            promoted, cand, share = gate.served()
            wanted = {v for v in (promoted, cand) if v is not None}
            for vid in wanted - loaded:
                engine.add_version(vid, learner.models_dir / vid)
                loaded.add(vid)
            if engine.default_version != promoted:
                engine.set_default(promoted)
            for vid in loaded - wanted:
                engine.retire_version(vid)
            loaded &= wanted
            tasks = sample_tasks(per_tick, seed=seed * 1_000_003 + n_req)
            who = [f"user-{rng.randrange(scn.users)}" for _ in tasks]
            arm = [cand if cand and assign_arm(cand, TENANT, u, share) == "candidate" else promoted for u in who]
            outs: dict[int, object] = {}
            for vid in set(arm):
                idx = [i for i, a in enumerate(arm) if a == vid]
                got = engine.generate(
                    [tok.encode_prompt(tasks[i].prompt) for i in idx],
                    [SamplingParams(max_tokens=max_tokens, seed=n_req + i) for i in idx],
                    vid,
                )
                outs.update(zip(idx, got))
                per_cycle[-1].served_by["canary" if vid == cand else "promoted"] += len(idx)
            done = [outs[i] for i in range(len(tasks))]
            checks = check_batch(tasks, [o.text for o in done])  # type: ignore[attr-defined]
            for t, o, c, u in zip(tasks, done, checks, who):
                user = users.setdefault(u, SimulatedUser(u, seed=seed))
                ev = CompletionEvent.from_completion(o, TENANT, u, "completions").model_copy(update={"ts": now[0]})
                joiner.on_completion(ev)
                for sig in user.react(t, o.text, c):  # type: ignore[attr-defined]
                    joiner.on_feedback(
                        FeedbackEvent(
                            tenant=TENANT,
                            completion_id=ev.completion_id,
                            user_id=ev.user_id,
                            kind=sig.kind,
                            value=sig.value,
                            ts=now[0] + rng.uniform(0.05, 0.5) * scn.window_s,  # within the window
                        )
                    )
            n_req += len(tasks)
            now[0] += dt
            for s in joiner.tick(now[0]):
                bus.publish(TOPICS["sample"], s.completion.completion_id, s.model_dump_json().encode())
            joiner.drain_late()  # none expected (feedback comes within the window); kept bounded regardless
            for _ in range(3):  # a window's worth of samples may exceed one poll's room
                held_before, late_before = learner.counters["held_back"], learner.counters["published_held"]
                v = learner.run_once(timeout_s=0.0)
                cur = per_cycle[-1]
                cur.registered += learner.counters["published_held"] - late_before
                if v:
                    st = learner.last_stats
                    held = learner.counters["held_back"] - held_before
                    cur.updates += 1
                    cur.held_back += held
                    cur.registered += 1 - held
                    cur.tokens += st["tokens"]
                    cur.clipped_tokens += st["clipped_tokens"]
                    cur.clamped_tokens += st["clamped_tokens"]
                    cur.masked_tokens += st["masked_tokens"]
                    cur.capped_tokens += st["truncated_tokens"]
                    n = st["samples"]
                    cur.staleness_versions.append((st["staleness_versions_mean"], st["staleness_versions_max"], n))
                    cur.staleness_updates.append((st["staleness_updates_mean"], st["staleness_updates_max"], n))
                counts = {k: learner.counters[k] for k in LEARNER_COUNTERS}
                cur.samples += sum(counts[k] - seen[k] for k in LEARNER_COUNTERS)
                cur.dropped_stale += counts["dropped_stale"] - seen["dropped_stale"]
                cur.dropped_lag += counts["dropped_lag"] - seen["dropped_lag"]
                seen.update({k: counts[k] - seen[k] for k in LEARNER_COUNTERS})
            before = len(gate.promotions)
            gate.step(now[0])
            if len(gate.promotions) > before:
                row = per_cycle[-1].row()
                print(
                    f"  cycle {len(gate.promotions)}: {gate.promotions[-1]['version']} promoted at "
                    f"{(now[0] - start_time) / 3600:.1f} h; {row['samples']} samples, dropped "
                    f"{row['dropped_share']:.1%}, clipped {row['clipped_share']:.2%}, {row['updates']} updates "
                    f"({time.perf_counter() - t_wall:.0f} s)",
                    flush=True,
                )
                if len(gate.promotions) < cycles:
                    per_cycle.append(CycleStats())
    finally:
        engine.shutdown()
        learner.close()
        bus.close()
    previous = 0.0
    for promo in gate.promotions:
        promo["cycle_h"] = (promo["promoted"] - (previous or start_time)) / 3600
        previous = promo["promoted"]
    total = CycleStats()
    sums = (
        "samples",
        "dropped_stale",
        "dropped_lag",
        "tokens",
        "clipped_tokens",
        "clamped_tokens",
        "masked_tokens",
        "capped_tokens",
        "updates",
        "held_back",
    )
    for cyc in per_cycle:
        for k in (*sums, "registered"):
            setattr(total, k, getattr(total, k) + getattr(cyc, k))
        total.served_by.update(cyc.served_by)
        total.staleness_versions += cyc.staleness_versions
        total.staleness_updates += cyc.staleness_updates
    waiting = [v.id for v in reg.list("candidate")]
    return {
        "scenario": asdict(scn),
        "design": design,
        "learner_config": json.loads(cfg.model_dump_json()),
        "cycle_floor_h": cycle_seconds(scn, canary) / 3600,
        "implied_updates_per_cycle": max(
            cycle_seconds(scn, canary) * scn.traffic_per_h / 3600 / cfg.update_every_samples,
            cycle_seconds(scn, canary) / cfg.update_every_s,
        ),
        "promotions": gate.promotions,
        "cycles": [c.row() for c in per_cycle],
        "total": total.row(),
        "requests": n_req,
        "simulated_h": (now[0] - start_time) / 3600,
        "candidates_waiting_at_end": waiting,
        "wall_s": time.perf_counter() - t_wall,
        "learner_counters": dict(learner.counters),
    }


def ensure_model(path: Path) -> Path:
    if not (path / "config.json").is_file():
        from demo.bootstrap import BootstrapConfig, bootstrap

        bootstrap(path, BootstrapConfig())
    return path


def main() -> None:
    ap = common.parser(__doc__)
    ap.add_argument("--model", type=Path, default=SHIPPED_BASE, help="the base (default: models/demo-base)")
    ap.add_argument("--scenario", nargs="+", default=list(SCENARIOS), choices=list(SCENARIOS))
    ap.add_argument("--design", nargs="+", default=list(DESIGNS), choices=list(DESIGNS))
    ap.add_argument("--cycles", type=int, default=5)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=1, help="torch intra-op threads of the learner")
    a = ap.parse_args()
    st = common.stamp()
    torch.set_num_threads(a.threads)
    torch.manual_seed(a.seed)
    model = ensure_model(a.model)
    runs = []
    for name in a.scenario:
        for d in a.design:
            with tempfile.TemporaryDirectory(prefix="flywheel-staleness-") as work:
                print(f"{name} / {d} ...", flush=True)
                run = simulate(model, SCENARIOS[name], DESIGNS[d], a.cycles, a.seed, Path(work))
                run["name"] = d
                t = run["total"]
                run["floors_met"] = (
                    t["dropped_share"] <= FLOOR_DROPPED and t["clipped_share"] + t["truncated_share"] <= FLOOR_CLIPPED
                )
                runs.append(run)
                print(
                    f"{name} / {d}: dropped {t['dropped_share']:.1%} (lag {t['dropped_lag_share']:.1%}), "
                    f"clipped {t['clipped_share']:.2%}, clamped {t['truncated_share']:.2%}, "
                    f"{t['updates']} updates, {run['wall_s']:.0f} s",
                    flush=True,
                )
    res = {
        "model": common.shown(a.model),
        "cycles": a.cycles,
        "floors": {"dropped": FLOOR_DROPPED, "clipped_or_truncated": FLOOR_CLIPPED},
        "runs": runs,
    }
    common.save(NAME, res, st, a.out)


if __name__ == "__main__":
    main()
