"""From `sample` events (the joiner's output) to the trainer's `Sequence`s.

Owns the decoding of the recorded routing (uint8 [P + N - 1, L, K], base64 in the event) and the
filters applied before training: the samples of tenants opted out of training, greedy completions (no
usable importance ratio), empty outputs, samples whose behaviour version is more than `max_staleness`
versions behind the trainer (as `learner.lineage.staleness` counts), and samples more than `max_lag`
updates behind it (the policy lag bound) are dropped and counted, never silently. When the drops leave
too few samples for an update, the learner sets the dropped ones aside (`set_aside`) and keeps the
rest buffered, rather than take an optimizer step on a handful of samples.
"""

from __future__ import annotations

from collections import Counter
from typing import TypeVar

import numpy as np

from feedback.bus import Record
from feedback.events import SampleEvent
from learner.baselines import baseline_key
from learner.replay import Sequence

T = TypeVar("T")


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


def drop_reason(
    ev: SampleEvent,
    staleness: dict[str, int],
    max_staleness: int,
    lag: dict[str, int] | None = None,
    max_lag: int | None = None,
    untrained: frozenset[str] = frozenset(),
) -> str | None:
    """Why `ev` is not trained on ("opted_out", "empty", "greedy", "unknown_version", "stale", "lag"), or
    None. `staleness`: how many versions behind the trainer each known version is; `lag`: how many updates
    (`learner.lineage.staleness(state, "updates")`), bounded by `max_lag` (None: no bound); `untrained`:
    tenants whose feedback never trains the shared model."""
    if ev.tenant in untrained:
        return "opted_out"
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
    if lag is not None and max_lag is not None and lag.get(c.model_version, 0) > max_lag:
        return "lag"
    return None


def partition(
    batch: list[tuple[T, SampleEvent]],
    staleness: dict[str, int],
    max_staleness: int,
    lag: dict[str, int] | None = None,
    max_lag: int | None = None,
    untrained: frozenset[str] = frozenset(),
) -> tuple[list[tuple[T, SampleEvent]], Counter[str]]:
    """The (record, event) pairs `drop_reason` keeps, in order, and the count of the rest by reason."""
    kept, dropped = [], Counter[str]()
    for rec, ev in batch:
        why = drop_reason(ev, staleness, max_staleness, lag, max_lag, untrained)
        if why is None:
            kept.append((rec, ev))
        else:
            dropped[why] += 1
    return kept, dropped


def set_aside(
    buffer: list[tuple[Record, SampleEvent | None]], kept: set[str]
) -> tuple[list[tuple[Record, SampleEvent | None]], list[str]]:
    """`buffer` with every sample whose event id is not in `kept` replaced by its bare record (its
    position is still committed with the next update; it is never trained), and those event ids."""
    out: list[tuple[Record, SampleEvent | None]] = []
    gone = []
    for rec, ev in buffer:
        if ev is None or ev.event_id in kept:
            out.append((rec, ev))
        else:
            out.append((Record(rec.topic, rec.partition, rec.offset, rec.key, b""), None))
            gone.append(ev.event_id)
    return out, gone


def cadence_met(n: int, elapsed_s: float, every_samples: int, min_samples: int, every_s: float) -> bool:
    """The learner's cadence: `every_samples` samples, or `min_samples` once `every_s` has passed."""
    return n >= every_samples or (n >= min_samples and elapsed_s >= every_s)
