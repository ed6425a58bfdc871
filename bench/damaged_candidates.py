"""Damaged candidates through the real offline gate, and a better one all the way to every replica.

From one base (the demo bootstrap; by default the shipped one, `models/demo-base`: `SHIPPED_BASE`), four
candidates are trained in-process with the demo's own loop (`demo.loop.run_demo_loop`: served completions,
simulated users' signals, the joiner's rewards, policy-gradient updates), each on the same training budget:

- `honest`: every user is an honest simulated user (the better candidate);
- `shuffled`: the rewards of each round are permuted across the batch (`shuffle_rewards`);
- `adversarial`: every second user is adversarial: it reacts as if wrong completions were right and
  right ones wrong (`AdversarialUser`), so half the traffic rewards bugs;
- `family`: honest everywhere except one family, whose rewards are negated (`invert_family`), tuned
  (rounds, lr) so that this family drops by >= 15 points while the overall pass rate moves < 2 points
  (tuned on the old 8-family product, family `max`; its successor here is `max_default`).

Each candidate is measured (`measure`: the suite's prompts, the gate split's 512 (the old 8-family
product's suite, of bench/results/damaged_candidates.*, had 62), `--measure-g` samples each at
temperature 1, with seeds of its own, so the numbers are not the gate's) and then goes through the real
offline gate: registered with its weights in the weight store as the learner publishes them, the base
published and promoted by `gating.bootstrap.publish_base`, `gating.gate.Gate.step` with an embedded
engine of its own, `weight_store_loader` (the weights as shipped) and `demo.suite.demo_suite()`.
Expected: `honest` passes, the three damaged ones are rejected; the report says what was measured.

`--all-the-way` then takes the honest candidate through the online canary over HTTP (see
`all_the_way`). Writes bench/results/damaged_candidates.json and .md.

    .venv/bin/python -m bench.damaged_candidates [--rounds 10] [--gate-g 8] [--all-the-way]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import os
import platform
import random
import shutil
import sys
import tempfile
import threading
import time
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import torch

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:  # run as a script: bench/damaged_candidates.py
    sys.path.insert(0, str(ROOT))

from api.fleet import CANARY_TTL_S  # noqa: E402
from api.main import create_app  # noqa: E402
from core.security import KeyStore  # noqa: E402
from core.settings import Settings  # noqa: E402
from demo.bootstrap import SHIPPED_BASE, BootstrapConfig, bootstrap  # noqa: E402
from demo.checker import CheckResult, check_batch  # noqa: E402
from demo.loop import DemoLoopConfig, RewardHook, User, run_demo_loop  # noqa: E402
from demo.split import sample_tasks  # noqa: E402
from demo.suite import demo_suite  # noqa: E402
from demo.tasks import Task  # noqa: E402
from demo.users import FeedbackSignal, SimulatedUser  # noqa: E402
from feedback.bus_embedded import EmbeddedBus  # noqa: E402
from feedback.completion_index import CompletionIndex  # noqa: E402
from feedback.events import SampleEvent  # noqa: E402
from feedback.joiner import JoinerService  # noqa: E402
from feedback.rewards import RewardSpec  # noqa: E402
from feedback.sdk.client import FeedbackClient  # noqa: E402
from gating.bootstrap import SHIPPING_DTYPE, STORE, file_entry, publish_base  # noqa: E402
from gating.canary import CanaryConfig, CanaryOutcomes, decide  # noqa: E402
from gating.evals import sample_seed  # noqa: E402
from gating.gate import Gate, GateConfig, GateStep  # noqa: E402
from gating.gate_process import verifier_scorer, weight_store_loader  # noqa: E402
from gating.models import AuditEntryPublic, CanaryProgress  # noqa: E402
from gating.registry import Registry  # noqa: E402
from gating.suites import EvalSuite  # noqa: E402
from learner.trainer import TrainerConfig  # noqa: E402
from serving.checkpoint import load_checkpoint  # noqa: E402
from serving.engine import EmbeddedEngine  # noqa: E402
from serving.sampling import SamplingParams  # noqa: E402
from serving.tokenizer import Tokenizer  # noqa: E402
from serving.weight_store import WeightStore, shipping_state  # noqa: E402

log = logging.getLogger(__name__)
RESULTS = ROOT / "bench" / "results"
BASE_DIR = SHIPPED_BASE
KINDS = ("honest", "shuffled", "adversarial", "family", "honest_short")
EXPECT_PASS = ("honest", "honest_short")  # better than the base in every family (measured below)
MEASURE_SEED = 7_777  # the measurement's sample seeds: never the gate's (GateConfig.seed)


# -- what the damaged candidates are fed ----------------------------------------------------------


class AdversarialUser:
    """A simulated user who rewards wrong completions and punishes right ones: it reacts as an honest
    user would if every check came out the other way (style preferences unchanged)."""

    def __init__(self, user: SimulatedUser):
        self.user = user
        self.user_id = user.user_id

    def react(self, task: Task, completion: str, check: CheckResult) -> list[FeedbackSignal]:
        return self.user.react(task, completion, dataclasses.replace(check, passed=not check.passed))


def honest_users(n: int, seed: int) -> list[SimulatedUser]:
    """The loop's default users (same ids and seeds as `run_demo_loop` makes them)."""
    return [SimulatedUser(f"user-{i}", seed=seed * 1000 + i) for i in range(n)]


def half_adversarial(n: int, seed: int) -> list[User]:
    """Every second user adversarial: completions go round-robin, so exactly half of them."""
    return [AdversarialUser(u) if i % 2 else u for i, u in enumerate(honest_users(n, seed))]


def shuffle_rewards(seed: int) -> RewardHook:
    """Each round's rewards permuted across the round's samples (same rewards, wrong completions)."""

    def hook(r: int, samples: list[SampleEvent], task_of: Mapping[str, Task]) -> list[SampleEvent]:
        rewards = [s.reward for s in samples]
        random.Random(seed * 1_000_003 + r).shuffle(rewards)
        return [s.model_copy(update={"reward": x}) for s, x in zip(samples, rewards, strict=True)]

    return hook


def invert_family(family: str) -> RewardHook:
    """The rewards of `family`'s completions negated; every other family's as joined."""

    def hook(r: int, samples: list[SampleEvent], task_of: Mapping[str, Task]) -> list[SampleEvent]:
        return [
            s.model_copy(update={"reward": -s.reward}) if task_of[s.completion.completion_id].family == family else s
            for s in samples
        ]

    return hook


def train(base: Path, kind: str, cfg: DemoLoopConfig, out: Path, family: str | None = None) -> dict[str, Any]:
    """Train one candidate of `kind` from `base` into the checkpoint folder `out`; the loop's report."""
    users: Sequence[User] | None = None
    rewards: RewardHook | None = None
    if kind == "shuffled":
        rewards = shuffle_rewards(cfg.seed)
    elif kind == "adversarial":
        users = half_adversarial(cfg.users, cfg.seed)
    elif kind == "family":
        if family is None:
            raise ValueError("kind 'family' needs the family whose rewards are inverted")
        rewards = invert_family(family)
    elif kind not in ("honest", "honest_short"):
        raise ValueError(f"unknown kind {kind!r}; expected one of {KINDS}")
    t0 = time.perf_counter()
    report = run_demo_loop(base, cfg, users=users, rewards=rewards, save_to=out)
    return {"seconds": time.perf_counter() - t0, "loop": report}


# -- measuring pass rates -------------------------------------------------------------------------


def measure(engine: EmbeddedEngine, version: str, suite: EvalSuite, G: int, max_tokens: int = 48) -> dict[str, Any]:
    """Pass rate of `version` on the suite's prompts, G samples each at temperature 1 (seeds of the
    measurement's own): overall (mean over prompts, as the gate weighs them) and per family."""
    tok = engine.tokenizer(version)
    prompts = [it.prompt for it in suite.items for _ in range(G)]
    params = [
        SamplingParams(
            temperature=1.0,
            top_p=1.0,
            max_tokens=max_tokens,
            stop=suite.stop,
            seed=sample_seed(MEASURE_SEED, it.prompt, g),
        )
        for it in suite.items
        for g in range(G)
    ]
    outs = engine.generate([tok.encode_prompt(p) for p in prompts], params, version)
    per_prompt = np.asarray(suite.verifier.verify(prompts, [o.text for o in outs])).reshape(len(suite.items), G)
    means = per_prompt.mean(axis=1)
    fams: dict[str, list[float]] = {}
    for it, m in zip(suite.items, means, strict=True):
        fams.setdefault(it.family, []).append(float(m))
    return {
        "G": G,
        "n_samples": int(per_prompt.size),
        "overall": float(means.mean()),
        "families": {f: float(np.mean(v)) for f, v in sorted(fams.items())},
        "per_prompt": means.tolist(),
    }


def measure_all(folders: Mapping[str, Path], suite: EvalSuite, G: int) -> dict[str, dict[str, Any]]:
    engine = EmbeddedEngine(max_batch=64, max_model_len=256, seed=0)
    try:
        out = {}
        for name, folder in folders.items():
            engine.add_version(name, folder)
            out[name] = measure(engine, name, suite, G)
        return out
    finally:
        engine.shutdown()


# -- the real offline gate ------------------------------------------------------------------------


def register_candidate(reg: Registry, models: Path, base: Path, candidate: Path, vid: str) -> None:
    """As the learner publishes a version: the base published and promoted first (`publish_base`),
    the candidate's folder under `models`, its weights a weight-store delta on the base, registered."""
    inc = publish_base(reg, models, base)
    shutil.copytree(candidate, models / vid)
    state = shipping_state(load_checkpoint(candidate), SHIPPING_DTYPE)
    put = WeightStore(models / STORE).put(vid, state, parent=inc.id)
    reg.register(
        version_id=vid,
        parent_id=inc.id,
        files=[file_entry(models, put.path, put.kind)],
        delta_base_id=inc.id if put.kind == "delta" else None,
        reason=f"trained ({vid})",
    )


def gate_one(
    base: Path, candidate: Path, vid: str, suite: EvalSuite, cfg: GateConfig, work: Path
) -> tuple[GateStep, AuditEntryPublic]:
    """`candidate` registered (`register_candidate`) in a registry of its own under `work`, then one
    `Gate.step` on it, in an embedded engine of the gate's own; the step and the registry's record of
    the verdict (the audit entry of the transition to canary or rejected: reason and numbers)."""
    models = work / "models"
    reg = Registry(f"sqlite:///{work / 'registry.db'}")
    try:
        register_candidate(reg, models, base, candidate, vid)

        def engine() -> EmbeddedEngine:
            return EmbeddedEngine(max_batch=64, max_model_len=256, seed=0)

        gate = Gate(reg, engine, weight_store_loader(models, work / "gate-cache"), suite, cfg)
        step = gate.step()
        if step.action not in ("passed", "rejected"):
            raise RuntimeError(f"the gate did not reach a verdict on {vid}: {step}")
        return step, reg.audit(vid)[-1]
    finally:
        reg.close()


# -- the better candidate all the way: canary over HTTP, approval, every replica, rollback ----------


class Gateway:
    """The gateway (`api.main.create_app`, built from its settings: replicas following the registry)
    under uvicorn on a free loopback port, in a thread of this process."""

    def __init__(self, app: Any):
        import socket

        import uvicorn

        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            self.port = sock.getsockname()[1]
        self.server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=self.port, log_level="warning"))
        self.thread = threading.Thread(target=self.server.run, daemon=True)
        self.url = f"http://127.0.0.1:{self.port}"

    def __enter__(self) -> Gateway:
        self.thread.start()
        wait_for(lambda: self.server.started or not self.thread.is_alive(), 120, "the gateway to start")
        if not self.thread.is_alive():
            raise RuntimeError("the gateway did not start")
        return self

    def __exit__(self, *exc: object) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=60)


def wait_for(check: Callable[[], Any], timeout_s: float, what: str, every_s: float = 0.1) -> float:
    """Seconds until `check()` is true; RuntimeError naming `what` after `timeout_s`."""
    t0 = time.perf_counter()
    while not check():
        if time.perf_counter() - t0 > timeout_s:
            raise RuntimeError(f"timed out after {timeout_s:.0f} s waiting for {what}")
        time.sleep(every_s)
    return time.perf_counter() - t0


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


def all_the_way(
    base: Path,
    candidate: Path,
    work: Path,
    suite: EvalSuite,
    cfg: GateConfig,
    n_users: int,
    per_user: int,
    window_s: float,
    max_rounds_per_step: int,
) -> dict[str, Any]:
    """The better candidate from registration to every replica and back:

    1. the gateway starts (2 embedded replicas following the registry; it publishes and promotes the base);
    2. the candidate is registered as the learner does (`register_candidate`, weight-store delta);
    3. `Gate.step`: the offline verdict, on the weight-store artifact, against the base;
    4. the canary: every `Gate.step` reads the joined samples from the bus; between steps `Traffic`
       sends a round of completions and feedback (with exposures) over HTTP, the real joiner
       (`JoinerService`, window `window_s`) joins them; until `awaiting_approval` (or an abort);
    5. an admin approves over HTTP (`POST /admin/versions/{id}/approve`, a key-store admin key) and
       every replica's heartbeat reports the candidate's artifact hash (`GET /admin/fleet`);
    6. an admin rolls back over HTTP; every replica reports the base's hash again and serves it.
    The wall time of each stage is recorded."""
    home = work / "home"
    settings = Settings(home=home, model_dir=base, engine="embedded", replicas=2, heartbeat_s=0.5)
    reg = Registry(settings.db_url)
    bus = EmbeddedBus(home / "bus")
    index = CompletionIndex(home / "completion_index.db")
    admin = {"Authorization": f"Bearer {KeyStore(settings.key_store_path).create(['admin'], label='bench')[0]}"}
    stages: dict[str, Any] = {}
    vid = "cand-honest"
    stop = threading.Event()
    try:
        t0 = time.perf_counter()
        with Gateway(create_app(settings, bus=bus, index=index, registry=reg)) as gw:

            def fleet() -> dict[str, Any]:
                r = httpx.get(gw.url + "/admin/fleet", headers=admin, timeout=30)
                r.raise_for_status()
                return r.json()

            def every_replica(version: str) -> bool:
                f, sha = fleet(), reg.get(version).artifact_sha256
                reports = [r["holds"].get(version) == sha and version in r["serves"] for r in f["replicas"]]
                return f["complete"] and f["promoted_id"] == version and len(reports) == 2 and all(reports)

            promoted = reg.promoted()
            assert promoted is not None, "the gateway publishes and promotes the base"
            base_id = promoted.id
            wait_for(lambda: every_replica(base_id), 120, "both replicas to serve the base")
            stages["gateway_start_s"] = time.perf_counter() - t0

            t0 = time.perf_counter()
            register_candidate(reg, settings.learner_models_dir, base, candidate, vid)
            stages["register_s"] = time.perf_counter() - t0

            joiner = JoinerService(bus, RewardSpec(), window_s)
            threading.Thread(target=joiner.run, args=(stop,), daemon=True, name="joiner").start()

            def engine() -> EmbeddedEngine:
                return EmbeddedEngine(max_batch=64, max_model_len=256, seed=0)

            loader = weight_store_loader(settings.learner_models_dir, home / "gate" / "versions")
            score = verifier_scorer(suite.verifier, Tokenizer.from_file(base))
            gate = Gate(reg, engine, loader, suite, cfg, bus=bus, score=score)
            t0 = time.perf_counter()
            step = gate.step()
            stages["offline"] = {"wall_s": time.perf_counter() - t0, "action": step.action, "detail": step.detail}
            if step.action != "passed":
                stages["stopped"] = f"offline: {step.action}"
                return stages

            users = [SimulatedUser(f"user-{i}", seed=i) for i in range(n_users)]
            traffic = Traffic(gw.url, users, per_user)
            canary: list[dict[str, Any]] = []
            stages["canary"] = canary
            feedback = FeedbackClient(gw.url, batch_size=1000, flush_interval_s=0.2)
            try:
                t_canary = time.perf_counter()
                step = gate.step()  # the canary starts at its first share
                ramp = -1
                rounds = 0
                while step.action in ("canary", "next_step"):
                    share = reg.get(vid).gate["canary"]["share"]
                    if reg.get(vid).gate["canary"]["step"] != ramp:  # a new step: replicas hold the candidate
                        ramp = reg.get(vid).gate["canary"]["step"]
                        t_step, rounds = time.perf_counter(), 0
                        hold_s = wait_for(
                            lambda: all(vid in r["holds"] for r in fleet()["replicas"]),
                            120,
                            "both replicas to hold the candidate",
                        )
                        time.sleep(CANARY_TTL_S)  # the gateway's cached view of the share
                        canary.append({"step": ramp, "share": share, "replicas_hold_s": hold_s, "rounds": []})
                    if rounds >= max_rounds_per_step:
                        stages["stopped"] = f"canary step {ramp} did not pass in {rounds} rounds"
                        return stages
                    sent = traffic.round(feedback)
                    time.sleep(window_s + 1.0)  # the attribution window closes; the joiner emits the samples
                    before = reg.get(vid).gate["canary"]
                    step = gate.step()
                    rounds += 1
                    look = step_numbers(before, reg.get(vid).gate["canary"], cfg.canary)
                    canary[-1]["rounds"].append({**sent, "gate": step.action, "detail": step.detail, "look": look})
                    canary[-1]["wall_s"] = time.perf_counter() - t_step
                    log.info(
                        "canary step %d (%.0f%%) round %d: %s %s", ramp, 100 * share, rounds, step.action, step.detail
                    )
                stages["canary_wall_s"] = time.perf_counter() - t_canary
                stages["canary_outcome"] = step.action
                stages["served_by_version"] = dict(traffic.served)
                stages["joiner"] = dict(joiner.stats)
                if step.action != "awaiting_approval":
                    stages["stopped"] = f"canary: {step.action}: {step.detail}"
                    return stages
            finally:
                feedback.close()

            t0 = time.perf_counter()
            r = httpx.post(
                gw.url + f"/admin/versions/{vid}/approve",
                json={"reason": "bench: canary passed"},
                headers=admin,
                timeout=60,
            )
            r.raise_for_status()
            stages["approve_http_s"] = time.perf_counter() - t0
            wait_for(lambda: every_replica(vid), 120, "every replica to report the candidate's hash")
            stages["approve_to_every_replica_s"] = time.perf_counter() - t0
            stages["after_approval"] = {"fleet": _fleet_summary(fleet()), "served": _served(gw.url, 8)}

            t0 = time.perf_counter()
            r = httpx.post(
                gw.url + f"/admin/versions/{vid}/rollback",
                json={"reason": "bench: rollback drill"},
                headers=admin,
                timeout=60,
            )
            r.raise_for_status()
            wait_for(lambda: every_replica(base_id), 120, "every replica to report the base's hash again")
            stages["rollback_to_every_replica_s"] = time.perf_counter() - t0
            stages["after_rollback"] = {
                "fleet": _fleet_summary(fleet()),
                "served": _served(gw.url, 8),
                "status": reg.get(vid).status.value,
                "promoted": getattr(reg.promoted(), "id", None),
            }
            stages["audit"] = [
                {
                    "action": a.action,
                    "from": a.from_status and a.from_status.value,
                    "to": a.to_status.value,
                    "actor": a.actor,
                    "reason": a.reason,
                }
                for a in reg.audit(vid)
            ]
        return stages
    finally:
        stop.set()
        bus.close()
        index.close()
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


# -- the report ----------------------------------------------------------------------------------


def verdict_row(step: GateStep, entry: AuditEntryPublic) -> dict[str, Any]:
    """What the gate decided and every number behind it, trimmed of the per-prompt lists."""
    assert step.result is not None, "a verdict reached in this step"
    n = step.result.numbers
    return {
        "action": step.action,
        "passed": step.result.passed,
        "failed": step.result.failed,
        "registry": {"status": entry.to_status.value, "actor": entry.actor, "reason": entry.reason},
        "reward": n["reward"],
        "non_inferiority": n["non_inferiority"],
        "bootstrap": n["bootstrap"],
        "families": n["families"],
        "guardrails": n["guardrails"],
        "checks": n["checks"],
        "sampling": n["sampling"],
        "suite": {k: n["suite"][k] for k in ("name", "version", "n_prompts", "families")},
        "in_distribution": n["in_distribution"],
        "timing_s": n["timing_s"],
    }


def family_config(cfg: DemoLoopConfig, family: str, weight: int) -> DemoLoopConfig:
    """`cfg` with `family` served `weight` times as often as each other family."""
    from demo.tasks import FAMILIES

    return cfg.model_copy(update={"families": tuple(FAMILIES) + (family,) * (weight - 1)})


def run(args: argparse.Namespace) -> dict[str, Any]:
    torch.set_num_threads(args.threads)
    load_before = os.getloadavg()
    started = time.strftime("%Y-%m-%d %H:%M:%S %Z")
    t_start = time.perf_counter()
    recipe = BootstrapConfig()
    boot = bootstrap(args.base, recipe)  # reused when the folder holds a finished bootstrap
    base_info = {
        "folder": str(args.base),
        "config": f"BootstrapConfig() defaults (seed {recipe.seed}, {recipe.steps} steps of {recipe.batch_size} "
        f"sequences, {recipe.corpus_size}-example corpus)",
        "train_seconds": boot["train_seconds"],
        "total_seconds": boot["total_seconds"],
        "eval": boot["eval"],
    }
    suite = demo_suite()
    work = Path(tempfile.mkdtemp(prefix="damaged-")) if args.work is None else args.work
    work.mkdir(parents=True, exist_ok=True)
    cfg = DemoLoopConfig(
        rounds=args.rounds, eval_tasks=64, eval_every=args.rounds, trainer=TrainerConfig(lr=args.lr), seed=args.seed
    )
    configs = {k: cfg for k in args.kinds}
    if "family" in configs:
        configs["family"] = family_config(cfg, args.family, args.family_weight)
    if "honest_short" in configs:
        configs["honest_short"] = cfg.model_copy(update={"rounds": args.short_rounds, "eval_every": args.short_rounds})
    folders: dict[str, Path] = {"base": args.base}
    training: dict[str, Any] = {}
    for kind in args.kinds:
        out = work / "candidates" / kind
        shutil.rmtree(out, ignore_errors=True)
        t = train(args.base, kind, configs[kind], out, family=args.family)
        loop = t["loop"]
        training[kind] = {
            "seconds": t["seconds"],
            "config": json.loads(configs[kind].model_dump_json(exclude={"reward"})),
            "reward_mean_by_round": [h.get("reward_mean") for h in loop["history"][1:]],
            "samples_trained": sum(h.get("samples", 0) for h in loop["history"][1:]),
        }
        folders[kind] = out
        log.info("trained %s in %.1fs", kind, t["seconds"])
    t0 = time.perf_counter()
    measured = measure_all(folders, suite, args.measure_g)
    measure_s = time.perf_counter() - t0
    base_m = measured["base"]
    for m in measured.values():
        m["overall_diff_points"] = 100 * (m["overall"] - base_m["overall"])
        m["family_diff_points"] = {f: 100 * (x - base_m["families"][f]) for f, x in m["families"].items()}
        del m["per_prompt"]
    gate_cfg = GateConfig(G=args.gate_g, seed=args.gate_seed)

    def gate(kind: str, cfg: GateConfig) -> dict[str, Any]:
        gw = work / f"gate-G{cfg.G}" / kind
        shutil.rmtree(gw, ignore_errors=True)
        gw.mkdir(parents=True)
        t0 = time.perf_counter()
        step, entry = gate_one(args.base, folders[kind], f"cand-{kind}", suite, cfg, gw)
        log.info("gate (G=%d) on %s: %s (%s)", cfg.G, kind, step.action, entry.reason)
        return {**verdict_row(step, entry), "wall_s": time.perf_counter() - t0}

    gated = {kind: gate(kind, gate_cfg) for kind in args.kinds}
    # A verdict against expectation, again at a larger G: is it the evidence, or the candidate?
    unexpected = [k for k in args.kinds if gated[k]["passed"] != (k in EXPECT_PASS)]
    recheck_cfg = gate_cfg.model_copy(update={"G": args.recheck_g})
    rechecked = {k: gate(k, recheck_cfg) for k in unexpected} if args.recheck_g else {}
    report: dict[str, Any] = {
        "when": started,
        "machine": {
            "platform": platform.platform(),
            "cpus": os.cpu_count(),
            "torch": torch.__version__,
            "torch_threads": torch.get_num_threads(),
            "loadavg_before": load_before,
            "loadavg_after": os.getloadavg(),
            "note": "a 2-core VM shared with other jobs",
        },
        "command": "python -m bench.damaged_candidates " + " ".join(args.argv),
        "commit": _git_head(),
        "base": base_info,
        "kinds": {
            "honest": "every user honest (the better candidate)",
            "shuffled": "each round's rewards permuted across the round's samples",
            "adversarial": "every second user rewards wrong completions and punishes right ones",
            "family": f"honest except family {args.family!r}, whose rewards are negated; {args.family!r} is "
            f"served {args.family_weight}x as often as each other family",
            "honest_short": f"as honest, on a smaller budget ({args.short_rounds} rounds): better, by less",
        },
        "training": training,
        "measured": {"G": args.measure_g, "seed": MEASURE_SEED, "seconds": measure_s, "versions": measured},
        "gate": {
            "config": json.loads(
                gate_cfg.model_dump_json(
                    include={"G", "margin", "alpha", "seed", "max_tokens", "temperature", "n_resamples"}
                )
            ),
            "suite": suite.suite_version,
            "n_prompts": len(suite.items),
            "verdicts": gated,
            "recheck": {"G": args.recheck_g, "verdicts": rechecked},
        },
    }
    if args.all_the_way:
        canary = CanaryConfig(
            min_step_s=1,
            min_users_per_arm=args.min_users_per_arm,
            min_users_for_harm=args.min_users_per_arm,
            max_step_s=900,
        )
        cfg_atw = gate_cfg.model_copy(update={"canary": canary})
        t0 = time.perf_counter()
        stages = all_the_way(
            args.base,
            folders["honest"],
            work / "all-the-way",
            suite,
            cfg_atw,
            args.users,
            args.per_user,
            args.window_s,
            args.max_rounds_per_step,
        )
        report["all_the_way"] = {
            "config": {
                "users": args.users,
                "per_user": args.per_user,
                "window_s": args.window_s,
                "replicas": 2,
                "canary": json.loads(canary.model_dump_json()),
            },
            "wall_s": time.perf_counter() - t0,
            "stages": stages,
        }
    report["machine"]["loadavg_after"] = os.getloadavg()
    report["seconds"] = time.perf_counter() - t_start
    return report


def _git_head() -> str | None:
    """The commit this ran on (the gate's code changes under it), None outside a git checkout."""
    import subprocess

    done = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"], capture_output=True, text=True)
    return done.stdout.strip() or None


def _pts(x: float) -> str:
    return f"{100 * x:+.1f}"


def _eval_set(ev: dict[str, Any]) -> str:
    """What the bootstrap's evaluation ran on (reports of the old 8-family product: 256 sampled tasks)."""
    return f"{ev['n']} {ev['split']}-split prompts" if "split" in ev else "256 sampled tasks"


def markdown(r: dict[str, Any]) -> str:
    """The report as tables (bench/results/damaged_candidates.md)."""
    m, g, kinds = r["machine"], r["gate"], list(r["training"])
    verdicts, versions = g["verdicts"], r["measured"]["versions"]
    fams = list(versions["base"]["families"])
    b = r["base"]
    out = [
        "# Damaged candidates through the offline gate",
        "",
        f"{r['when']}, {m['platform']}, {m['cpus']} CPUs ({m['note']}), torch {m['torch']} with "
        f"{m['torch_threads']} intra-op threads at the end (the embedded engine's loop sets one, process-wide); "
        f"load average {m['loadavg_before'][0]:.2f} before, "
        f"{m['loadavg_after'][0]:.2f} after. `{r['command']}`"
        + (f" at commit {r['commit']}" if r.get("commit") else "")
        + f": {r['seconds']:.0f} s in all.",
        "",
        f"Base: `{b['folder']}`, {b['config']}; its bootstrap took {b['total_seconds']:.0f} s "
        f"({b['train_seconds']:.0f} s of training; reused if already there). Pass rate at its bootstrap "
        f"evaluation {100 * b['eval']['pass_rate']:.1f} % ({_eval_set(b['eval'])}).",
        "",
        "## The candidates",
        "",
        "| candidate | what the learner was fed | rounds x completions | samples trained | lr | reward mean, first -> "
        "last round | training (s) |",
        "|---|---|---:|---:|---:|---|---:|",
    ]
    for k in kinds:
        t = r["training"][k]
        rm = [x for x in t["reward_mean_by_round"] if x is not None]
        out.append(
            f"| {k} | {r['kinds'][k]} | {t['config']['rounds']} x {t['config']['samples_per_round']} | "
            f"{t['samples_trained']} | {t['config']['trainer']['lr']:g} | {rm[0]:+.3f} -> {rm[-1]:+.3f} | "
            f"{t['seconds']:.1f} |"
        )
    meas = r["measured"]
    out += [
        "",
        f"## Measured pass rates (suite prompts, G = {meas['G']} samples each at temperature 1, seeds of the "
        f"measurement's own; {meas['seconds']:.0f} s)",
        "",
        "Points difference from the base in brackets. Overall: the mean over the prompts, as the gate weighs them.",
        "",
        "| version | overall | " + " | ".join(fams) + " |",
        "|---|---:|" + "---:|" * len(fams),
    ]
    for name, v in versions.items():
        cells = [
            f"{100 * v['families'][f]:.1f}" + ("" if name == "base" else f" ({v['family_diff_points'][f]:+.1f})")
            for f in fams
        ]
        overall = f"{100 * v['overall']:.1f}" + ("" if name == "base" else f" ({v['overall_diff_points']:+.1f})")
        out.append(f"| {name} | {overall} | " + " | ".join(cells) + " |")
    gc = g["config"]
    out += [
        "",
        f"## The offline gate (`Gate.step`, G = {gc['G']}, {g['n_prompts']} prompts, margin {gc['margin']}, "
        f"alpha {gc['alpha']}, seed {gc['seed']}; suite `{g['suite']}`, in-distribution)",
        "",
        "Overall: the paired t test on per-prompt means (decides) with its one-sided 95 % lower bound, and the "
        "paired bootstrap's lower bound (a cross-check). Families: the per-family harm tests (is the family worse "
        "than -margin?), Holm-corrected; the flagged ones are listed with their difference and p value.",
        "",
    ]
    out += verdict_tables(verdicts, fams)
    out += ["", "The registry's reasons:", ""]
    out += [f"- {k}: {verdicts[k]['registry']['status']} ({verdicts[k]['registry']['reason']})" for k in kinds]
    rc = g.get("recheck", {})
    if rc.get("verdicts"):
        out += [
            "",
            f"### The verdicts against expectation, again at G = {rc['G']} (same seed, same candidates)",
            "",
        ]
        out += verdict_tables(rc["verdicts"], fams)
    out += findings(r)
    if "all_the_way" in r:
        out += all_the_way_markdown(r["all_the_way"])
    return "\n".join(out) + "\n"


def verdict_tables(verdicts: dict[str, Any], fams: list[str]) -> list[str]:
    """The gate's verdicts (one row per candidate) and its per-family tests (one column per candidate)."""
    kinds = list(verdicts)
    out = [
        "| candidate | verdict | failed checks | pass rate cand / inc | diff (points) | lower bound | p | "
        "bootstrap lower | families failed | length ratio | malformed cand / inc | looping cand / inc | "
        "KL (nats/token) | gate wall (s) |",
        "|---|---|---|---|---:|---:|---:|---:|---|---:|---|---|---:|---:|",
    ]
    for k in kinds:
        v = verdicts[k]
        ni, bs, gr = v["non_inferiority"], v["bootstrap"], v["guardrails"]
        failed_f = [
            f"{f} {_pts(x['mean_diff'])} (p {x.get('p_regression', x['p_value']):.2g})"
            for f, x in v["families"].items()
            if not x["passed"]
        ]
        out.append(
            f"| {k} | **{'passed' if v['passed'] else 'rejected'}** | {', '.join(v['failed']) or '-'} | "
            f"{100 * v['reward']['candidate']:.1f} / {100 * v['reward']['incumbent']:.1f} | {_pts(ni['mean_diff'])} | "
            f"{_pts(ni['lower_bound'])} | {ni['p_value']:.2g} | {_pts(bs['lower_bound'])} | "
            f"{'; '.join(failed_f) or '-'} | {gr['length']['ratio']:.2f} | "
            f"{100 * gr['malformed']['candidate_share']:.1f} / {100 * gr['malformed']['incumbent_share']:.1f} % | "
            f"{100 * gr['repetition']['candidate_share']:.1f} / {100 * gr['repetition']['incumbent_share']:.1f} % | "
            f"{gr['kl']['per_token']:.3f} | {v['wall_s']:.0f} |"
        )
    out += [
        "",
        "Per family at the gate: difference in points [one-sided 95 % lower, upper bound], the harm test's p "
        "(H0: no worse than -margin) and its Holm verdict.",
        "",
        "| family | prompts | " + " | ".join(kinds) + " |",
        "|---|---:|" + "---|" * len(kinds),
    ]
    for f in fams:
        cells = []
        for k in kinds:
            x = verdicts[k]["families"][f]
            up = x.get("upper_bound", 2 * x["mean_diff"] - x["lower_bound"])
            p_reg = f" p {x['p_regression']:.2g}" if "p_regression" in x else ""
            verdict = "ok" if x["passed"] else "**regressed**"
            cells.append(f"{_pts(x['mean_diff'])} [{_pts(x['lower_bound'])}, {_pts(up)}]{p_reg} {verdict}")
        out.append(f"| {f} | {verdicts[kinds[0]]['families'][f]['n_prompts']} | " + " | ".join(cells) + " |")
    timing = {k: verdicts[k]["timing_s"] for k in kinds}
    out += [
        "",
        "Gate time split (s): "
        + "; ".join(f"{k} sampling {t['sampling']:.0f} of {t['total']:.0f}" for k, t in timing.items())
        + " (the rest: verifier, and the KL scorer's one forward per candidate sample).",
    ]
    return out


def findings(r: dict[str, Any]) -> list[str]:
    """What the numbers say, computed from them: each verdict against its expectation, and the
    one-family candidate against its definition (>= 15 points down on the family, < 2 overall)."""
    versions, verdicts = r["measured"]["versions"], r["gate"]["verdicts"]
    out = ["", "## Findings (computed from the numbers above)", ""]
    for k, v in verdicts.items():
        expect = "pass" if k in EXPECT_PASS else "be rejected"
        got = "passed" if v["passed"] else f"rejected ({', '.join(v['failed'])})"
        gains = versions[k]["family_diff_points"]
        ok = v["passed"] == (k in EXPECT_PASS)
        line = f"- {k}: expected to {expect}; {got} at G = {r['gate']['config']['G']}" + (
            "." if ok else " **(not as expected)**."
        )
        if k in EXPECT_PASS:
            line += f" Measured, every family moved by {min(gains.values()):+.1f} to {max(gains.values()):+.1f} points."
        rc = r["gate"].get("recheck", {}).get("verdicts", {}).get(k)
        if rc is not None:
            line += f" At G = {r['gate']['recheck']['G']}: " + (
                "passed." if rc["passed"] else f"rejected ({', '.join(rc['failed'])})."
            )
        out.append(line)
    gaps = sorted(
        100 * (v["non_inferiority"]["mean_diff"] - v["non_inferiority"]["lower_bound"]) for v in verdicts.values()
    )
    margin = 100 * r["gate"]["config"]["margin"]
    gap = gaps[len(gaps) // 2]
    out.append(
        f"- Resolution of the overall test at G = {r['gate']['config']['G']} on {r['gate']['n_prompts']} prompts: the "
        f"lower bound lies {gap:.1f} points (median; {gaps[0]:.1f} to {gaps[-1]:.1f}) below the "
        f"estimate, so a candidate only passes it when it measures at least {gap - margin:+.1f} points; "
        "a candidate equal to the base overall is not shown non-inferior."
    )
    if "family" in versions:
        fam = r["training"]["family"]["config"]["families"]
        broken = max(set(fam), key=fam.count)
        drop, overall = versions["family"]["family_diff_points"][broken], versions["family"]["overall_diff_points"]
        meets = drop <= -15 and abs(overall) < 2
        out.append(
            f"- The one-family regression, measured: {broken} {drop:+.1f} points, overall {overall:+.1f} points: "
            + ("meets" if meets else "**does not meet**")
            + " its definition (>= 15 down on one family, < 2 overall)."
        )
        if "family" in verdicts and broken not in verdicts["family"]["registry"]["reason"]:
            out.append(
                f"- The registry's reason for rejecting it names the failed checks but not {broken}, the family "
                "that regressed (that is in the numbers stored with it). Proposed (gating/evals.py "
                "`OfflineResult.summary`, the lead's): name the flagged families in the summary."
            )
    return out


def all_the_way_markdown(a: dict[str, Any]) -> list[str]:
    st, c = a["stages"], a["config"]
    cc = c["canary"]
    out = [
        "",
        "## The better candidate all the way (`--all-the-way`)",
        "",
        f"The honest candidate, on a gateway built from its settings with {c['replicas']} embedded replicas "
        f"following the registry; {c['users']} simulated users, {c['per_user']} completions each per traffic round "
        f"(`model: flywheel`, their user id), each shown (`FeedbackClient.shown`) and reacted to through the SDK; "
        f"the joiner (`JoinerService`, window {c['window_s']:g} s) on the embedded bus; canary steps "
        f"{', '.join(f'{x:.0%}' for x in cc['steps'])}, min_step_s {cc['min_step_s']:g}, min_users_per_arm "
        f"{cc['min_users_per_arm']}, margin {cc['margin']}, alpha {cc['alpha']}. {a['wall_s']:.0f} s in all.",
        "",
        "| stage | wall (s) | what happened |",
        "|---|---:|---|",
        f"| gateway start (base published, both replicas serving it) | {st['gateway_start_s']:.1f} | |",
        f"| register the candidate (weight-store delta) | {st['register_s']:.2f} | |",
        f"| offline gate | {st['offline']['wall_s']:.1f} | {st['offline']['action']}: {st['offline']['detail']} |",
    ]
    for s in st.get("canary", []):
        last = s["rounds"][-1]
        look = last.get("look", {})
        users = look.get("users", {})
        rw = look.get("reward", {})
        n = sum(x["completions"] for x in s["rounds"])
        out.append(
            f"| canary step {s['step']} ({s['share']:.0%}) | {s['wall_s']:.1f} | {len(s['rounds'])} rounds, {n} "
            f"completions; users candidate / incumbent {users.get('candidate')} / {users.get('incumbent')}; reward "
            f"difference {rw.get('estimate', float('nan')):+.3f}, always-valid [{rw.get('lower', float('nan')):+.3f}, "
            f"{rw.get('upper', float('nan')):+.3f}]; {last['gate']}: {last['detail']} |"
        )
    if "approve_to_every_replica_s" in st:
        out += [
            f"| approve over HTTP (admin key) | {st['approve_http_s']:.2f} | |",
            f"| approval -> every replica reports the candidate's hash | {st['approve_to_every_replica_s']:.2f} | "
            f"served afterwards: {st['after_approval']['served']} |",
            f"| rollback over HTTP -> every replica reports the base's hash | "
            f"{st['rollback_to_every_replica_s']:.2f} | "
            f"served afterwards: {st['after_rollback']['served']}; candidate {st['after_rollback']['status']}, "
            f"promoted {st['after_rollback']['promoted']} |",
        ]
    if "stopped" in st:
        out += ["", f"Stopped: {st['stopped']}."]
    if "joiner" in st:
        out += ["", f"Joiner: {st['joiner']}. Completions served per version: {st.get('served_by_version')}."]
    if "after_approval" in st:
        out += ["", "Replicas' heartbeats after approval (version: artifact SHA-256 prefix):", ""]
        for rep in st["after_approval"]["fleet"]["replicas"]:
            out.append(
                f"- {rep['id']}: holds { ({k: v[:12] for k, v in rep['holds'].items()}) }, serves {rep['serves']}"
            )
        out += ["", "Audit trail of the candidate:", ""]
        out += [f"- {x['action']} {x['from']} -> {x['to']} by {x['actor']}: {x['reason']}" for x in st["audit"]]
    return out


def parse(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--base", type=Path, default=BASE_DIR, help="the bootstrapped base (made if missing)")
    p.add_argument("--kinds", nargs="+", default=list(KINDS), choices=KINDS)
    p.add_argument("--rounds", type=int, default=20, help="loop rounds of 128 completions, every candidate")
    p.add_argument("--lr", type=float, default=3e-4)
    p.add_argument("--short-rounds", type=int, default=8, help="honest_short: the honest candidate's smaller budget")
    p.add_argument("--family", default="max_default", help="the family the one-family regression breaks")
    p.add_argument("--family-weight", type=int, default=24, help="its traffic, relative to each other family")
    p.add_argument("--seed", type=int, default=0, help="the loop's seed (tasks, users, sampling)")
    p.add_argument("--measure-g", type=int, default=32, help="samples per suite prompt for the measurement")
    p.add_argument("--gate-g", type=int, default=8, help="the gate's G (GateConfig default 8)")
    p.add_argument("--gate-seed", type=int, default=0)
    p.add_argument("--recheck-g", type=int, default=0, help="gate again at this G the verdicts against expectation")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--all-the-way", action="store_true", help="then the honest candidate through canary and approval")
    p.add_argument("--users", type=int, default=120, help="all the way: simulated users sending traffic")
    p.add_argument("--per-user", type=int, default=4, help="all the way: completions per user per traffic round")
    p.add_argument("--window-s", type=float, default=30.0, help="all the way: the joiner's attribution window")
    p.add_argument("--min-users-per-arm", type=int, default=5, help="all the way: CanaryConfig.min_users_per_arm")
    p.add_argument("--max-rounds-per-step", type=int, default=10)
    p.add_argument("--work", type=Path, default=None, help="folder for candidates and registries (default: temp)")
    p.add_argument("--out", type=Path, default=RESULTS / "damaged_candidates")
    args = p.parse_args(argv)
    args.argv = list(argv) if argv is not None else sys.argv[1:]
    return args


def main(argv: Sequence[str] | None = None) -> None:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    for chatty in ("learner.trainer", "demo.loop", "flywheel.service", "httpx"):
        logging.getLogger(chatty).setLevel(logging.WARNING)
    args = parse(argv)
    report = run(args)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.with_suffix(".json").write_text(json.dumps(report, indent=2))
    args.out.with_suffix(".md").write_text(markdown(report))
    print(markdown(report))


if __name__ == "__main__":
    main()
