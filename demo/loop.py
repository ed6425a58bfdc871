"""The online-RL loop in one process, on the demo product: the real joiner and learner over the embedded bus.

`flywheel demo` runs the whole system (`demo.system`: the gateway over HTTP, the joiner, the learner and
the gate, each a process). This loop is its fast twin, for experiments and for training candidates in
tests and benchmarks in seconds. It runs the same services the system runs, in a temporary home: an
embedded bus (`feedback.bus_embedded`), a SQLite registry, the joiner (`feedback.joiner.JoinerService`)
and the learner (`learner.service.LearnerService`: staleness and lag bounds, the poisoning screen with
the demo's verifier, quarantine, checkpoints, the weight store and the registry).

Every round: the promoted version completes a fresh batch of demo tasks (temperature 1, as the product
serves); each completion is published as the `completion` event the gateway would publish, and a
simulated user's signals as the `feedback` events the SDK would send; the simulated clock passes the
attribution window, so the joiner publishes the round's `sample` events; the learner reads them and
runs one update (one per round, whatever its `update_every_samples` cadence would say); the candidate it
registers is served next round.

What it leaves out, on purpose (each has its own component and tests): HTTP (events go straight to the
bus, in the same types), the gate and the canary, and weight shipping (the engine loads each version's
checkpoint). With no gate, the candidates stay candidates: the loop serves the learner's newest, so its
data is on-policy (the system serves the promoted version, updates behind the learner: `bench/staleness.py`
measures that lag), the base stays the promoted version, and so the KL reference (`kl_coef` > 0) and the
registry's incumbent are the base throughout; there is no bound in updates (`max_lag_updates` None),
which would count from the base.

Hooks for experiments on what the learner is fed (`bench/damaged_candidates.py` trains damaged
candidates with them): `users` replaces the honest simulated users (anything with a `user_id` and
`react(task, completion, check)`, e.g. users who reward wrong completions), `rewards` rewrites each
round's joined samples before the learner sees them (shuffled or inverted rewards: the joiner's samples
are rewritten onto a topic of the loop's own, which the learner reads), and `save_to` writes the final
weights as a checkpoint folder.
"""

from __future__ import annotations

import json
import logging
import tempfile
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any, Protocol

import torch
from pydantic import BaseModel, ConfigDict, Field

from demo.checker import CheckResult, DemoVerifier, check_batch
from demo.evaluation import evaluate
from demo.split import sample_tasks, split_tasks
from demo.tasks import Task
from demo.users import FeedbackSignal, SimulatedUser
from feedback.bus_embedded import EmbeddedBus
from feedback.events import TOPICS, CompletionEvent, FeedbackEvent, SampleEvent
from feedback.joiner import JoinerService
from feedback.rewards import RewardSpec
from learner.config import LearnerConfig
from learner.poisoning import PoisoningConfig
from learner.service import LearnerService
from learner.trainer import TrainerConfig
from registry.registry import Registry
from serving.checkpoint import load_checkpoint, save_checkpoint
from serving.engine import EmbeddedEngine
from serving.sampling import SamplingParams
from serving.tokenizer import Tokenizer

log = logging.getLogger(__name__)
EVAL_SEED = 99_999  # offset of the evaluation's sampling seed
REWRITTEN_TOPIC = "loop.samples"  # the learner's topic when a `rewards` hook rewrites the joiner's samples
ROUND_KEYS = (
    "reward_mean",
    "adv_mean",
    "ratio_mean",
    "clip_frac",
    "grad_norm",
    "abs_dlogp_mean",
    "abs_dlogp_max",
    "routing_disagreement",
    "entropy",
    "kl_k3",
    "lag_updates_max",
    "samples_per_s",
    "tokens_per_s",
)


class DemoLoopConfig(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    rounds: int = Field(20, ge=1, description="Learner updates (one per round).")
    samples_per_round: int = Field(128, ge=1, description="Completions served (and judged) per round.")
    users: int = Field(50, ge=1, description="Simulated users; completions go to them round-robin.")
    window_s: float = Field(300.0, gt=0, description="Joiner attribution window (simulated seconds).")
    max_staleness: int = Field(2, ge=0, description="The learner's `max_staleness` (versions).")
    eval_tasks: int = Field(
        256, ge=1, description="Gate-split prompts per evaluation (the loop's progress; never report)."
    )
    eval_every: int = Field(5, ge=1, description="Evaluate every this many rounds (and at the end).")
    max_tokens: int = Field(48, ge=1, description="Completion length limit.")
    seed: int = Field(0, description="Seeds tasks, users and sampling.")
    families: tuple[str, ...] | None = Field(
        None,
        description="Families of the served tasks, drawn uniformly from this tuple (repeat one to weight it); "
        "None: all, uniformly.",
    )
    trainer: TrainerConfig = Field(
        default_factory=lambda: TrainerConfig(lr=3e-4), description="Learner settings (lr 3e-4 for the demo)."
    )
    poisoning: PoisoningConfig = Field(default_factory=PoisoningConfig, description="The learner's poisoning screen.")
    reward: RewardSpec = Field(default_factory=RewardSpec, description="How signals become rewards.")

    def learner(self, topic: str) -> LearnerConfig:
        """The learner's settings: the cadence is the loop's (one update per round), the rest as configured."""
        return LearnerConfig(
            update_every_samples=self.samples_per_round,  # a poll takes at most one round's samples
            update_every_s=1e12,
            min_samples=1,
            max_staleness=self.max_staleness,
            max_lag_updates=None,  # nothing is promoted after the base: a bound from it would stop the loop
            hold_check_s=0.0,
            topic=topic,
            trainer=self.trainer,
            poisoning=self.poisoning,
        )


class User(Protocol):
    """What the loop shows completions to (`demo.users.SimulatedUser` by default)."""

    user_id: str

    def react(self, task: Task, completion: str, check: CheckResult) -> list[FeedbackSignal]: ...


RewardHook = Callable[[int, list[SampleEvent], Mapping[str, Task]], list[SampleEvent]]
"""`rewards(round, samples, task_of)`: the round's joined samples as the learner gets them (`task_of`:
completion id -> its task)."""


class _Loop:
    """The services of one run, in `home`, on a simulated clock."""

    def __init__(self, home: Path, model_dir: Path, cfg: DemoLoopConfig, rewrite: bool):
        self.clock = [1_000_000.0]  # simulated time: the joiner's window closes without waiting for it
        now: Callable[[], float] = lambda: self.clock[0]  # noqa: E731
        self.bus = EmbeddedBus(home / "bus", fsync=False)
        self.registry = Registry(f"sqlite:///{home / 'registry.db'}")
        self.joiner = JoinerService(self.bus, cfg.reward, cfg.window_s, clock=now)
        topic = REWRITTEN_TOPIC if rewrite else TOPICS["sample"]
        self.learner = LearnerService(
            self.bus, self.registry, home / "models", model_dir, cfg.learner(topic), clock=now, verifier=DemoVerifier()
        )

    def close(self) -> None:
        self.learner.close()
        self.joiner.close()
        self.bus.close()
        self.registry.close()


def run_demo_loop(
    model_dir: str | Path,
    cfg: DemoLoopConfig | None = None,
    report_path: str | Path | None = None,
    *,
    users: Sequence[User] | None = None,
    rewards: RewardHook | None = None,
    save_to: str | Path | None = None,
) -> dict:
    """The loop (module docstring); `users`, `rewards` and `save_to` are the experiment hooks (default:
    `cfg.users` honest simulated users, rewards as joined, nothing saved)."""
    cfg = cfg or DemoLoopConfig()
    torch.manual_seed(cfg.seed)
    if users is None:
        users = [SimulatedUser(f"user-{i}", seed=cfg.seed * 1000 + i) for i in range(cfg.users)]
    if not users:
        raise ValueError("users must not be empty")
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="flywheel-loop-") as tmp:
        loop = _Loop(Path(tmp), Path(model_dir), cfg, rewrite=rewards is not None)
        engine = EmbeddedEngine(max_batch=64, max_model_len=loop.learner.model.args.max_seq_len, seed=cfg.seed)
        try:
            report = _run(loop, engine, cfg, users, rewards)
            if save_to is not None:
                save_checkpoint(loop.learner.model, save_to, tokenizer=loop.learner.tokenizer)
        finally:
            engine.shutdown()
            loop.close()
    report["seconds"] = time.perf_counter() - t0
    if report_path:
        Path(report_path).parent.mkdir(parents=True, exist_ok=True)
        Path(report_path).write_text(json.dumps(report, indent=2))
    return report


def _serve(engine: EmbeddedEngine, learner: LearnerService, version: str, served: str | None) -> str:
    """`version` served by default from its checkpoint (the previous one retired); its id."""
    if version != served:
        model = load_checkpoint(learner.checkpoint_dir(version))
        engine.add_version(version, model, Tokenizer.from_file(learner.checkpoint_dir(version)), default=True)
        if served is not None:
            engine.retire_version(served)
    return version


def _run(
    loop: _Loop, engine: EmbeddedEngine, cfg: DemoLoopConfig, users: Sequence[User], rewards: RewardHook | None
) -> dict[str, Any]:
    learner, registry, bus, clock = loop.learner, loop.registry, loop.bus, loop.clock
    served = _serve(engine, learner, registry.incumbent().id, None)
    base_id = served
    tok = engine.tokenizer(served)
    task_of: dict[str, Task] = {}
    eval_set = split_tasks("gate", cfg.eval_tasks)
    history: list[dict[str, Any]] = []
    base = evaluate(engine, served, eval_set, cfg.seed + EVAL_SEED, max_tokens=cfg.max_tokens)
    history.append({"round": 0, "version": served, **base})
    log.info("demo loop: base %s", base)
    for r in range(cfg.rounds):
        round_seed = cfg.seed * 100_003 + r
        tasks = sample_tasks(cfg.samples_per_round, seed=round_seed, families=cfg.families)
        # One seed per completion, as `evaluate` does: what is served (and so learned) does not
        # depend on how the engine's thread happens to batch the requests.
        first = round_seed * cfg.samples_per_round
        outs = engine.generate(
            [tok.encode_prompt(t.prompt) for t in tasks],
            [SamplingParams(max_tokens=cfg.max_tokens, seed=first + i) for i in range(len(tasks))],
            served,
        )
        checks = check_batch(tasks, [o.text for o in outs])
        completions, feedback = [], []
        for i, (t, o, c) in enumerate(zip(tasks, outs, checks)):
            user = users[(r * cfg.samples_per_round + i) % len(users)]
            ev = CompletionEvent.from_completion(
                o, tenant="demo", user=user.user_id, endpoint="completions", context=t.family
            ).model_copy(update={"ts": clock[0]})
            task_of[ev.completion_id] = t
            completions.append((ev.completion_id, ev.model_dump_json().encode()))
            for sig in user.react(t, o.text, c):
                fb = FeedbackEvent(
                    tenant="demo",
                    completion_id=ev.completion_id,
                    user_id=ev.user_id,
                    kind=sig.kind,
                    value=sig.value,
                    ts=clock[0] + 1.0,
                )
                feedback.append((ev.completion_id, fb.model_dump_json().encode()))
        bus.publish_many(TOPICS["completion"], completions)
        bus.publish_many(TOPICS["feedback"], feedback)
        loop.joiner.run_once(timeout_s=0.0)  # reads them; the windows are open
        clock[0] += cfg.window_s + 1.0
        samples = loop.joiner.run_once(timeout_s=0.0)  # the windows closed: the round's samples
        if rewards is not None:
            rewritten = rewards(r, samples, task_of)
            bus.publish_many(
                REWRITTEN_TOPIC, [(s.completion.completion_id, s.model_dump_json().encode()) for s in rewritten]
            )
        while learner.poll(timeout_s=0.0):
            pass
        buffered = sum(1 for _, ev in learner.buffer if ev is not None)
        new = learner.update() if buffered else None
        stats = learner.last_stats if new else {}
        if new is not None:
            served = _serve(engine, learner, new, served)
        row: dict[str, Any] = {
            "round": r + 1,
            "version": served,
            "samples": int(stats.get("samples", 0)),
            "dropped": stats.get("dropped", {}),
            **{k: stats[k] for k in ROUND_KEYS if k in stats},
        }
        if (r + 1) % cfg.eval_every == 0 or r + 1 == cfg.rounds:
            row.update(evaluate(engine, served, eval_set, cfg.seed + EVAL_SEED, max_tokens=cfg.max_tokens))
        history.append(row)
        log.info(
            "demo loop round %d: %s", r + 1, {k: (round(v, 4) if isinstance(v, float) else v) for k, v in row.items()}
        )
    final = next(h for h in reversed(history) if "satisfaction" in h)
    return {
        "config": json.loads(cfg.model_dump_json()),
        "base": base,
        "base_version": base_id,
        "final": {"version": final["version"], "pass_rate": final["pass_rate"], "satisfaction": final["satisfaction"]},
        "satisfaction_gain_points": (final["satisfaction"] - base["satisfaction"]) * 100,
        "joiner": dict(loop.joiner.stats),
        "learner": dict(learner.counters),
        "history": history,
    }
