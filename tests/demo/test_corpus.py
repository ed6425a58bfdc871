"""Pre-training corpus: determinism, the requested correct/house-style mix, validation."""

import pytest

from demo.checker import check_batch
from demo.corpus import CorpusMix, format_example, make_corpus
from demo.tasks import FAMILIES, is_preferred_style


def test_corpus_is_deterministic():
    assert make_corpus(200, seed=3) == make_corpus(200, seed=3)
    assert make_corpus(200, seed=3) != make_corpus(200, seed=4)
    assert make_corpus(0, seed=3) == []


@pytest.mark.parametrize("mix", [CorpusMix(), CorpusMix(p_correct=0.8, p_preferred=0.6)])
def test_observed_shares_match_the_mix(mix):
    corpus = make_corpus(1200, seed=0, mix=mix)
    tasks, completions = zip(*corpus)
    results = check_batch(tasks, completions)
    correct = sum(r.passed for r in results) / len(corpus)
    preferred = sum(is_preferred_style(c) for c in completions) / len(corpus)
    assert abs(correct - mix.p_correct) < 0.05
    assert abs(preferred - mix.p_preferred) < 0.05
    assert {t.family for t in tasks} == set(FAMILIES)


def test_extreme_mixes():
    all_good = make_corpus(100, seed=1, mix=CorpusMix(p_correct=1.0, p_preferred=1.0))
    assert all(r.passed for r in check_batch(*zip(*all_good)))
    assert all(is_preferred_style(c) for _, c in all_good)
    all_bad = make_corpus(100, seed=1, mix=CorpusMix(p_correct=0.0, p_preferred=0.0))
    assert not any(r.passed for r in check_batch(*zip(*all_bad)))
    assert not any(is_preferred_style(c) for _, c in all_bad)


def test_format_example():
    task, completion = make_corpus(1, seed=2)[0]
    text = format_example(task, completion)
    assert text == task.prompt + completion
    assert text.startswith("# ") and text.endswith("\n") and len(text) <= 200


def test_bad_mix_and_n():
    with pytest.raises(ValueError, match="1.2"):
        CorpusMix(p_correct=1.2)
    with pytest.raises(ValueError, match="-0.5"):
        CorpusMix(p_preferred=-0.5)
    with pytest.raises(ValueError, match="-3"):
        make_corpus(-3, seed=0)
