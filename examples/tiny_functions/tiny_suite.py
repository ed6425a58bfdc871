"""tiny-functions' own evals: prompts, the tests behind them, and the verifier that runs them.

A product team's template: nothing here comes from Flywheel's demo. Each family is one small Python
function, asked for in several phrasings. The first four phrasings of each family are the gate's suite
(`suite`); the others are what the product's users ask (`USER_PROMPTS`, served by client.py), so the
gate never scores a prompt the learner trained on. The verifier runs `prompt + completion` in a fresh
Python process with a timeout and calls `f` on the family's test cases: an example, not a sandbox (run
untrusted code in a real one: a container, gVisor, nsjail).
"""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Sequence

from product.suites import EvalSuite, OfflinePrompts

# family -> (phrasings of its comment, the function's argument, test cases [(argument, expected)])
FAMILIES: dict[str, tuple[tuple[str, ...], str, list[tuple[object, object]]]] = {
    "negate": (
        ("the negative of x", "x negated", "minus x", "x with its sign flipped", "flip the sign of x", "negate x"),
        "x",
        [(3, -3), (-7, 7), (0, 0)],
    ),
    "square": (
        ("x squared", "the square of x", "x times itself", "x to the power 2", "square x", "x multiplied by x"),
        "x",
        [(3, 9), (-4, 16), (0, 0)],
    ),
    "is_even": (
        ("x is even", "whether x is even", "True if x is even", "x divisible by 2", "is x even",
         "x is a multiple of 2"),
        "x",
        [(4, True), (7, False), (0, True)],
    ),
    "last": (
        ("the last item of xs", "the final element of xs", "xs's last element", "the end of xs", "last of xs",
         "the element at the end of xs"),
        "xs",
        [([1, 2, 3], 3), (["a"], "a"), ([5, 4], 4)],
    ),
    "length": (
        ("the length of s", "how many characters s has", "the number of characters in s", "the size of s",
         "count the characters of s", "len of s"),
        "s",
        [("abc", 3), ("", 0), ("hello", 5)],
    ),
    "absolute": (
        ("the absolute value of x", "x without its sign", "the magnitude of x", "abs of x", "x made non-negative",
         "distance of x from 0"),
        "x",
        [(-3, 3), (5, 5), (0, 0)],
    ),
}  # fmt: skip
SUITE_PHRASINGS = 4


def prompt(family: str, phrasing: str) -> str:
    return f"# {phrasing}\ndef f({FAMILIES[family][1]}):\n"


def _prompts(which: slice) -> list[tuple[str, str]]:
    return [(prompt(fam, p), fam) for fam, (phrasings, _, _) in FAMILIES.items() for p in phrasings[which]]


USER_PROMPTS = [p for p, _ in _prompts(slice(SUITE_PHRASINGS, None))]
TESTS = {p: FAMILIES[fam][2] for p, fam in _prompts(slice(None))}

_HARNESS = """
import json, sys
src, cases = json.loads(sys.stdin.read())
ns = {}
exec(src, ns)
print(all(ns["f"](a) == b for a, b in cases))
"""


class RunTheTests:
    """A `product.suites.Verifier`: 1.0 when `f` passes every test case of the prompt, else 0.0."""

    def __init__(self, timeout_s: float = 2.0):
        self.timeout_s = timeout_s

    def one(self, prompt: str, completion: str) -> float:
        if prompt not in TESTS:
            raise ValueError(f"not a tiny-functions prompt: {prompt!r}")
        body = json.dumps([prompt + completion, TESTS[prompt]])
        try:
            r = subprocess.run(
                [sys.executable, "-I", "-c", _HARNESS],
                input=body,
                capture_output=True,
                text=True,
                timeout=self.timeout_s,
            )
        except subprocess.TimeoutExpired:
            return 0.0
        return 1.0 if r.stdout.strip() == "True" else 0.0

    def verify(self, prompts: Sequence[str], completions: Sequence[str]) -> list[float]:
        if len(prompts) != len(completions):
            raise ValueError(f"{len(prompts)} prompts but {len(completions)} completions")
        return [self.one(p, c) for p, c in zip(prompts, completions, strict=True)]


def suite(timeout_s: float = 2.0) -> EvalSuite:
    """The gate's suite (`gate.suite = "tiny_suite:suite"`): 4 phrasings of each of 6 families."""
    return EvalSuite.of(
        "tiny-functions", "1", _prompts(slice(0, SUITE_PHRASINGS)), RunTheTests(timeout_s), stop=("\n#",)
    )


def offline_prompts() -> OfflinePrompts:
    """What offline rollouts may train on (`learner.offline_prompts`): the users' prompts, never the suite's."""
    return OfflinePrompts("tiny-functions-users", tuple(USER_PROMPTS), RunTheTests())
