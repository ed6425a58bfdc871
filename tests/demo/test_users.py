"""Simulated users: satisfaction ordering, determinism, acceptance rate, valid signals."""

import pytest

from demo.checker import CheckResult
from demo.tasks import completions_for, task_from_prompt
from demo.users import SIGNAL_KINDS, FeedbackSignal, SimulatedUser, UserPrefs, satisfaction

TASK = task_from_prompt("# add 3 to x\ndef f(x):\n")
PASS = CheckResult(passed=True, n_passed=5, n_tests=5, error=None)
FAIL = CheckResult(passed=False, n_passed=2, n_tests=5, error=None)
PREFERRED = completions_for(TASK)["correct_preferred"][0]
OTHER = completions_for(TASK)["correct_other"][0]
WRONG = completions_for(TASK)["incorrect_preferred"][0]
CASES = [(PREFERRED, PASS), (OTHER, PASS), (WRONG, FAIL)]


def test_satisfaction_ordering_and_values():
    good, verbose, wrong = (satisfaction(TASK, text, result) for text, result in CASES)
    assert (good, verbose, wrong) == (0.9, 0.3, 0.05)
    assert good > verbose > wrong
    # Correctness comes from the check result, not from the text.
    assert satisfaction(TASK, PREFERRED, FAIL) == 0.05
    prefs = UserPrefs(p_accept_correct_preferred=0.8, p_accept_correct_other=0.5, p_accept_incorrect=0.1)
    assert [satisfaction(TASK, text, result, prefs) for text, result in CASES] == [0.8, 0.5, 0.1]


def test_react_is_deterministic_per_seed_and_call_count():
    def run(seed):
        user = SimulatedUser("u1", seed=seed)
        return [user.react(TASK, text, result) for text, result in CASES * 20]

    assert run(3) == run(3)
    assert run(3) != run(4)
    assert SimulatedUser("u1", 3).react(TASK, PREFERRED, PASS) == run(3)[0]
    assert SimulatedUser("u1", 3).prefs != SimulatedUser("u2", 3).prefs  # per-user jitter


@pytest.mark.parametrize("text,result", CASES)
def test_acceptance_frequency_matches_satisfaction(text, result):
    user = SimulatedUser("u7", seed=11)
    expected = user.satisfaction(TASK, text, result)
    assert abs(expected - satisfaction(TASK, text, result)) < 0.15  # jitter stays small
    trials = 3000
    accepted = sum(any(signal.kind == "accepted" for signal in user.react(TASK, text, result)) for _ in range(trials))
    assert abs(accepted / trials - expected) < 0.03


def test_signals_are_valid_and_consistent():
    user = SimulatedUser("u2", seed=5)
    seen = set()
    kept = {True: [], False: []}
    for _ in range(400):
        for text, result in CASES:
            signals = user.react(TASK, text, result)
            kinds = [s.kind for s in signals]
            seen.update(kinds)
            assert kinds[-1] == "dwell" and kinds.count("dwell") == 1
            assert ("accepted" in kinds) != ("rejected" in kinds or "regenerated" in kinds)
            for signal in signals:
                assert signal.kind in SIGNAL_KINDS
                if signal.kind == "rating":
                    assert signal.value in ((4, 5) if "accepted" in kinds else (1, 2))
                elif signal.kind == "edited":
                    assert 0.0 <= signal.value <= 1.0
                    kept[text == PREFERRED].append(signal.value)
                elif signal.kind == "dwell":
                    assert signal.value > 0
                else:
                    assert signal.value is None
            if "thumb_up" in kinds or "copied" in kinds:
                assert "accepted" in kinds
            if "thumb_down" in kinds:
                assert "accepted" not in kinds
    assert seen == set(SIGNAL_KINDS)
    assert min(kept[True]) > max(kept[False])  # good completions keep more of their text when edited


def test_invalid_prefs_and_signals():
    with pytest.raises(ValueError, match="1.5"):
        UserPrefs(p_accept_incorrect=1.5)
    with pytest.raises(ValueError, match="-0.1"):
        UserPrefs(p_copy=-0.1)
    with pytest.raises(ValueError, match="thumbs_sideways"):
        FeedbackSignal("thumbs_sideways")
    with pytest.raises(ValueError):
        FeedbackSignal("rating", 7)
    with pytest.raises(ValueError):
        FeedbackSignal("accepted", 1.0)
