"""Synthetic pre-training corpus for the tiny demo model: a deliberate mix of good and bad code.

Called by the pre-training (`demo.bootstrap`). Each example is one *train* task prompt
(`demo.split`) followed by one known completion (`demo.tasks.completions_for`); correctness and
house style are drawn independently, so a model pre-trained on it writes correct code only about
`p_correct` of the time and in the house style about `p_preferred` of the time. That gap is what
RL from the simulated users' feedback closes. Nothing of the gate or report splits is in it
(`demo.split.find_leaks`, tested).
"""

from __future__ import annotations

import random
from dataclasses import dataclass

from demo.split import sample_tasks
from demo.tasks import Task, completions_for


@dataclass(frozen=True)
class CorpusMix:
    p_correct: float = 0.5
    """Share of examples whose completion is correct."""
    p_preferred: float = 0.3
    """Share of examples written in the house style (independent of correctness)."""

    def __post_init__(self) -> None:
        for name in ("p_correct", "p_preferred"):
            value = getattr(self, name)
            if not 0.0 <= value <= 1.0:
                raise ValueError(f"{name} must be in [0, 1], got {value}")


def make_corpus(n: int, seed: int, mix: CorpusMix = CorpusMix()) -> list[tuple[Task, str]]:
    """`n` (train task, known completion) pairs, deterministic from `seed`."""
    if n < 0:
        raise ValueError(f"n must be >= 0, got {n}")
    tasks = sample_tasks(n, seed, split="train")
    rng = random.Random(f"corpus:{seed}")
    examples = []
    for task in tasks:
        correct = "correct" if rng.random() < mix.p_correct else "incorrect"
        style = "preferred" if rng.random() < mix.p_preferred else "other"
        examples.append((task, rng.choice(completions_for(task)[f"{correct}_{style}"])))
    return examples


def format_example(task: Task, completion: str) -> str:
    """The exact training text (the caller appends the EOS token)."""
    return task.prompt + completion
