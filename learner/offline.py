"""Offline group rollouts (GRPO-style) for the same learner: G samples per prompt, verifiable rewards.

`rollout_groups` has an engine sample G completions for each of a set of prompts (meant for
idle serving capacity off-peak; no production process calls it: off-peak lending is not built);
a verifier (`product.suites.Verifier`, implemented by the product: the demo's runs each task's
tests) scores each; advantages are group-relative (`learner.objective.group_advantages`: r_i -
mean of the group, divided by its std). A group whose samples all scored the same carries no signal and
is dropped (counted). The resulting sequences carry their advantage and `weight = offline_weight`,
and `LearnerService.add_offline` queues them to be mixed into the next online update
(`Trainer.update(..., group_advantages=...)`).
"""

from __future__ import annotations

from collections.abc import Sequence as Seq
from dataclasses import dataclass, field

from learner.objective import group_advantages
from learner.replay import Sequence
from product.suites import Verifier
from serving.sampling import SamplingParams


@dataclass
class GroupBatch:
    sequences: list[Sequence] = field(default_factory=list)
    advantages: list[float] = field(default_factory=list)
    groups: int = 0
    dropped_flat_groups: int = 0
    pass_rate: float = 0.0
    """Share of all rolled-out completions that scored 1.0."""


def rollout_groups(
    engine,
    version: str,
    prompts: Seq[str],
    verifier: Verifier,
    group_size: int,
    weight: float = 1.0,
    temperature: float = 1.0,
    max_tokens: int = 48,
    seed: int = 0,
    keys: Seq[str] | None = None,
) -> GroupBatch:
    """`group_size` completions of each prompt by `version`, scored by `verifier`; `keys[i]` names
    prompt i's baseline key (e.g. its task family; sequences get `offline:<key>`)."""
    if group_size < 2:
        raise ValueError(f"group_size must be >= 2 for group-relative advantages, got {group_size}")
    if temperature <= 0:
        raise ValueError(f"temperature must be > 0 for rollouts, got {temperature}")
    if keys is not None and len(keys) != len(prompts):
        raise ValueError(f"got {len(prompts)} prompts but {len(keys)} keys")
    tok = engine.tokenizer(version)
    owners = [prompt for prompt in prompts for _ in range(group_size)]
    params = [
        SamplingParams(temperature=temperature, max_tokens=max_tokens, seed=seed * 1_000_003 + pi * group_size + g)
        for pi in range(len(prompts))
        for g in range(group_size)
    ]
    outs = engine.generate([tok.encode_prompt(p) for p in owners], params, version)
    scores = [float(s) for s in verifier.verify(owners, [o.text for o in outs])]
    if len(scores) != len(outs):
        raise ValueError(f"the verifier returned {len(scores)} scores for {len(outs)} completions")
    out = GroupBatch(pass_rate=sum(s == 1.0 for s in scores) / max(1, len(scores)))
    for pi in range(len(prompts)):
        idx = range(pi * group_size, (pi + 1) * group_size)
        rewards = [scores[i] for i in idx]
        if len(set(rewards)) == 1:
            out.dropped_flat_groups += 1
            continue
        out.groups += 1
        key = f"offline:{keys[pi]}" if keys is not None else "offline"
        for i, adv in zip(idx, group_advantages(rewards)):
            o = outs[i]
            out.sequences.append(
                Sequence(
                    o.prompt_ids,
                    o.output_ids,
                    o.logprobs,
                    o.routed_experts,
                    temperature,
                    1.0,
                    reward=scores[i],
                    version=version,
                    key=key,
                    weight=weight,
                )
            )
            out.advantages.append(adv)
    return out
