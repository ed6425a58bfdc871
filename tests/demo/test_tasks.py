"""The richer demo product: known completions really pass/fail, prompt parsing, twins, size, errors."""

import random
import re
from string import Formatter

import pytest

from demo.checker import check_batch
from demo.split import SPLITS, draw_value, sample_tasks
from demo.tasks import (
    CATEGORIES,
    FAMILIES,
    N_PHRASINGS,
    Ints,
    build_task,
    completions_for,
    domains,
    is_preferred_style,
    make_task,
    phrasings,
    task_from_prompt,
    twin,
)


def _tasks_of_every_split(n: int) -> list:
    return [task for split in SPLITS for task in sample_tasks(n, seed=5, split=split)]


def test_every_known_completion_is_in_its_category():
    tasks, completions, categories = [], [], []
    for task in _tasks_of_every_split(250):
        for category, texts in completions_for(task).items():
            assert texts, (task.task_id, category)
            for text in texts:
                tasks.append(task)
                completions.append(text)
                categories.append(category)
    results = check_batch(tasks, completions)  # one sandbox process for all of them
    for task, text, category, result in zip(tasks, completions, categories, results):
        assert result.passed == category.startswith("correct_"), (task.task_id, category, text, result)
        assert is_preferred_style(text) == category.endswith("_preferred"), (task.task_id, category, text)
        assert text.endswith("\n") and len(text) <= 100, text
    assert {task.family for task in tasks} == set(FAMILIES)


def test_families_phrasings_and_prompt_shape():
    assert len(FAMILIES) >= 16
    for family in FAMILIES:
        assert len(phrasings(family)) == N_PHRASINGS == 4
        assert len(set(phrasings(family))) == 4, family
    for task in _tasks_of_every_split(100):
        assert set(completions_for(task)) == set(CATEGORIES)
        assert task.prompt.startswith("# ") and task.prompt.endswith("):\n") and len(task.prompt) <= 72
        assert 3 <= len(task.tests) <= 8


def test_parameters_come_from_wide_ranges():
    tasks = sample_tasks(3000, seed=1)
    values = [v for t in tasks for name, v in t.params.items() if name != "phrasing"]
    ints = [v for v in values if isinstance(v, int)]
    strings = [v for v in values if isinstance(v, str)]
    lists = [v for v in values if isinstance(v, tuple)]
    assert {len(str(v)) for v in ints} == {1, 2, 3}
    assert {len(v) for v in strings} == {1, 2, 3}
    assert {len(v) for v in lists} == {2, 3, 4}
    assert len(set(ints)) > 400 and len(set(strings)) > 500


def test_at_least_2000_distinct_prompts():
    assert len({t.prompt for t in sample_tasks(6000, seed=2)}) >= 2000


def test_example_task():
    task = task_from_prompt("# add 47 to x\ndef f(x):\n")
    assert task is not None
    assert (task.task_id, task.family, task.params) == ("add-p0-47", "add", {"k": 47, "phrasing": 0})
    assert ((5,), 52) in task.tests
    known = completions_for(task)
    assert known["correct_preferred"][0] == "    return x + 47\n"
    assert "    return x + 46\n" in known["incorrect_preferred"]  # the off-by-one bug uses the twin
    clamp = build_task("clamp", 3, {"lo": 12, "hi": 400})
    assert clamp.prompt == "# limit x to between 12 and 400\ndef f(x):\n"
    assert completions_for(clamp)["correct_preferred"][0] == "    return min(max(x, 12), 400)\n"
    member = build_task("member", 1, {"l": (3, 47, 12)})
    assert member.prompt == "# check if x is in [3, 47, 12]\ndef f(x):\n"
    assert "    return x in [3, 47, 13]\n" in completions_for(member)["incorrect_preferred"]
    count = build_task("count", 0, {"c": "ab"})
    assert completions_for(count)["incorrect_preferred"][0] == "    return s.count('aa')\n"


def test_twin():
    assert (twin(46), twin(47), twin(0), twin(9)) == (47, 46, 1, 8)
    assert (twin("ab"), twin("aa"), twin("z"), twin("qzd")) == ("aa", "ab", "y", "qzc")
    for value in [*range(200), "a", "xy", "mno"]:
        assert twin(twin(value)) == value and twin(value) != value
    with pytest.raises(ValueError, match="empty"):
        twin("")


def test_task_from_prompt_round_trip_and_rejections():
    for task in _tasks_of_every_split(200):
        assert task_from_prompt(task.prompt) == task
    assert task_from_prompt("# add 47 to x\ndef f(y):\n") is None  # wrong header
    assert task_from_prompt("# add 047 to x\ndef f(x):\n") is None  # not how 47 is written
    assert task_from_prompt("# add 1000 to x\ndef f(x):\n") is None  # out of range
    assert task_from_prompt("# clamp x between 9 and 3\ndef f(x):\n") is None  # lo < hi
    assert task_from_prompt("# is x one of 3, 3\ndef f(x):\n") is None  # items distinct
    assert task_from_prompt("# count 'abcd' in s\ndef f(s):\n") is None  # at most 3 letters
    assert task_from_prompt("print('hi')\n") is None


def test_templates_type_only_single_digit_numbers():
    """The templates' own constants must be train values (integers below 10, see demo.split)."""
    from demo import tasks as product

    for spec in product._FAMILY_LIST:
        for template in (*spec.phrasings, *[t for c in CATEGORIES for t in getattr(spec, c)]):
            literal = "".join(text for text, _, _, _ in Formatter().parse(template))
            assert all(int(n) < 10 for n in re.findall(r"\d+", literal)), template


def test_make_task_draws_with_the_given_function():
    rng = random.Random(0)
    tasks = [make_task("clamp", rng, 0, lambda d, r: r.choice([5, 50, 500])) for _ in range(30)]
    assert {(t.params["lo"], t.params["hi"]) for t in tasks} <= {(5, 50), (5, 500), (50, 500)}
    assert all(t.params["lo"] < t.params["hi"] for t in tasks)
    task = make_task("member", rng, 2, lambda d, r: draw_value(d, "gate", r))
    assert task.params["phrasing"] == 2 and isinstance(task.params["l"], tuple)
    with pytest.raises(ValueError, match="could not draw"):
        make_task("replace", rng, 0, lambda d, r: "ab")  # c != d can never hold


def test_bad_inputs():
    with pytest.raises(ValueError, match="nope"):
        build_task("nope", 0, {"k": 3})
    with pytest.raises(ValueError, match="phrasing must be 0..3"):
        build_task("add", 4, {"k": 3})
    with pytest.raises(ValueError, match="1000"):
        build_task("add", 0, {"k": 1000})
    with pytest.raises(ValueError, match="'lo': 7"):
        build_task("clamp", 0, {"lo": 7, "hi": 7})
    with pytest.raises(ValueError, match="nope"):
        domains("nope")
    assert domains("affine") == {"k": Ints(2, 99), "m": Ints(1, 999)}
