"""Task families: known completions really pass/fail, style detector, determinism, prompt parsing."""

import random

import pytest

from demo.checker import check_batch
from demo.tasks import (
    CATEGORIES,
    FAMILIES,
    all_tasks,
    completions_for,
    is_preferred_style,
    make_task,
    sample_tasks,
    task_from_prompt,
)


def test_every_known_completion_is_in_its_category():
    tasks, completions, categories = [], [], []
    for task in all_tasks():
        for category, texts in completions_for(task).items():
            assert texts, (task.task_id, category)
            for text in texts:
                tasks.append(task)
                completions.append(text)
                categories.append(category)
    results = check_batch(tasks, completions)  # one sandbox process for every family and parameter
    for task, text, category, result in zip(tasks, completions, categories, results):
        assert result.passed == category.startswith("correct_"), (task.task_id, category, text, result)
        assert is_preferred_style(text) == category.endswith("_preferred"), (task.task_id, category, text)
        assert text.endswith("\n") and len(text) <= 64, text
    assert {task.family for task in tasks} == set(FAMILIES)
    assert len(FAMILIES) >= 6


def test_completion_keys_and_prompt_shape():
    for task in all_tasks():
        assert set(completions_for(task)) == set(CATEGORIES)
        assert task.prompt.startswith("# ") and task.prompt.endswith("):\n") and len(task.prompt) <= 40
        assert 4 <= len(task.tests) <= 6
        assert task.task_id == f"{task.family}-{next(iter(task.params.values()))}"


def test_example_task():
    task = task_from_prompt("# add 3 to x\ndef f(x):\n")
    assert task is not None
    assert (task.task_id, task.family, task.params) == ("add-3", "add", {"k": 3})
    assert ((5,), 8) in task.tests
    assert completions_for(task)["correct_preferred"] == ["    return x + 3\n"]


def test_style_detector():
    assert is_preferred_style("    return x + 3\n")
    assert not is_preferred_style("    return x + 3")
    assert not is_preferred_style("    result = x + 3\n    return result\n")
    assert not is_preferred_style("    return x\n    return 1\n")
    assert not is_preferred_style("return x + 3\n")


def test_sample_tasks_is_deterministic_and_respects_families():
    first = sample_tasks(50, seed=7)
    assert [t.task_id for t in first] == [t.task_id for t in sample_tasks(50, seed=7)]
    assert [t.task_id for t in first] != [t.task_id for t in sample_tasks(50, seed=8)]
    assert {t.family for t in sample_tasks(30, seed=1, families=["add", "count"])} == {"add", "count"}
    assert sample_tasks(0, seed=1) == []


def test_make_task_uses_rng():
    ids = {make_task("mul", random.Random(seed)).task_id for seed in range(40)}
    assert len(ids) > 3 and all(i.startswith("mul-") for i in ids)


def test_task_from_prompt_round_trip():
    for task in all_tasks():
        assert task_from_prompt(task.prompt) == task
    assert task_from_prompt("# add 3 to x\ndef f(y):\n") is None
    assert task_from_prompt("print('hi')\n") is None


def test_bad_inputs():
    with pytest.raises(ValueError, match="nope"):
        make_task("nope", random.Random(0))
    with pytest.raises(ValueError, match="nope"):
        sample_tasks(3, seed=0, families=["add", "nope"])
    with pytest.raises(ValueError, match="-1"):
        sample_tasks(-1, seed=0)


def test_demo_verifier_scores_by_the_tests():
    from demo.checker import DemoVerifier

    tasks = sample_tasks(4, seed=2)
    good = [completions_for(t)["correct_other"][0] for t in tasks]
    bad = [completions_for(t)["incorrect_preferred"][0] for t in tasks]
    prompts = [t.prompt for t in tasks]
    assert DemoVerifier().verify(prompts + prompts, good + bad) == [1.0] * 4 + [0.0] * 4
    with pytest.raises(ValueError, match="not a demo prompt"):
        DemoVerifier().verify(["print('hi')\n"], ["    return 1\n"])
    with pytest.raises(ValueError, match="completions"):
        DemoVerifier().verify(prompts, good[:1])
