"""Reward shaping: every kind's value by hand, combinations, caps, clipping, budgets, validation."""

import pytest

from feedback.events import Signal
from feedback.rewards import RewardSpec, UserBudget, counted_signals, reward, signal_reward
from tests.conftest import approx_ulps

SPEC = RewardSpec()


def sig(kind, value=None, ts=0.0, user="u1"):
    return Signal(kind=kind, value=value, ts=ts, user_id=user, event_id=f"fb-{kind}-{ts}")


@pytest.mark.parametrize(
    "kind,value,expected",
    [
        ("accepted", None, 0.75),
        ("rejected", None, -0.25),
        ("thumb_up", None, 0.5),
        ("thumb_down", None, -0.5),
        ("rating", 1, -0.5),  # (1 - 3) / 4
        ("rating", 2, -0.25),
        ("rating", 3, 0.0),
        ("rating", 4, 0.25),
        ("rating", 5, 0.5),
        ("edited", 1.0, 0.75),  # 0.75 * 1 - 0.25 * 0
        ("edited", 0.0, -0.25),
        ("edited", 0.5, 0.25),  # 0.375 - 0.125
        ("edited", 0.8, 0.55),  # 0.6 - 0.05
        ("copied", None, 0.25),
        ("regenerated", None, -0.25),
        ("dwell", 0.0, 0.0),
        ("dwell", 15.0, 0.025),  # 0.05 * 15 / 30
        ("dwell", 600.0, 0.05),  # capped at 30 s
    ],
)
def test_signal_reward_by_kind(kind, value, expected):
    assert signal_reward(SPEC, sig(kind, value)) == approx_ulps(expected)


def test_default_spec_is_default_v1_with_docstrings_on_every_field():
    assert SPEC.name == "default-v1"
    missing = [n for n, f in RewardSpec.model_fields.items() if not f.description]
    assert missing == []


@pytest.mark.parametrize(
    "signals,expected",
    [
        ([sig("accepted"), sig("copied")], 1.0),
        ([sig("accepted"), sig("copied"), sig("thumb_up")], 1.0),  # 1.5, per-user cap 1.0
        ([sig("rejected"), sig("thumb_down"), sig("rating", 1)], -1.0),  # -1.25 capped
        ([sig("accepted", ts=1), sig("edited", 0.5, ts=2)], 0.25),  # the edit supersedes the accept
        ([sig("accepted", ts=1), sig("edited", 0.5, ts=2), sig("copied", ts=3)], 0.5),
        ([sig("accepted", ts=1), sig("rejected", ts=2)], -0.25),  # latest of {accepted, rejected, edited}
        ([sig("rejected", ts=1), sig("accepted", ts=2)], 0.75),
        ([sig("accepted", ts=1), sig("rejected", ts=1)], -0.25),  # same ts: the later in arrival order
        ([sig("thumb_up", ts=1), sig("thumb_down", ts=2)], -0.5),  # a changed vote
        ([sig("accepted"), sig("dwell", 30.0)], 0.8),
        ([sig("regenerated"), sig("dwell", 1.5)], -0.2475),  # -0.25 + 0.05 * 1.5 / 30
        ([sig("rating", 4), sig("rating", 2, ts=5)], -0.25),  # one rating per user: the latest
    ],
)
def test_reward_of_combinations(signals, expected):
    assert reward(SPEC, signals) == approx_ulps(expected)


def test_no_counting_signal_gives_none():
    assert reward(SPEC, []) is None
    assert reward(SPEC, [sig("dwell", 20.0)]) is None  # dwell is only a tie-breaker
    assert reward(SPEC, [sig("dwell", 20.0), sig("thumb_up")]) == approx_ulps(0.5 + 0.05 * 20 / 30)


def test_one_user_counts_once_per_kind_latest_wins():
    spam = [sig("thumb_up", ts=t) for t in range(50)]
    assert reward(SPEC, spam) == approx_ulps(0.5)
    counted = counted_signals(spam + [sig("dwell", 3.0, ts=1), sig("dwell", 9.0, ts=2)])
    assert [(s.kind, s.ts) for s in counted] == [("thumb_up", 49.0), ("dwell", 2.0)]
    assert counted[1].value == 9.0
    # Anonymous signals form one user; other users count separately.
    assert reward(SPEC, [sig("thumb_up", user=None), sig("thumb_up", user=None)]) == approx_ulps(0.5)
    assert reward(SPEC, [sig("thumb_up", user="a"), sig("copied", user="b")]) == approx_ulps(0.75)


def test_per_user_cap_bounds_one_users_contribution():
    spec = RewardSpec(per_user_cap=0.5)
    # a: 0.75 + 0.25 = 1.0 -> 0.5; b: -0.25. Uncapped this would be 0.75.
    signals = [sig("accepted", user="a"), sig("copied", user="a"), sig("rejected", user="b")]
    assert reward(spec, signals) == approx_ulps(0.25)
    assert reward(SPEC, signals) == approx_ulps(0.75)
    # Three users at +1 each: each within its cap, the total clipped to reward_max.
    many = [sig("accepted", user=u) for u in "abc"] + [sig("copied", user=u) for u in "abc"]
    assert reward(SPEC, many) == 1.0


def test_final_clip_to_reward_range():
    spec = RewardSpec(reward_min=-0.2, reward_max=0.6)
    assert reward(spec, [sig("accepted")]) == approx_ulps(0.6)
    assert reward(spec, [sig("thumb_down")]) == approx_ulps(-0.2)
    assert reward(spec, [sig("copied")]) == approx_ulps(0.25)


def test_user_budget_windowing():
    b = UserBudget(max_per_window=2, window_s=10.0)
    assert b.admit("a", "c1", 0.0)
    assert b.admit("a", "c2", 1.0)
    assert not b.admit("a", "c3", 2.0)  # third completion in the window
    assert b.admit("a", "c1", 3.0)  # already counted: more signals on it cost nothing
    assert b.admit("b", "c3", 2.0)  # budgets are per user
    assert b.used("a", 3.0) == 2
    assert b.admit("a", "c3", 10.5)  # c1 (ts 0) has left the window (0.5, 10.5]
    assert not b.admit("a", "c4", 10.6)  # c2 (ts 1) and c3 (ts 10.5) are in it
    assert b.used("a", 10.6) == 2
    b.prune(25.0)
    assert b.used("a", 25.0) == 0 and b._used == {}
    assert UserBudget.from_spec(SPEC).max_per_window == 200


@pytest.mark.parametrize(
    "kwargs,field",
    [
        ({"per_user_cap": 0.0}, "per_user_cap"),
        ({"reward_min": 0.5}, "reward_min"),
        ({"reward_min": 1.0, "reward_max": 1.0}, "reward_min"),
        ({"dwell_weight": 0.3}, "dwell_weight"),
        ({"dwell_weight": -0.01}, "dwell_weight"),
        ({"dwell_cap_s": 0.0}, "dwell_cap_s"),
        ({"name": "bad name!"}, "name"),
        ({"name": ""}, "name"),
        ({"accepted": -1.0}, "accepted"),
        ({"thumb_down": 0.5}, "thumb_down"),
        ({"edited_none_kept": 0.9}, "edited_none_kept"),
        ({"max_rewarded_per_user": 0}, "max_rewarded_per_user"),
        ({"budget_window_s": 0.0}, "budget_window_s"),
        ({"silence": -1.5}, "silence"),
        ({"rating_weight": 1.0}, "rating_weight"),  # unknown field: extra="forbid"
    ],
)
def test_invalid_spec_raises_value_error_naming_the_field(kwargs, field):
    with pytest.raises(ValueError, match=field):
        RewardSpec(**kwargs)


def test_spec_is_frozen_and_budget_validates():
    with pytest.raises(ValueError, match="frozen"):
        SPEC.accepted = 1.0  # type: ignore[misc]
    with pytest.raises(ValueError, match="max_per_window"):
        UserBudget(0, 10.0)
    with pytest.raises(ValueError, match="window_s"):
        UserBudget(1, 0.0)


def test_silence_after_exposure_is_a_reward_and_no_exposure_is_none():
    assert signal_reward(SPEC, sig("shown")) == 0.0
    assert reward(SPEC, [sig("shown")]) == 0.0  # shown, then nothing: silence (0.0 by default)
    assert reward(SPEC, [sig("shown"), sig("dwell", 15.0)]) == approx_ulps(0.025)  # silence + dwell
    assert reward(SPEC, [sig("dwell", 15.0)]) is None  # never reported shown: maybe never seen
    assert reward(SPEC, []) is None
    ignored = RewardSpec(silence=-0.1)
    assert reward(ignored, [sig("shown")]) == approx_ulps(-0.1)
    assert reward(ignored, [sig("shown"), sig("thumb_up")]) == approx_ulps(0.5)  # a reaction: no silence
    assert reward(ignored, [sig("shown", user="a"), sig("thumb_down", user="b")]) == approx_ulps(-0.5)
