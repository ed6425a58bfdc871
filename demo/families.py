"""The demo product's family table: parameter domains, twins, and the 18 families' templates.

Each family is a small table (`_Family`): its argument, its parameters (`Ints`, `Letters` or
`IntLists` domains, plus an optional constraint), four comment templates, a reference
implementation, test arguments that catch every known bug, and four sets of completion templates.
`demo.tasks` builds, parses and judges prompts from it; `demo.split` assigns its values to splits.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from itertools import product as cartesian
from string import ascii_lowercase


@dataclass(frozen=True)
class Ints:
    """Integers lo..hi, written in decimal."""

    lo: int
    hi: int

    def values(self) -> range:
        return range(self.lo, self.hi + 1)

    def contains(self, value: object) -> bool:
        return type(value) is int and self.lo <= value <= self.hi

    def render(self, value: int) -> str:
        return str(value)


@dataclass(frozen=True)
class Letters:
    """Strings of 1..max_len lowercase letters, written between single quotes by the templates."""

    max_len: int = 3

    def values(self) -> list[str]:
        return ["".join(t) for n in range(1, self.max_len + 1) for t in cartesian(ascii_lowercase, repeat=n)]

    def contains(self, value: object) -> bool:
        return isinstance(value, str) and 1 <= len(value) <= self.max_len and all(c in ascii_lowercase for c in value)

    def render(self, value: str) -> str:
        return value


@dataclass(frozen=True)
class IntLists:
    """Tuples of min_len..max_len distinct integers of `item`, written "3, 47, 12"."""

    item: Ints
    min_len: int = 2
    max_len: int = 4

    def contains(self, value: object) -> bool:
        return (
            isinstance(value, tuple)
            and self.min_len <= len(value) <= self.max_len
            and len(set(value)) == len(value)
            and all(self.item.contains(v) for v in value)
        )

    def render(self, value: tuple[int, ...]) -> str:
        return ", ".join(map(str, value))


Domain = Ints | Letters | IntLists


def twin(value: int | str) -> int | str:
    """The value with its last bit flipped (46 <-> 47) or its last letter flipped within its pair
    (a <-> b, c <-> d, ...): the wrong constant of an off-by-one bug."""
    if isinstance(value, int):
        return value ^ 1
    if not value:
        raise ValueError("twin of an empty string")
    last = ord(value[-1]) - ord("a")
    return value[:-1] + ascii_lowercase[last ^ 1]


@dataclass(frozen=True)
class _Family:
    name: str
    arg: str  # the function's single argument
    params: tuple[tuple[str, Domain], ...]
    phrasings: tuple[str, ...]  # comment templates, without "# "
    reference: Callable[[dict], Callable]  # format values -> reference function
    test_args: Callable[[dict], list]  # format values -> list of single arguments
    correct_preferred: tuple[str, ...]
    correct_other: tuple[str, ...]
    incorrect_preferred: tuple[str, ...]
    incorrect_other: tuple[str, ...]
    valid: Callable[[dict], bool] = lambda p: True  # a constraint between parameters


_K = Ints(1, 999)
_LETTERS = Letters(3)


def _xs_tests(v: dict) -> list:
    """Lists around the threshold k, for the filter families: each of their bugs fails one."""
    k = v["k"]
    return [[k + 1, k, k - 1], [], [k, 1000, 0], [k + 2, k, 1, k + 1, k - 3], [k - 1, k - 2, k - 5]]


_FAMILY_LIST = (
    _Family(
        name="add",
        arg="x",
        params=(("k", _K),),
        phrasings=("add {k} to x", "return x plus {k}", "x increased by {k}", "return x increased by {k}"),
        reference=lambda v: lambda x: x + v["k"],
        test_args=lambda v: [0, 1, 5, -3, 12],
        correct_preferred=("    return x + {k}\n", "    return {k} + x\n"),
        correct_other=("    result = x + {k}\n    return result\n", "    y = x\n    y += {k}\n    return y\n"),
        incorrect_preferred=("    return x + {K}\n", "    return x - {k}\n", "    return x * {k}\n"),
        incorrect_other=("    result = x + {K}\n    return result\n", "    y = x\n    y -= {k}\n    return y\n"),
    ),
    _Family(
        name="sub",
        arg="x",
        params=(("k", _K),),
        phrasings=("subtract {k} from x", "return x minus {k}", "x decreased by {k}", "return x decreased by {k}"),
        reference=lambda v: lambda x: x - v["k"],
        test_args=lambda v: [0, 1, 5, -3, 12],
        correct_preferred=("    return x - {k}\n",),
        correct_other=("    result = x - {k}\n    return result\n", "    y = x\n    y -= {k}\n    return y\n"),
        incorrect_preferred=("    return {k} - x\n", "    return x - {K}\n", "    return x + {k}\n"),
        incorrect_other=("    result = {k} - x\n    return result\n", "    y = x\n    y += {k}\n    return y\n"),
    ),
    _Family(
        name="mul",
        arg="x",
        params=(("k", Ints(2, 999)),),
        phrasings=(
            "multiply x by {k}",
            "return x times {k}",
            "the product of x and {k}",
            "return the product of x and {k}",
        ),
        reference=lambda v: lambda x: x * v["k"],
        test_args=lambda v: [0, 1, 3, -4, 7],
        correct_preferred=("    return x * {k}\n", "    return {k} * x\n"),
        correct_other=(
            "    result = x * {k}\n    return result\n",
            "    y = 0\n    for _ in range({k}):\n        y += x\n    return y\n",
        ),
        incorrect_preferred=("    return x * {K}\n", "    return x + {k}\n", "    return x // {k}\n"),
        incorrect_other=(
            "    result = x * {K}\n    return result\n",
            "    y = 0\n    for _ in range({K}):\n        y += x\n    return y\n",
        ),
    ),
    _Family(
        name="affine",
        arg="x",
        params=(("k", Ints(2, 99)), ("m", _K)),
        phrasings=(
            "multiply x by {k} then add {m}",
            "return x times {k} plus {m}",
            "x times {k}, then plus {m}",
            "multiply x by {k}, then plus {m}",
        ),
        reference=lambda v: lambda x: x * v["k"] + v["m"],
        test_args=lambda v: [0, 1, 2, -3, 10],
        correct_preferred=("    return x * {k} + {m}\n", "    return {m} + x * {k}\n"),
        correct_other=("    y = x * {k}\n    return y + {m}\n", "    y = x * {k}\n    y += {m}\n    return y\n"),
        incorrect_preferred=("    return (x + {m}) * {k}\n", "    return x * {k} - {m}\n", "    return x * {k}\n"),
        incorrect_other=("    y = x + {m}\n    return y * {k}\n", "    y = x * {K}\n    return y + {m}\n"),
    ),
    _Family(
        name="clamp",
        arg="x",
        params=(("lo", Ints(0, 999)), ("hi", Ints(0, 999))),
        valid=lambda p: p["lo"] < p["hi"],
        phrasings=(
            "clamp x between {lo} and {hi}",
            "limit x to the range {lo} to {hi}",
            "x, but at least {lo} and at most {hi}",
            "limit x to between {lo} and {hi}",
        ),
        reference=lambda v: lambda x: min(max(x, v["lo"]), v["hi"]),
        test_args=lambda v: [v["lo"] - 5, v["lo"], (v["lo"] + v["hi"]) // 2, v["hi"], v["hi"] + 5, -1000],
        correct_preferred=("    return min(max(x, {lo}), {hi})\n", "    return max({lo}, min(x, {hi}))\n"),
        correct_other=(
            "    if x < {lo}:\n        return {lo}\n    if x > {hi}:\n        return {hi}\n    return x\n",
            "    y = max(x, {lo})\n    return min(y, {hi})\n",
        ),
        incorrect_preferred=(
            "    return max(min(x, {lo}), {hi})\n",
            "    return min(max(x, {hi}), {lo})\n",
            "    return max(x, {lo})\n",
        ),
        incorrect_other=(
            "    if x < {lo}:\n        return {lo}\n    return x\n",
            "    y = min(x, {lo})\n    return max(y, {hi})\n",
        ),
    ),
    _Family(
        name="repeat",
        arg="s",
        params=(("k", Ints(2, 999)),),
        phrasings=(
            "repeat s {k} times",
            "return s repeated {k} times",
            "s, {k} times over",
            "return s, {k} times over",
        ),
        reference=lambda v: lambda s: s * v["k"],
        test_args=lambda v: ["ab", "x", "", "hi"],
        correct_preferred=("    return s * {k}\n",),
        correct_other=(
            "    result = s * {k}\n    return result\n",
            "    t = ''\n    for _ in range({k}):\n        t += s\n    return t\n",
        ),
        incorrect_preferred=("    return s * {K}\n", "    return s\n", "    return s * {k} + s\n"),
        incorrect_other=(
            "    result = s * {K}\n    return result\n",
            "    t = s\n    for _ in range({k}):\n        t += s\n    return t\n",
        ),
    ),
    _Family(
        name="count",
        arg="s",
        params=(("c", _LETTERS),),
        phrasings=(
            "count '{c}' in s",
            "how many times '{c}' occurs in s",
            "number of '{c}' in s",
            "how many times is '{c}' in s",
        ),
        reference=lambda v: lambda s: s.count(v["c"]),
        test_args=lambda v: ["", v["c"], v["c"] + "-" + v["c"], v["C"], "-" + v["c"] + "-" + v["C"] + "-" + v["c"]],
        correct_preferred=("    return s.count('{c}')\n",),
        correct_other=(
            "    n = s.count('{c}')\n    return n\n",
            "    parts = s.split('{c}')\n    return len(parts) - 1\n",
        ),
        incorrect_preferred=("    return s.count('{C}')\n", "    return s.count('{c}') + 1\n", "    return len(s)\n"),
        incorrect_other=(
            "    n = s.count('{C}')\n    return n\n",
            "    parts = s.split('{c}')\n    return len(parts)\n",
        ),
    ),
    _Family(
        name="startswith",
        arg="s",
        params=(("c", _LETTERS),),
        phrasings=(
            "does s start with '{c}'",
            "check if s starts with '{c}'",
            "is '{c}' a prefix of s",
            "check if '{c}' is a prefix of s",
        ),
        reference=lambda v: lambda s: s.startswith(v["c"]),
        test_args=lambda v: ["", v["c"], v["c"] + "-", "-" + v["c"], "--", v["C"] + "-"],
        correct_preferred=("    return s.startswith('{c}')\n",),
        correct_other=(
            "    if s.startswith('{c}'):\n        return True\n    return False\n",
            "    ok = s.startswith('{c}')\n    return ok\n",
        ),
        incorrect_preferred=(
            "    return s.endswith('{c}')\n",
            "    return s.startswith('{C}')\n",
            "    return '{c}' in s\n",
        ),
        incorrect_other=(
            "    ok = s.endswith('{c}')\n    return ok\n",
            "    if '{c}' in s:\n        return True\n    return False\n",
        ),
    ),
    _Family(
        name="endswith",
        arg="s",
        params=(("c", _LETTERS),),
        phrasings=(
            "does s end with '{c}'",
            "check if s ends with '{c}'",
            "is '{c}' a suffix of s",
            "check if '{c}' is a suffix of s",
        ),
        reference=lambda v: lambda s: s.endswith(v["c"]),
        test_args=lambda v: ["", v["c"], v["c"] + "-", "-" + v["c"], "--", "-" + v["C"]],
        correct_preferred=("    return s.endswith('{c}')\n",),
        correct_other=(
            "    if s.endswith('{c}'):\n        return True\n    return False\n",
            "    ok = s.endswith('{c}')\n    return ok\n",
        ),
        incorrect_preferred=(
            "    return s.startswith('{c}')\n",
            "    return s.endswith('{C}')\n",
            "    return '{c}' in s\n",
        ),
        incorrect_other=(
            "    ok = s.startswith('{c}')\n    return ok\n",
            "    if '{c}' in s:\n        return True\n    return False\n",
        ),
    ),
    _Family(
        name="replace",
        arg="s",
        params=(("c", Letters(2)), ("d", Letters(2))),  # two strings to copy: 1-2 letters each
        valid=lambda p: p["c"] != p["d"],
        phrasings=(
            "replace '{c}' with '{d}' in s",
            "s with every '{c}' changed to '{d}'",
            "in s, change '{c}' to '{d}'",
            "replace every '{c}' in s with '{d}'",
        ),
        reference=lambda v: lambda s: s.replace(v["c"], v["d"]),
        test_args=lambda v: ["", v["c"], v["c"] + "-" + v["c"], v["d"] + "-" + v["c"], "--"],
        correct_preferred=("    return s.replace('{c}', '{d}')\n",),
        correct_other=(
            "    t = s.replace('{c}', '{d}')\n    return t\n",
            "    parts = s.split('{c}')\n    return '{d}'.join(parts)\n",
        ),
        incorrect_preferred=(
            "    return s.replace('{d}', '{c}')\n",
            "    return s.replace('{c}', '{d}', 1)\n",
            "    return s.replace('{c}', '')\n",
        ),
        incorrect_other=(
            "    t = s.replace('{d}', '{c}')\n    return t\n",
            "    t = s.replace('{c}', '{d}', 1)\n    return t\n",
        ),
    ),
    _Family(
        name="prepend",
        arg="s",
        params=(("c", _LETTERS),),
        phrasings=(
            "put '{c}' before s",
            "return '{c}' followed by s",
            "s with '{c}' added in front",
            "put '{c}' in front of s",
        ),
        reference=lambda v: lambda s: v["c"] + s,
        test_args=lambda v: ["", "-", "x-y"],
        correct_preferred=("    return '{c}' + s\n",),
        correct_other=("    t = '{c}' + s\n    return t\n", "    t = '{c}'\n    t += s\n    return t\n"),
        incorrect_preferred=("    return s + '{c}'\n", "    return '{C}' + s\n", "    return '{c}' + s + '{c}'\n"),
        incorrect_other=("    t = s + '{c}'\n    return t\n", "    t = '{C}'\n    t += s\n    return t\n"),
    ),
    _Family(
        name="filter_gt",
        arg="xs",
        params=(("k", Ints(0, 999)),),
        phrasings=(
            "items of xs greater than {k}",
            "keep the items of xs above {k}",
            "the list of x in xs with x > {k}",
            "keep items of xs greater than {k}",
        ),
        reference=lambda v: lambda xs: [x for x in xs if x > v["k"]],
        test_args=_xs_tests,
        correct_preferred=("    return [x for x in xs if x > {k}]\n",),
        correct_other=(
            "    out = [x for x in xs if x > {k}]\n    return out\n",
            "    out = list(filter(lambda x: x > {k}, xs))\n    return out\n",
        ),
        incorrect_preferred=(
            "    return [x for x in xs if x >= {k}]\n",
            "    return [x for x in xs if x > {K}]\n",
            "    return [x for x in xs if x < {k}]\n",
        ),
        incorrect_other=(
            "    out = [x for x in xs if x >= {k}]\n    return out\n",
            "    out = list(filter(lambda x: x > {K}, xs))\n    return out\n",
        ),
    ),
    _Family(
        name="sum_gt",
        arg="xs",
        params=(("k", _K),),
        phrasings=(
            "sum of the items of xs greater than {k}",
            "add up the items of xs above {k}",
            "total of x in xs with x > {k}",
            "add up the items of xs greater than {k}",
        ),
        reference=lambda v: lambda xs: sum(x for x in xs if x > v["k"]),
        test_args=_xs_tests,
        correct_preferred=(
            "    return sum(x for x in xs if x > {k})\n",
            "    return sum([x for x in xs if x > {k}])\n",
        ),
        correct_other=(
            "    total = 0\n    for x in xs:\n        if x > {k}:\n            total += x\n    return total\n",
            "    big = [x for x in xs if x > {k}]\n    return sum(big)\n",
        ),
        incorrect_preferred=(
            "    return sum(x for x in xs if x >= {k})\n",
            "    return sum(xs)\n",
            "    return [x for x in xs if x > {k}]\n",
        ),
        incorrect_other=(
            "    total = 0\n    for x in xs:\n        if x > {K}:\n            total += x\n    return total\n",
            "    big = [x for x in xs if x < {k}]\n    return sum(big)\n",
        ),
    ),
    _Family(
        name="count_lt",
        arg="xs",
        params=(("k", _K),),
        phrasings=(
            "how many items of xs are less than {k}",
            "count the items of xs below {k}",
            "number of x in xs with x < {k}",
            "how many items of xs are below {k}",
        ),
        reference=lambda v: lambda xs: sum(1 for x in xs if x < v["k"]),
        test_args=_xs_tests,
        correct_preferred=(
            "    return sum(1 for x in xs if x < {k})\n",
            "    return len([x for x in xs if x < {k}])\n",
        ),
        correct_other=(
            "    n = 0\n    for x in xs:\n        if x < {k}:\n            n += 1\n    return n\n",
            "    small = [x for x in xs if x < {k}]\n    return len(small)\n",
        ),
        incorrect_preferred=(
            "    return sum(1 for x in xs if x <= {k})\n",
            "    return len([x for x in xs if x > {k}])\n",
            "    return len(xs)\n",
        ),
        incorrect_other=(
            "    n = 0\n    for x in xs:\n        if x < {K}:\n            n += 1\n    return n\n",
            "    small = [x for x in xs if x <= {k}]\n    return len(small)\n",
        ),
    ),
    _Family(
        name="map_add",
        arg="xs",
        params=(("k", _K),),
        phrasings=(
            "add {k} to each item of xs",
            "xs with {k} added to every item",
            "each x in xs plus {k}",
            "add {k} to every item of xs",
        ),
        reference=lambda v: lambda xs: [x + v["k"] for x in xs],
        test_args=lambda v: [[1, 2, 3], [], [0], [-5, 10]],
        correct_preferred=("    return [x + {k} for x in xs]\n",),
        correct_other=(
            "    out = [x + {k} for x in xs]\n    return out\n",
            "    out = []\n    for x in xs:\n        out.append(x + {k})\n    return out\n",
        ),
        incorrect_preferred=(
            "    return [x + {K} for x in xs]\n",
            "    return [x * {k} for x in xs]\n",
            "    return xs + [{k}]\n",
        ),
        incorrect_other=(
            "    out = [x - {k} for x in xs]\n    return out\n",
            "    out = []\n    for x in xs:\n        out.append(x + {K})\n    return out\n",
        ),
    ),
    _Family(
        name="max_default",
        arg="xs",
        params=(("k", Ints(0, 999)),),
        phrasings=(
            "max of xs, or {k} if empty",
            "largest item of xs, {k} when xs is empty",
            "the maximum of xs (default {k})",
            "largest item of xs, or {k} if empty",
        ),
        reference=lambda v: lambda xs: max(xs) if xs else v["k"],
        test_args=lambda v: [[3, 7, 2], [], [-5, -2], [4], [1, 9, 9, 0]],
        correct_preferred=("    return max(xs, default={k})\n", "    return max(xs) if xs else {k}\n"),
        correct_other=(
            "    if not xs:\n        return {k}\n    return max(xs)\n",
            "    best = max(xs) if xs else {k}\n    return best\n",
        ),
        incorrect_preferred=(
            "    return min(xs, default={k})\n",
            "    return max(xs, default={K})\n",
            "    return xs[-1] if xs else {k}\n",
        ),
        incorrect_other=(
            "    if not xs:\n        return {K}\n    return max(xs)\n",
            "    if not xs:\n        return {k}\n    return min(xs)\n",
        ),
    ),
    _Family(
        name="member",
        arg="x",
        params=(("l", IntLists(Ints(0, 999), 2, 4)),),
        phrasings=("is x one of {l}", "check if x is in [{l}]", "x in the list [{l}]", "check if x is one of {l}"),
        reference=lambda v: lambda x: x in v["l"],
        test_args=lambda v: [*v["l"], v["L"][-1], -1, 1000],
        correct_preferred=("    return x in [{l}]\n", "    return x in ({l})\n"),
        correct_other=(
            "    ok = x in [{l}]\n    return ok\n",
            "    for y in [{l}]:\n        if x == y:\n            return True\n    return False\n",
        ),
        incorrect_preferred=("    return x not in [{l}]\n", "    return x in [{L}]\n", "    return x == {l0}\n"),
        incorrect_other=(
            "    ok = x not in [{l}]\n    return ok\n",
            "    for y in [{L}]:\n        if x == y:\n            return True\n    return False\n",
        ),
    ),
    _Family(
        name="join_map",
        arg="xs",
        params=(("c", _LETTERS),),
        phrasings=(
            "join the items of xs with '{c}'",
            "the items of xs as text, separated by '{c}'",
            "xs joined by '{c}'",
            "the items of xs joined by '{c}'",
        ),
        reference=lambda v: lambda xs: v["c"].join(str(x) for x in xs),
        test_args=lambda v: [[1, 2, 3], [], [45], [7, 0]],
        correct_preferred=("    return '{c}'.join(str(x) for x in xs)\n", "    return '{c}'.join(map(str, xs))\n"),
        correct_other=(
            "    parts = [str(x) for x in xs]\n    return '{c}'.join(parts)\n",
            "    parts = map(str, xs)\n    return '{c}'.join(parts)\n",
        ),
        incorrect_preferred=(
            "    return '{C}'.join(str(x) for x in xs)\n",
            "    return ''.join(str(x) for x in xs)\n",
            "    return '{c}'.join(xs)\n",
        ),
        incorrect_other=(
            "    parts = [str(x) for x in xs]\n    return '{C}'.join(parts)\n",
            "    parts = [str(x) for x in xs]\n    return ' '.join(parts)\n",
        ),
    ),
)
