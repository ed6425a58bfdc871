"""From `sample` events (the joiner's output) to the trainer's `Sequence`s.

Owns the decoding of the recorded routing (uint8 [P + N - 1, L, K], base64 in the event) and the
filters applied before training: greedy completions (no usable importance ratio), empty outputs,
and samples whose behaviour version is more than `max_staleness` versions behind the trainer (as
`learner.lineage.staleness` counts) are dropped and counted, never silently.
"""

from __future__ import annotations

from collections import Counter

import numpy as np

from feedback.events import SampleEvent
from learner.baselines import baseline_key
from learner.replay import Sequence


def sequence_from_sample(ev: SampleEvent, key: str | None = None) -> Sequence:
    """`key`: the sequence's baseline key, by default the completion's (`learner.baselines.baseline_key`)."""
    c = ev.completion
    shape = tuple(c.routed_experts.shape)
    experts = np.frombuffer(c.routed_experts.to_bytes(), dtype=np.uint8).reshape(shape).copy()
    return Sequence(
        prompt_ids=c.prompt_ids,
        output_ids=c.output_ids,
        logprobs=c.logprobs,
        routed_experts=experts,
        temperature=float(c.params.get("temperature", 1.0)),
        top_p=float(c.params.get("top_p", 1.0)),
        reward=ev.reward,
        version=c.model_version,
        key=key if key is not None else baseline_key(ev),
    )


def drop_reason(ev: SampleEvent, staleness: dict[str, int], max_staleness: int) -> str | None:
    """Why `ev` is not trained on ("empty", "greedy", "unknown_version", "stale"), or None.
    `staleness`: how many versions behind the trainer each known version is."""
    c = ev.completion
    if not c.output_ids:
        return "empty"
    if float(c.params.get("temperature", 1.0)) <= 0:
        return "greedy"
    behind = staleness.get(c.model_version)
    if behind is None:
        return "unknown_version"
    if behind > max_staleness:
        return "stale"
    return None


def select(
    events: list[SampleEvent], version_index: dict[str, int], current: int, max_staleness: int, key_of=None
) -> tuple[list[Sequence], Counter[str]]:
    """Trainable sequences and the count of what was dropped, by reason (versions at `version_index`,
    the trainer at `current`)."""
    staleness = {v: current - i for v, i in version_index.items()}
    dropped: Counter[str] = Counter()
    out = []
    for ev in events:
        why = drop_reason(ev, staleness, max_staleness)
        if why is not None:
            dropped[why] += 1
            continue
        out.append(sequence_from_sample(ev, key_of(ev) if key_of else None))
    return out, dropped
