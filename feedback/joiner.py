"""The joiner: attributes feedback to completions, turns each completion's signals into one reward,
and publishes one `SampleEvent` per rewarded completion for the learner.

Two layers:

* `JoinerCore` — a pure state machine (no I/O, time passed in): `on_completion`, `on_feedback`,
  `tick(now) -> [SampleEvent]`. Feedback counts for a completion when its `ts` is at most
  `window_s` after the completion's `ts`. The completion's window closes at `ts + window_s`; the
  first `tick(now)` with `now` past that emits its sample (reward by `feedback.rewards`), or
  nothing if no signal counted (`no_feedback`). Feedback that arrives before its completion
  (completions and feedback travel on different topics) waits in a bounded orphan buffer until
  `fb.ts + window_s`; by then any completion it could belong to has closed, so it expires
  (`orphans_expired`). Feedback for a closed completion, or with a `ts` past the window, is late:
  counted per kind (`late`, `late_<kind>`), kept for the caller to log or dead-letter
  (`drain_late()`), never silently dropped. Redelivered events (same `event_id`) are ignored via
  a bounded seen-set; feedback from another tenant than its completion's is rejected and counted.
  A user over their `UserBudget` has their signals dropped and counted (`dropped_by_budget`).
  The sample is deterministic: `event_id` = hash(completion_id, spec name), `ts` = window close.

* `JoinerService` — wires the core to an `EventBus`: consumes the completion and feedback topics
  as one member of one consumer group (one consumer on both topics), publishes samples keyed by completion_id, and commits safely. The core
  remembers the source (topic, partition, offset) of every record it still holds (pending
  completions, their signals, orphans); after the samples of a round are published and flushed,
  each partition is committed up to, not including, its oldest held record (or past everything
  consumed when it holds none). A crash therefore loses nothing: restart re-consumes from the
  committed positions and rebuilds the state. Samples published before the crash may be emitted
  again, with the same `event_id`; the learner drops ids it has seen.

  Windows close on event time guarded by processing time: each round reads the clock *before*
  draining both topics to their current end, then ticks with that reading. Every event stamped
  before that instant was published before it (the gateway stamps `ts` when it publishes), so it
  has been read: a window never closes on feedback that is still sitting in the bus, also not
  while replaying a backlog after a restart. A round that cannot drain (more than
  `max_records_per_round` waiting) does not tick; windows stay open until the joiner catches up.

Several joiners can share the work in one group: both topics are partitioned by completion_id
with the same function, and each joiner is one group member on both topics, which the buses
assign partition p of both topics together (equal partition counts; Kafka's range assignor, the
embedded bus's round-robin), so a completion meets its feedback. When a rebalance takes
partitions away, the joiner forgets what it held from them (`JoinerCore.release`) and stops
committing them; their new owner reads them again from the committed position. Deliberate simplifications: the seen-set, the set of closed completions and the user budgets live
in memory, so after a restart late feedback for a completion closed before the crash counts as
an orphan, and budgets start empty. Feedback without a user id is attributed to the completion's
user; budgets are kept per tenant and user (the anonymous user of each tenant has its own). Called by `flywheel joiner` and the demo.
"""

from __future__ import annotations

import hashlib
import heapq
import itertools
import logging
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field

from pydantic import ValidationError

from feedback.bus import Consumer, EventBus, Record
from feedback.events import FEEDBACK_KINDS, TOPICS, CompletionEvent, FeedbackEvent, SampleEvent, Signal
from feedback.rewards import RewardSpec, UserBudget, counted_signals, reward, user_key

log = logging.getLogger(__name__)

Source = tuple[str, int, int]  # (topic, partition, offset) of the bus record an event came from
STAT_KEYS = ("completions", "feedback", "samples", "late", "duplicates", "no_feedback", "dropped_by_budget",
             "tenant_mismatch", "orphans_expired", "orphans_overflow", "malformed")


def sample_event_id(completion_id: str, spec_name: str) -> str:
    """Deterministic: a replayed completion yields the same sample id, which the learner dedupes."""
    return hashlib.sha256(f"sample:{completion_id}:{spec_name}".encode()).hexdigest()[:32]


@dataclass
class _Pending:
    completion: CompletionEvent
    deadline: float
    signals: list[Signal] = field(default_factory=list)
    sources: list[Source] = field(default_factory=list)
    event_ids: list[str] = field(default_factory=list)  # the completion's and its attached feedback's


@dataclass(frozen=True)
class LateFeedback:
    event: FeedbackEvent
    source: Source | None
    reason: str  # "closed" (its completion was already emitted) or "past_window" (ts after the window)


class _BoundedSet:
    """Remembers the last `capacity` keys added (FIFO eviction)."""

    def __init__(self, capacity: int):
        self.capacity = capacity
        self._d: OrderedDict[str, None] = OrderedDict()

    def __contains__(self, key: str) -> bool:
        return key in self._d

    def add(self, key: str) -> None:
        self._d[key] = None
        while len(self._d) > self.capacity:
            self._d.popitem(last=False)

    def discard(self, key: str) -> None:
        self._d.pop(key, None)


class JoinerCore:
    """Pure join state: completions waiting for their window to close, orphan feedback, counters.

    `source` (optional on every input) is where the event came from on the bus; `oldest_held()`
    reports, per partition, the oldest source still held, so a caller knows what it may commit.
    """

    def __init__(self, spec: RewardSpec, window_s: float, clock: Callable[[], float] = time.time, *,
                 max_orphans: int = 100_000, max_seen: int = 200_000, max_closed: int = 200_000,
                 max_late_kept: int = 10_000):
        if not window_s > 0:
            raise ValueError(f"window_s must be > 0, got {window_s}")
        if max_orphans < 1:
            raise ValueError(f"max_orphans must be >= 1, got {max_orphans}")
        self.spec, self.window_s, self.clock = spec, window_s, clock
        self.max_orphans, self.max_late_kept = max_orphans, max_late_kept
        self.budget = UserBudget.from_spec(spec)
        self.stats: dict[str, int] = {k: 0 for k in STAT_KEYS} | {f"late_{k}": 0 for k in FEEDBACK_KINDS}
        self._pending: dict[str, _Pending] = {}
        self._deadlines: list[tuple[float, int, str]] = []  # heap of (deadline, seq, completion_id)
        self._orphans: dict[str, list[tuple[FeedbackEvent, Source | None]]] = {}
        self._n_orphans = 0
        self._orphan_expiry: list[tuple[float, int, str, str]] = []  # heap of (expiry, seq, cid, event_id)
        self._seq = itertools.count()
        self._seen = _BoundedSet(max_seen)
        self._closed = _BoundedSet(max_closed)
        self._late: list[LateFeedback] = []

    # ---- input ---------------------------------------------------------------------------------
    def on_completion(self, ev: CompletionEvent, source: Source | None = None) -> None:
        if ev.event_id in self._seen or ev.completion_id in self._pending or ev.completion_id in self._closed:
            self.stats["duplicates"] += 1
            return
        self._seen.add(ev.event_id)
        self.stats["completions"] += 1
        p = _Pending(ev, ev.ts + self.window_s, sources=[source] if source is not None else [],
                     event_ids=[ev.event_id])
        self._pending[ev.completion_id] = p
        heapq.heappush(self._deadlines, (p.deadline, next(self._seq), ev.completion_id))
        for fb, src in self._orphans.pop(ev.completion_id, []):
            self._n_orphans -= 1
            self._attach(p, fb, src)

    def on_feedback(self, ev: FeedbackEvent, source: Source | None = None) -> None:
        if ev.event_id in self._seen:
            self.stats["duplicates"] += 1
            return
        self._seen.add(ev.event_id)
        self.stats["feedback"] += 1
        p = self._pending.get(ev.completion_id)
        if p is not None:
            self._attach(p, ev, source)
        elif ev.completion_id in self._closed:
            self._late_feedback(ev, source, "closed")
        else:
            self._buffer_orphan(ev, source)

    def _attach(self, p: _Pending, ev: FeedbackEvent, source: Source | None) -> None:
        c = p.completion
        if ev.tenant != c.tenant:
            self.stats["tenant_mismatch"] += 1
            log.warning("feedback %s (tenant %r) names completion %s of tenant %r: rejected",
                        ev.event_id, ev.tenant, c.completion_id, c.tenant)
            return
        if ev.ts > p.deadline:
            self._late_feedback(ev, source, "past_window")
            return
        user = ev.user_id if ev.user_id is not None else c.user_id
        p.signals.append(Signal(kind=ev.kind, value=ev.value, ts=ev.ts, user_id=user))
        p.event_ids.append(ev.event_id)
        if source is not None:
            p.sources.append(source)

    def _late_feedback(self, ev: FeedbackEvent, source: Source | None, reason: str) -> None:
        self.stats["late"] += 1
        self.stats[f"late_{ev.kind}"] += 1
        if len(self._late) >= self.max_late_kept:
            raise RuntimeError(f"{len(self._late)} late feedback events not drained: call drain_late()")
        self._late.append(LateFeedback(ev, source, reason))

    def _buffer_orphan(self, ev: FeedbackEvent, source: Source | None) -> None:
        if self._n_orphans >= self.max_orphans:
            self._evict_oldest_orphan()
        self._orphans.setdefault(ev.completion_id, []).append((ev, source))
        self._n_orphans += 1
        expiry = ev.ts + self.window_s
        heapq.heappush(self._orphan_expiry, (expiry, next(self._seq), ev.completion_id, ev.event_id))

    def _evict_oldest_orphan(self) -> None:
        while self._orphan_expiry:
            _, _, cid, eid = heapq.heappop(self._orphan_expiry)
            if self._drop_orphan(cid, eid):
                self.stats["orphans_overflow"] += 1
                log.warning("orphan buffer full (%d): dropped feedback %s for unknown completion %s",
                            self.max_orphans, eid, cid)
                return

    def _drop_orphan(self, cid: str, eid: str) -> bool:
        entries = self._orphans.get(cid)
        if not entries:
            return False  # already attached to its completion
        kept = [(fb, src) for fb, src in entries if fb.event_id != eid]
        if len(kept) == len(entries):
            return False
        self._n_orphans -= 1
        if kept:
            self._orphans[cid] = kept
        else:
            del self._orphans[cid]
        return True

    # ---- output --------------------------------------------------------------------------------
    def tick(self, now: float | None = None) -> list[SampleEvent]:
        """Close every window that ended before `now`; expire orphans; return the new samples."""
        now = self.clock() if now is None else now
        out: list[SampleEvent] = []
        while self._deadlines and self._deadlines[0][0] < now:
            _, _, cid = heapq.heappop(self._deadlines)
            p = self._pending.pop(cid, None)
            if p is None:  # released (its partition went to another joiner)
                continue
            self._closed.add(cid)
            sample = self._close(p)
            if sample is None:
                self.stats["no_feedback"] += 1
            else:
                self.stats["samples"] += 1
                out.append(sample)
        while self._orphan_expiry and self._orphan_expiry[0][0] < now:
            _, _, cid, eid = heapq.heappop(self._orphan_expiry)
            if self._drop_orphan(cid, eid):
                self.stats["orphans_expired"] += 1
        self.budget.prune(now)
        return out

    def _close(self, p: _Pending) -> SampleEvent | None:
        c = p.completion
        counted = counted_signals(p.signals)
        admitted: set[str] = set()
        for user in dict.fromkeys(user_key(s) for s in counted):  # users in first-signal order
            # Per tenant: the anonymous user of one tenant is not another's.
            if self.budget.admit(f"{c.tenant}/{user}", c.completion_id, c.ts):
                admitted.add(user)
            else:
                self.stats["dropped_by_budget"] += sum(1 for s in counted if user_key(s) == user)
        kept = [s for s in counted if user_key(s) in admitted]
        r = reward(self.spec, kept)
        if r is None:
            return None
        return SampleEvent(event_id=sample_event_id(c.completion_id, self.spec.name), tenant=c.tenant,
                           ts=p.deadline, completion=c, reward=r, signals=kept, reward_spec=self.spec.name)

    def release(self, partitions: set[int]) -> int:
        """Forget what came from `partitions` (they went to another joiner in a rebalance): pending
        completions read from them with their signals, and orphans read from them. Their event ids
        leave the seen-set, so the records count again if the partitions come back (they are read
        again from the committed position, which is not past anything held). Returns how many events
        were forgotten. Events held without a source (not from a bus) are kept."""
        forgotten = 0
        for cid, p in list(self._pending.items()):
            if p.sources and p.sources[0][0] == TOPICS["completion"] and p.sources[0][1] in partitions:
                del self._pending[cid]  # its deadline entry is skipped by tick()
                for eid in p.event_ids:
                    self._seen.discard(eid)
                forgotten += len(p.event_ids)
        for cid, entries in list(self._orphans.items()):
            kept = [(fb, src) for fb, src in entries if src is None or src[1] not in partitions]
            for fb, src in entries:
                if src is not None and src[1] in partitions:
                    self._seen.discard(fb.event_id)
                    forgotten += 1
            self._n_orphans -= len(entries) - len(kept)
            if kept:
                self._orphans[cid] = kept
            else:
                del self._orphans[cid]
        return forgotten

    def drain_late(self) -> list[LateFeedback]:
        late, self._late = self._late, []
        return late

    # ---- what is held --------------------------------------------------------------------------
    @property
    def pending_count(self) -> int:
        return len(self._pending)

    @property
    def orphan_count(self) -> int:
        return self._n_orphans

    def oldest_held(self) -> dict[tuple[str, int], int]:
        """Per (topic, partition): the smallest offset among the records whose events the core holds."""
        out: dict[tuple[str, int], int] = {}
        held = [src for p in self._pending.values() for src in p.sources]
        held += [src for entries in self._orphans.values() for _, src in entries if src is not None]
        for topic, partition, offset in held:
            key = (topic, partition)
            if offset < out.get(key, offset + 1):
                out[key] = offset
        return out


class JoinerService:
    """Consume completions and feedback, publish samples, commit what is safe. See the module docstring."""

    def __init__(self, bus: EventBus, spec: RewardSpec, window_s: float, group: str = "joiner",
                 clock: Callable[[], float] = time.time, *, max_records: int = 500,
                 max_records_per_round: int = 50_000, dead_letter_topic: str | None = None):
        self.bus, self.spec, self.clock = bus, spec, clock
        self.max_records, self.max_records_per_round = max_records, max_records_per_round
        self.dead_letter_topic = dead_letter_topic
        self.core = JoinerCore(spec, window_s, clock)
        self.topics = (TOPICS["completion"], TOPICS["feedback"])
        # One member on both topics: the group gives it the same partition numbers of each.
        self.consumer: Consumer = bus.consumer(self.topics, group)
        self._consumed: dict[tuple[str, int], int] = {}  # position after the last record read
        self._committed: dict[tuple[str, int], int] = {}
        self._owned: set[int] | None = None  # partition numbers held after the last round

    @property
    def stats(self) -> dict[str, int]:
        return self.core.stats

    @property
    def partitions(self) -> list[int]:
        """Partition numbers (of both topics) this joiner owned after its last round."""
        return sorted(self._owned or ())

    def run_once(self, timeout_s: float = 1.0) -> list[SampleEvent]:
        """One round: read the clock, drain both topics, tick, publish, flush, commit."""
        now = self.clock()  # before draining: every event stamped before `now` is read below
        caught_up = self._drain(timeout_s)
        self._follow_assignment()
        samples = self.core.tick(now) if caught_up else []
        for s in samples:
            self.bus.publish(TOPICS["sample"], s.completion.completion_id, s.model_dump_json().encode())
        self.bus.flush()
        self._commit()
        return samples

    def run(self, stop_event: threading.Event, timeout_s: float = 0.5) -> None:
        """`run_once` until `stop_event` is set, then commit what is safe and leave the group."""
        try:
            while not stop_event.is_set():
                self.run_once(timeout_s)
        finally:
            self.close()

    def close(self) -> None:
        """Leave the group. Records still held are not committed: a restart reads them again."""
        self.consumer.close()

    # ---- internals -----------------------------------------------------------------------------
    def _drain(self, timeout_s: float) -> bool:
        """Read both topics to their current end; False if stopped by `max_records_per_round`."""
        deadline = time.monotonic() + timeout_s
        n, waited = 0, False
        while n < self.max_records_per_round:
            records = self.consumer.poll(self.max_records, timeout_s=0.0)
            self._handle(records)
            n += len(records)
            if records:
                continue
            remaining = deadline - time.monotonic()
            if n or waited or remaining <= 0:
                return True
            # Nothing yet: wait once for new data (the embedded bus wakes on any publish).
            records = self.consumer.poll(self.max_records, timeout_s=remaining)
            self._handle(records)
            n += len(records)
            waited = True
        log.info("joiner round stopped after %d records without reaching the end: windows stay open", n)
        return False

    def _follow_assignment(self) -> None:
        """After a rebalance, forget what came from partitions this member lost: their new owner
        reads them again from the committed position (not past anything held here), and this
        member must neither emit their samples nor commit their offsets."""
        owned = {p for _, p in self.consumer.assignment()}
        if self._owned is not None and self._owned - owned:
            lost = self._owned - owned
            forgotten = self.core.release(lost)
            for key in [k for k in (*self._consumed, *self._committed) if k[1] in lost]:
                self._consumed.pop(key, None)
                self._committed.pop(key, None)
            log.info("joiner: partitions %s went to another member; %d held events forgotten", sorted(lost), forgotten)
        self._owned = owned

    def _handle(self, records: list[Record]) -> None:
        for r in records:
            src: Source = (r.topic, r.partition, r.offset)
            try:
                if r.topic == TOPICS["completion"]:
                    self.core.on_completion(CompletionEvent.model_validate_json(r.value), src)
                else:
                    self.core.on_feedback(FeedbackEvent.model_validate_json(r.value), src)
            except ValidationError as e:
                self._malformed(r, e)
            key = (r.topic, r.partition)
            self._consumed[key] = max(self._consumed.get(key, 0), r.offset + 1)
        for late in self.core.drain_late():  # after every batch: the core keeps only max_late_kept
            self._report_late(late)

    def _malformed(self, r: Record, e: ValidationError) -> None:
        where = f"{r.topic}/{r.partition}@{r.offset}"
        if self.dead_letter_topic is None:
            raise ValueError(f"malformed record at {where} (set dead_letter_topic to divert such records)"
                             ) from e
        log.error("malformed record at %s sent to %s: %s", where, self.dead_letter_topic, e)
        self.core.stats["malformed"] += 1
        self.bus.publish(self.dead_letter_topic, r.key, r.value)

    def _report_late(self, late: LateFeedback) -> None:
        ev = late.event
        where = "" if late.source is None else "%s/%d@%d" % late.source
        log.info("late feedback %s (%s, %s) for completion %s at %s", ev.event_id, ev.kind, late.reason,
                 ev.completion_id, where)
        if self.dead_letter_topic is not None:
            self.bus.publish(self.dead_letter_topic, ev.completion_id, ev.model_dump_json().encode())

    def _commit(self) -> None:
        held = self.core.oldest_held()
        records = []
        for (topic, partition), consumed in self._consumed.items():
            position = min(held.get((topic, partition), consumed), consumed)
            if position > self._committed.get((topic, partition), 0):
                # Consumer.commit(records) commits through the given record: name the one before.
                records.append(Record(topic, partition, position - 1, "", b""))
                self._committed[(topic, partition)] = position
        if records:
            self.consumer.commit(records)
