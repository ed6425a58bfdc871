"""The joiner and the learner on the Kafka bus (a real Kafka-protocol broker, tansu, started here):
several instances in one consumer group split the partitions, and nothing is lost or repeated."""

from __future__ import annotations

import threading
import time
import uuid

import pytest

from feedback.bus_kafka import KafkaBus
from feedback.events import TOPICS, CompletionEvent, FeedbackEvent, RoutedExperts, SampleEvent
from feedback.joiner import JoinerService, sample_event_id
from feedback.rewards import RewardSpec
from tests.feedback.conftest import FAST_CONSUMER, kafka_broker, running_broker  # noqa: F401 (fixtures)

pytestmark = pytest.mark.kafka
PARTITIONS = 4


def kafka_bus(broker, folder) -> KafkaBus:
    return KafkaBus(broker.bootstrap, folder, partitions=PARTITIONS, send_timeout_s=5, consumer_config=FAST_CONSUMER)


def completion(cid: str, ts: float) -> CompletionEvent:
    return CompletionEvent(
        event_id=f"ev-c-{cid}", completion_id=cid, tenant="t1", ts=ts, user_id=f"user-{cid}",
        model_version="v1", endpoint="completions", prompt_ids=[1, 2], output_ids=[3], logprobs=[-0.5],
        routed_experts=RoutedExperts.from_bytes((2, 1, 1), b"\x00\x01"), text="x", finish_reason="stop",
        params={}, latency_ms={})


def feedback(cid: str, kind: str, ts: float) -> FeedbackEvent:
    return FeedbackEvent(event_id=f"ev-f-{cid}-{kind}", completion_id=cid, tenant="t1", ts=ts,
                         user_id=f"user-{cid}", kind=kind)


@pytest.mark.slow
def test_two_joiners_split_the_partitions_and_join_every_completion_with_its_feedback(running_broker, tmp_path):  # noqa: F811
    spec, group = RewardSpec(), f"joiner-{uuid.uuid4().hex[:8]}"
    buses = [kafka_bus(running_broker, tmp_path / f"spool{i}") for i in range(3)]  # 2 joiners + the product
    joiners = [JoinerService(buses[i], spec, window_s=2.0, group=group) for i in (0, 1)]
    stop, errors = threading.Event(), []
    emitted: list[list[str]] = [[], []]

    def run(i: int) -> None:
        try:
            while not stop.is_set():
                emitted[i] += [s.event_id for s in joiners[i].run_once(0.2)]
        except BaseException as e:  # surfaced below
            errors.append(e)

    threads = [threading.Thread(target=run, args=(i,), daemon=True) for i in (0, 1)]
    for t in threads:
        t.start()
    checker = buses[2].consumer(TOPICS["sample"], f"check-{uuid.uuid4().hex[:8]}")
    try:
        deadline = time.monotonic() + 60
        while not (joiners[0].partitions and joiners[1].partitions
                   and sorted(joiners[0].partitions + joiners[1].partitions) == list(range(PARTITIONS))):
            assert time.monotonic() < deadline, "the joiners' group did not settle"
            assert not errors, errors
            time.sleep(0.1)
        n, kinds = 60, ("accepted", "thumb_down", "copied")
        for i in range(n):  # a third of the feedback is published before its completion
            c, f = completion(f"cmp-{i}", time.time()), feedback(f"cmp-{i}", kinds[i % 3], time.time())
            for ev in ((f, c) if i % 3 == 2 else (c, f)):
                topic = TOPICS["completion"] if isinstance(ev, CompletionEvent) else TOPICS["feedback"]
                buses[2].publish(topic, ev.completion_id, ev.model_dump_json().encode())
        buses[2].flush(30)
        samples: dict[str, SampleEvent] = {}
        deadline = time.monotonic() + 60
        while len(samples) < n and time.monotonic() < deadline:
            for r in checker.poll(200, timeout_s=0.5):
                s = SampleEvent.model_validate_json(r.value)
                assert s.event_id not in samples, "a sample was emitted twice"
                samples[s.event_id] = s
        time.sleep(1.0)
        assert not checker.poll(200, timeout_s=0.5), "a sample was emitted twice"
    finally:
        stop.set()
        for t in threads:
            t.join(timeout=15)
        for j in joiners:
            j.close()
        checker.close()
    assert not errors, errors
    assert sorted(samples) == sorted(sample_event_id(f"cmp-{i}", spec.name) for i in range(n))
    want = {"accepted": 0.75, "thumb_down": -0.5, "copied": 0.25}
    for i in range(n):
        s = samples[sample_event_id(f"cmp-{i}", spec.name)]
        assert s.reward == pytest.approx(want[kinds[i % 3]]), (i, s.signals)
    assert emitted[0] and emitted[1] and not set(emitted[0]) & set(emitted[1])  # both worked, on different keys
    for j in joiners:
        assert j.stats["late"] == 0 and j.stats["orphans_expired"] == 0 and j.stats["tenant_mismatch"] == 0
    for b in buses:
        b.close()
