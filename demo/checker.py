"""Verifiable checker: does a completion solve its task?

Called by the demo product loop (to score completions and feed the simulated users), by the corpus
tests and by evaluation; `DemoVerifier` is a `product.suites.Verifier`, for the learner's offline
rollouts and the gate's suite (`demo.suite`). The executed source is exactly `task.prompt + completion`; it runs in the
sandbox (`demo.sandbox`), one child process per batch. Results are compared with the expected
values after both sides are JSON-normalised, and compared as JSON text so that e.g. `1` does not
pass for `True`.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass

from demo.sandbox import ExecResult, run_functions
from demo.tasks import Task, task_from_prompt


@dataclass(frozen=True)
class CheckResult:
    passed: bool
    """All tests passed."""
    n_passed: int
    n_tests: int
    error: str | None
    """The execution error ("timeout", "SyntaxError: ...", "blocked: ..."), if any; None when the
    code ran cleanly (wrong answers are not errors)."""


def check(task: Task, completion: str, timeout_s: float = 1.0) -> CheckResult:
    """Check one completion (spawns one sandbox process; prefer `check_batch` for many)."""
    return check_batch([task], [completion], timeout_s)[0]


def check_batch(tasks: Sequence[Task], completions: Sequence[str], timeout_s: float = 1.0) -> list[CheckResult]:
    """Check `completions[i]` against `tasks[i]`, all in one sandbox process."""
    if len(tasks) != len(completions):
        raise ValueError(f"got {len(tasks)} tasks but {len(completions)} completions")
    items = [
        (task.prompt + completion, [args for args, _ in task.tests])
        for task, completion in zip(tasks, completions, strict=True)
    ]
    return [_score(task, result) for task, result in zip(tasks, run_functions(items, timeout_s), strict=True)]


def _canonical(value: object) -> str:
    return json.dumps(value, sort_keys=True)


def _score(task: Task, result: ExecResult) -> CheckResult:
    n_tests = len(task.tests)
    if result.results is None:
        return CheckResult(passed=False, n_passed=0, n_tests=n_tests, error=result.error)
    n_passed = sum(
        call_error is None and _canonical(got) == _canonical(expected)
        for (_, expected), got, call_error in zip(task.tests, result.results, result.call_errors, strict=True)
    )
    return CheckResult(passed=result.ok and n_passed == n_tests, n_passed=n_passed, n_tests=n_tests, error=result.error)


@dataclass(frozen=True)
class DemoVerifier:
    """Scores a completion of a demo prompt 1.0 if every test of its task passes, else 0.0."""

    timeout_s: float = 1.0

    def verify(self, prompts: Sequence[str], completions: Sequence[str]) -> list[float]:
        tasks = [task_from_prompt(p) for p in prompts]
        unknown = next((p for p, t in zip(prompts, tasks) if t is None), None)
        if unknown is not None:
            raise ValueError(f"not a demo prompt: {unknown!r}")
        known = [t for t in tasks if t is not None]  # every one of them, as just checked
        return [float(c.passed) for c in check_batch(known, completions, self.timeout_s)]
