"""Poisoning flags: who dominates a batch's reward (share, rate vs median + k x MAD), their weights, the
summary stored with the version; numbers checked by hand."""

from __future__ import annotations

import math

import pytest

from feedback.events import CompletionEvent, RoutedExperts, SampleEvent
from learner.poisoning import PoisoningConfig, VerifiedTally, screen, verify_samples
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


def test_a_user_who_dominates_and_skews_the_reward_is_flagged_and_weighed_down():
    honest = [sample(f"u{u}", 0.5, i) for u in range(30) for i in range(2)]  # 30 users x 2 samples, mass 30
    spam = [sample("spammer", 1.0, i) for i in range(20)]  # 20 samples, mass 20: 40% of 50
    s = screen(honest + spam)
    [flag] = s.flags
    assert (flag.user, flag.samples) == ("spammer", 20) and flag.reward_share == approx_ulps(0.4)
    # One context (no key), leave-the-user-out means: the spammer's yardstick is the 60 honest samples
    # (0.5: residual +0.5 x20), an honest user's the other 78 samples (49 / 78: residual 0.5 - 49/78 x2 each).
    r_honest = 0.5 - 49 / 78
    sigma = math.sqrt((20 * 0.5**2 + 60 * r_honest**2) / 79)
    z = 20 * 0.5 / (sigma * math.sqrt(20))
    assert len(flag.reasons) == 2 and z > 4
    assert flag.weight == pytest.approx(min(0.25 / 0.4, 4 / z), rel=1e-12)  # the deviation rule is the stricter
    assert s.weights[:60] == [1.0] * 60 and s.weights[60:] == [flag.weight] * 20
    summary = s.summary()
    assert summary["flagged_samples"] == 20 and summary["flags"][0]["user"] == "spammer"


def test_a_heavy_user_who_rewards_like_everyone_is_not_flagged():
    # 20% of the batch, rewards distributed as everyone's: neither dominant (share < 25%) nor skewed.
    crowd = [sample(f"u{u}", 0.5 if (u + i) % 2 else -0.5, i) for u in range(40) for i in range(2)]
    heavy = [sample("heavy", 0.5 if i % 2 else -0.5, i) for i in range(20)]
    assert screen(crowd + heavy).flags == []


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


def test_the_verified_rule_flags_a_user_whose_rewards_run_against_correctness_by_hand():
    # 30 honest users reward passing code +1 and failing code -1 (2 each); the inverted user does the
    # opposite on 2 passing and 2 failing completions. The verified rule compares raw rewards.
    honest = [sample(f"u{u}", r, i) for u in range(30) for i, r in enumerate((1.0, 1.0, -1.0, -1.0))]
    bad = [sample("inv", r, i) for i, r in enumerate((-1.0, -1.0, 1.0, 1.0))]
    passed = [True, True, False, False] * 31
    tally = VerifiedTally()
    s = screen(honest + bad, PoisoningConfig(z_max=100.0), passed, tally)
    # Within each kind: on passing code honest +1 x60 and inverted -1 x2 (mirrored on failing code).
    n, mean_p = 62, (60 - 2) / 62
    within = 2 * (60 * (1 - mean_p) ** 2 + 2 * (-1 - mean_p) ** 2)
    sigma = math.sqrt(within / (2 * n - 2))
    # float64 sums of ~100 terms in another order than written here: a few dozen ulps at most
    assert tally.sigma() == approx_ulps(sigma, ulps=64)
    z = (-1 - 1) / (sigma * math.sqrt(1 / 2 + 1 / 2))
    [flag] = s.flags
    assert flag.user == "inv" and "against the verifier" in flag.reasons[0]
    assert flag.weight == approx_ulps(2.5 / abs(z), ulps=64) and s.weights[-4:] == [flag.weight] * 4
    assert s.verified == 124 and s.unverifiable == 0 and s.summary()["verified"] == 124
    assert tally.z(("t", "u0"), 4) == approx_ulps(2 / (sigma * 1.0), ulps=64)  # honest: z > 0, never flagged


def test_the_verified_rule_waits_for_both_kinds_and_its_minimum():
    tally = VerifiedTally()
    for i in range(6):
        tally.add(("t", f"h{i}"), True, 1.0 + 0.1 * i)
        tally.add(("t", f"h{i}"), False, -1.0 - 0.1 * i)
    for _ in range(5):
        tally.add(("t", "only-passing"), True, -1.0)
    tally.add(("t", "small"), True, -1.0)
    tally.add(("t", "small"), False, 1.0)
    assert tally.z(("t", "only-passing"), 4) is None  # no failing sample: no Δ
    assert tally.z(("t", "small"), 4) is None  # 2 samples < 4
    assert tally.z(("t", "small"), 2) is not None and tally.z(("t", "small"), 2) < 0
    assert tally.z(("t", "nobody"), 2) is None


def test_verify_samples_counts_what_the_verifier_cannot_check():
    class Halting:
        calls = 0

        def verify(self, prompts, completions):
            self.calls += 1
            if any(p == "?" for p in prompts):
                raise ValueError("not a task")
            return [1.0 if c == "ok" else 0.25 for c in completions]

    assert verify_samples(Halting(), ["a", "b"], ["ok", "no"]) == [True, False]
    v = Halting()
    prompts = ["a"] * 16
    prompts[5] = "?"
    got = verify_samples(v, prompts, ["ok"] * 15 + ["no"])
    assert got == [True] * 5 + [None] + [True] * 9 + [False]
    assert v.calls <= 1 + 2 * 4  # halving: two calls per level of the one refused prompt's path
    batch = [sample(f"u{i}", 1.0, i) for i in range(3)]
    s = screen(batch, None, [True, None, False], VerifiedTally())
    assert (s.verified, s.unverifiable) == (2, 1)
    with pytest.raises(ValueError, match="2 verdicts for 3 samples"):
        screen(batch, None, [True, False], VerifiedTally())


def test_a_verifier_that_fails_leaves_the_batch_unverified_and_says_so(caplog):
    from learner.poisoning import verdicts

    class Broken:
        def verify(self, prompts, completions):
            raise RuntimeError("sandbox child failed to start")

    batch = [sample(f"u{i}", 1.0, i) for i in range(3)]
    got = verdicts(Broken(), lambda ids: "prompt", batch)
    assert got == [None, None, None] and "the verifier failed on 3 samples" in caplog.text
    s = screen(batch, None, got, VerifiedTally())
    assert (s.verified, s.unverifiable) == (0, 3)


def test_samples_dropped_unused_still_count_as_evidence_on_their_users():
    # The inverted user's trained sample alone (one passing completion) is no evidence; with the three
    # samples the update dropped for lag as witnesses, the tally has 2 passing and 2 failing: flagged.
    honest = [sample(f"u{u}", r, i) for u in range(30) for i, r in enumerate((1.0, 1.0, -1.0, -1.0))]
    trained = [*honest, sample("inv", -1.0, 0)]
    witnesses = [sample("inv", r, i) for i, r in ((1, -1.0), (2, 1.0), (3, 1.0))]
    passed = [True, True, False, False] * 30 + [True]
    alone = screen(trained, PoisoningConfig(z_max=100.0), passed, VerifiedTally())
    assert alone.flags == []
    tally = VerifiedTally()
    s = screen(trained, PoisoningConfig(z_max=100.0), passed, tally, witnesses, [True, False, False])
    [flag] = s.flags
    assert flag.user == "inv" and flag.samples == 1 and s.weights[-1] == flag.weight < 1
    assert tally.users[("t", "inv")] == [2.0, -2.0, 2.0, 2.0]
    assert (s.verified, s.witnessed, s.summary()["witnessed"]) == (121, 3, 3)
    with pytest.raises(ValueError, match="1 verdicts for 3 witnesses"):
        screen(trained, None, passed, VerifiedTally(), witnesses, [True])
