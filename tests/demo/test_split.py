"""The three-way split: the rule, the sets, and the split test (nothing of gate or report in the
pre-training corpus or in the train traffic)."""

import re
from string import ascii_lowercase

import pytest

from demo.corpus import format_example
from demo.split import (
    HELD_OUT_PHRASING,
    SPLITS,
    TRAIN_PHRASINGS,
    find_leaks,
    n_prompts,
    sample_tasks,
    split_of,
    split_tasks,
    value_split,
)
from demo.tasks import FAMILIES, build_task, phrasings, template_words, twin
from serving.tokenizer import train_tokenizer


@pytest.mark.slow  # the whole corpus and traffic scanned
def test_the_split_test_corpus_and_traffic_hold_nothing_of_gate_or_report(demo_corpus):
    corpus = demo_corpus  # exactly what `flywheel bootstrap` pre-trains the shipped base on
    traffic = [t.prompt for seed in range(4) for t in sample_tasks(5_000, seed=100 + seed)]
    texts = [format_example(task, completion) for task, completion in corpus]
    assert find_leaks(texts) == []
    assert find_leaks(traffic) == []
    assert {split_of(task) for task, _ in corpus} == {"train"}
    held_out = {t.prompt for split in ("gate", "report") for t in split_tasks(split, 2000)}
    assert not held_out & ({t.prompt for t, _ in corpus} | set(traffic))
    # Spelled out once more without the split's own functions: no held-out comment line, and no
    # held-out value as a whole digit run or quoted string, anywhere.
    held_comments = [
        re.compile(re.sub(r"\\\{\w+\\\}", ".+", re.escape(phrasings(f)[HELD_OUT_PHRASING]))) for f in FAMILIES
    ]
    numbers = {int(n) for text in texts + traffic for n in re.findall(r"\d+", text)}
    quoted = {s for text in texts + traffic for s in re.findall(r"'([a-z]+)'", text)}
    assert len(numbers) > 500 and len(quoted) > 1000
    assert {value_split(v) for v in numbers} == {value_split(s) for s in quoted} == {"train"}
    comments = {line[2:] for text in texts + traffic for line in text.splitlines() if line.startswith("# ")}
    assert not [c for c in comments for regex in held_comments if regex.fullmatch(c)]


def test_find_leaks_finds_each_kind_of_leak(demo_corpus):
    gate, report = split_tasks("gate", 1)[0], split_tasks("report", 1)[0]
    gate_int = next(v for v in range(10, 1000) if value_split(v) == "gate")
    report_str = next(
        s for s in (a + b for a in ascii_lowercase for b in ascii_lowercase) if value_split(s) == "report"
    )
    cross = build_task("add", 0, {"k": gate_int})  # train phrasing, gate value: no split
    held_phrasing = build_task("add", HELD_OUT_PHRASING, {"k": 5})  # held-out phrasing, train value
    clean = demo_corpus[0][0].prompt + demo_corpus[0][1]
    cases = {
        gate.prompt: "gate prompt",
        report.prompt: "report prompt",
        cross.prompt: f"gate value {gate_int}",
        held_phrasing.prompt: "held-out phrasing of 'add'",
        clean + f"    return s.count('{report_str}')\n": f"report value '{report_str}'",
    }
    for text, expected in cases.items():
        leaks = find_leaks([clean, text])
        assert leaks and all(leak.startswith("text 1:") for leak in leaks), (text, leaks)
        assert any(expected in leak for leak in leaks), (text, leaks)
    assert find_leaks([clean, f"x = {gate_int + 1000}\n", "about 'abcd'\n"]) == []  # other numbers, words


def test_value_rule():
    ints = range(10, 1000)
    shares = {split: sum(value_split(v) == split for v in ints) / len(ints) for split in SPLITS}
    assert 0.05 < shares["gate"] < 0.15 and 0.05 < shares["report"] < 0.15, shares
    strings = [a + b for a in ascii_lowercase for b in ascii_lowercase]
    assert 0.05 < sum(value_split(s) == "report" for s in strings) / len(strings) < 0.15
    assert {value_split(v) for v in range(10)} == {value_split(c) for c in ascii_lowercase} == {"train"}
    assert {value_split(w) for w in template_words() if len(w) <= 3} == {"train"}  # 'in', 'of', 'sum', ...
    for value in [*range(1000), *strings, "abc", "qzd", "mno"]:
        assert value_split(value) == value_split(twin(value))  # an off-by-one bug keeps its split
    for bad in (-1, "Ab", "a1", "", 2.5):
        with pytest.raises(ValueError):
            value_split(bad)


def test_tasks_of_each_split():
    for split in SPLITS:
        tasks = sample_tasks(400, seed=3, split=split)
        assert {split_of(t) for t in tasks} == {split}
        assert {t.family for t in tasks} == set(FAMILIES)
        assert {t.params["phrasing"] for t in tasks} == set(
            TRAIN_PHRASINGS if split == "train" else (HELD_OUT_PHRASING,)
        )
        assert [t.task_id for t in tasks] == [t.task_id for t in sample_tasks(400, seed=3, split=split)]
    assert [t.task_id for t in sample_tasks(50, seed=3)] != [t.task_id for t in sample_tasks(50, seed=4)]
    assert {t.family for t in sample_tasks(40, seed=1, families=["add", "count"])} == {"add", "count"}
    assert sample_tasks(0, seed=1) == []


def test_fixed_sets_are_distinct_deterministic_and_disjoint():
    report = split_tasks("report", 1200)
    assert len({t.prompt for t in report}) == 1200 and {split_of(t) for t in report} == {"report"}
    assert [t.prompt for t in split_tasks("report", 300)] == [t.prompt for t in report[:300]]
    per_family = [sum(t.family == f for t in report) for f in FAMILIES]
    assert min(per_family) >= 1200 // len(FAMILIES) - 1
    gate = split_tasks("gate", 1200)
    assert not {t.prompt for t in gate} & {t.prompt for t in report}
    values = lambda tasks: {v for t in tasks for k, v in t.params.items() if k != "phrasing"}  # noqa: E731
    assert not values(gate) & values(report)
    counts = {split: sum(n_prompts(split).values()) for split in SPLITS}
    assert counts["train"] >= 2000 and counts["report"] >= 1000 and counts["gate"] >= 1000
    assert n_prompts("report")["add"] == 1 * sum(value_split(k) == "report" for k in range(1, 1000))


def test_held_out_prompts_are_made_of_tokens_the_corpus_has(demo_corpus):
    """With quoted strings spelled out, a gate or report prompt is new text in old tokens."""
    texts = [format_example(t, c) for t, c in demo_corpus[:3000]]
    tok = train_tokenizer(texts, vocab_size=512, spell_quoted_strings=True)
    seen = {i for text in texts for i in tok.encode(text)}
    for task in split_tasks("gate", 100) + split_tasks("report", 100):
        assert set(tok.encode(task.prompt)) <= seen, task.prompt
    letters = tok.encode("    return s.count('qzd')\n")
    assert [tok.decode([i]) for i in letters[-5:-2]] == ["q", "z", "d"]
    plain = train_tokenizer(texts, vocab_size=512)  # the default is unchanged: letters are not isolated
    pieces = lambda t: [p for p, _ in t.inner.pre_tokenizer.pre_tokenize_str("s.count('qzd')")]  # noqa: E731
    assert "qzd" in pieces(plain) and "qzd" not in pieces(tok) and ["q", "z", "d"] == pieces(tok)[4:7]


def test_the_prompts_of_no_split_belong_to_none_and_extend_deterministically():
    from demo.split import unsplit_tasks

    tasks = unsplit_tasks(60)
    assert all(split_of(t) is None for t in tasks) and len({t.prompt for t in tasks}) == 60
    assert [t.prompt for t in unsplit_tasks(20)] == [t.prompt for t in tasks[:20]]
    # the two kinds alternate: a train phrasing with report values, the held-out phrasing with train values
    assert all(t.params["phrasing"] in (0, 1, 2) for t in tasks[0::2])
    assert all(t.params["phrasing"] == 3 for t in tasks[1::2])
