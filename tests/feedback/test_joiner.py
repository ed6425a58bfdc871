"""The joiner: the pure core (windows, orphans, late, duplicates, tenants, budgets), the service
against a real EmbeddedBus (end to end, crash and resume), and simulated users' rewards."""

import subprocess
import sys
import threading
from collections import defaultdict
from statistics import mean

import pytest

from core.service_metrics import ServiceMetrics
from demo.checker import CheckResult
from demo.split import sample_tasks
from demo.tasks import CATEGORIES, completions_for
from demo.users import SimulatedUser
from feedback.bus_embedded import EmbeddedBus
from feedback.events import TOPICS, CompletionEvent, FeedbackEvent, RoutedExperts, SampleEvent
from feedback.joiner import JoinerCore, JoinerService, sample_event_id
from feedback.rewards import RewardSpec
from tests.conftest import approx_ulps

SPEC = RewardSpec()
WINDOW = 60.0


def completion(cid, ts, tenant="t1", user="u1"):
    return CompletionEvent(
        event_id=f"event-completion-{cid}",
        completion_id=cid,
        tenant=tenant,
        ts=ts,
        user_id=user,
        model_version="v1",
        endpoint="completions",
        prompt_ids=[1, 2],
        output_ids=[3],
        logprobs=[-0.5],
        routed_experts=RoutedExperts.from_bytes((2, 1, 1), b"\x00\x01"),
        text="x",
        finish_reason="stop",
        params={},
        latency_ms={},
    )


def feedback(cid, kind, ts, value=None, tenant="t1", user="u1", event_id=None):
    return FeedbackEvent(
        event_id=event_id or f"event-feedback-{cid}-{kind}-{ts}-{user}",
        completion_id=cid,
        tenant=tenant,
        ts=ts,
        user_id=user,
        kind=kind,
        value=value,
    )


def core(**spec_kwargs):
    return JoinerCore(RewardSpec(**spec_kwargs), WINDOW, clock=lambda: pytest.fail("tick must get `now`"))


# ---- core --------------------------------------------------------------------------------------
def test_join_within_window_emits_one_sample_when_the_window_closes():
    j = core()
    j.on_completion(completion("c1", 0.0))
    j.on_feedback(feedback("c1", "accepted", 10.0))
    j.on_feedback(feedback("c1", "copied", 20.0))
    assert j.tick(59.0) == [] and j.tick(60.0) == []  # the window [0, 60] is still open
    [s] = j.tick(60.5)
    assert s.completion.completion_id == "c1" and s.reward == approx_ulps(1.0)
    assert [x.kind for x in s.signals] == ["accepted", "copied"] and s.signals[0].user_id == "u1"
    assert s.reward_spec == "default-v1" and s.tenant == "t1" and s.ts == 60.0
    assert s.event_id == sample_event_id("c1", "default-v1")
    assert j.tick(1000.0) == []
    assert {k: j.stats[k] for k in ("completions", "feedback", "samples", "late", "no_feedback")} == {
        "completions": 1,
        "feedback": 2,
        "samples": 1,
        "late": 0,
        "no_feedback": 0,
    }


def test_feedback_before_its_completion_is_buffered_then_joined_or_expired():
    j = core()
    j.on_feedback(feedback("c2", "thumb_down", 5.0))
    j.on_feedback(feedback("ghost", "thumb_up", 0.0))
    assert j.orphan_count == 2
    j.on_completion(completion("c2", 0.0))
    assert j.orphan_count == 1
    [s] = j.tick(61.0)
    assert s.completion.completion_id == "c2" and s.reward == approx_ulps(-0.5)
    assert j.orphan_count == 0 and j.stats["orphans_expired"] == 1  # ghost: 0 + 60 < 61


def test_orphan_buffer_is_bounded():
    j = JoinerCore(SPEC, WINDOW, max_orphans=3)
    for i in range(5):
        j.on_feedback(feedback(f"nobody{i}", "thumb_up", float(i)))
    assert j.orphan_count == 3 and j.stats["orphans_overflow"] == 2
    j.on_completion(completion("nobody0", 0.0))  # its orphan was evicted first (oldest expiry)
    assert j.tick(100.0) == [] and j.stats["no_feedback"] == 1


def test_late_feedback_is_counted_per_kind_and_handed_out():
    j = core()
    j.on_completion(completion("c1", 0.0))
    assert j.tick(61.0) == [] and j.stats["no_feedback"] == 1
    j.on_feedback(feedback("c1", "thumb_up", 70.0))  # its completion is closed
    j.on_completion(completion("c3", 100.0))
    j.on_feedback(feedback("c3", "rating", 200.0, value=5))  # ts after c3's window, c3 still open
    j.on_feedback(feedback("c4", "accepted", 300.0))  # before its completion, and past its window
    j.on_completion(completion("c4", 200.0))
    assert j.stats["late"] == 3
    assert (j.stats["late_thumb_up"], j.stats["late_rating"], j.stats["late_accepted"]) == (1, 1, 1)
    late = j.drain_late()
    assert [(x.event.completion_id, x.reason) for x in late] == [
        ("c1", "closed"),
        ("c3", "past_window"),
        ("c4", "past_window"),
    ]
    assert j.drain_late() == []
    assert j.tick(1000.0) == [] and j.stats["no_feedback"] == 3 and j.stats["samples"] == 0


def test_duplicate_events_are_ignored():
    j = core()
    c = completion("c1", 0.0)
    f = feedback("c1", "rating", 1.0, value=4, event_id="same-id-1")
    j.on_completion(c)
    j.on_completion(c)  # redelivered
    j.on_feedback(f)
    j.on_feedback(f)  # redelivered
    j.on_feedback(feedback("c1", "thumb_up", 2.0, event_id="same-id-1"))  # same id, other content
    [s] = j.tick(61.0)
    assert [x.kind for x in s.signals] == ["rating"] and s.reward == approx_ulps(0.25)
    assert (j.stats["completions"], j.stats["feedback"], j.stats["duplicates"]) == (1, 1, 3)
    j.on_completion(c)  # redelivered after its window closed: no second sample
    assert j.tick(2000.0) == [] and j.stats["duplicates"] == 4 and j.stats["samples"] == 1


def test_feedback_from_another_tenant_is_rejected():
    j = core()
    j.on_feedback(feedback("c1", "thumb_up", 1.0, tenant="evil"))  # as an orphan first
    j.on_completion(completion("c1", 0.0, tenant="t1"))
    j.on_feedback(feedback("c1", "accepted", 2.0, tenant="evil"))
    j.on_feedback(feedback("c1", "rejected", 3.0, tenant="t1"))
    [s] = j.tick(61.0)
    assert j.stats["tenant_mismatch"] == 2
    assert [x.kind for x in s.signals] == ["rejected"] and s.reward == approx_ulps(-0.25)


def test_completions_without_counting_feedback_emit_nothing():
    j = core()
    j.on_completion(completion("quiet", 0.0))
    j.on_completion(completion("dwell-only", 0.0))
    j.on_feedback(feedback("dwell-only", "dwell", 5.0, value=12.0))
    j.on_feedback(feedback("dwell-only", "dwell", 8.0, value=20.0, user="u2"))
    assert j.tick(61.0) == []
    assert j.stats["no_feedback"] == 2 and j.stats["samples"] == 0
    assert j.stats["unrewarded_signals"] == 2  # rule 6: dwell alone, never shown; counted, not silent


def test_every_exposed_completion_yields_a_sample_silence_included():
    j = core(silence=-0.2)
    for cid in ("shown-ignored", "shown-liked", "never-shown"):
        j.on_completion(completion(cid, 0.0))
    j.on_feedback(feedback("shown-ignored", "shown", 1.0))
    j.on_feedback(feedback("shown-liked", "shown", 1.0))
    j.on_feedback(feedback("shown-liked", "accepted", 5.0))
    j.on_feedback(feedback("never-shown", "dwell", 5.0, value=3.0))
    j.on_feedback(feedback("shown-ignored", "thumb_up", WINDOW + 1.0))  # past the window: silence stands
    out = {s.completion.completion_id: s for s in j.tick(WINDOW + 2.0)}
    assert set(out) == {"shown-ignored", "shown-liked"}
    assert out["shown-ignored"].reward == approx_ulps(-0.2) and out["shown-ignored"].silent
    assert out["shown-liked"].reward == approx_ulps(0.75) and out["shown-liked"].exposed
    assert not out["shown-liked"].silent
    assert j.stats["samples"] == 2 and j.stats["silent"] == 1 and j.stats["no_feedback"] == 1
    assert j.stats["late"] == 1


def test_feedback_without_user_is_attributed_to_the_completions_user():
    j = core()
    j.on_completion(completion("c1", 0.0, user="alice"))
    j.on_feedback(feedback("c1", "thumb_up", 1.0, user=None))
    j.on_feedback(feedback("c1", "thumb_up", 2.0, user="alice"))  # the same user: counts once
    j.on_feedback(feedback("c1", "copied", 3.0, user="bob"))
    [s] = j.tick(61.0)
    assert [(x.kind, x.user_id) for x in s.signals] == [("thumb_up", "alice"), ("copied", "bob")]
    assert s.reward == approx_ulps(0.75)


def test_user_budget_drops_and_counts_signals_beyond_it():
    j = core(max_rewarded_per_user=2, budget_window_s=100.0)
    for i in range(3):
        j.on_completion(completion(f"c{i}", float(i)))
        j.on_feedback(feedback(f"c{i}", "accepted", i + 1.0, user="mallory"))
        j.on_feedback(feedback(f"c{i}", "copied", i + 1.5, user="mallory"))
    j.on_feedback(feedback("c2", "thumb_down", 5.0, user="carol"))
    samples = j.tick(100.0)
    assert [s.reward for s in samples] == approx_ulps([1.0, 1.0, -0.5])  # c2: only carol counts
    assert j.stats["dropped_by_budget"] == 2
    j.on_completion(completion("c9", 150.0))  # c0 and c1 (ts 0, 1) have left the window (50, 150]
    j.on_feedback(feedback("c9", "accepted", 151.0, user="mallory"))
    assert [s.reward for s in j.tick(300.0)] == [0.75]


def test_the_anonymous_budget_is_per_tenant():
    """300 anonymous completions over two tenants, a budget of 150: every one is rewarded."""
    j = core(max_rewarded_per_user=150, budget_window_s=1e6)
    for i in range(300):
        tenant = "t0" if i % 2 else "t1"
        j.on_completion(completion(f"c{i}", float(i), tenant=tenant, user=None))
        j.on_feedback(feedback(f"c{i}", "accepted", i + 0.5, tenant=tenant, user=None))
    assert len(j.tick(5000.0)) == 300 and j.stats["dropped_by_budget"] == 0
    j.on_completion(completion("one-more", 400.0, tenant="t0", user=None))  # over t0's budget
    j.on_feedback(feedback("one-more", "accepted", 400.5, tenant="t0", user=None))
    assert j.tick(5000.0) == [] and j.stats["dropped_by_budget"] == 1


def test_sample_ids_are_deterministic_per_completion_and_spec():
    def run(spec):
        j = JoinerCore(spec, WINDOW)
        j.on_completion(completion("c1", 0.0))
        j.on_feedback(feedback("c1", "thumb_up", 1.0))
        return j.tick(61.0)[0]

    a, b, other = run(SPEC), run(SPEC), run(RewardSpec(name="other-v2"))
    assert a.event_id == b.event_id == sample_event_id("c1", "default-v1")
    assert a.model_dump() == b.model_dump()
    assert other.event_id != a.event_id and other.reward_spec == "other-v2"
    assert sample_event_id("c2", "default-v1") != a.event_id


def test_oldest_held_tracks_sources_of_pending_and_orphans():
    j = core()
    j.on_completion(completion("c1", 0.0), ("comp", 0, 4))
    j.on_feedback(feedback("c1", "thumb_up", 1.0), ("fb", 1, 7))
    j.on_feedback(feedback("later", "thumb_up", 30.0), ("fb", 1, 9))  # orphan
    j.on_feedback(feedback("c1", "copied", 2.0), ("fb", 1, 8))
    assert j.oldest_held() == {("comp", 0): 4, ("fb", 1): 7}
    j.tick(61.0)  # c1 closes; the orphan (expires at 90) is still held
    assert j.oldest_held() == {("fb", 1): 9}
    j.tick(91.0)
    assert j.oldest_held() == {}


def test_window_must_be_positive():
    with pytest.raises(ValueError, match="window_s"):
        JoinerCore(SPEC, 0.0)


def test_feedback_package_does_not_import_torch():
    code = "import sys, feedback.joiner, feedback.rewards; assert 'torch' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)


# ---- service against a real embedded bus ------------------------------------------------------
class Clock:
    def __init__(self, t=0.0):
        self.t = t

    def __call__(self):
        return self.t


def publish(bus, ev):
    topic = TOPICS["completion"] if isinstance(ev, CompletionEvent) else TOPICS["feedback"]
    bus.publish(topic, ev.completion_id, ev.model_dump_json().encode())


def read_samples(bus, group="learner-test"):
    c = bus.consumer(TOPICS["sample"], group)
    out = []
    while records := c.poll(1000, timeout_s=0.0):
        out += [(r.key, SampleEvent.model_validate_json(r.value)) for r in records]
    c.close()
    return out


def test_service_end_to_end_with_safe_commits(tmp_path):
    bus = EmbeddedBus(tmp_path)
    clock = Clock(10.0)
    metrics = ServiceMetrics("joiner", tmp_path / "metrics", interval_s=0)
    svc = JoinerService(bus, SPEC, window_s=WINDOW, clock=clock, metrics=metrics)
    publish(bus, feedback("c0", "thumb_up", 1.0))  # feedback before its completion
    for i in range(12):
        publish(bus, completion(f"c{i}", float(i)))
        if i % 2 == 0:
            publish(bus, feedback(f"c{i}", "accepted", i + 2.0))
    publish(bus, feedback("c3", "accepted", 500.0))  # late: after c3's window
    assert svc.run_once(0.0) == []
    # Every record is held by an open window: nothing may be committed yet.
    assert bus.committed(TOPICS["completion"], "joiner") == {}
    assert bus.committed(TOPICS["feedback"], "joiner") == {}

    clock.t = 1000.0
    samples = svc.run_once(0.0)
    evens = sorted(f"c{i}" for i in range(0, 12, 2))
    assert sorted(s.completion.completion_id for s in samples) == evens
    consumed = dict(read_samples(bus))
    assert sorted(consumed) == evens  # keyed by completion_id
    assert consumed["c0"].reward == approx_ulps(1.0)  # accepted + thumb_up
    assert all(consumed[f"c{i}"].reward == approx_ulps(0.75) for i in range(2, 12, 2))
    assert consumed["c4"].event_id == sample_event_id("c4", SPEC.name)
    assert (svc.stats["samples"], svc.stats["no_feedback"], svc.stats["late"]) == (6, 6, 1)
    # Nothing is held any more: everything consumed is committed.
    assert sum(bus.committed(TOPICS["completion"], "joiner").values()) == 12
    assert sum(bus.committed(TOPICS["feedback"], "joiner").values()) == 8
    assert metrics.consumed == {TOPICS["completion"]: 12, TOPICS["feedback"]: 8}
    assert metrics.produced == {TOPICS["sample"]: 6} and metrics.stats["late"] == 1
    text = (tmp_path / "metrics" / "joiner.prom").read_text()
    assert f'flywheel_service_produced_records_total{{service="joiner",topic="{TOPICS["sample"]}"}} 6.0' in text
    svc.close()
    bus.close()


class CrashingBus(EmbeddedBus):
    """The real embedded bus; the process 'dies' in flush number `crash_at` (after publishing the
    round's samples, before committing the round's offsets)."""

    crash_at = 0

    def flush(self, timeout_s=30.0):
        self.crash_at -= 1
        if self.crash_at == 0:
            raise SystemExit("simulated crash")


def expected_reward(i):
    kinds = {1: ["accepted"], 2: ["thumb_down"], 3: ["accepted", "copied"], 4: ["rejected", "rating"]}
    return {1: 0.75, 2: -0.5, 3: 1.0, 4: -0.75}.get(i % 5), kinds.get(i % 5, [])


def test_crash_and_resume_yields_exactly_one_sample_per_completion(tmp_path):
    n, window = 80, 10.0
    bus = CrashingBus(tmp_path)
    bus.crash_at = 2
    for i in range(n):  # i % 5 == 0: no feedback; every 7th completion's feedback comes first
        events = [feedback(f"c{i}", k, i + 1.0, value=(1 if k == "rating" else None)) for k in expected_reward(i)[1]]
        events.insert(0 if i % 7 else len(events), completion(f"c{i}", float(i)))
        for ev in events:
            publish(bus, ev)
    clock = Clock(30.0)
    svc = JoinerService(bus, SPEC, window_s=window, clock=clock, max_records=16)
    first = svc.run_once(0.0)  # closes c0..c19
    assert len(first) == 16
    clock.t = 55.0
    with pytest.raises(SystemExit):
        svc.run_once(0.0)  # publishes c20..c44's samples, crashes before committing
    del svc  # no close(), no commit
    bus.close()

    bus = EmbeddedBus(tmp_path)
    clock = Clock(70.0)
    svc = JoinerService(bus, SPEC, window_s=window, clock=clock, max_records=16)
    svc.run_once(0.0)
    clock.t = 1000.0
    svc.run_once(0.0)
    assert svc.stats["late"] == 0 and svc.stats["orphans_expired"] == 0

    samples = read_samples(bus)
    by_id = defaultdict(list)
    for key, s in samples:
        by_id[s.event_id].append(s)
        assert key == s.completion.completion_id
    with_feedback = [i for i in range(n) if i % 5]
    assert len(by_id) == len(with_feedback) == 64
    assert sorted(by_id) == sorted(sample_event_id(f"c{i}", SPEC.name) for i in with_feedback)
    assert len(samples) == 64 + 20  # c20..c44 (20 with feedback) were emitted again after the crash
    for i in with_feedback:
        copies = by_id[sample_event_id(f"c{i}", SPEC.name)]
        assert [s.reward for s in copies] == approx_ulps([expected_reward(i)[0]] * len(copies))
    # After the restart's final round nothing is held: every record is committed.
    assert sum(bus.committed(TOPICS["completion"], "joiner").values()) == n
    assert sum(bus.committed(TOPICS["feedback"], "joiner").values()) == sum(
        len(expected_reward(i)[1]) for i in range(n)
    )
    bus.close()


# ---- simulated users -------------------------------------------------------------------------
def test_simulated_users_reward_correct_house_style_above_incorrect():
    j = JoinerCore(SPEC, WINDOW)
    users = [SimulatedUser(f"user{k}", seed=7) for k in range(10)]
    category_of = {}
    for i, task in enumerate(sample_tasks(200, seed=3)):
        category = CATEGORIES[i % 4]
        text = completions_for(task)[category][0]
        check = CheckResult(passed=category.startswith("correct"), n_passed=0, n_tests=0, error=None)
        cid, ts, user = f"c{i}", float(i), users[i % 10]
        j.on_completion(completion(cid, ts, user=user.user_id))
        category_of[cid] = category
        for k, signal in enumerate(user.react(task, text, check)):
            j.on_feedback(feedback(cid, signal.kind, ts + 1 + 0.1 * k, value=signal.value, user=user.user_id))
    samples = j.tick(10_000.0)
    assert len(samples) == 200  # every reaction has an accept, reject or regenerate
    rewards = defaultdict(list)
    for s in samples:
        rewards[category_of[s.completion.completion_id]].append(s.reward)
    good = mean(rewards["correct_preferred"])
    bad = mean(rewards["incorrect_preferred"] + rewards["incorrect_other"])
    assert good > mean(rewards["correct_other"]) > bad
    assert good - bad > 0.5


def test_a_malformed_record_goes_to_the_dead_letter_topic_and_the_joiner_carries_on(tmp_path):
    from feedback.dead_letter import DEAD_LETTER_TOPIC, DeadLetter

    bus = EmbeddedBus(tmp_path)
    bus.publish(TOPICS["feedback"], "c1", b"{not json")
    svc = JoinerService(bus, SPEC, window_s=WINDOW, clock=Clock(100.0))
    publish(bus, completion("c1", 0.0))
    publish(bus, feedback("c1", "thumb_up", 90.0))  # late
    assert svc.run_once(0.0) == []
    assert (svc.stats["malformed"], svc.stats["late"], svc.stats["late_thumb_up"]) == (1, 1, 1)
    c = bus.consumer(DEAD_LETTER_TOPIC, "inspect")
    letters = [DeadLetter.model_validate_json(r.value) for r in c.poll(10, timeout_s=0.0)]
    by_stage = {x.stage: x for x in letters}
    bad = by_stage["joiner.decode"]
    assert (bad.topic, bad.offset, bad.raw()) == (TOPICS["feedback"], 0, b"{not json")
    assert set(by_stage) == {"joiner.decode"}  # late feedback is counted, not a letter
    bus.close()


def test_run_until_stopped_then_leaves_the_group(tmp_path):
    bus = EmbeddedBus(tmp_path)
    svc = JoinerService(bus, SPEC, window_s=WINDOW, clock=Clock(1000.0))
    publish(bus, completion("c1", 0.0))
    publish(bus, feedback("c1", "accepted", 1.0))
    stop = threading.Event()
    t = threading.Thread(target=svc.run, args=(stop, 0.05))
    t.start()
    learner = bus.consumer(TOPICS["sample"], "learner")
    records = learner.poll(10, timeout_s=10.0)
    stop.set()
    t.join(timeout=10)
    assert not t.is_alive()
    assert [r.key for r in records] == ["c1"]
    with pytest.raises(RuntimeError, match="closed"):
        svc.consumer.poll(1, timeout_s=0.0)
    bus.close()


# ---- several joiners in one group -------------------------------------------------------------
def test_release_forgets_what_came_from_lost_partitions_and_lets_it_count_again():
    j = core()
    j.on_completion(completion("c1", 0.0), (TOPICS["completion"], 1, 0))
    j.on_feedback(feedback("c1", "accepted", 1.0), (TOPICS["feedback"], 1, 0))
    j.on_completion(completion("c2", 0.0), (TOPICS["completion"], 2, 0))
    j.on_feedback(feedback("c2", "thumb_up", 1.0), (TOPICS["feedback"], 2, 0))
    j.on_feedback(feedback("ghost", "thumb_up", 1.0), (TOPICS["feedback"], 1, 1))  # orphan from p1
    assert j.release({1}) == 3
    assert j.pending_count == 1 and j.orphan_count == 0
    assert j.oldest_held() == {(TOPICS["completion"], 2): 0, (TOPICS["feedback"], 2): 0}
    assert [s.completion.completion_id for s in j.tick(100.0)] == ["c2"]  # c1's window is gone with it
    # The partition comes back (read again from the committed position): its events count again.
    j.on_completion(completion("c1", 0.0), (TOPICS["completion"], 1, 0))
    j.on_feedback(feedback("c1", "accepted", 1.0), (TOPICS["feedback"], 1, 0))
    [s] = j.tick(100.0)
    assert s.completion.completion_id == "c1" and s.reward == approx_ulps(0.75)
    assert j.stats["duplicates"] == 0


def test_a_second_joiner_takes_half_the_partitions_and_every_sample_is_emitted_once(tmp_path):
    bus = EmbeddedBus(tmp_path, partitions=4)
    n = 40
    for i in range(n):
        publish(bus, completion(f"c{i}", float(i)))
        publish(bus, feedback(f"c{i}", "accepted" if i % 2 else "thumb_down", i + 1.0))
    clock = Clock(50.0)  # no window (60 s) has closed yet: the first joiner holds everything
    a = JoinerService(bus, SPEC, window_s=WINDOW, clock=clock)
    assert a.run_once(0.0) == [] and a.core.pending_count == n
    b = JoinerService(bus, SPEC, window_s=WINDOW, clock=clock)  # the group rebalances: 2 partitions each
    assert a.run_once(0.0) == []
    assert b.run_once(0.0) == []
    owned = {name: {p for _, p in s.consumer.assignment()} for name, s in (("a", a), ("b", b))}
    assert owned["a"] and owned["b"] and not owned["a"] & owned["b"]
    assert a.core.pending_count + b.core.pending_count == n  # a forgot what b now holds
    clock.t = 1000.0
    samples = a.run_once(0.0) + b.run_once(0.0)
    assert sorted(s.completion.completion_id for s in samples) == sorted(f"c{i}" for i in range(n))
    assert all(s.reward == approx_ulps(0.75 if int(s.completion.completion_id[1:]) % 2 else -0.5) for s in samples)
    emitted = [s.event_id for _, s in read_samples(bus)]
    assert len(emitted) == len(set(emitted)) == n  # once each: a emitted nothing for b's partitions
    for st in (a.stats, b.stats):
        assert st["late"] == 0 and st["orphans_expired"] == 0
    # Everything is committed, each partition by its owner.
    assert sum(bus.committed(TOPICS["completion"], "joiner").values()) == n
    assert sum(bus.committed(TOPICS["feedback"], "joiner").values()) == n
    a.close()
    b.close()
    bus.close()


def test_windows_close_at_the_producers_watermark_not_past_it(tmp_path):
    """A gateway's spool holding feedback (the broker away) holds its watermark back: the joiner closes
    no window past it, so feedback that reaches the bus late still counts; once the watermark moves
    on, the window closes with it."""
    bus = EmbeddedBus(tmp_path)
    clock = Clock(1000.0)
    mark = {"at": 50.0}  # the gateway still holds something accepted at t=50
    svc = JoinerService(bus, SPEC, window_s=WINDOW, clock=clock, watermark=lambda: mark["at"])
    publish(bus, completion("c1", 10.0))  # window closes at 70: past the clock, not past the watermark
    assert svc.run_once(0.0) == [] and svc.held_s == 950.0 and svc.rounds_clock_only == 0
    publish(bus, feedback("c1", "accepted", 55.0))  # what the spool held, delivered at last
    mark["at"] = None  # no live producer: the clock alone (`cli.main.producer_watermark` logs it)
    samples = svc.run_once(0.0)
    assert [s.completion.completion_id for s in samples] == ["c1"] and samples[0].reward == approx_ulps(0.75)
    assert [sig.event_id for sig in samples[0].signals] == ["event-feedback-c1-accepted-55.0-u1"]
    assert svc.stats["late"] == 0 and svc.rounds_clock_only == 1  # the degraded path, counted
    svc.close()
    bus.close()


def test_a_window_closes_grace_s_after_it_ends_and_counts_only_feedback_stamped_inside_it():
    c = JoinerCore(SPEC, WINDOW, grace_s=5.0)
    c.on_completion(completion("c1", 10.0))
    assert c.tick(71.0) == []  # the window ended at 70; feedback stamped before then may still come
    c.on_feedback(feedback("c1", "accepted", 69.0))
    c.on_feedback(feedback("c1", "copied", 72.0))  # stamped after the window: late, grace or not
    (sample,) = c.tick(75.5)
    assert [s.kind for s in sample.signals] == ["accepted"] and c.stats["late"] == 1
    with pytest.raises(ValueError, match="grace_s"):
        JoinerCore(SPEC, WINDOW, grace_s=-1.0)


class SlowBus(EmbeddedBus):
    """The real embedded bus whose flush times out while `slow` (a broker too slow to take the samples)."""

    slow = True

    def flush(self, timeout_s=30.0):
        if self.slow:
            raise TimeoutError("spool: 3 records not forwarded after 30.0s")


def test_a_flush_that_times_out_commits_nothing_and_the_joiner_goes_on(tmp_path):
    bus = SlowBus(tmp_path)
    clock = Clock(10.0)
    svc = JoinerService(bus, SPEC, window_s=WINDOW, clock=clock)
    publish(bus, completion("c1", 1.0))
    publish(bus, feedback("c1", "accepted", 2.0))
    clock.t = 1000.0
    assert len(svc.run_once(0.0)) == 1  # published (spooled), not confirmed: no commit
    assert bus.committed(TOPICS["completion"], "joiner") == {}
    bus.slow = False
    svc.run_once(0.0)
    assert sum(bus.committed(TOPICS["completion"], "joiner").values()) == 1
    svc.close()
    bus.close()
