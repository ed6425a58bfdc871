"""The fixed three-way split of the demo product's prompts: train, gate and report.

- **train**: what users send (the demo's traffic) and what the base model is pre-trained on.
- **gate**: the offline suite the gate evaluates candidates on.
- **report**: held out from everything; used only for the numbers we publish, never for a
  decision or a hyperparameter.

The rule, on two axes, is a pure function of the prompt; nothing is stored or random:

1. **Phrasings.** Every family has four comment templates (`demo.tasks`): 0, 1 and 2 are
   train's; 3 is held out, and gate and report share it. Shared, because gate and report should
   measure the same thing: with its own phrasing each, a family whose gate phrasing happens to be
   easy and whose report phrasing happens to be hard would make the gate's verdicts a biased guess
   of the published numbers. Report stays unseen anyway: its *values* are its own.
2. **Values.** Every integer and every letter string has one split. Integers below 10 and single
   letters are always train: they are the atoms (digits and letters are single tokens, see
   `serving.tokenizer.train_tokenizer(spell_quoted_strings=True)`) that every larger value is
   written with, and the templates' own constants. A larger value goes by a hash of its twin
   class `min(v, twin(v))` (46 and 47 together; 'aa' and 'ab' together), so that the off-by-one
   bugs of the corpus (`demo.tasks.twin`) stay in the value's split:
   `sha256("int:46") % 10` (or `"str:aa"`): 0 -> gate, 1 -> report, 2..9 -> train. About 10% of
   the multi-digit integers go to each held-out split, and of the 2-3 letter strings, except that
   strings spelling a word of the templates ('in', 'of', 'sum', ...) are train. A list is in the
   split of its items (items of mixed splits: no split).

A train prompt has a train phrasing and only train values; a gate (report) prompt has the held-out
phrasing and only gate (report) values. Any other combination (say, a train phrasing with gate
values) belongs to no split: it is never served, trained on, gated or reported, and only the
calibration's diagnostics (`bench/demo_calibration.py`) use such prompts, built from gate values.

`find_leaks` checks texts (the pre-training corpus, a stream of traffic, the prompts a demo run
logged) for anything of gate or report: a prompt, a held-out value as it is written (a whole digit
run, a whole letter run; digits and quoted letters are single tokens, so this is also the token
sequence), or a comment in the held-out phrasing.

Called by the pre-training corpus (`demo.corpus.make_corpus`), the demo's traffic (`sample_tasks(split="train")`),
the gate's suite and the published evaluation (`split_tasks("gate" | "report", n)`).
"""

from __future__ import annotations

import functools
import hashlib
import math
import random
import re
from collections.abc import Iterable, Sequence

from demo.tasks import (
    FAMILIES,
    Domain,
    IntLists,
    Ints,
    Letters,
    Task,
    comment_regex,
    domains,
    make_task,
    task_from_prompt,
    template_words,
    twin,
)

SPLITS = ("train", "gate", "report")
TRAIN_PHRASINGS = (0, 1, 2)
HELD_OUT_PHRASING = 3
_BUCKETS = {0: "gate", 1: "report"}  # of sha256 % 10; every other bucket is train
_RESERVED = frozenset(min(w, str(twin(w))) for w in template_words() if 2 <= len(w) <= 3)


def _check_split(split: str) -> None:
    if split not in SPLITS:
        raise ValueError(f"unknown split {split!r}; expected one of {SPLITS}")


@functools.lru_cache(maxsize=1 << 16)
def value_split(value: int | str) -> str:
    """The split of one integer or letter string (module docstring, rule 2)."""
    if isinstance(value, int):
        if value < 0:
            raise ValueError(f"values are non-negative integers, got {value}")
        if value < 10:
            return "train"
        key = f"int:{min(value, value ^ 1)}"
    elif isinstance(value, str) and value.isascii() and value.isalpha() and value.islower():
        cls = min(value, str(twin(value)))
        if len(value) == 1 or cls in _RESERVED:
            return "train"
        key = f"str:{cls}"
    else:
        raise ValueError(f"a value is an integer or a lowercase letter string, got {value!r}")
    bucket = int.from_bytes(hashlib.sha256(key.encode()).digest()[:8], "big") % 10
    return _BUCKETS.get(bucket, "train")


def _values_split(values: Iterable[object]) -> str | None:
    splits = set()
    for value in values:
        for atom in value if isinstance(value, tuple) else (value,):
            splits.add(value_split(atom))
    return splits.pop() if len(splits) == 1 else None


def split_of(task: Task) -> str | None:
    """ "train", "gate", "report", or None for a product prompt outside the split (module docstring)."""
    values = _values_split(v for name, v in task.params.items() if name != "phrasing")
    phrasing = task.params["phrasing"]
    if phrasing in TRAIN_PHRASINGS:
        return "train" if values == "train" else None
    return values if values in ("gate", "report") else None


def phrasings_of(split: str) -> tuple[int, ...]:
    _check_split(split)
    return TRAIN_PHRASINGS if split == "train" else (HELD_OUT_PHRASING,)


@functools.cache
def _pools(domain: Ints | Letters, split: str) -> tuple[tuple, ...]:
    """The split's values of `domain`, grouped by size (digits, letters); empty groups left out."""
    groups: dict[int, list] = {}
    for value in domain.values():
        if value_split(value) == split:
            groups.setdefault(len(str(value)), []).append(value)
    return tuple(tuple(group) for _, group in sorted(groups.items()))


def draw_value(domain: Domain, split: str, rng: random.Random) -> object:
    """One value of `domain` in `split`: its size (number of digits, of letters, of list items)
    uniform, then the value uniform among those of that size, so short values are common too."""
    _check_split(split)
    if isinstance(domain, IntLists):
        n = rng.randint(domain.min_len, domain.max_len)
        items: list[object] = []
        while len(items) < n:
            item = draw_value(domain.item, split, rng)
            if item not in items:
                items.append(item)
        return tuple(items)
    groups = _pools(domain, split)
    if not groups:
        raise ValueError(f"{domain} has no values in split {split!r}")
    return rng.choice(rng.choice(groups))


def _check_families(families: Sequence[str] | None) -> tuple[str, ...]:
    names = tuple(FAMILIES if families is None else families)
    if not names:
        raise ValueError("families must not be empty")
    for name in names:
        domains(name)  # raises for an unknown family
    return names


def sample_tasks(n: int, seed: int, split: str = "train", families: Sequence[str] | None = None) -> list[Task]:
    """`n` tasks of `split` (repeats possible), family and phrasing uniform, deterministic from `seed`.
    With split="train" this is the demo's user traffic."""
    if n < 0:
        raise ValueError(f"n must be >= 0, got {n}")
    _check_split(split)
    names = _check_families(families)
    rng = random.Random(seed)
    allowed = phrasings_of(split)
    return [
        make_task(rng.choice(names), rng, rng.choice(allowed), lambda d, r: draw_value(d, split, r)) for _ in range(n)
    ]


def split_tasks(split: str, n: int, families: Sequence[str] | None = None) -> list[Task]:
    """The split's fixed set of `n` distinct tasks, families in turn (a family that has no new
    prompt left is skipped): the gate's suite and the report's prompts. Deterministic: the same
    `n` always gives the same tasks, and a larger `n` extends a smaller one's list."""
    if n < 0:
        raise ValueError(f"n must be >= 0, got {n}")
    _check_split(split)
    names = list(_check_families(families))
    rngs = {name: random.Random(f"{split}:{name}") for name in names}
    allowed = phrasings_of(split)
    seen: set[str] = set()
    out: list[Task] = []
    while len(out) < n and names:
        for name in list(names):
            for _ in range(200):
                task = make_task(name, rngs[name], rngs[name].choice(allowed), lambda d, r: draw_value(d, split, r))
                if task.prompt not in seen:
                    seen.add(task.prompt)
                    out.append(task)
                    break
            else:
                names.remove(name)  # exhausted (or nearly): no new prompt in 200 draws
            if len(out) == n:
                break
    if len(out) < n:
        raise ValueError(f"split {split!r} has fewer than {n} distinct prompts for {families}")
    return out


def _draw_in(split: str, domain: Domain, rng: random.Random) -> object:
    return draw_value(domain, split, rng)


def unsplit_tasks(n: int) -> list[Task]:
    """A fixed set of `n` distinct prompts of no split (`split_of` is None), families in turn, in two
    kinds alternating: a train phrasing with report values (values nobody saw) and the held-out
    phrasing with train values (a phrasing no user sent). Never served, trained on or gated: the
    report's check that a gain is not tied to the split's own combinations. Deterministic, and a
    larger `n` extends a smaller one's list."""
    if n < 0:
        raise ValueError(f"n must be >= 0, got {n}")
    kinds = ((TRAIN_PHRASINGS, "report"), ((HELD_OUT_PHRASING,), "train"))
    rng = random.Random("unsplit")
    seen: set[str] = set()
    out: list[Task] = []
    draws = 0
    while len(out) < n:
        draws += 1
        if draws > 200 * (n + 1):
            raise ValueError(f"could not draw {n} distinct prompts of no split")
        phrasings, values = kinds[len(out) % 2]
        family = FAMILIES[(len(out) // 2) % len(FAMILIES)]
        task = make_task(family, rng, rng.choice(phrasings), functools.partial(_draw_in, values))
        if task.prompt not in seen and split_of(task) is None:
            seen.add(task.prompt)
            out.append(task)
    return out


def _n_values(domain: Domain, split: str) -> int:
    if isinstance(domain, IntLists):
        m = _n_values(domain.item, split)
        return sum(math.perm(m, k) for k in range(domain.min_len, domain.max_len + 1))
    return sum(len(group) for group in _pools(domain, split))


def n_prompts(split: str) -> dict[str, int]:
    """Distinct prompts of `split`, per family (constraints counted exactly: lo < hi, c != d)."""
    _check_split(split)
    counts = {}
    for family in FAMILIES:
        sizes = [_n_values(domain, split) for domain in domains(family).values()]
        combos = math.prod(sizes)
        if family == "clamp":
            combos = math.comb(sizes[0], 2)  # lo < hi, both from the same range
        elif family == "replace":
            combos = sizes[0] * (sizes[0] - 1)  # c != d
        counts[family] = combos * len(phrasings_of(split))
    return counts


_NUMBER_RE = re.compile(r"\d+")
_WORD_RE = re.compile(r"[a-z]+")
_PROMPT_RE = re.compile(r"# [^\n]*\ndef f\([a-z]+\):\n")
_HELD_OUT_RES = [(family, comment_regex(family, HELD_OUT_PHRASING)) for family in FAMILIES]


def find_leaks(texts: Iterable[str]) -> list[str]:
    """Everything of gate or report found in `texts` (module docstring), one line per finding,
    naming the text's index; [] when clean. Texts: corpus examples, traffic or logged prompts."""
    leaks = []
    for i, text in enumerate(texts):
        for match in _NUMBER_RE.finditer(text):
            split = value_split(int(match[0]))
            if split != "train":
                leaks.append(f"text {i}: {split} value {match[0]} at {match.start()}")
        for match in _WORD_RE.finditer(text):
            if len(match[0]) <= 3 and (split := value_split(match[0])) != "train":
                leaks.append(f"text {i}: {split} value {match[0]!r} at {match.start()}")
        for line in text.splitlines():
            if line.startswith("# "):
                family = next((f for f, regex in _HELD_OUT_RES if regex.fullmatch(line[2:])), None)
                if family is not None:
                    leaks.append(f"text {i}: held-out phrasing of {family!r}: {line!r}")
        for match in _PROMPT_RE.finditer(text):
            task = task_from_prompt(match[0])
            if task is not None and (split_ := split_of(task)) in ("gate", "report"):
                leaks.append(f"text {i}: {split_} prompt {task.task_id}")
    return leaks
