"""The first book of the fault harness (`bench/faults.py`): every feedback event the gateways accepted
is a signal in exactly one sample. Read from the bus once the traffic has ended: the samples topic from
the start; for the events in no sample, where each was lost (`trace_missing`), and which were replaced
by a later signal of the same user and kind under the reward rules (`superseded_ids`), belonged to a
completion that earns no reward (`unrewarded_ids`: dwell alone, never reported shown), or were dropped
by the joiner's per-user budget (`budget_dropped_ids`), not lost."""

from __future__ import annotations

import json
import logging
import os
import time
from collections import defaultdict
from typing import Any

log = logging.getLogger(__name__)
MAX_TRACED = 200  # missing events listed in the result (the first, by id); all of them are traced


def exactly_once_book(
    settings: Any,
    traffic: Any,
    tenant: str,
    window_s: float,
    quiet_s: float,
    timeout_s: float,
    budget: tuple[int, float] | None = None,
) -> dict[str, Any]:
    """Book 1 over the run's `traffic` (`demo.traffic.Traffic`) for `tenant` (module docstring). `budget`:
    the reward spec's (`max_rewarded_per_user`, `budget_window_s`), to tell the events the joiner's
    per-user budget dropped by design from lost ones."""
    accepted = accepted_ids(traffic, tenant)
    # the events the joiner's per-user budget drops by design: not waited for, and counted apart
    capped = budget_dropped_ids(traffic, tenant, *budget) & accepted if budget is not None else set()
    signals_of: dict[str, list[tuple[str | None, str, float]]] = {}
    samples, took, caught_up = read_samples(settings, window_s, accepted - capped, quiet_s, timeout_s, signals_of)
    once = exactly_once(accepted, samples) | {"all_seen_after_s": round(took, 1), "joiner_caught_up": caught_up}
    left = once.pop("all_missing_ids")
    if budget is not None:
        missing_capped = capped & set(left)
        once["capped_by_budget"] = len(missing_capped)
        once["capped_but_in_a_sample"] = len(capped) - len(missing_capped)  # the replay's order differed
        once["joiner_dropped_by_budget"] = joiner_stat(settings, "dropped_by_budget")  # signals, its own count
        left = [e for e in left if e not in missing_capped]
        once["missing"] = len(left)
        once["missing_ids"] = left[:MAX_TRACED]
        once["ok"] = once["missing"] == 0 and not _doubles(once)
    if left:  # where each was lost: before the bus, or between the bus and a sample; every one is traced
        try:
            traced = trace_missing(settings, set(left))
            events = traced["events"]
            on_topic = [t for t in events.values() if t["on_feedback_topic"]]
            once["traced_where"] = {  # over every event traced, those the rules explain included
                "never_on_feedback_topic": len(events) - len(on_topic),
                "on_it_no_completion_on_bus": sum(not t["completion_on_bus"] for t in on_topic),
                "on_it_with_completion": sum(bool(t["completion_on_bus"]) for t in on_topic),
            }
            superseded = superseded_ids(events, signals_of)
            once["superseded"] = len(superseded)  # rule 2: a later signal of the user's replaced it
            unrewarded = unrewarded_ids(events, signals_of) - superseded
            once["unrewarded"] = len(unrewarded)  # rule 6: only dwell, never shown: no sample at all
            once["joiner_unrewarded_signals"] = joiner_stat(settings, "unrewarded_signals")
            by_rule = superseded | unrewarded
            left = [e for e in left if e not in by_rule]
            once["missing"] = len(left)
            once["missing_ids"] = left[:MAX_TRACED]
            once["missing_examples"] = left[:10]
            # the post-mortem of what is still missing (the first MAX_TRACED), not of what the rules explain
            once["missing_traced"] = {"read_to_end": traced["read_to_end"],
                                      "events": {e: events[e] for e in left[:MAX_TRACED]}}  # fmt: skip
            once["ok"] = once["missing"] == 0 and not _doubles(once)
        except Exception as e:  # a post-mortem: its failure must not lose the books
            log.exception("faults: tracing the missing events failed")
            once["missing_traced_error"] = repr(e)
    return once


def _doubles(once: dict[str, Any]) -> int:
    return once["in_more_than_one_sample"] + once["twice_in_one_sample"] + once["re_emitted_with_other_signals"]


def accepted_ids(traffic: Any, tenant: str) -> set[str]:
    """The event ids of the feedback the gateways accepted: every key sent, less those given up."""
    from feedback.events import event_id_for

    return {event_id_for(tenant, k) for k in traffic.feedback_keys if k not in traffic.feedback_given_up}


def read_samples(
    settings: Any,
    window_s: float,
    expected: set[str],
    quiet_s: float = 15.0,
    timeout_s: float = 900.0,
    signals_of: dict[str, list[tuple[str | None, str, float]]] | None = None,
) -> tuple[dict[str, Any], float, bool | None]:
    """Every sample on the samples topic, read from the start by a group of its own: sample id -> the
    list of its records' signals (event ids); the seconds it took; and whether the joiner was seen
    caught up (None on the embedded bus, where that is not asked). Reads until every `expected` event
    id has been seen in a sample, or until the joiner has caught up (`JoinerLag.caught_up`) and the
    samples topic has been read to the end it had then, or `timeout_s`; then `quiet_s` more for repeats.
    Events that no sample will ever hold (replaced by a later signal under the reward rules) end the
    wait only through the joiner's catching up: waiting for them alone ran every full run to its timeout."""
    from feedback.connect import open_bus
    from feedback.events import TOPICS, SampleEvent

    signals_of = {} if signals_of is None else signals_of  # completion id -> its sample's (user, kind, ts)
    t0 = time.monotonic()
    time.sleep(window_s)
    bus = open_bus(settings, "faults-books")
    consumer = bus.consumer(TOPICS["sample"], group=f"faults-books-{os.getpid()}-{time.time_ns()}")
    lag = JoinerLag(settings, settle_s=max(2 * window_s, quiet_s)) if settings.bus == "kafka" else None
    out: dict[str, list[list[str]]] = defaultdict(list)
    seen: set[str] = set()
    deadline = t0 + timeout_s
    caught_up: bool | None = None if lag is None else False
    sample_ends: dict[tuple[str, int], int] | None = None

    def read() -> int:
        got = consumer.poll(max_records=5000, timeout_s=1.0)
        for r in got:
            s = SampleEvent.model_validate_json(r.value)
            ids = [sig.event_id for sig in s.signals]
            out[s.event_id].append(ids)
            seen.update(ids)
            signals_of[s.completion.completion_id] = [(g.user_id, g.kind, g.ts) for g in s.signals]
        return len(got)

    try:
        while not expected <= seen and time.monotonic() < deadline:
            got = read()
            if lag is None or sample_ends is not None:
                if sample_ends is not None and not got and consumer.reached(sample_ends):
                    break  # the joiner had caught up, and every sample it had published is read
                continue
            if lag.caught_up():
                caught_up = True
                sample_ends = consumer.ends()  # what the joiner published, all of it below these
                if sample_ends is None or not consumer.assignment():
                    sample_ends = None  # asked again next time round
                    caught_up = False
        last_new = time.monotonic()
        while time.monotonic() - last_new < quiet_s and time.monotonic() < deadline + quiet_s:
            if read():
                last_new = time.monotonic()
    finally:
        consumer.close()
        bus.close()
        if lag is not None:
            lag.close()
    return out, time.monotonic() - t0, caught_up


class JoinerLag:
    """Whether the joiner's group has committed every completion and feedback record on the bus (Kafka).
    The traffic has ended when the books begin, so the topics' ends no longer move: once the group's
    committed positions reach the ends listed now and stay put for `settle_s`, the joiner has read every
    record, closed every window and flushed every sample (it commits a record only after its sample is on
    the bus, `feedback.joiner`). The settling covers tansu 0.6, which sometimes lists the first offset of
    a partition's last batch as its end."""

    def __init__(self, settings: Any, group: str = "joiner", settle_s: float = 30.0):
        from kafka import KafkaAdminClient, KafkaConsumer, TopicPartition

        from feedback.events import TOPICS

        self.group, self.settle_s = group, settle_s
        self._admin = KafkaAdminClient(bootstrap_servers=settings.kafka_bootstrap, client_id="faults-lag")
        probe = KafkaConsumer(bootstrap_servers=settings.kafka_bootstrap, client_id="faults-lag-probe")
        try:
            tps = [TopicPartition(t, p) for t in (TOPICS["completion"], TOPICS["feedback"])
                   for p in sorted(probe.partitions_for_topic(t) or ())]  # fmt: skip
            self.ends = {tp: int(o) for tp, o in probe.end_offsets(tps).items()}
        finally:
            probe.close()
        self._last: dict[Any, int] | None = None
        self._since = time.monotonic()

    def caught_up(self) -> bool:
        try:
            offsets = self._admin.list_group_offsets({self.group: list(self.ends)})[self.group]
        except Exception as e:  # the broker busy or restarting: not known yet, asked again
            log.warning("faults: the joiner's committed offsets: %r", e)
            return False
        committed = {tp: int(om.offset) for tp, om in offsets.items() if tp in self.ends}
        if committed != self._last:
            self._last, self._since = committed, time.monotonic()
        behind = [tp for tp, end in self.ends.items() if end > 0 and committed.get(tp, 0) < end]
        return not behind and time.monotonic() - self._since >= self.settle_s

    def close(self) -> None:
        self._admin.close()


def exactly_once(accepted: set[str], samples: dict[str, list[list[str]]]) -> dict[str, Any]:
    """Each accepted event in exactly one sample, once (module docstring, book 1)."""
    where: dict[str, set[str]] = defaultdict(set)
    twice_in_one = 0
    differing = 0
    for sid, records in samples.items():
        if any(sorted(r) != sorted(records[0]) for r in records[1:]):
            differing += 1  # a re-emitted sample whose signals changed: its first record is what a learner keeps
        ids = records[0]
        twice_in_one += len(ids) - len(set(ids))
        for eid in ids:
            where[eid].add(sid)
    missing = sorted(accepted - where.keys())
    in_many = sorted(e for e in accepted if len(where.get(e, ())) > 1)
    return {
        "accepted": len(accepted),
        "samples": len(samples),
        "sample_records": sum(len(r) for r in samples.values()),
        "missing": len(missing),
        "in_more_than_one_sample": len(in_many),
        "twice_in_one_sample": twice_in_one,
        "re_emitted_with_other_signals": differing,
        "counted_not_acknowledged": len(where.keys() - accepted),
        "missing_examples": missing[:10],
        "missing_ids": missing[:MAX_TRACED],
        "all_missing_ids": missing,
        "ok": not missing and not in_many and not twice_in_one and not differing,
    }


def trace_missing(settings: Any, missing: set[str], timeout_s: float = 600.0) -> dict[str, Any]:
    """Where accepted events that reached no sample were lost: each id's feedback record on the feedback
    topic (else it never reached the bus: lost between the gateway's answer and the broker), and its
    completion's record on the completion topic (else the joiner could not join it). Both topics read
    from the start, to their ends, by groups of their own; `read_to_end` says whether each got there
    within `timeout_s` (if not, "not found" means "not read")."""
    from feedback.connect import open_bus
    from feedback.events import TOPICS, FeedbackEvent

    bus = open_bus(settings, "faults-trace")
    found: dict[str, dict[str, Any]] = {}
    completions: set[str] = set()
    read_to_end: dict[str, bool] = {}
    try:
        for topic in ("feedback", "completion"):
            consumer = bus.consumer(TOPICS[topic], group=f"faults-trace-{topic}-{os.getpid()}-{time.time_ns()}")
            try:
                ends = None  # asked once the group has given this reader its partitions
                deadline = time.monotonic() + timeout_s
                while time.monotonic() < deadline and not (ends and consumer.reached(ends)):
                    if ends is None and consumer.assignment():
                        ends = consumer.ends()
                    for r in consumer.poll(max_records=5000, timeout_s=1.0):
                        if topic == "feedback":
                            ev = FeedbackEvent.model_validate_json(r.value)
                            if ev.event_id in missing:
                                found[ev.event_id] = {"partition": r.partition, "offset": r.offset,
                                                      "completion_id": ev.completion_id, "ts": ev.ts, "kind": ev.kind,
                                                      "value": ev.value, "user": ev.user_id}  # fmt: skip
                        else:  # only the id: a completion record is large
                            completions.add(json.loads(r.value)["completion_id"])
                read_to_end[topic] = bool(ends) and consumer.reached(ends)
            finally:
                consumer.close()
    finally:
        bus.close()
    events: dict[str, Any] = {}
    for eid in sorted(missing):
        rec = found.get(eid)
        if rec is None:
            events[eid] = {"on_feedback_topic": False}
        else:
            events[eid] = {"on_feedback_topic": True, **rec, "completion_on_bus": rec["completion_id"] in completions}
    return {"read_to_end": read_to_end, "events": events}


def superseded_ids(traced: dict[str, Any], signals_of: dict[str, list[tuple[str | None, str, float]]]) -> set[str]:
    """Traced events that are in no sample by the reward rules, not by a loss: the sample of their
    completion holds a signal of the same user and kind (or exclusive group: `feedback.rewards`) stamped
    at or after them, which replaced them (`counted_signals`: the latest per user and kind counts)."""
    from feedback.rewards import EXCLUSIVE_GROUPS

    def group(kind: str) -> Any:
        return next((g for g in EXCLUSIVE_GROUPS if kind in g), kind)

    out: set[str] = set()
    for eid, t in traced.items():
        if not t.get("on_feedback_topic") or "kind" not in t:
            continue
        for user, kind, ts in signals_of.get(t["completion_id"], []):
            if (t["user"] is None or user == t["user"]) and group(kind) == group(t["kind"]) and ts >= t["ts"]:
                out.add(eid)
                break
    return out


def unrewarded_ids(traced: dict[str, Any], signals_of: dict[str, list[tuple[str | None, str, float]]]) -> set[str]:
    """Traced events in no sample because their completion earned no reward (`feedback.rewards.reward`
    is None, rule 6: never reported shown, and only dwell): their completion has no sample, and the
    rule, replayed on its traced events, gives none. Its `shown` was given up (a gateway down) or never
    sent, while a later dwell got through. The joiner counts these as `unrewarded_signals`."""
    from feedback.events import Signal
    from feedback.rewards import RewardSpec, reward

    by_completion: dict[str, list[tuple[str, dict[str, Any]]]] = defaultdict(list)
    for eid, t in traced.items():
        if t.get("on_feedback_topic") and "kind" in t and t["completion_id"] not in signals_of:
            by_completion[t["completion_id"]].append((eid, t))
    out: set[str] = set()
    for events in by_completion.values():
        signals = [Signal(kind=t["kind"], value=t.get("value"), ts=t["ts"], user_id=t["user"], event_id=eid)
                   for eid, t in events]  # fmt: skip
        if reward(RewardSpec(), signals) is None:  # which signals earn nothing does not depend on the weights
            out.update(eid for eid, _ in events)
    return out


def budget_dropped_ids(traffic: Any, tenant: str, max_per_window: int, window_s: float) -> set[str]:
    """Accepted events the joiner's per-user budget drops by design (`feedback.rewards.UserBudget`: a user
    rewards at most `max_per_window` completions per `window_s`): the rule itself, fed each user's
    completions with accepted feedback in the order they returned (the joiner closes them in the order
    of their timestamps; at the boundary two completions in flight at once may swap). Every accepted
    event of a completion whose user the budget refuses."""
    from feedback.events import event_id_for
    from feedback.rewards import UserBudget

    given_up = traffic.feedback_given_up
    by_completion: dict[str, list[str]] = defaultdict(list)  # completion id -> its accepted keys
    user_of: dict[str, str] = {}
    for key in traffic.feedback_keys:
        if key in given_up or key not in traffic.feedback_of:
            continue
        cid, user = traffic.feedback_of[key]
        by_completion[cid].append(key)
        user_of[cid] = user
    rule = UserBudget(max_per_window, window_s)
    out: set[str] = set()
    for cid in sorted(by_completion, key=lambda c: traffic.completed_at.get(c, 0.0)):
        if not rule.admit(f"{tenant}/{user_of[cid]}", cid, traffic.completed_at.get(cid, 0.0)):
            out.update(event_id_for(tenant, k) for k in by_completion[cid])
    return out


def joiner_stat(settings: Any, name: str) -> float | None:
    """One of the joiner's own numbers from the metrics file it writes (`core.service_metrics`), or None."""
    from core.service_metrics import SUFFIX

    path = settings.home / "metrics" / f"joiner{SUFFIX}"
    try:
        text = path.read_text()
    except OSError:
        return None
    for line in text.splitlines():
        if line.startswith("flywheel_service_stat{") and f'name="{name}"' in line:
            return float(line.rsplit(" ", 1)[1])
    return None
