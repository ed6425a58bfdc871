"""Task families of the demo code-completion product, and their known completions.

A task is a one-line comment plus a function header; the model completes the function body:

    prompt     = "# add 3 to x\\ndef f(x):\\n"
    completion = "    return x + 3\\n"

Each family is a small table: a comment template, one parameter drawn from a small range, a
pure-python reference implementation (the source of the expected test results), and four sets of
completion templates (correct/incorrect x house style/other style). The corpus builder
(`demo.corpus`) samples those completions, the checker (`demo.checker`) runs the tests, and the
simulated users (`demo.users`) use `is_preferred_style` to judge style.

The house style is a single concise `    return <expr>` line; everything longer is "other".
Template fields: {k} the integer parameter, {k1} = k + 1, {km1} = k - 1, {c} the letter
parameter, {o} another letter (used for wrong-letter bugs and in the tests).
"""

from __future__ import annotations

import random
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass

LETTERS = ("a", "b", "e", "o", "x")
CATEGORIES = ("correct_preferred", "correct_other", "incorrect_preferred", "incorrect_other")
_PREFERRED_RE = re.compile(r"    return [^\n]+\n")


@dataclass(frozen=True)
class Task:
    """One completion problem. Frozen but not hashable (params is a dict); use task_id as a key."""

    task_id: str
    """Stable id, deterministic from family and params, e.g. "add-3"."""
    family: str
    prompt: str
    """Comment line plus function header, ending with "\\n"; the model writes the body."""
    params: dict
    """The drawn parameter, e.g. {"k": 3} or {"c": "a"}."""
    tests: tuple
    """(args_tuple, expected_result) pairs, computed by the family's reference implementation."""


@dataclass(frozen=True)
class _Family:
    name: str
    comment: str  # comment template, without "# "
    arg: str  # the function's single argument
    param: str  # "k" or "c"
    values: tuple
    reference: Callable[[dict], Callable]  # format values -> reference function
    test_args: Callable[[dict], list]  # format values -> list of single arguments
    correct_preferred: tuple[str, ...]
    correct_other: tuple[str, ...]
    incorrect_preferred: tuple[str, ...]
    incorrect_other: tuple[str, ...]


_FAMILY_LIST = (
    _Family(
        name="add",
        comment="add {k} to x",
        arg="x",
        param="k",
        values=tuple(range(1, 10)),
        reference=lambda v: lambda x: x + v["k"],
        test_args=lambda v: [0, 1, 5, -3, 12],
        correct_preferred=("    return x + {k}\n",),
        correct_other=(
            "    result = x + {k}\n    return result\n",
            "    y = x\n    y += {k}\n    return y\n",
        ),
        incorrect_preferred=("    return x + {k1}\n", "    return x - {k}\n", "    return x * {k}\n"),
        incorrect_other=(
            "    result = x + {k1}\n    return result\n",
            "    y = x\n    y -= {k}\n    return y\n",
        ),
    ),
    _Family(
        name="mul",
        comment="multiply x by {k}",
        arg="x",
        param="k",
        values=tuple(range(2, 10)),
        reference=lambda v: lambda x: x * v["k"],
        test_args=lambda v: [0, 1, 3, -4, 7],
        correct_preferred=("    return x * {k}\n",),
        correct_other=(
            "    result = x * {k}\n    return result\n",
            "    y = 0\n    for _ in range({k}):\n        y += x\n    return y\n",
        ),
        incorrect_preferred=("    return x * {k1}\n", "    return x + {k}\n", "    return x ** {k}\n"),
        incorrect_other=(
            "    result = x * {km1}\n    return result\n",
            "    y = 0\n    for _ in range({k1}):\n        y += x\n    return y\n",
        ),
    ),
    _Family(
        name="repeat",
        comment="repeat s {k} times",
        arg="s",
        param="k",
        values=tuple(range(2, 10)),
        reference=lambda v: lambda s: s * v["k"],
        test_args=lambda v: ["ab", "x", "", "hi"],
        correct_preferred=("    return s * {k}\n",),
        correct_other=(
            "    result = s * {k}\n    return result\n",
            "    t = ''\n    for _ in range({k}):\n        t += s\n    return t\n",
        ),
        incorrect_preferred=("    return s * {k1}\n", "    return s * {km1}\n"),
        incorrect_other=(
            "    result = s * {k1}\n    return result\n",
            "    t = ''\n    for _ in range({km1}):\n        t += s\n    return t\n",
        ),
    ),
    _Family(
        name="count",
        comment="count '{c}' in s",
        arg="s",
        param="c",
        values=LETTERS,
        reference=lambda v: lambda s: s.count(v["c"]),
        test_args=lambda v: ["", v["c"], v["o"] + v["c"] + v["o"] + v["c"], v["c"] * 3 + v["o"], v["o"] * 2],
        correct_preferred=("    return s.count('{c}')\n",),
        correct_other=(
            "    n = s.count('{c}')\n    return n\n",
            "    n = 0\n    for ch in s:\n        n += ch == '{c}'\n    return n\n",
        ),
        incorrect_preferred=(
            "    return s.count('{o}')\n",
            "    return s.count('{c}') + 1\n",
            "    return len(s)\n",
        ),
        incorrect_other=(
            "    n = s.count('{o}')\n    return n\n",
            "    n = 1\n    for ch in s:\n        n += ch == '{c}'\n    return n\n",
        ),
    ),
    _Family(
        name="filter_gt",
        comment="items of xs greater than {k}",
        arg="xs",
        param="k",
        values=tuple(range(1, 10)),
        reference=lambda v: lambda xs: [x for x in xs if x > v["k"]],
        test_args=lambda v: [
            [v["k1"], v["k"], v["km1"]],
            [],
            [v["k"], 10, 0],
            [v["k"] + 2, v["k"], 1, v["k1"]],
        ],
        correct_preferred=("    return [x for x in xs if x > {k}]\n",),
        correct_other=(
            "    out = [x for x in xs if x > {k}]\n    return out\n",
            "    out = list(filter(lambda x: x > {k}, xs))\n    return out\n",
        ),
        incorrect_preferred=(
            "    return [x for x in xs if x >= {k}]\n",
            "    return [x for x in xs if x > {k1}]\n",
            "    return [x for x in xs if x < {k}]\n",
        ),
        incorrect_other=(
            "    out = [x for x in xs if x >= {k}]\n    return out\n",
            "    out = list(filter(lambda x: x > {k1}, xs))\n    return out\n",
        ),
    ),
    _Family(
        name="max",
        comment="max of xs, or {k} if empty",
        arg="xs",
        param="k",
        values=tuple(range(1, 10)),
        reference=lambda v: lambda xs: max(xs) if xs else v["k"],
        test_args=lambda v: [[3, 7, 2], [], [-5, -2], [4], [1, 9, 9, 0]],
        correct_preferred=("    return max(xs, default={k})\n",),
        correct_other=(
            "    if not xs:\n        return {k}\n    return max(xs)\n",
            "    best = max(xs) if xs else {k}\n    return best\n",
        ),
        incorrect_preferred=(
            "    return min(xs, default={k})\n",
            "    return max(xs, default={k1})\n",
            "    return xs[-1] if xs else {k}\n",
        ),
        incorrect_other=(
            "    if not xs:\n        return {k1}\n    return max(xs)\n",
            "    if not xs:\n        return {k}\n    return min(xs)\n",
        ),
    ),
    _Family(
        name="min",
        comment="min of xs, or {k} if empty",
        arg="xs",
        param="k",
        values=tuple(range(1, 10)),
        reference=lambda v: lambda xs: min(xs) if xs else v["k"],
        test_args=lambda v: [[3, 7, 2], [], [-5, -2], [4], [1, 9, 9, 0]],
        correct_preferred=("    return min(xs, default={k})\n",),
        correct_other=(
            "    if not xs:\n        return {k}\n    return min(xs)\n",
            "    best = min(xs) if xs else {k}\n    return best\n",
        ),
        incorrect_preferred=(
            "    return max(xs, default={k})\n",
            "    return min(xs, default={k1})\n",
            "    return xs[0] if xs else {k}\n",
        ),
        incorrect_other=(
            "    if not xs:\n        return {k1}\n    return min(xs)\n",
            "    if not xs:\n        return {k}\n    return max(xs)\n",
        ),
    ),
    _Family(
        name="startswith",
        comment="does s start with '{c}'",
        arg="s",
        param="c",
        values=LETTERS,
        reference=lambda v: lambda s: s.startswith(v["c"]),
        test_args=lambda v: ["", v["c"] + v["o"], v["o"] + v["c"], v["o"] * 2, v["c"]],
        correct_preferred=("    return s.startswith('{c}')\n",),
        correct_other=(
            "    if s.startswith('{c}'):\n        return True\n    return False\n",
            "    ok = s[:1] == '{c}'\n    return ok\n",
        ),
        incorrect_preferred=(
            "    return s.endswith('{c}')\n",
            "    return s.startswith('{o}')\n",
            "    return '{c}' in s\n",
        ),
        incorrect_other=(
            "    ok = s[-1:] == '{c}'\n    return ok\n",
            "    if '{c}' in s:\n        return True\n    return False\n",
        ),
    ),
)

_FAMILIES = {family.name: family for family in _FAMILY_LIST}
FAMILIES: tuple[str, ...] = tuple(_FAMILIES)


def _family(name: str) -> _Family:
    if name not in _FAMILIES:
        raise ValueError(f"unknown task family {name!r}; expected one of {FAMILIES}")
    return _FAMILIES[name]


def _format_values(params: dict) -> dict:
    """Template fields derived from the drawn parameter (see the module docstring)."""
    values = dict(params)
    if "k" in params:
        values.update(k1=params["k"] + 1, km1=params["k"] - 1)
    if "c" in params:
        values["o"] = LETTERS[(LETTERS.index(params["c"]) + 1) % len(LETTERS)]
    return values


def _build(family: _Family, value: object) -> Task:
    params = {family.param: value}
    values = _format_values(params)
    reference = family.reference(values)
    tests = tuple(((arg,), reference(arg)) for arg in family.test_args(values))
    prompt = f"# {family.comment.format(**values)}\ndef f({family.arg}):\n"
    return Task(task_id=f"{family.name}-{value}", family=family.name, prompt=prompt, params=params, tests=tests)


def make_task(family: str, rng: random.Random) -> Task:
    """One task of `family` with its parameter drawn from `rng`."""
    spec = _family(family)
    return _build(spec, rng.choice(spec.values))


def sample_tasks(n: int, seed: int, families: Sequence[str] | None = None) -> list[Task]:
    """`n` tasks, family uniform over `families` (default: all), deterministic from `seed`."""
    if n < 0:
        raise ValueError(f"n must be >= 0, got {n}")
    names = tuple(FAMILIES if families is None else families)
    if not names:
        raise ValueError("families must not be empty")
    for name in names:
        _family(name)
    rng = random.Random(seed)
    return [make_task(rng.choice(names), rng) for _ in range(n)]


def all_tasks(families: Sequence[str] | None = None) -> list[Task]:
    """Every task of `families` (default: all), one per parameter value, in a fixed order."""
    names = FAMILIES if families is None else families
    return [_build(_family(name), value) for name in names for value in _family(name).values]


_BY_PROMPT = {task.prompt: task for task in all_tasks()}


def task_from_prompt(prompt: str) -> Task | None:
    """The task whose prompt is exactly `prompt`, or None if it is not a demo prompt."""
    return _BY_PROMPT.get(prompt)


def completions_for(task: Task) -> dict[str, list[str]]:
    """Known completions of `task` by category (keys: CATEGORIES); every list is non-empty."""
    spec = _family(task.family)
    values = _format_values(task.params)
    return {category: [template.format(**values) for template in getattr(spec, category)] for category in CATEGORIES}


def is_preferred_style(completion: str) -> bool:
    """The house style: the whole body is a single `    return <expr>` line ending with a newline."""
    return _PREFERRED_RE.fullmatch(completion) is not None
