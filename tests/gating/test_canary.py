"""The online canary (`gating.canary`): decide() on hand-built outcomes, the counts' round trip, and
`Gate.canary_step` end to end on a real SQLite registry and a real EmbeddedBus."""

from __future__ import annotations

import hashlib
import time
from datetime import UTC, datetime, timedelta

import pytest

from feedback.bus_embedded import EmbeddedBus
from feedback.events import TOPICS, CompletionEvent, RoutedExperts, SampleEvent, Signal
from gating.canary import CanaryConfig, CanaryOutcomes, decide
from gating.gate import Gate, GateConfig
from gating.sequential import step_rho
from gating.stats import assign_arm
from registry.models import CanaryProgress
from registry.registry import Registry
from tests.conftest import approx_ulps

T0 = datetime(2025, 1, 1, tzinfo=UTC)
CFG = CanaryConfig(min_users_per_arm=30, min_step_s=600, max_step_s=3600)


def sample(
    user: str,
    arm: str | None,
    reward: float,
    version: str | None = None,
    latency: float = 100.0,
    finish: str = "stop",
    ts: float | None = None,
    n: int = 0,
    shown: bool = True,
    ttft: float = 5.0,
) -> SampleEvent:
    version = version or ("cand" if arm == "candidate" else "inc")
    ts = T0.timestamp() + 1 if ts is None else ts
    c = CompletionEvent(
        completion_id=f"c-{user}-{arm}-{n}",
        tenant="t1",
        ts=ts,
        user_id=user,
        model_version=version,
        endpoint="completions",
        prompt_ids=[1, 2],
        output_ids=[3, 4],
        logprobs=[-0.5, -0.5],
        routed_experts=RoutedExperts.from_bytes((3, 1, 1), b"\x00\x01\x00"),
        text="x",
        finish_reason=finish,
        params={},
        latency_ms={"queued": 1.0, "first_token": ttft, "total": latency},
        arm=arm,
    )
    signals = [Signal(kind="shown", ts=ts + 1, user_id=user, event_id=f"shown-{user}-{arm}-{n}")] if shown else []
    return SampleEvent(tenant="t1", ts=ts + 60, completion=c, reward=reward, signals=signals, reward_spec="default-v1")


def outcomes(n_cand: int, n_inc: int, reward=lambda arm, i: 1.0, latency=lambda arm, i: 100.0, step: int = 0):
    o = CanaryOutcomes()
    for arm, n in (("candidate", n_cand), ("incumbent", n_inc)):
        for i in range(n):
            for k in range(2):  # two requests per user: the user is the unit
                assert o.add(
                    step, sample(f"{arm}-u{i}", arm, reward(arm, i), latency=latency(arm, i), n=k), "cand", "inc"
                )
    return o


def progress(step: int = 0, share: float = 0.5) -> CanaryProgress:
    return CanaryProgress(step=step, share=share, started_at=T0)


def at(seconds: float) -> datetime:
    return T0 + timedelta(seconds=seconds)


def noisy(arm: str, i: int) -> float:
    return float((i * 7 + (arm == "candidate")) % 3 == 0)


# ---- decide ------------------------------------------------------------------------------------
def test_sample_ratio_mismatch_aborts_invalid():
    d = decide(progress(share=0.5), outcomes(10, 90), CFG, at(700))
    assert d.action == "abort_invalid" and d.numbers["srm"]["p_value"] < 0.001 and d.numbers["users"]["candidate"] == 10


def test_clear_time_per_token_harm_aborts_at_once():
    lat = lambda arm, i: (300.0 if arm == "candidate" else 100.0) + (i % 5)  # noqa: E731
    d = decide(progress(), outcomes(40, 40, latency=lat), CFG, at(10))  # before min duration: harm stops at once
    g = d.numbers["guardrails"]
    assert d.action == "abort_harm" and g["tpot_ms"]["harmed"] and not g["ttft_ms"]["harmed"]
    assert "tpot_ms" in d.reason and "latency_ms" not in g  # whole-request latency is no guardrail


@pytest.mark.parametrize("slower, harmed", [(1.2, False), (1.4, False), (2.0, True)])
def test_time_to_first_token_is_harm_only_beyond_its_tolerance(slower, harmed):
    # 40 users per arm, TTFT 20 ms (+ a little spread) vs `slower` times that: +20% and +40% are
    # significant but within the 50% tolerance (shared engines: the busier arm queues longer), 2x is harm.
    o = CanaryOutcomes()
    for arm in ("candidate", "incumbent"):
        for i in range(40):
            ttft = 20.0 * (slower if arm == "candidate" else 1.0) + (i % 5) * 0.1
            for k in range(2):
                o.add(0, sample(f"{arm}-u{i}", arm, 1.0, ttft=ttft, n=k), "cand", "inc")
    d = decide(progress(), o, CFG, at(10))
    g = d.numbers["guardrails"]["ttft_ms"]
    assert g["lower"] > 0 and g["allowed"] == pytest.approx(10.0, abs=0.1)  # half the incumbent's mean
    assert g["harmed"] is harmed and (d.action == "abort_harm") is harmed, d.reason


def test_equal_arms_pass_the_step_and_the_last_step_awaits_approval():
    o = outcomes(40, 40)
    d = decide(progress(step=0, share=0.5), o, CFG, at(700))
    assert d.action == "next_step" and d.numbers["passed"] and d.numbers["reward"]["lower"] == 0.0
    last = decide(progress(step=2, share=0.5), outcomes(40, 40, step=2), CFG, at(700))
    assert last.action == "awaiting_approval" and last.numbers["last_step"]


def test_too_few_users_or_too_short_waits():
    assert decide(progress(), outcomes(10, 10), CFG, at(700)).action == "wait"
    assert decide(progress(), outcomes(40, 40), CFG, at(100)).action == "wait"  # min duration not met


def test_max_duration_without_passing_is_inconclusive():
    d = decide(progress(), outcomes(10, 10), CFG, at(3600))
    assert d.action == "abort_inconclusive" and not d.numbers["passed"]


def test_absence_of_detected_harm_never_passes():
    cfg = CanaryConfig(min_users_per_arm=3, min_step_s=0, max_step_s=3600, min_users_for_harm=3)
    d = decide(progress(), outcomes(4, 4, reward=noisy), cfg, at(10))
    assert d.numbers["reward"]["lower"] < -cfg.margin < d.numbers["reward"]["upper"]  # wide: no harm detected
    assert d.action == "wait" and not d.numbers["passed"]


def test_satisfaction_clearly_worse_aborts_harm():
    rew = lambda arm, i: (0.2 if arm == "candidate" else 0.9) + 0.01 * (i % 3)  # noqa: E731
    d = decide(progress(), outcomes(40, 40, reward=rew), CFG, at(10))
    assert d.action == "abort_harm" and d.numbers["reward"]["upper"] < -CFG.margin


def test_only_matching_experiment_arms_count_and_steps_are_stratified():
    o = CanaryOutcomes()
    assert not o.add(0, sample("u1", "anonymous", 1.0, version="inc"), "cand", "inc")
    assert not o.add(0, sample("u1", "eval", 1.0, version="cand"), "cand", "inc")
    assert not o.add(0, sample("u1", "candidate", 1.0, version="other"), "cand", "inc")
    assert not o.add(0, sample("u1", "incumbent", 1.0, version="cand"), "cand", "inc")
    assert o.add(0, sample("u1", "candidate", 1.0, finish="error", latency=50.0), "cand", "inc")
    assert o.add(1, sample("u2", "incumbent", 0.0), "cand", "inc")
    assert o.per_user(0, "candidate", "error_rate") == [1.0] and o.users(0, "incumbent") == {}
    assert o.per_user(1, "incumbent", "reward") == [0.0]


def test_a_drop_in_pass_rate_aborts_even_when_users_are_as_satisfied():
    """The verifier's pass rate is a guardrail the learner does not optimise: lower is worse."""
    o = CanaryOutcomes()
    for arm in ("candidate", "incumbent"):
        for i in range(40):
            for k in range(2):
                passed = float((i + k) % 4 != 0) if arm == "incumbent" else float((i + k) % 4 == 0)
                assert o.add(0, sample(f"{arm}-u{i}", arm, 0.5, n=k), "cand", "inc", passed=passed)
    d = decide(progress(), o, CFG, at(10))
    g = d.numbers["guardrails"]["pass_rate"]
    assert d.action == "abort_harm" and g["harmed"] and g["direction"] == "lower_is_worse"
    assert g["estimate"] == approx_ulps(0.25 - 0.75) and "pass_rate" in d.reason
    assert not d.numbers["guardrails"]["tpot_ms"]["harmed"]
    same = outcomes(40, 40)  # no scores at all: the guardrail has nothing to judge, and does not block
    assert "pass_rate" not in decide(progress(), same, CFG, at(700)).numbers["guardrails"]


def test_denominators_are_exposures_unless_configured_otherwise():
    o = CanaryOutcomes()
    assert not o.add(0, sample("u1", "candidate", 1.0, shown=False), "cand", "inc")  # feedback, never shown
    assert o.add(0, sample("u1", "candidate", 0.0, n=1), "cand", "inc")  # shown (silence: reward 0)
    assert o.per_user(0, "candidate", "reward") == [0.0]
    assert o.add(0, sample("u2", "candidate", 1.0, shown=False), "cand", "inc", denominator="feedback")
    assert CanaryConfig().denominator == "exposures"


def test_outcomes_round_trip():
    o = outcomes(3, 4, reward=noisy)
    o.add(1, sample("x", "candidate", 0.5, latency=42.0, finish="error"), "cand", "inc")
    assert not o.seen("flywheel.samples", 0, 5) and o.seen("flywheel.samples", 0, 3)
    back = CanaryOutcomes.from_dict(o.to_dict())
    assert back == o and back.to_dict() == o.to_dict()
    assert back.per_user(0, "incumbent", "reward") == o.per_user(0, "incumbent", "reward")
    with pytest.raises(ValueError, match="format"):
        CanaryOutcomes.from_dict({"format": 99})


def test_config_checks_the_ramp():
    with pytest.raises(ValueError, match="increasing"):
        CanaryConfig(steps=(0.5, 0.2))
    with pytest.raises(ValueError, match="increasing"):
        CanaryConfig(steps=(0.5, 1.0))


# ---- Gate.canary_step end to end -----------------------------------------------------------------
def files(vid: str) -> list[dict]:
    sha = hashlib.sha256(vid.encode()).hexdigest()
    return [{"path": f"store/{vid}.snapshot.fws", "sha256": sha, "bytes": 1, "kind": "snapshot"}]


@pytest.fixture
def world(tmp_path):
    reg = Registry(f"sqlite:///{tmp_path / 'registry.db'}")
    reg.bootstrap("base", files=files("base"))
    reg.register(version_id="v1", parent_id="base", files=files("v1"))
    reg.transition("v1", "evaluating", "gate", "test")
    reg.transition("v1", "canary", "gate", "test")
    bus = EmbeddedBus(tmp_path / "bus", partitions=2, fsync=False)
    yield reg, bus
    bus.close()
    reg.close()


def publish_traffic(
    bus: EmbeddedBus, share: float, cand_reward: float, per_arm: int = 40, ts: float | None = None
) -> None:
    """Users assigned as the gateway does (salt = the candidate's id) until each arm has `per_arm`;
    their completions end at `ts` (default: now)."""
    got = {"candidate": 0, "incumbent": 0}
    records, i, now = [], 0, time.time() if ts is None else ts
    while min(got.values()) < per_arm:
        user = f"user-{i}"
        i += 1
        arm = assign_arm("v1", "t1", user, share)
        if got[arm] >= per_arm:
            continue
        got[arm] += 1
        reward = cand_reward if arm == "candidate" else 1.0
        s = sample(user, arm, reward, version="v1" if arm == "candidate" else "base", ts=now)
        records.append((s.completion.completion_id, s.model_dump_json().encode()))
    records.append(("anon", sample("", "anonymous", 0.0, version="base", ts=now).model_dump_json().encode()))
    bus.publish_many(TOPICS["sample"], records)


def gate_for(reg, bus, route_lag_s: float = 0.0) -> Gate:
    """route_lag_s 0: these samples are made here after the step started, none routed at an older share."""
    cfg = GateConfig(canary=CanaryConfig(steps=(0.5,), min_step_s=0, max_step_s=3600, route_lag_s=route_lag_s))
    return Gate(reg, lambda: pytest.fail("no engine"), lambda v: pytest.fail("no load"), None, cfg, bus=bus)  # type: ignore[arg-type]


def test_canary_without_a_bus_waits(world):
    reg, _ = world
    gate = Gate(reg, lambda: pytest.fail("no engine"), lambda v: pytest.fail("no load"), None)  # type: ignore[arg-type]
    assert gate.step().action == "canary" and "canary" not in reg.get("v1").gate


def test_equal_arms_reach_awaiting_approval_with_share_zero(world):
    reg, bus = world
    gate = gate_for(reg, bus)
    first = gate.step()
    c = reg.get("v1").gate["canary"]
    assert first.action == "canary" and c["step"] == 0 and c["share"] == 0.5
    publish_traffic(bus, 0.5, cand_reward=1.0)
    done = gate.step()
    v = reg.get("v1")
    assert done.action == "awaiting_approval" and v.status == "awaiting_approval", done.detail
    assert v.gate["canary"]["share"] == 0.0
    counts = CanaryOutcomes.from_dict(v.gate["canary"]["counts"])
    assert len(counts.users(0, "candidate")) == 40 and len(counts.users(0, "incumbent")) == 40
    last = reg.audit("v1")[-1]
    assert last.to_status == "awaiting_approval" and last.details["users"] == {"candidate": 40, "incumbent": 40}
    assert gate.step().action == "awaiting_approval"  # nothing more: a person decides


def test_completions_ending_right_after_a_step_starts_are_not_counted_in_it(world):
    """They may have been routed at the previous share (gateways cache it): counted, they would make a
    ramp's first look see the previous step's split and abort on SRM."""
    reg, bus = world
    gate = gate_for(reg, bus, route_lag_s=3.0)
    gate.step()
    started = reg.get("v1").gate["canary"]["started_at"]
    t0 = datetime.fromisoformat(started).timestamp() if isinstance(started, str) else started.timestamp()
    publish_traffic(bus, 0.2, cand_reward=1.0, per_arm=10, ts=t0 + 1.0)  # routed at an older share
    gate.step()
    counts = CanaryOutcomes.from_dict(reg.get("v1").gate["canary"]["counts"])
    assert counts.users(0, "candidate") == {} and counts.users(0, "incumbent") == {}
    publish_traffic(bus, 0.5, cand_reward=1.0, ts=t0 + 3.5)
    assert gate.step().action == "awaiting_approval"


def test_a_malformed_sample_is_dead_lettered_and_the_canary_goes_on(world):
    """A record on the sample topic that is not a `SampleEvent` goes to the dead-letter topic with its
    topic, partition and offset (stage "gate.decode"), is counted, and the good samples around it still
    decide the step."""
    from feedback.dead_letter import DEAD_LETTER_TOPIC, DeadLetter

    reg, bus = world
    gate = gate_for(reg, bus)
    gate.step()
    bus.publish(TOPICS["sample"], "bad-1", b'{"not": "a sample"}')
    bus.publish(TOPICS["sample"], "bad-2", b"\xff\xfe")
    publish_traffic(bus, 0.5, cand_reward=1.0)
    assert gate.step().action == "awaiting_approval"
    consumer = bus.consumer(DEAD_LETTER_TOPIC, "reader")
    letters = [DeadLetter.model_validate_json(r.value) for r in consumer.poll(100, timeout_s=0.5)]
    consumer.close()
    assert sorted(x.key for x in letters) == ["bad-1", "bad-2"] and gate.unreadable_samples == 2
    assert {(x.topic, x.stage) for x in letters} == {(TOPICS["sample"], "gate.decode")}
    assert {x.raw() for x in letters} == {b'{"not": "a sample"}', b"\xff\xfe"} and all(x.offset >= 0 for x in letters)
    assert gate.metrics.stats["dead_lettered_malformed"] == 2


def test_a_much_worse_candidate_is_aborted(world):
    reg, bus = world
    gate = gate_for(reg, bus)
    gate.step()
    publish_traffic(bus, 0.5, cand_reward=0.0)
    done = gate.step()
    v = reg.get("v1")
    assert done.action == "abort_harm" and v.status == "aborted", done.detail
    assert v.gate["canary"]["share"] == 0.0
    assert reg.audit("v1")[-1].details["reward"]["upper"] < -0.03


def test_a_restarted_gate_resumes_and_counts_nothing_twice(world):
    reg, bus = world

    def mk(group: str = "gate.canary") -> Gate:
        c = CanaryConfig(
            steps=(0.5,), min_step_s=0, max_step_s=3600, min_users_per_arm=60, consumer_group=group, route_lag_s=0
        )
        return Gate(reg, lambda: None, lambda v: None, None, GateConfig(canary=c), bus=bus)  # type: ignore[arg-type, return-value]

    mk().step()
    publish_traffic(bus, 0.5, cand_reward=1.0)
    assert mk().step().action == "canary"  # 40 users per arm < 60: waits
    # A gate whose group is behind (a replay of every record): the persisted positions skip them.
    assert mk("gate.other").step().action == "canary"
    again = CanaryOutcomes.from_dict(reg.get("v1").gate["canary"]["counts"])
    assert len(again.users(0, "candidate")) == 40
    assert sum(r[0] for r in again.users(0, "candidate").values()) == 40


# ---- after promotion: the guardrails keep watching -----------------------------------------------
def test_guardrails_keep_running_after_promotion_and_raise_an_alert(world):
    reg, bus = world
    gate = gate_for(reg, bus)
    gate.step()
    publish_traffic(bus, 0.5, cand_reward=1.0)
    assert gate.step().action == "awaiting_approval"
    verdict = {"passed": True, "incumbent_id": "base", "artifact_sha256": reg.get("v1").artifact_sha256}
    reg.record_gate("v1", "offline", {**verdict, "suite_version": "s1", "numbers": {}}, "gate")
    assert gate.watch(reg.promoted(), []) is None  # the bootstrap had no canary: no baseline, no watch
    reg.approve("v1", "ops", "canary passed")
    gate.step()
    w = reg.get("v1").gate["watch"]
    assert not w["done"] and w["alerts"] == [] and len(w["counts"]["steps"]["0"]["incumbent"]) == 40
    now = time.time()
    # Slower (latency is not watched: before and after are different minutes of the machine) and failing.
    harmed = [
        sample(f"after-{i}", None, 1.0, version="v1", latency=300.0 + i % 3, ts=now, finish="error", ttft=50.0)
        for i in range(40)
    ]
    ignored = [sample("e1", "eval", 1.0, version="v1", latency=9e9, ts=now), sample("b", None, 1.0, ts=now)]
    bus.publish_many(TOPICS["sample"], [(s.completion.completion_id, s.model_dump_json().encode()) for s in harmed])
    bus.publish_many(TOPICS["sample"], [(s.completion.completion_id, s.model_dump_json().encode()) for s in ignored])
    gate.step()
    w = reg.get("v1").gate["watch"]
    assert [a["metric"] for a in w["alerts"]] == ["error_rate"] and gate.alerts == 1
    assert w["users"] == {"candidate": 40, "incumbent": 40} and set(w["guardrails"]) == {
        "error_rate"
    }  # no pass rates here
    assert reg.audit("v1")[-1].reason.startswith("ALERT: error_rate")
    gate.step()  # no new alert for the same metric
    assert gate.alerts == 1 and reg.promoted().id == "v1"  # it alerts; a person decides on a rollback


def test_the_verifier_scores_canary_completions_from_their_token_ids(tiny_checkpoint):
    from demo.checker import DemoVerifier
    from demo.split import sample_tasks
    from demo.tasks import completions_for
    from gating.gate_process import verifier_scorer
    from serving.tokenizer import Tokenizer

    tok = Tokenizer.from_file(tiny_checkpoint)
    task = sample_tasks(1, seed=3)[0]
    good, bad = completions_for(task)["correct_preferred"][0], completions_for(task)["incorrect_other"][0]
    ids = tok.encode_prompt(task.prompt)
    samples = [sample("u", "candidate", 1.0, n=i) for i in range(3)]
    samples = [
        s.model_copy(update={"completion": s.completion.model_copy(update={"prompt_ids": p, "text": t})})
        for s, p, t in zip(samples, [ids, ids, tok.encode_prompt("# not a task\n")], [good, bad, good])
    ]
    assert verifier_scorer(DemoVerifier(), tok)(samples) == [1.0, 0.0, None]


def test_guardrail_harm_tests_split_alpha_over_guardrails_and_steps():
    assert CanaryConfig().harm_alpha == approx_ulps(0.05 / 12)  # 4 guardrails x 3 steps
    assert CanaryConfig(steps=(0.5,), guardrails=("ttft_ms",)).harm_alpha == approx_ulps(0.05)
    assert CanaryConfig(guardrail_alpha=0.01).harm_alpha == 0.01


# ---- progress is state; decisions are audited; ρ, extensions, lapsed time --------------------------
def test_looks_are_stored_on_the_version_and_only_decisions_are_audited(world):
    reg, bus = world
    cfg = GateConfig(
        canary=CanaryConfig(steps=(0.5,), min_step_s=0, max_step_s=3600, min_users_per_arm=60, route_lag_s=0)
    )
    gate = Gate(reg, lambda: pytest.fail("no engine"), lambda v: pytest.fail("no load"), None, cfg, bus=bus)  # type: ignore[arg-type]
    gate.step()
    for _ in range(3):  # three looks with new samples, 40 users per arm (< 60): it waits
        publish_traffic(bus, 0.5, cand_reward=1.0)
        assert gate.step().action == "canary"
    c = reg.get("v1").gate["canary"]
    reasons = [a.reason for a in reg.audit("v1") if a.action == "record_gate"]
    assert len(reasons) == 1 and reasons[0].startswith("canary started at 50%; ρ "), reasons
    assert len(c["history"]) == 3 and c["history"][-1]["users"] == {"candidate": 40, "incumbent": 40}
    assert c["rho"] > 0 and c["expected_users"] >= 120 and c["active_s"] >= 0  # at least what the step needs
    lo, hi = c["history"][-1]["diff"][1:]
    assert lo <= 0.0 <= hi


def test_the_step_is_sized_from_the_users_metered_before_it(world):
    reg, bus = world
    cfg = GateConfig(canary=CanaryConfig(steps=(0.5,), min_users_per_arm=2, max_step_s=3600, route_lag_s=0))
    gate = Gate(reg, lambda: None, lambda v: None, None, cfg, bus=bus)  # type: ignore[arg-type, return-value]
    now = time.time()
    before = [sample(f"m{i}", None, 0.0, version="base", ts=now - 100) for i in range(500)]
    gate.meter([(None, s) for s in before])  # type: ignore[misc]
    plan = gate.step_plan(0.5)
    assert plan["expected_users"] == 500 and plan["expected_from"] == "measured"
    assert plan["rho"] == approx_ulps(step_rho(500))
    pinned = Gate(reg, lambda: None, lambda v: None, None, GateConfig(canary=CanaryConfig(expected_users=2000)))  # type: ignore[arg-type, return-value]
    assert pinned.step_plan(0.2)["rho"] == approx_ulps(step_rho(2000))


def test_a_step_that_runs_out_ahead_is_extended_once_then_inconclusive():
    ahead = lambda arm, i: (0.6 if arm == "candidate" else 0.5) + 0.3 * (i % 2)  # noqa: E731
    cfg = CanaryConfig(min_users_per_arm=30, min_step_s=600, max_step_s=3600, margin=0.01)
    p = progress().model_copy(update={"rho": 10.0, "active_s": 3600.0})
    o = outcomes(31, 31, reward=ahead)
    d = decide(p, o, cfg, at(3600))
    assert d.action == "extend" and "inconclusive" in d.reason and "extended" in d.reason
    again = decide(p.model_copy(update={"extensions": 1, "active_s": 3700.0}), o, cfg, at(3700))
    assert again.action == "wait"  # within its extension
    out = decide(p.model_copy(update={"extensions": 1, "active_s": 7200.0}), o, cfg, at(7200))
    assert out.action == "abort_inconclusive" and out.numbers["inconclusive"] == {"ahead": True, "extensions": 1}
    behind = decide(
        p,
        outcomes(31, 31, reward=lambda a, i: ahead("incumbent" if a == "candidate" else "candidate", i)),
        cfg,
        at(3600),
    )
    assert behind.action == "abort_inconclusive" and not behind.numbers["inconclusive"]["ahead"]


def test_time_without_a_live_lease_does_not_count_toward_the_step(world):
    reg, bus = world
    clock = [T0 + timedelta(days=3650)]
    cfg = GateConfig(canary=CanaryConfig(steps=(0.5,), min_step_s=0, max_step_s=3600, route_lag_s=0))
    gate = Gate(reg, lambda: None, lambda v: None, None, cfg, bus=bus, clock=lambda: clock[0])  # type: ignore[arg-type, return-value]
    gate.lease_s = 15.0
    reg.beat_gate("g1", host="h", pid=1, beat_s=5.0, at=clock[0])
    gate.step()
    clock[0] += timedelta(seconds=10)
    reg.beat_gate("g1", host="h", pid=1, beat_s=5.0, at=clock[0])
    gate.step()
    clock[0] += timedelta(seconds=100)  # the gate was down: its lease lapsed 15 s after its last beat
    reg.beat_gate("g1", host="h", pid=1, beat_s=5.0, at=clock[0])
    gate.step()
    c = reg.get("v1").gate["canary"]
    assert c["active_s"] == pytest.approx(25.0) and c["lapsed_s"] == pytest.approx(85.0)
    clock[0] += timedelta(seconds=30)  # no beat for 30 s: no live lease now
    gate.step()
    c = reg.get("v1").gate["canary"]
    assert c["active_s"] == pytest.approx(25.0) and c["lapsed_s"] == pytest.approx(115.0)
