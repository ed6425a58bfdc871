"""Offline group rollouts (GRPO-style) for the same learner: G samples per prompt, verifiable rewards.

Off-peak, idle serving capacity samples G completions for each of a set of prompts; the demo's
checker verifies each (reward 1 if every test passes, else 0); advantages are group-relative
(`learner.objective.group_advantages`: r_i - mean of the group, divided by its std). A group whose
samples all scored the same carries no signal and is dropped (counted). The resulting sequences
carry their advantage and `weight = offline_weight`, and are mixed into an online update by
`Trainer.update(..., group_advantages=...)`.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from demo.checker import check_batch
from demo.tasks import Task
from learner.objective import group_advantages
from learner.replay import Sequence
from serving.sampling import SamplingParams


@dataclass
class GroupBatch:
    sequences: list[Sequence] = field(default_factory=list)
    advantages: list[float] = field(default_factory=list)
    groups: int = 0
    dropped_flat_groups: int = 0
    pass_rate: float = 0.0


def verified(task: Task, text: str, check) -> float:
    """The default verifiable reward: 1 if every test of the task passes, else 0."""
    return 1.0 if check.passed else 0.0


def rollout_groups(engine, version: str, tasks: list[Task], group_size: int, weight: float = 1.0,
                   temperature: float = 1.0, max_tokens: int = 48, seed: int = 0, reward_fn=verified) -> GroupBatch:
    if group_size < 2:
        raise ValueError(f"group_size must be >= 2 for group-relative advantages, got {group_size}")
    if temperature <= 0:
        raise ValueError(f"temperature must be > 0 for rollouts, got {temperature}")
    tok = engine.tokenizer(version)
    prompts, params, owners = [], [], []
    for ti, task in enumerate(tasks):
        for g in range(group_size):
            prompts.append(tok.encode_prompt(task.prompt))
            params.append(SamplingParams(temperature=temperature, max_tokens=max_tokens,
                                         seed=seed * 1_000_003 + ti * group_size + g))
            owners.append(task)
    outs = engine.generate(prompts, params, version)
    checks = check_batch(owners, [o.text for o in outs])
    out = GroupBatch(pass_rate=sum(c.passed for c in checks) / max(1, len(checks)))
    for ti in range(len(tasks)):
        idx = range(ti * group_size, (ti + 1) * group_size)
        rewards = [float(reward_fn(tasks[ti], outs[i].text, checks[i])) for i in idx]
        if len(set(rewards)) == 1:
            out.dropped_flat_groups += 1
            continue
        out.groups += 1
        for i, adv in zip(idx, group_advantages(rewards)):
            o = outs[i]
            out.sequences.append(Sequence(o.prompt_ids, o.output_ids, o.logprobs, o.routed_experts, temperature,
                                          1.0, reward=rewards[i - idx.start], version=version,
                                          key=f"offline:{tasks[ti].family}", weight=weight))
            out.advantages.append(adv)
    return out
