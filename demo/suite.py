"""The demo product's offline eval suite for the gate: every demo task, scored by its tests.

`demo_suite()` is `gating.suites.EvalSuite` "demo-tasks": one prompt per task (`demo.tasks.all_tasks`:
every family, every parameter value, in a fixed order), family = the task's family, verifier
`demo.checker.DemoVerifier` (the task's tests in the sandbox), and `well_formed` = the prompt plus the
completion parses as Python. Until the demo has a held-out split (docs/design.md, "The demo product")
these are the product's own prompts, which users are served and the learner trains on: the suite says
`in_distribution=True`, and so does every verdict reached on it.

Passed to `gating.gate_process.run_gate` by whoever starts the gate for the demo (`flywheel gate`, to be wired).
"""

from __future__ import annotations

import ast
from collections.abc import Sequence

from demo.checker import DemoVerifier
from demo.tasks import Task, all_tasks
from gating.suites import EvalSuite, SuiteItem

DEMO_SUITE_NAME = "demo-tasks"
DEMO_SUITE_VERSION = "1"
"""Bump when the task set or its checks change meaning (the content hash in `suite_version` changes anyway)."""


def python_parses(prompt: str, completion: str) -> bool:
    """The executed source (`prompt + completion`, as the checker runs it) is valid Python."""
    try:
        ast.parse(prompt + completion)
    except (SyntaxError, ValueError):
        return False
    return True


def demo_suite(tasks: Sequence[Task] | None = None, timeout_s: float = 1.0) -> EvalSuite:
    """The gate's suite on demo tasks (default: all of them); in-distribution until a held-out split exists."""
    chosen = list(all_tasks() if tasks is None else tasks)
    return EvalSuite(
        DEMO_SUITE_NAME,
        DEMO_SUITE_VERSION,
        tuple(SuiteItem(t.prompt, t.family) for t in chosen),
        DemoVerifier(timeout_s),
        in_distribution=True,
        well_formed=python_parses,
    )
