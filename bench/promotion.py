"""A better candidate all the way: the offline gate, the canary over HTTP with simulated users, a person's
approval, every replica serving it, and a rollback; the wall time of every stage.

The candidate is the `honest` one of `bench.damaged_candidates` (trained with the demo's loop from the base,
the same budget), or `--candidate DIR`. What runs:
1. the gateway, `flywheel serve` in a process of its own (2 embedded replicas following the registry,
   heartbeat 0.5 s; it publishes and promotes the base), and the joiner, `flywheel joiner` in another,
   both under one `core.supervisor.Supervisor`, on one FLYWHEEL_HOME (embedded bus, SQLite registry);
2. the candidate registered as the learner registers one (`register_candidate`: a weight-store delta);
3. `Gate.step` in this process, holding the gate's lease (`gating.lease.GateLease`: gateways route users to
   a canary only while a gate beats it): the offline verdict on the weight-store artifact against the base;
4. the canary: between the gate's looks, `Traffic` sends a round of completions over HTTP (`model:
   flywheel`, each user's id), shows each (`FeedbackClient.shown`) and sends the simulated users'
   reactions through the SDK; the joiner joins them once the attribution window closes; the gate reads
   the samples from the bus, until `awaiting_approval` (or an abort);
5. an admin approves over HTTP (`POST /admin/versions/{id}/approve`) and every replica's heartbeat
   reports the candidate's artifact hash (`GET /admin/fleet`);
6. an admin rolls back over HTTP; every replica reports the base's hash again and serves it.
The peer of each stage is its floor (approval to every replica within 2 s); of the canary, the base on the
same users in the same steps.
"""

from __future__ import annotations

import logging
import random
import shutil
import tempfile
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import httpx

from api.fleet import CANARY_TTL_S
from bench import common
from bench.damaged_candidates import add_training_args, loop_config, quiet_logs, register_candidate, train
from core.settings import Settings
from core.supervisor import Supervisor
from demo.bootstrap import SHIPPED_BASE
from demo.checker import check_batch
from demo.split import sample_tasks
from demo.suite import demo_suite
from demo.tasks import Task
from demo.users import SimulatedUser
from feedback.connect import open_bus
from feedback.sdk.client import FeedbackClient
from gating.canary import CanaryConfig, CanaryOutcomes, decide
from gating.gate import Gate, GateConfig
from gating.gate_process import verifier_scorer, weight_store_loader
from gating.lease import GateLease
from product.suites import EvalSuite
from registry.keys import KeyStore
from registry.models import CanaryProgress
from registry.registry import Registry
from serving.engine import EmbeddedEngine
from serving.tokenizer import Tokenizer

NAME = "promotion"
log = logging.getLogger(__name__)


@dataclass
class Traffic:
    """Simulated users of the product over HTTP: each asks the `flywheel` alias for completions of demo
    tasks, is shown each one (`FeedbackClient.shown`) and reacts as a `SimulatedUser` does, through the SDK."""

    url: str
    users: list[SimulatedUser]
    per_user: int
    max_tokens: int = 48
    threads: int = 16
    rounds: int = 0
    served: Counter = field(default_factory=Counter)

    def round(self, feedback: FeedbackClient) -> dict[str, Any]:
        """One round: every user asks `per_user` completions, in chunks of `2 * threads` requests at a time;
        each chunk is checked, shown and reacted to as soon as it is served (well inside the attribution
        window), then the feedback is flushed."""
        from concurrent.futures import ThreadPoolExecutor

        rng = random.Random(f"traffic:{self.rounds}")
        self.rounds += 1
        jobs = [(u, t) for u in self.users for t in sample_tasks(self.per_user, seed=rng.randrange(1 << 30))]
        rng.shuffle(jobs)
        models: list[str] = []
        passed: list[bool] = []
        t0 = time.perf_counter()
        with httpx.Client(timeout=120) as http, ThreadPoolExecutor(self.threads) as pool:

            def complete(job: tuple[SimulatedUser, Task]) -> dict[str, Any]:
                user, task = job
                body = {"model": "flywheel", "prompt": task.prompt, "max_tokens": self.max_tokens, "user": user.user_id}
                r = http.post(self.url + "/v1/completions", json=body)
                r.raise_for_status()
                return r.json()

            chunk = 2 * self.threads
            for i in range(0, len(jobs), chunk):
                part = jobs[i : i + chunk]
                answers = list(pool.map(complete, part))
                texts = [a["choices"][0]["text"] for a in answers]
                for (user, task), a, text, check in zip(part, answers, texts, check_batch([t for _, t in part], texts)):
                    feedback.shown(a["id"], user=user.user_id)
                    for sig in user.react(task, text, check):
                        feedback.send(sig.kind, a["id"], sig.value, user=user.user_id)
                    models.append(a["model"])
                    passed.append(check.passed)
        if not feedback.flush(timeout=60):
            raise RuntimeError("feedback was not delivered within 60 s")
        self.served.update(models)
        return {
            "completions": len(jobs),
            "seconds": time.perf_counter() - t0,
            "by_version": dict(Counter(models)),
            "pass_rate_by_version": {
                v: sum(p for m, p in zip(models, passed) if m == v) / models.count(v) for v in sorted(set(models))
            },
        }


@dataclass
class Plan:
    """What the drill runs on: the base and candidate, the suite and gate settings, and the traffic."""

    base: Path
    candidate: Path
    suite: EvalSuite
    cfg: GateConfig
    n_users: int
    per_user: int
    window_s: float
    max_rounds_per_step: int
    vid: str = "cand-honest"


@dataclass
class Drill:
    """One run of the stages against a live gateway (its URL, admin key and registry), under `sup`."""

    plan: Plan
    url: str
    admin: dict[str, str]
    reg: Registry
    sup: Supervisor
    stages: dict[str, Any] = field(default_factory=dict)

    def fleet(self) -> dict[str, Any]:
        r = httpx.get(self.url + "/admin/fleet", headers=self.admin, timeout=30)
        r.raise_for_status()
        data: dict[str, Any] = r.json()
        return data

    def every_replica(self, version: str) -> bool:
        """Both replicas report `version` promoted, held under the registry's hash and served."""
        f, sha = self.fleet(), self.reg.get(version).artifact_sha256
        reports = [r["holds"].get(version) == sha and version in r["serves"] for r in f["replicas"]]
        return bool(f["complete"] and f["promoted_id"] == version and len(reports) == 2 and all(reports))

    def waited(self, condition: Callable[[], Any], timeout_s: float, what: str) -> float:
        """Seconds until `condition()` holds (a supervised process dying ends the wait)."""
        t = time.perf_counter()
        common.wait_until(condition, timeout_s, what=what, interval_s=0.1, check=self.sup.check)
        return time.perf_counter() - t

    def admin_post(self, what: str, reason: str) -> None:
        url = self.url + f"/admin/versions/{self.plan.vid}/{what}"
        httpx.post(url, json={"reason": reason}, headers=self.admin, timeout=60).raise_for_status()

    def run(self, settings: Settings, bus: Any, t0: float) -> dict[str, Any]:
        p, st = self.plan, self.stages
        promoted = self.reg.promoted()
        assert promoted is not None, "the gateway publishes and promotes the base"
        base_id = promoted.id
        self.waited(lambda: self.every_replica(base_id), 120, "both replicas to serve the base")
        st["gateway_start_s"] = time.perf_counter() - t0

        t0 = time.perf_counter()
        register_candidate(self.reg, settings.learner_models_dir, p.base, p.candidate, p.vid)
        st["register_s"] = time.perf_counter() - t0

        def engine() -> EmbeddedEngine:
            return EmbeddedEngine(max_batch=64, max_model_len=256, seed=0)

        loader = weight_store_loader(settings.learner_models_dir, settings.home / "gate" / "versions")
        score = verifier_scorer(p.suite.verifier, Tokenizer.from_file(p.base))
        gate = Gate(self.reg, engine, loader, p.suite, p.cfg, bus=bus, score=score)
        # gateways route users to a canary only while a gate beats its lease
        with GateLease(self.reg, p.cfg.lease_beat_s, p.cfg.lease_stuck_s) as lease:
            if not self.offline(gate) or not self.canary(gate, lease):
                return st
        self.approve_and_roll_back(base_id)
        return st

    def offline(self, gate: Gate) -> bool:
        t0 = time.perf_counter()
        step = gate.step()
        self.stages["offline"] = {"wall_s": time.perf_counter() - t0, "action": step.action, "detail": step.detail}
        if step.action != "passed":
            self.stages["stopped"] = f"offline: {step.action}"
        return step.action == "passed"

    def canary(self, gate: Gate, lease: GateLease) -> bool:
        """Traffic rounds and the gate's looks until the canary passes (True) or ends otherwise."""
        p, st, vid = self.plan, self.stages, self.plan.vid
        traffic = Traffic(self.url, [SimulatedUser(f"user-{i}", seed=i) for i in range(p.n_users)], p.per_user)
        steps: list[dict[str, Any]] = []
        st["canary"] = steps
        feedback = FeedbackClient(self.url, batch_size=1000, flush_interval_s=0.2)
        try:
            t_canary = time.perf_counter()
            lease.progress()
            step = gate.step()  # the canary starts at its first share
            ramp, rounds, t_step = -1, 0, time.perf_counter()
            while step.action in ("canary", "next_step"):
                progress = self.reg.get(vid).gate["canary"]
                if progress["step"] != ramp:  # a new step: replicas hold the candidate
                    ramp, share = progress["step"], progress["share"]
                    t_step, rounds = time.perf_counter(), 0
                    hold_s = self.waited(
                        lambda: all(vid in r["holds"] for r in self.fleet()["replicas"]), 120, "replicas to hold it"
                    )
                    time.sleep(CANARY_TTL_S)  # the gateway's cached view of the share
                    steps.append({"step": ramp, "share": share, "replicas_hold_s": hold_s, "rounds": []})
                if rounds >= p.max_rounds_per_step:
                    st["stopped"] = f"canary step {ramp} did not pass in {rounds} rounds"
                    return False
                sent = traffic.round(feedback)
                time.sleep(p.window_s + 1.0)  # the attribution window closes; the joiner emits the samples
                before = self.reg.get(vid).gate["canary"]
                lease.progress()
                step = gate.step()
                rounds += 1
                look = step_numbers(before, self.reg.get(vid).gate["canary"], p.cfg.canary)
                steps[-1]["rounds"].append({**sent, "gate": step.action, "detail": step.detail, "look": look})
                steps[-1]["wall_s"] = time.perf_counter() - t_step
                log.info("canary step %d round %d: %s %s", ramp, rounds, step.action, step.detail)
            st["canary_wall_s"] = time.perf_counter() - t_canary
            st["canary_outcome"] = step.action
            st["served_by_version"] = dict(traffic.served)
            if step.action != "awaiting_approval":
                st["stopped"] = f"canary: {step.action}: {step.detail}"
            return step.action == "awaiting_approval"
        finally:
            feedback.close()

    def approve_and_roll_back(self, base_id: str) -> None:
        st, vid = self.stages, self.plan.vid
        t0 = time.perf_counter()
        self.admin_post("approve", "bench: canary passed")
        st["approve_http_s"] = time.perf_counter() - t0
        self.waited(lambda: self.every_replica(vid), 120, "every replica to report the candidate's hash")
        st["approve_to_every_replica_s"] = time.perf_counter() - t0
        st["after_approval"] = {"fleet": _fleet_summary(self.fleet()), "served": _served(self.url, 8)}

        t0 = time.perf_counter()
        self.admin_post("rollback", "bench: rollback drill")
        self.waited(lambda: self.every_replica(base_id), 120, "every replica to report the base's hash again")
        st["rollback_to_every_replica_s"] = time.perf_counter() - t0
        st["after_rollback"] = {
            "fleet": _fleet_summary(self.fleet()),
            "served": _served(self.url, 8),
            "status": self.reg.get(vid).status.value,
            "promoted": getattr(self.reg.promoted(), "id", None),
        }
        st["audit"] = [
            {"action": a.action, "from": a.from_status and a.from_status.value, "to": a.to_status.value,
             "actor": a.actor, "reason": a.reason}
            for a in self.reg.audit(vid)
        ]  # fmt: skip


def all_the_way(plan: Plan, work: Path) -> dict[str, Any]:
    """The stages of the module docstring, each timed; stops early (with `stopped`) when one fails."""
    home = work / "home"
    home.mkdir(parents=True)
    settings = Settings(home=home, model_dir=plan.base, engine="embedded", replicas=2, heartbeat_s=0.5)
    admin = {"Authorization": f"Bearer {KeyStore(settings.db_url).create(['admin'], label='bench')[0]}"}
    env = {"FLYWHEEL_MODEL_DIR": str(plan.base), "FLYWHEEL_ENGINE": "embedded", "FLYWHEEL_REPLICAS": "2"}
    env["FLYWHEEL_HEARTBEAT_S"] = "0.5"
    with Supervisor("bench-promotion") as sup:
        t0 = time.perf_counter()
        gw = common.gateway(home, env, sup)
        argv = common.module_argv("cli", "joiner", "--window-s", str(plan.window_s))
        common.start(sup, "joiner", argv, env={**env, "FLYWHEEL_HOME": str(home)}, log_path=home / "joiner.log")
        reg = Registry(settings.db_url)
        bus = open_bus(settings, "bench")
        try:
            return Drill(plan, gw.url, admin, reg, sup).run(settings, bus, t0)
        finally:
            bus.close()
            reg.close()


def step_numbers(before: dict[str, Any], after: dict[str, Any], cfg: CanaryConfig) -> dict[str, Any]:
    """The numbers behind the gate's look at a canary step (users per arm, the always-valid interval on
    the reward difference, SRM, guardrails): `gating.canary.decide` again on the step as it was
    (`before`) with the samples the gate had counted by then (`after`'s counts)."""
    progress = CanaryProgress.model_validate(before)
    outcomes = CanaryOutcomes.from_dict(after["counts"])
    d = decide(progress, outcomes, cfg, datetime.now(UTC))
    keep = ("step", "share", "users", "reward", "srm", "guardrails", "passed", "reason")
    return {k: d.numbers[k] for k in keep if k in d.numbers}


def _fleet_summary(f: dict[str, Any]) -> dict[str, Any]:
    return {
        "complete": f["complete"],
        "state": f["state"],
        "promoted_id": f["promoted_id"],
        "replicas": [{"id": r["replica_id"], "holds": r["holds"], "serves": r["serves"]} for r in f["replicas"]],
    }


def _served(url: str, n: int) -> dict[str, int]:
    """Which version answers `n` users asking for the alias."""
    body = {"model": "flywheel", "prompt": "# add 1 to x\ndef f(x):\n", "max_tokens": 4}
    got = [
        httpx.post(url + "/v1/completions", json={**body, "user": f"probe-{i}"}, timeout=60).json()["model"]
        for i in range(n)
    ]
    return dict(Counter(got))


def main() -> None:
    quiet_logs()
    p = common.parser(__doc__)
    p.add_argument("--base", type=Path, default=SHIPPED_BASE, help="the bootstrapped base")
    p.add_argument("--candidate", type=Path, default=None, help="a trained candidate (default: train the honest one)")
    add_training_args(p)
    p.add_argument("--gate-g", type=int, default=8, help="the gate's G (GateConfig default 8)")
    p.add_argument("--gate-seed", type=int, default=0)
    p.add_argument("--users", type=int, default=120, help="simulated users sending traffic")
    p.add_argument("--per-user", type=int, default=4, help="completions per user per traffic round")
    p.add_argument("--window-s", type=float, default=30.0, help="the joiner's attribution window")
    p.add_argument("--min-users-per-arm", type=int, default=5, help="CanaryConfig.min_users_per_arm")
    p.add_argument("--max-rounds-per-step", type=int, default=10)
    args = p.parse_args()
    st = common.stamp()
    work = Path(tempfile.mkdtemp(prefix="promotion-"))
    try:
        training = None
        candidate = args.candidate
        if candidate is None:
            import torch

            torch.set_num_threads(args.threads)
            candidate = work / "honest"
            t = train(args.base, "honest", loop_config(args), candidate)
            training = {"seconds": t["seconds"], "rounds": args.rounds, "lr": args.lr, "seed": args.seed}
        canary = CanaryConfig(
            min_step_s=1,
            min_users_per_arm=args.min_users_per_arm,
            min_users_for_harm=args.min_users_per_arm,
            max_step_s=900,
        )
        cfg = GateConfig(G=args.gate_g, seed=args.gate_seed, canary=canary)
        t0 = time.perf_counter()
        plan = Plan(
            args.base, candidate, demo_suite(), cfg, args.users, args.per_user, args.window_s, args.max_rounds_per_step
        )
        stages = all_the_way(plan, work / "all-the-way")
        result = {
            "base": common.shown(args.base),
            "candidate": "honest, trained here" if training else common.shown(candidate),
            "training": training,
            "config": {
                "users": args.users,
                "per_user": args.per_user,
                "window_s": args.window_s,
                "replicas": 2,
                "gate_G": args.gate_g,
                "canary": canary.model_dump(mode="json"),
            },
            "wall_s": time.perf_counter() - t0,
            "stages": stages,
        }
        common.save(NAME, result, st, args.out)
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
