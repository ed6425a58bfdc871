"""The demo product's tasks: 18 families, 4 phrasings each, parameters from wide ranges.

A task is a one-line comment plus a function header, and the model writes the body:

    prompt     = "# add 47 to x\\ndef f(x):\\n"
    completion = "    return x + 47\\n"

Parameters are multi-digit integers (0-999), short strings of 1-3 lowercase letters (1-2 where a
family copies two) and lists of integers; some families take two steps (filter then sum, multiply
then add, clamp, map then join); every family's comment has four phrasings. Which prompts are
shown to users, pre-trained on, gated on or reported on is not decided here but in `demo.split`;
this module only says what a prompt of the product is, how to build and parse one, and which
completions of it are known to be right or wrong, in which style.

Each family is a small table: its argument, its parameters (`Ints`, `Letters` or `IntLists`
domains, plus an optional constraint such as lo < hi), four comment templates, a pure-python
reference implementation (the source of the expected test results), test arguments that catch
every known bug, and four sets of completion templates (correct/incorrect x house style/other).

Template fields: a parameter by name ({k}, {lo}, {c}, {l}, ...), its *twin* in upper case ({K},
{C}, {L}: the value with its last bit, or last letter, flipped: 46 <-> 47, 'ab' <-> 'aa'; for a
list, the list with its last item twinned) and {l0}, a list's first item. Twins are the constants
of the off-by-one bugs; `demo.split` keeps a value and its twin in the same split, so a bug written
into the pre-training corpus never spells a held-out value. Numbers typed in the templates are
single digits (always in the train split).

The house style: the whole body is a single `    return <expr>` line.
"""

from __future__ import annotations

import random
import re
from collections.abc import Callable
from dataclasses import dataclass
from string import Formatter

from demo.families import _FAMILY_LIST, Domain, IntLists, Ints, Letters, _Family, twin

CATEGORIES = ("correct_preferred", "correct_other", "incorrect_preferred", "incorrect_other")
N_PHRASINGS = 4
_PREFERRED_RE = re.compile(r"    return [^\n]+\n")


@dataclass(frozen=True)
class Task:
    """One completion problem. Frozen but not hashable (params is a dict); use task_id as a key."""

    task_id: str
    """Stable id, deterministic from family, phrasing and params, e.g. "add-p0-47"."""
    family: str
    prompt: str
    """Comment line plus function header, ending with "\\n"; the model writes the body."""
    params: dict
    """The drawn parameters and the phrasing number, e.g. {"k": 47, "phrasing": 0}."""
    tests: tuple
    """(args_tuple, expected_result) pairs, computed by the family's reference implementation."""


_FIELD_RE = {Ints: r"\d+", Letters: r"[a-z]+", IntLists: r"\d+(?:, \d+)*"}


_FAMILIES = {family.name: family for family in _FAMILY_LIST}
FAMILIES: tuple[str, ...] = tuple(_FAMILIES)


def _family(name: str) -> _Family:
    if name not in _FAMILIES:
        raise ValueError(f"unknown task family {name!r}; expected one of {FAMILIES}")
    return _FAMILIES[name]


def domains(family: str) -> dict[str, Domain]:
    """The parameters of `family` and their domains, in template order."""
    return dict(_family(family).params)


def phrasings(family: str) -> tuple[str, ...]:
    """The comment templates of `family` (without "# "); `demo.split` says which split uses which."""
    return _family(family).phrasings


def is_valid(family: str, params: dict) -> bool:
    """`params` (without "phrasing") are in their domains and meet the family's constraint."""
    spec = _family(family)
    names = [name for name, _ in spec.params]
    if sorted(params) != sorted(names):
        return False
    return all(domain.contains(params[name]) for name, domain in spec.params) and spec.valid(params)


def _format_values(spec: _Family, params: dict) -> dict:
    """Template fields of the drawn parameters (see the module docstring)."""
    values: dict = {}
    for name, domain in spec.params:
        value = params[name]
        if isinstance(domain, IntLists):
            values.update(
                {
                    name: domain.render(value),
                    f"{name}0": value[0],
                    name.upper(): domain.render(value[:-1] + (twin(value[-1]),)),
                }
            )
        else:
            values.update({name: value, name.upper(): twin(value)})
    return values


def _reference_values(spec: _Family, params: dict) -> dict:
    """What the reference and test lambdas see: raw values (lists as tuples) and twins."""
    values = dict(params)
    for name, domain in spec.params:
        value = params[name]
        values[name.upper()] = value[:-1] + (twin(value[-1]),) if isinstance(domain, IntLists) else twin(value)
    return values


def task_id(family: str, phrasing: int, params: dict) -> str:
    """Stable id, e.g. "add-p0-47", "clamp-p3-12-400", "member-p1-3.47.12"."""
    spec = _family(family)
    parts = []
    for name, _ in spec.params:
        value = params[name]
        parts.append(".".join(map(str, value)) if isinstance(value, tuple) else str(value))
    return f"{family}-p{phrasing}-" + "-".join(parts)


def build_task(family: str, phrasing: int, params: dict) -> Task:
    """The task of `family` with comment template number `phrasing` and parameters `params`."""
    spec = _family(family)
    if not (isinstance(phrasing, int) and 0 <= phrasing < len(spec.phrasings)):
        raise ValueError(f"phrasing must be 0..{len(spec.phrasings) - 1} for {family!r}, got {phrasing!r}")
    if not is_valid(family, params):
        raise ValueError(f"invalid parameters {params!r} for family {family!r} ({dict(spec.params)})")
    reference_values = _reference_values(spec, params)
    reference = spec.reference(reference_values)
    tests = tuple(((arg,), reference(arg)) for arg in spec.test_args(reference_values))
    comment = spec.phrasings[phrasing].format(**_format_values(spec, params))
    return Task(
        task_id=task_id(family, phrasing, params),
        family=family,
        prompt=f"# {comment}\ndef f({spec.arg}):\n",
        params={**params, "phrasing": phrasing},
        tests=tests,
    )


def make_task(family: str, rng: random.Random, phrasing: int, draw: Callable[[Domain, random.Random], object]) -> Task:
    """A task of `family` with `phrasing`, each parameter drawn by `draw(domain, rng)` until the
    family's constraint holds (`demo.split.draw_value` draws from one split's values)."""
    spec = _family(family)
    for _ in range(1000):
        params = {name: draw(domain, rng) for name, domain in spec.params}
        if spec.valid(params):
            return build_task(family, phrasing, params)
    raise ValueError(f"could not draw valid parameters for {family!r} in 1000 tries")


def completions_for(task: Task) -> dict[str, list[str]]:
    """Known completions of `task` by category (keys: CATEGORIES); every list is non-empty."""
    spec = _family(task.family)
    params = {name: task.params[name] for name, _ in spec.params}
    values = _format_values(spec, params)
    return {category: [template.format(**values) for template in getattr(spec, category)] for category in CATEGORIES}


def is_preferred_style(completion: str) -> bool:
    """The house style: the whole body is a single `    return <expr>` line ending with a newline."""
    return _PREFERRED_RE.fullmatch(completion) is not None


def _comment_regex(spec: _Family, template: str) -> str:
    pattern, domains_of = "", dict(spec.params)
    seen: set[str] = set()
    for literal, field, _, _ in Formatter().parse(template):
        pattern += re.escape(literal)
        if field is None:
            continue
        if field in seen:
            pattern += f"(?P={field})"
        else:
            seen.add(field)
            pattern += f"(?P<{field}>{_FIELD_RE[type(domains_of[field])]})"
    return pattern


def comment_regex(family: str, phrasing: int) -> re.Pattern[str]:
    """Matches exactly the comment text (without "# ") of `family`'s phrasing, any parameters."""
    spec = _family(family)
    return re.compile(_comment_regex(spec, spec.phrasings[phrasing]))


_PROMPT_RES = [
    (spec.name, i, re.compile(f"# {_comment_regex(spec, template)}\ndef f\\({spec.arg}\\):\n"))
    for spec in _FAMILY_LIST
    for i, template in enumerate(spec.phrasings)
]


def _parse(domain: Domain, text: str) -> object:
    if isinstance(domain, Letters):
        return text
    if isinstance(domain, IntLists):
        return tuple(int(part) for part in text.split(", "))
    return int(text)


def task_from_prompt(prompt: str) -> Task | None:
    """The task whose prompt is exactly `prompt` (any split), or None if it is not a product prompt."""
    for family, phrasing, regex in _PROMPT_RES:
        match = regex.fullmatch(prompt)
        if match is None:
            continue
        spec = _FAMILIES[family]
        params = {name: _parse(domain, match[name]) for name, domain in spec.params}
        if is_valid(family, params):
            task = build_task(family, phrasing, params)
            if task.prompt == prompt:  # e.g. "047" parses as 47 but is not how 47 is written
                return task
    return None


def template_words() -> frozenset[str]:
    """Every lowercase word typed in a comment or completion template (fields excluded)."""
    words: set[str] = set()
    for spec in _FAMILY_LIST:
        templates = spec.phrasings + spec.correct_preferred + spec.correct_other
        for template in templates + spec.incorrect_preferred + spec.incorrect_other + (f"def f({spec.arg}):",):
            for literal, _, _, _ in Formatter().parse(template):
                words.update(re.findall(r"[a-z]+", literal))
    return frozenset(words)
