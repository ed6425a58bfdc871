"""The demo product's offline eval suite for the gate: the gate split, scored by each task's tests.

`demo_suite()` is `product.suites.EvalSuite` "demo-gate": `GATE_PROMPTS` distinct prompts of the gate
split, `GATE_PER_FAMILY` of each of the 18 families (`demo.split.split_tasks("gate", n)`: the
held-out phrasing with values of its own, never in the pre-training corpus, the users' traffic or the
report split), family = the task's family,
verifier `demo.checker.DemoVerifier` (the task's tests in the sandbox), and `well_formed` = the
prompt plus the completion parses as Python. The suite is held out (`in_distribution=False`).

Why 28 per family (504 prompts): an equally good candidate must pass the gate's non-inferiority test
(margin 3 points, alpha 0.05) most of the time, which at G 8 takes about 500 prompts (about 26% on 62,
about 88% on 504: bench/gate_sim_offline.py, docs/benchmarks.md); and the per-family harm test must
catch a family dropped by 25 points, which at G 8 takes at least 16 prompts per family (78% at 16, at
least 95% at 28: tests/gating/test_family_power.py). `split_tasks` takes the families in turn, so any
multiple of 18 is stratified.

Passed to `gating.gate_process.run_gate` by `flywheel gate` and by `flywheel demo`.
"""

from __future__ import annotations

import ast
from collections.abc import Sequence

from demo.checker import DemoVerifier
from demo.split import split_of, split_tasks
from demo.tasks import FAMILIES, Task
from product.suites import EvalSuite, OfflinePrompts, SuiteItem

DEMO_SUITE_NAME = "demo-gate"
DEMO_SUITE_VERSION = "3"
"""Bump when the task set or its checks change meaning (the content hash in `suite_version` changes anyway)."""
GATE_PER_FAMILY = 28
GATE_PROMPTS = GATE_PER_FAMILY * len(FAMILIES)


def python_parses(prompt: str, completion: str) -> bool:
    """The executed source (`prompt + completion`, as the checker runs it) is valid Python."""
    try:
        ast.parse(prompt + completion)
    except (SyntaxError, ValueError):
        return False
    return True


def demo_suite(tasks: Sequence[Task] | None = None, timeout_s: float = 1.0, n: int = GATE_PROMPTS) -> EvalSuite:
    """The gate's suite: `n` gate-split prompts, or the given `tasks` (then marked in-distribution
    unless every one of them is a gate prompt)."""
    chosen = list(split_tasks("gate", n) if tasks is None else tasks)
    if not chosen:
        raise ValueError("demo_suite needs at least one task")
    return EvalSuite(
        DEMO_SUITE_NAME,
        DEMO_SUITE_VERSION,
        tuple(SuiteItem(t.prompt, t.family) for t in chosen),
        DemoVerifier(timeout_s),
        in_distribution=any(split_of(t) != "gate" for t in chosen),
        well_formed=python_parses,
    )


def demo_offline_prompts(n: int = 512, timeout_s: float = 1.0) -> OfflinePrompts:
    """The demo's `learner.offline_prompts`: `n` train-split prompts (what the users ask; never a gate
    or report prompt), scored by the tasks' tests."""
    if n < 1:
        raise ValueError(f"n must be at least 1, got {n}")
    return OfflinePrompts("demo-train", tuple(t.prompt for t in split_tasks("train", n)), DemoVerifier(timeout_s))
