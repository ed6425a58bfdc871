"""What the learner needs from a product to score offline rollouts: a verifier of completions.

The learner knows prompts and completion texts only; the product that owns the tasks (the demo:
`demo.checker.DemoVerifier`) implements this protocol, so `learner` never imports it.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol, runtime_checkable


@runtime_checkable
class Verifier(Protocol):
    def verify(self, prompts: Sequence[str], completions: Sequence[str]) -> list[float]:
        """Score `completions[i]` as the completion of `prompts[i]`, one score per pair, in order:
        1.0 passes every check, 0.0 fails, a value in between is partial credit. Raises ValueError
        for a prompt the verifier cannot check, or when the two lengths differ."""
        ...
