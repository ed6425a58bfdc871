"""The joiner and the learner on the Kafka bus (a real Kafka-protocol broker, tansu, started here):
several instances in one consumer group split the partitions, and nothing is lost or repeated."""

from __future__ import annotations

import sys
import threading
import time
import uuid
from pathlib import Path

import pytest

from core.harness import free_port, wait_until
from core.supervisor import Supervisor
from feedback.bus_kafka import KafkaBus
from feedback.events import TOPICS, CompletionEvent, FeedbackEvent, RoutedExperts, SampleEvent
from feedback.joiner import JoinerService, sample_event_id
from feedback.rewards import RewardSpec
from tests.conftest import approx_ulps, served_samples
from tests.feedback.conftest import FAST_CONSUMER, kafka_broker, read_until, running_broker  # noqa: F401 (fixtures)

pytestmark = pytest.mark.kafka
PARTITIONS = 4
ROOT = Path(__file__).resolve().parents[1]
RANK = (
    "from core.supervisor import child_setup; child_setup(); from tests.test_services_on_kafka import _learner_rank; "
)


def kafka_bus(broker, folder) -> KafkaBus:
    return KafkaBus(broker.bootstrap, folder, partitions=PARTITIONS, send_timeout_s=5, consumer_config=FAST_CONSUMER)


def completion(cid: str, ts: float) -> CompletionEvent:
    return CompletionEvent(
        event_id=f"ev-c-{cid}",
        completion_id=cid,
        tenant="t1",
        ts=ts,
        user_id=f"user-{cid}",
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


def feedback(cid: str, kind: str, ts: float) -> FeedbackEvent:
    return FeedbackEvent(
        event_id=f"ev-f-{cid}-{kind}", completion_id=cid, tenant="t1", ts=ts, user_id=f"user-{cid}", kind=kind
    )


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

    def no_errors() -> None:
        assert not errors, errors

    try:
        wait_until(
            lambda: (
                joiners[0].partitions
                and joiners[1].partitions
                and sorted(joiners[0].partitions + joiners[1].partitions) == list(range(PARTITIONS))
            ),
            60,
            what="the joiners' group settling",
            check=no_errors,
        )
        n, kinds = 60, ("accepted", "thumb_down", "copied")
        for i in range(n):  # a third of the feedback is published before its completion
            c, f = completion(f"cmp-{i}", time.time()), feedback(f"cmp-{i}", kinds[i % 3], time.time())
            for ev in (f, c) if i % 3 == 2 else (c, f):
                topic = TOPICS["completion"] if isinstance(ev, CompletionEvent) else TOPICS["feedback"]
                buses[2].publish(topic, ev.completion_id, ev.model_dump_json().encode())
        buses[2].flush(30)
        samples: dict[str, SampleEvent] = {}

        def read() -> None:
            for r in checker.poll(200, timeout_s=0.5):
                s = SampleEvent.model_validate_json(r.value)
                assert s.event_id not in samples, "a sample was emitted twice"
                samples[s.event_id] = s

        read_until(read, lambda: len(samples) >= n, 60, what=f"{n} samples", quiet_s=1.5)
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
        assert s.reward == approx_ulps(want[kinds[i % 3]]), (i, s.signals)
    assert emitted[0] and emitted[1] and not set(emitted[0]) & set(emitted[1])  # both worked, on different keys
    for j in joiners:
        assert j.stats["late"] == 0 and j.stats["orphans_expired"] == 0 and j.stats["tenant_mismatch"] == 0
    for b in buses:
        b.close()


# ---- the learner: data-parallel ranks are the members of one consumer group ------------------------
N_SAMPLES = 40


def _learner_rank(rank: int, world_size: int, port: int, bootstrap: str, root: str, base: str, topic: str) -> None:
    import hashlib
    import json
    from pathlib import Path

    import torch

    from learner.distributed import init_process_group
    from learner.service import LearnerConfig, LearnerService
    from learner.trainer import TrainerConfig
    from registry.registry import Registry

    torch.set_num_threads(1)
    init_process_group(rank, world_size, "127.0.0.1", port, timeout_s=120)
    root_dir = Path(root)
    bus = KafkaBus(
        bootstrap,
        root_dir / f"spool-rank{rank}",
        partitions=PARTITIONS,
        send_timeout_s=5,
        consumer_config=FAST_CONSUMER,
    )
    # Batch sizes depend on when each rank's polls return, so the number of versions varies: staleness
    # is not what this test is about (a fourth version would make the base's samples stale). A lone last
    # sample must be trainable by the time trigger (with min_samples=2 it waited forever: 39 of 40).
    cfg = LearnerConfig(
        update_every_samples=10,
        min_samples=1,
        update_every_s=2.0,
        topic=topic,
        max_staleness=1000,
        max_lag_updates=None,  # no gate promotes here: the learner would wait at the bound
        trainer=TrainerConfig(lr=1e-3),
    )
    svc = LearnerService(bus, Registry(f"sqlite:///{root_dir}/registry.db"), root_dir / "models", base, cfg)
    try:
        for _ in range(600):  # the same number of rounds on every rank: `trained` is the same on all
            if svc.counters["trained"] >= N_SAMPLES:
                break
            if svc.consumer.assignment():
                (root_dir / f"rank{rank}.ready").touch()
            svc.run_once(timeout_s=0.2)
        weights = hashlib.sha256(b"".join(t.detach().numpy().tobytes() for t in svc.model.state_dict().values()))
        (root_dir / f"rank{rank}.json").write_text(
            json.dumps(
                {
                    "trained": svc.counters["trained"],
                    "partitions": sorted(svc.partitions_read),
                    "current": svc.current,
                    "weights": weights.hexdigest(),
                }
            )
        )
    finally:
        svc.close()
        bus.close()
        torch.distributed.destroy_process_group()


@pytest.fixture(scope="module")
def samples(tiny_checkpoint):
    return served_samples(tiny_checkpoint, [0.75 if i % 3 else -0.25 for i in range(N_SAMPLES)], max_tokens=8)


@pytest.mark.slow
def test_two_data_parallel_learner_ranks_split_the_partitions_and_train_each_sample_once(
    running_broker, tmp_path, tiny_checkpoint, samples
):  # noqa: F811
    import json

    from registry.registry import Registry

    Registry(f"sqlite:///{tmp_path}/registry.db")  # tables exist before the ranks open it
    topic = f"samples-{uuid.uuid4().hex[:8]}"  # the broker is the module's: other tests publish samples too
    args = (2, free_port(), running_broker.bootstrap, str(tmp_path), str(tiny_checkpoint), topic)
    with Supervisor("learner-ranks") as sup:

        def ranks_ok() -> None:
            for c in sup.children.values():
                assert c.returncode in (None, 0), f"{c.name} exited with {c.returncode}:\n{c.tail()}"

        for rank in (0, 1):
            code = f"{RANK}_learner_rank({rank}, *{args!r})"
            sup.start(f"rank{rank}", [sys.executable, "-c", code], cwd=ROOT, log_path=tmp_path / f"rank{rank}.log")
        producer = kafka_bus(running_broker, tmp_path / "spool-product")
        try:
            ready = [tmp_path / f"rank{r}.ready" for r in (0, 1)]
            wait_until(lambda: all(p.exists() for p in ready), 90, what="both ranks in their group", check=ranks_ok)
            for ev in samples:
                producer.publish(topic, ev.completion.completion_id, ev.model_dump_json().encode())
            producer.flush(30)
            wait_until(
                lambda: not any(c.alive() for c in sup.children.values()),
                210,
                what="the learner ranks training every sample",
                interval_s=0.2,
                check=ranks_ok,
            )
        finally:
            producer.close()
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1)]
    assert ranks[0]["weights"] == ranks[1]["weights"] and ranks[0]["current"] == ranks[1]["current"]
    assert ranks[0]["partitions"] and ranks[1]["partitions"]  # each rank read its own share...
    assert not set(ranks[0]["partitions"]) & set(ranks[1]["partitions"])  # ...and only its own
    state = json.loads((tmp_path / "models" / "learner.json").read_text())
    assert sorted(state["trained_ids"]) == sorted(ev.event_id for ev in samples)  # each sample once
    assert ranks[0]["trained"] == N_SAMPLES and len(state["versions"]) >= 3
    reg = Registry(f"sqlite:///{tmp_path}/registry.db")
    last = reg.get(state["current"])
    assert last.status == "candidate" and last.parent_id == state["versions"][-2]
    assert last.metrics["world_size"] == 2
    covered = [sum(end - start for start, end in reg.get(v).data_range[topic].values()) for v in state["versions"][1:]]
    assert sum(covered) == N_SAMPLES  # the versions' data ranges add up to every sample, once
