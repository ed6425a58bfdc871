"""Damaged candidates through the real offline gate: a better one passes, three damaged ones are rejected.

From one base (by default the shipped one, `models/demo-base`: `SHIPPED_BASE`), candidates are trained
in-process with the demo's own loop (`demo.loop.run_demo_loop`: served completions, simulated users'
signals, the joiner's rewards, policy-gradient updates), each on the same training budget:

- `honest`: every user is an honest simulated user (the better candidate);
- `honest_short`: the same on a smaller budget (better, by less);
- `shuffled`: the rewards of each round are permuted across the batch (`shuffle_rewards`);
- `adversarial`: every second user is adversarial: it reacts as if wrong completions were right and
  right ones wrong (`AdversarialUser`), so half the traffic rewards bugs;
- `family`: honest everywhere except one family (`max_default`), whose rewards are negated
  (`invert_family`) and which is served more often, so that it drops by >= 15 points while the overall
  pass rate moves < 2 points.

Each candidate is measured (`measure`: the gate suite's 504 prompts, `--measure-g` samples each at
temperature 1, seeds of the measurement's own, so the numbers are not the gate's) and then goes through
the real offline gate: registered with its weights in the weight store as the learner publishes them, the
base published and promoted by `registry.publish.publish_base`, `gating.gate.Gate.step` with an embedded
engine of its own, `weight_store_loader` (the weights as shipped) and `demo.suite.demo_suite()`. The peer of
every candidate is the base, in the same gate step; a verdict against expectation is gated again at
`--recheck-g`. The honest candidate's way through the canary to every replica is `bench.promotion`.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import random
import shutil
import tempfile
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch

from bench import common
from demo.bootstrap import SHIPPED_BASE, BootstrapConfig, bootstrap
from demo.checker import CheckResult
from demo.loop import DemoLoopConfig, RewardHook, User, run_demo_loop
from demo.suite import demo_suite
from demo.tasks import Task
from demo.users import FeedbackSignal, SimulatedUser
from feedback.events import SampleEvent
from gating.evals import suite_requests
from gating.gate import Gate, GateConfig, GateStep
from gating.gate_process import weight_store_loader
from learner.trainer import TrainerConfig
from product.suites import EvalSuite
from registry.models import AuditEntryPublic
from registry.publish import SHIPPING_DTYPE, STORE, file_entry, publish_base
from registry.registry import Registry
from serving.checkpoint import load_checkpoint
from serving.engine import EmbeddedEngine
from serving.weight_store import WeightStore, shipping_state

NAME = "damaged_candidates"
log = logging.getLogger(__name__)
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
    prompts, ids, params = suite_requests(engine.tokenizer(version), suite, G, MEASURE_SEED, max_tokens, 1.0)
    outs = engine.generate(ids, params, version)
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


def loop_config(args: argparse.Namespace) -> DemoLoopConfig:
    """The training budget of every candidate: `--rounds` rounds of 128 completions at `--lr`."""
    return DemoLoopConfig(
        rounds=args.rounds, eval_tasks=64, eval_every=args.rounds, trainer=TrainerConfig(lr=args.lr), seed=args.seed
    )


def family_config(cfg: DemoLoopConfig, family: str, weight: int) -> DemoLoopConfig:
    """`cfg` with `family` served `weight` times as often as each other family."""
    from demo.tasks import FAMILIES

    return cfg.model_copy(update={"families": tuple(FAMILIES) + (family,) * (weight - 1)})


def run(args: argparse.Namespace) -> dict[str, Any]:
    torch.set_num_threads(args.threads)
    recipe = BootstrapConfig()
    boot = bootstrap(args.base, recipe)  # reused when the folder holds a finished bootstrap
    base_info = {
        "folder": common.shown(args.base),
        "config": f"BootstrapConfig() defaults (seed {recipe.seed}, {recipe.steps} steps of {recipe.batch_size} "
        f"sequences, {recipe.corpus_size}-example corpus)",
        "train_seconds": boot["train_seconds"],
        "total_seconds": boot["total_seconds"],
        "eval": boot["eval"],
    }
    suite = demo_suite()
    work = Path(tempfile.mkdtemp(prefix="damaged-")) if args.work is None else args.work
    work.mkdir(parents=True, exist_ok=True)
    cfg = loop_config(args)
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
    return {
        "torch_threads": torch.get_num_threads(),
        "base": base_info,
        "kinds": {
            "honest": "every user honest (the better candidate)",
            "shuffled": "each round's rewards permuted across the round's samples",
            "adversarial": "every second user rewards wrong completions and punishes right ones",
            "family": f"honest except family {args.family!r}, whose rewards are negated; {args.family!r} is "
            f"served {args.family_weight}x as often as each other family",
            "honest_short": f"as honest, on a smaller budget ({args.short_rounds} rounds): better, by less",
        },
        "family": args.family,
        "expect_pass": list(EXPECT_PASS),
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
        "findings": findings(measured, gated, rechecked, args, training),
    }


def findings(
    versions: dict[str, Any],
    verdicts: dict[str, Any],
    rechecked: dict[str, Any],
    args: argparse.Namespace,
    training: dict[str, Any],
) -> dict[str, Any]:
    """What the report states, computed from the numbers: each verdict against its expectation, the
    resolution of the overall test, and the one-family candidate against its definition."""
    out: dict[str, Any] = {"verdicts": {}}
    for k, v in verdicts.items():
        gains = versions[k]["family_diff_points"]
        out["verdicts"][k] = {
            "expected_pass": k in EXPECT_PASS,
            "as_expected": v["passed"] == (k in EXPECT_PASS),
            "family_range": [min(gains.values()), max(gains.values())],
            "recheck": None
            if k not in rechecked
            else {"passed": rechecked[k]["passed"], "failed": rechecked[k]["failed"]},
        }
    gaps = sorted(
        100 * (v["non_inferiority"]["mean_diff"] - v["non_inferiority"]["lower_bound"]) for v in verdicts.values()
    )
    out["resolution_points"] = {"median": gaps[len(gaps) // 2], "min": gaps[0], "max": gaps[-1]}
    if "family" in versions:
        drop, overall = versions["family"]["family_diff_points"][args.family], versions["family"]["overall_diff_points"]
        out["family"] = {
            "name": args.family,
            "drop": drop,
            "overall": overall,
            "meets": drop <= -15 and abs(overall) < 2,
        }
    return out


def parse(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = common.parser(__doc__)
    p.add_argument("--base", type=Path, default=SHIPPED_BASE, help="the bootstrapped base (made if missing)")
    p.add_argument("--kinds", nargs="+", default=list(KINDS), choices=KINDS)
    add_training_args(p)
    p.add_argument("--short-rounds", type=int, default=8, help="honest_short: the honest candidate's smaller budget")
    p.add_argument("--family", default="max_default", help="the family the one-family regression breaks")
    p.add_argument("--family-weight", type=int, default=24, help="its traffic, relative to each other family")
    p.add_argument("--measure-g", type=int, default=32, help="samples per suite prompt for the measurement")
    p.add_argument("--gate-g", type=int, default=8, help="the gate's G (GateConfig default 8)")
    p.add_argument("--gate-seed", type=int, default=0)
    p.add_argument("--recheck-g", type=int, default=32, help="gate again at this G the verdicts against expectation")
    p.add_argument("--work", type=Path, default=None, help="folder for candidates and registries (default: temp)")
    return p.parse_args(argv)


def add_training_args(p: argparse.ArgumentParser) -> None:
    """The training budget every candidate gets (shared with `bench.promotion`)."""
    p.add_argument("--rounds", type=int, default=20, help="loop rounds of 128 completions, every candidate")
    p.add_argument("--lr", type=float, default=3e-4)
    p.add_argument("--seed", type=int, default=0, help="the loop's seed (tasks, users, sampling)")
    p.add_argument("--threads", type=int, default=2)


def quiet_logs() -> None:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    for chatty in ("learner.trainer", "demo.loop", "flywheel.service", "httpx"):
        logging.getLogger(chatty).setLevel(logging.WARNING)


def main(argv: Sequence[str] | None = None) -> None:
    quiet_logs()
    args = parse(argv)
    st = common.stamp()
    common.save(NAME, run(args), st, args.out)


if __name__ == "__main__":
    main()
