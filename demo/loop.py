"""The online-RL loop end to end in one process, on the demo product (no HTTP, bus or services).

`flywheel demo` runs the real system (`demo.system`); this loop is its fast, in-memory twin, for
experiments and for training candidates in tests and benchmarks in seconds.

Every round: the served version completes a fresh batch of demo tasks (sampled at temperature 1,
as the product serves); each completion becomes the `completion` event the gateway would record;
a simulated user reacts with the signals the product would report (`feedback` events); the joiner
(`feedback.joiner.JoinerCore`, the reward spec, per-user caps) turns them into `sample` events once
the attribution window closes; the learner keeps samples at most `max_staleness` versions old,
runs one policy-gradient update with router replay (`learner.trainer`), and the next version is
served. Gate-split prompts measure pass rate and the simulated users' satisfaction along the way
(`demo.evaluation`); the report split is left to the published numbers.

What it leaves out on purpose (each has its own component elsewhere): HTTP and the event bus
(events are handed over in memory, in the same types), gating, and weight shipping (the engine
serves the trained model object directly).

Hooks for experiments on what the learner is fed (`bench/damaged_candidates.py` trains damaged
candidates with them): `users` replaces the honest simulated users (anything with a `user_id` and
`react(task, completion, check)`, e.g. users who reward wrong completions), `rewards` rewrites each
round's joined samples before the learner sees them (shuffled or inverted rewards), and `save_to`
writes the final weights as a checkpoint folder.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any, Protocol

import torch
from pydantic import BaseModel, ConfigDict, Field

from demo.checker import CheckResult, check_batch
from demo.evaluation import evaluate
from demo.split import sample_tasks, split_tasks
from demo.tasks import Task
from demo.users import FeedbackSignal, SimulatedUser
from feedback.events import CompletionEvent, FeedbackEvent, SampleEvent
from feedback.joiner import JoinerCore
from feedback.rewards import RewardSpec
from learner.samples import select
from learner.trainer import Trainer, TrainerConfig
from serving.checkpoint import load_checkpoint, save_checkpoint
from serving.engine import EmbeddedEngine
from serving.sampling import SamplingParams
from serving.tokenizer import Tokenizer

log = logging.getLogger(__name__)
EVAL_SEED = 99_999  # offset of the evaluation's sampling seed


class DemoLoopConfig(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    rounds: int = Field(20, ge=1, description="Learner updates (one per round).")
    samples_per_round: int = Field(128, ge=1, description="Completions served (and judged) per round.")
    users: int = Field(50, ge=1, description="Simulated users; completions go to them round-robin.")
    window_s: float = Field(300.0, gt=0, description="Joiner attribution window (simulated seconds).")
    max_staleness: int = Field(2, ge=0, description="Samples older than this many versions are dropped.")
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
    reward: RewardSpec = Field(default_factory=RewardSpec, description="How signals become rewards.")


class User(Protocol):
    """What the loop shows completions to (`demo.users.SimulatedUser` by default)."""

    user_id: str

    def react(self, task: Task, completion: str, check: CheckResult) -> list[FeedbackSignal]: ...


RewardHook = Callable[[int, list[SampleEvent], Mapping[str, Task]], list[SampleEvent]]
"""`rewards(round, samples, task_of)`: the round's joined samples as the learner gets them (`task_of`:
completion id -> its task)."""


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
    model = load_checkpoint(model_dir)
    tok = Tokenizer.from_file(model_dir)
    engine = EmbeddedEngine(max_batch=64, max_model_len=model.args.max_seq_len, seed=cfg.seed)
    clock = [1_000_000.0]  # simulated time: the joiner's window closes without waiting for it
    joiner = JoinerCore(cfg.reward, cfg.window_s, clock=lambda: clock[0])
    if tok.pad_id is None:
        raise ValueError(f"{model_dir}: the tokenizer has no padding token; the trainer needs one")
    trainer = Trainer(model, cfg.trainer, tok.vocab_size, tok.pad_id)
    if users is None:
        users = [SimulatedUser(f"user-{i}", seed=cfg.seed * 1000 + i) for i in range(cfg.users)]
    if not users:
        raise ValueError("users must not be empty")
    task_of: dict[str, Task] = {}
    eval_set = split_tasks("gate", cfg.eval_tasks)
    versions: dict[str, int] = {"v0": 0}
    history = []
    t0 = time.perf_counter()
    try:
        engine.add_version("v0", model, tok)
        base = evaluate(engine, "v0", eval_set, cfg.seed + EVAL_SEED, max_tokens=cfg.max_tokens)
        history.append({"round": 0, **base})
        log.info("demo loop: base %s", base)
        for r in range(cfg.rounds):
            version = f"v{r}"
            round_seed = cfg.seed * 100_003 + r
            tasks = sample_tasks(cfg.samples_per_round, seed=round_seed, families=cfg.families)
            # One seed per completion, as `evaluate` does: what is served (and so learned) does not
            # depend on how the engine's thread happens to batch the requests.
            first = round_seed * cfg.samples_per_round
            outs = engine.generate(
                [tok.encode_prompt(t.prompt) for t in tasks],
                [SamplingParams(max_tokens=cfg.max_tokens, seed=first + i) for i in range(len(tasks))],
                version,
            )
            checks = check_batch(tasks, [o.text for o in outs])
            for i, (t, o, c) in enumerate(zip(tasks, outs, checks)):
                user = users[(r * cfg.samples_per_round + i) % len(users)]
                ev = CompletionEvent.from_completion(
                    o, tenant="demo", user=user.user_id, endpoint="completions", context=t.family
                )
                ev = ev.model_copy(update={"ts": clock[0]})
                joiner.on_completion(ev)
                task_of[ev.completion_id] = t
                for sig in user.react(t, o.text, c):
                    joiner.on_feedback(
                        FeedbackEvent(
                            tenant="demo",
                            completion_id=ev.completion_id,
                            user_id=ev.user_id,
                            kind=sig.kind,
                            value=sig.value,
                            ts=clock[0] + 1.0,
                        )
                    )
            clock[0] += cfg.window_s + 1.0
            samples = joiner.tick(clock[0])
            if rewards is not None:
                samples = rewards(r, samples, task_of)
            seqs, dropped = select(samples, versions, current=r, max_staleness=cfg.max_staleness)
            stats = trainer.update(seqs, behaviour_is_current=True).stats if seqs else {}
            nxt = f"v{r + 1}"
            versions[nxt] = r + 1
            engine.add_version(nxt, model, tok, default=True)  # the updated weights, under a new name
            engine.retire_version(version)
            row: dict[str, Any]
            row = {
                "round": r + 1,
                "samples": len(seqs),
                "dropped": dict(dropped),
                **{
                    k: stats[k]
                    for k in (
                        "reward_mean",
                        "adv_mean",
                        "ratio_mean",
                        "clip_frac",
                        "grad_norm",
                        "abs_dlogp_mean",
                        "abs_dlogp_max",
                        "routing_disagreement",
                        "samples_per_s",
                        "tokens_per_s",
                    )
                    if k in stats
                },
            }
            if (r + 1) % cfg.eval_every == 0 or r + 1 == cfg.rounds:
                row.update(evaluate(engine, nxt, eval_set, cfg.seed + EVAL_SEED, max_tokens=cfg.max_tokens))
            history.append(row)
            log.info(
                "demo loop round %d: %s",
                r + 1,
                {k: (round(v, 4) if isinstance(v, float) else v) for k, v in row.items()},
            )
        if save_to is not None:
            save_checkpoint(model, save_to, tokenizer=tok)
    finally:
        engine.shutdown()
    final = next(h for h in reversed(history) if "satisfaction" in h)
    report = {
        "config": json.loads(cfg.model_dump_json()),
        "base": base,
        "final": {"pass_rate": final["pass_rate"], "satisfaction": final["satisfaction"]},
        "satisfaction_gain_points": (final["satisfaction"] - base["satisfaction"]) * 100,
        "joiner": dict(joiner.stats),
        "history": history,
        "seconds": time.perf_counter() - t0,
    }
    if report_path:
        Path(report_path).parent.mkdir(parents=True, exist_ok=True)
        Path(report_path).write_text(json.dumps(report, indent=2))
    return report
