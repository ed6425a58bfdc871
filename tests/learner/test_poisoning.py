"""Poisoning flags: who dominates a batch's reward (share, rate vs median + k x MAD), their weights, the
summary stored with the version; numbers checked by hand."""

from __future__ import annotations

import pytest

from feedback.events import CompletionEvent, RoutedExperts, SampleEvent
from learner.poisoning import PoisoningConfig, screen
from tests.conftest import approx_ulps


def sample(user: str | None, reward: float, i: int, tenant: str = "t") -> SampleEvent:
    c = CompletionEvent(
        completion_id=f"c-{user}-{i}",
        tenant=tenant,
        user_id=user,
        model_version="v1",
        endpoint="completions",
        prompt_ids=[1],
        output_ids=[2],
        logprobs=[-0.1],
        routed_experts=RoutedExperts.from_bytes((1, 1, 1), b"\x00"),
        text="x",
        finish_reason="stop",
        params={},
        latency_ms={},
    )
    return SampleEvent(tenant=tenant, completion=c, reward=reward, signals=[], reward_spec="default-v1")


def test_an_honest_crowd_is_not_flagged():
    batch = [sample(f"u{u}", 0.5 if (u + i) % 2 else -0.5, i) for u in range(30) for i in range(1 + u % 3)]
    s = screen(batch)
    assert s.flags == [] and s.weights == [1.0] * len(batch) and s.users == 30
    assert s.summary()["flagged_users"] == 0


def test_a_user_who_dominates_by_rate_and_share_is_flagged_and_weighed_down():
    honest = [sample(f"u{u}", 0.5, i) for u in range(30) for i in range(2)]  # 30 users x 2 samples, mass 30
    spam = [sample("spammer", 1.0, i) for i in range(20)]  # 20 samples, mass 20: 40% of 50
    s = screen(honest + spam)
    [flag] = s.flags
    assert (flag.user, flag.samples) == ("spammer", 20) and flag.reward_share == approx_ulps(0.4)
    # median 2, MAD floored to 1: rate threshold 2 + 5 x 1 = 7 samples
    assert s.rate_threshold == 7.0 and len(flag.reasons) == 2
    assert flag.weight == approx_ulps(min(0.05 / 0.4, 7 / 20))  # 0.125: the share rule is the stricter
    assert s.weights[:60] == [1.0] * 60 and s.weights[60:] == [approx_ulps(0.125)] * 20
    summary = s.summary()
    assert summary["flagged_samples"] == 20 and summary["flags"][0]["user"] == "spammer"


def test_the_share_rule_waits_for_enough_users_and_anonymous_is_never_flagged():
    few = [sample(f"u{u}", 1.0, 0) for u in range(5)]  # each holds 20%: normal for five users
    assert screen(few).flags == []
    anon = [sample(None, 1.0, i) for i in range(50)] + [sample("u", 1.0, 0)]
    s = screen(anon)
    assert s.flags == [] and s.users == 1


def test_the_same_user_id_in_two_tenants_is_two_users():
    batch = [sample("u", 1.0, i, tenant="a") for i in range(3)] + [sample("u", 1.0, i, tenant="b") for i in range(3)]
    assert screen(batch).users == 2


def test_config_is_validated_and_can_be_off():
    with pytest.raises(ValueError):
        PoisoningConfig(max_share=0)
    spam = [sample("u0", 1.0, 0)] * 1 + [sample("spam", 1.0, i) for i in range(30)]
    assert screen(spam, PoisoningConfig(enabled=False)).flags == []
