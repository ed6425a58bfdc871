"""Poisoning flags: who dominates a batch's reward (share, rate vs median + k x MAD), their weights, the
summary stored with the version; numbers checked by hand."""

from __future__ import annotations

import math

import pytest

from feedback.bus_embedded import EmbeddedBus
from feedback.events import CompletionEvent, RoutedExperts, SampleEvent
from learner.poisoning import PoisoningConfig, Scout, VerifiedTally, screen, verify_samples
from tests.conftest import approx_ulps


def sample(user: str | None, reward: float, i: int, tenant: str = "t", text: str = "x") -> SampleEvent:
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
        text=text,
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
    for ev, ok in zip(honest + bad, passed, strict=True):
        tally.add((ev.tenant, ev.completion.user_id), ok, ev.reward)
    s = screen(honest + bad, PoisoningConfig(z_max=100.0), tally)
    # Within each kind: on passing code honest +1 x60 and inverted -1 x2 (mirrored on failing code).
    n, mean_p = 62, (60 - 2) / 62
    within = 2 * (60 * (1 - mean_p) ** 2 + 2 * (-1 - mean_p) ** 2)
    sigma = math.sqrt(within / (2 * n - 2))
    # float64 sums of ~100 terms in another order than written here: a few dozen ulps at most
    assert tally.sigma() == approx_ulps(sigma, ulps=64)
    z = (-1 - 1) / (sigma * math.sqrt(1 / 2 + 1 / 2))
    [flag] = s.flags
    assert flag.user == "inv" and "against the verifier" in flag.reasons[0]
    assert (
        flag.weight == approx_ulps(PoisoningConfig().verified_z_max / abs(z), ulps=64)
        and s.weights[-4:] == [flag.weight] * 4
    )
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


def test_a_verifier_that_fails_leaves_the_batch_unverified_and_says_so(caplog):
    from learner.poisoning import verdicts

    class Broken:
        def verify(self, prompts, completions):
            raise RuntimeError("sandbox child failed to start")

    batch = [sample(f"u{i}", 1.0, i) for i in range(3)]
    got = verdicts(Broken(), lambda ids: "prompt", batch)
    assert got == [None, None, None] and "the verifier failed on 3 samples" in caplog.text


class ByText:
    """Passes a completion whose text is "pass"; refuses the prompt "?" (`product.suites.Verifier`)."""

    def verify(self, prompts, completions):
        if "?" in prompts:
            raise ValueError("not a task")
        return [float(c == "pass") for c in completions]


def publish(bus: EmbeddedBus, events: list[SampleEvent]) -> None:
    for ev in events:
        bus.publish("samples", ev.completion.completion_id, ev.model_dump_json().encode())


def test_the_scout_counts_every_sample_on_the_topic_once_and_only_what_it_may(tmp_path):
    # 30 honest users and one inverted user on a 2-partition topic, with one anonymous sample, one of an
    # opted-out tenant, one the verifier refuses, one malformed record and one sample published twice.
    honest = [
        sample(f"u{u}", r, i, text=t) for u in range(30) for i, (r, t) in enumerate(((1.0, "pass"), (-1.0, "fail")))
    ]
    inverted = [sample("inv", r, i, text=t) for i, (r, t) in enumerate(((-1.0, "pass"), (1.0, "fail")) * 2)]
    refused = sample("u1", 1.0, 9, text="pass")
    refused = refused.model_copy(update={"completion": refused.completion.model_copy(update={"prompt_ids": [99]})})
    bus = EmbeddedBus(tmp_path / "bus", partitions=2)
    publish(bus, honest[:30] + inverted[:2])
    publish(bus, [sample(None, 1.0, 0), sample("u2", 1.0, 7, tenant="acme", text="pass"), honest[0]])
    bus.publish("samples", "junk", b"{not json")
    publish(bus, [refused])  # its prompt (ids [99]) is one the verifier refuses
    scout = Scout(
        bus.consumer("samples", "learner.scout"),
        ByText(),
        lambda ids: "?" if ids == [99] else "p",
        skip_tenants=frozenset({"acme"}),
    )
    tally = VerifiedTally()
    assert scout.catch_up(tally) == 30 + 2 + 3 + 1 + 1
    assert scout.take() == {"verified": 32, "unverifiable": 1, "skipped": 4}  # anonymous, acme, twice, junk
    screened = screen(honest + inverted[:2], PoisoningConfig(z_max=100.0), tally)
    assert screened.flags == []  # 2 verified samples: short of the rule's 4
    publish(bus, honest[30:] + inverted[2:])  # the rest arrives
    scout.catch_up(tally)
    assert scout.take() == {"verified": 32}
    assert tally.users[("t", "inv")] == [2.0, -2.0, 2.0, 2.0]
    [flag] = screen(honest + inverted, PoisoningConfig(z_max=100.0), tally).flags
    assert flag.user == "inv" and "against the verifier" in flag.reasons[0] and flag.samples == 4
    # Nothing committed: a restarted scout in the group gets every record again; the tally's positions
    # (saved with it) skip them all, and nothing counts twice.
    scout.close()
    again = Scout(bus.consumer("samples", "learner.scout"), ByText(), lambda ids: "p")
    before = (dict(tally.users), list(tally.kinds))
    assert again.catch_up(tally) == 30 + 2 + 3 + 1 + 1 + 32
    assert again.take() == {"skipped": 69} and (dict(tally.users), list(tally.kinds)) == before
    again.commit()  # the tally is durable: its reads are committed
    again.close()
    third = Scout(bus.consumer("samples", "learner.scout"), ByText(), lambda ids: "p")
    assert third.catch_up(tally) == 0
    third.close()
    bus.close()


def test_the_scout_counts_a_failing_verifier_as_unverifiable(tmp_path, caplog):
    class Broken:
        def verify(self, prompts, completions):
            raise RuntimeError("sandbox child failed to start")

    bus = EmbeddedBus(tmp_path / "bus", partitions=1)
    publish(bus, [sample(f"u{i}", 1.0, i) for i in range(3)])
    scout = Scout(bus.consumer("samples", "learner.scout"), Broken(), lambda ids: "p")
    tally = VerifiedTally()
    assert scout.catch_up(tally) == 3 and scout.take() == {"unverifiable": 3}
    assert tally.users == {} and tally.positions == {0: 3} and "the verifier failed on 3 samples" in caplog.text
    scout.close()
    bus.close()
