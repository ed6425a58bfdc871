"""Feedback acceptance: the rules a feedback event must pass before it is published as a reward input.

`accept(...)` takes the events of one request (already parsed as `FeedbackIn`) and, all or nothing:
1. looks their completions up in the `CompletionIndex`: another tenant's completion is as unknown as a
   made-up id (`NotFound`);
2. vouches for the user: the completion's user is the one who may rate it. Feedback naming another user
   is refused (`UserMismatch`); feedback naming no user is attributed to the completion's user; a
   completion served without a user takes feedback as anonymous (any user it names is dropped), so
   nobody can move an anonymous completion's reward onto a user of their choice;
3. stamps the time: the gateway's receive time, or the client's `ts` clamped to [served time, receive
   time], so back- or forward-dating cannot move feedback in or out of the joiner's attribution window;
4. claims idempotency keys (a key names one event id per tenant; a retry is a duplicate, the same key
   for a different event is `KeyReused`);
5. publishes the new events to the feedback topic keyed by completion id, and confirms the keys only
   once the events are durable (`PublishFailed` releases them).

Called by `api/routes/feedback.py` on a worker thread (it blocks on the database and the disk).
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import threading
import time
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field

from pydantic import BaseModel, ConfigDict, Field, field_validator

from feedback.bus import EventBus
from feedback.completion_index import CompletionIndex
from feedback.events import TOPICS, FeedbackEvent, FeedbackKind, event_id_for, hash_user, new_event_id, value_fits_kind

log = logging.getLogger(__name__)
MAX_BATCH = 1000
CLAIM_WAIT_S = 10.0  # how long a retry waits for the same key still being published by another request


class FeedbackIn(BaseModel):
    """One feedback event as the product sends it."""

    model_config = ConfigDict(extra="forbid", strict=True)
    completion_id: str = Field(min_length=1, max_length=128)
    kind: FeedbackKind
    value: float | None = Field(None, allow_inf_nan=False, validate_default=True)
    edit_distance: int | None = Field(None, ge=0)
    user: str | None = Field(None, max_length=256)
    ts: float | None = Field(None, gt=0, allow_inf_nan=False)
    idempotency_key: str | None = Field(None, min_length=1, max_length=256)

    _value_fits_kind = field_validator("value")(value_fits_kind)


Item = tuple[FeedbackIn, str | None]  # an event and its idempotency key


class FeedbackBatch(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    events: list[FeedbackIn] = Field(min_length=1, max_length=MAX_BATCH)


class IngestError(Exception):
    """A refused request: `index` is the event it is about (None: the request as a whole)."""

    status = 400
    code = "invalid_value"
    field: str | None = None

    def __init__(self, message: str, index: int | None = None):
        super().__init__(message)
        self.index = index


class NotFound(IngestError):
    status, code, field = 404, "completion_not_found", "completion_id"


class UserMismatch(IngestError):
    status, code, field = 403, "user_mismatch", "user"


class KeyReused(IngestError):
    status, code, field = 409, "idempotency_key_reused", "idempotency_key"


class KeyInUse(IngestError):
    status, code = 503, "idempotency_key_in_use"


class PublishFailed(IngestError):
    status, code = 503, "publish_failed"


@dataclass(frozen=True)
class Accepted:
    accepted: int  # events published now
    duplicates: int  # events of the request already accepted before (or twice in it)
    event_ids: list[str]  # one per event, in request order
    window_closed: list[int] = field(default_factory=list)  # request indices refused: received after the window


def fingerprint(item: FeedbackIn, tenant: str) -> str:
    """What an idempotency key stands for: everything the client said but the key ("v1:" + 32 hex)."""
    value, ts = (None if x is None else float(x) for x in (item.value, item.ts))
    what = [item.completion_id, hash_user(tenant, item.user), item.kind, value, item.edit_distance, ts]
    return "v1:" + hashlib.sha256(repr(what).encode()).hexdigest()[:32]


class InFlight:
    """The receive times of the requests being accepted: stamped, not yet on the bus. The gateway's bus
    watermark stays below them (`registry.watermarks`, `api.main.report_watermark`)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._stamps: Counter[float] = Counter()

    @contextlib.contextmanager
    def hold(self, ts: float | None = None) -> Iterator[float]:
        """Hold a receive time (`ts`, else now, read under the lock: a watermark read before it is
        below it, one read after it sees it) until the block ends; yields it."""
        with self._lock:
            ts = time.time() if ts is None else ts
            self._stamps[ts] += 1
        try:
            yield ts
        finally:
            with self._lock:
                self._stamps[ts] -= 1
                if not self._stamps[ts]:
                    del self._stamps[ts]

    def oldest(self) -> float | None:
        with self._lock:
            return min(self._stamps, default=None)


def accept(
    index: CompletionIndex,
    bus: EventBus,
    tenant: str,
    items: list[Item],
    now: float | None = None,
    in_flight: InFlight | None = None,
    window_s: float | None = None,
) -> Accepted:
    """Accept one request's events, `(event, idempotency key or None)`, all or nothing. `in_flight`
    holds the receive time until the events are on the bus (or refused). `window_s`: the joiner's
    attribution window; a new event received after its completion's window closed is not published
    and its index is listed in `window_closed`: it could never count, and the product should know (a
    repeat of an event accepted in time is still a duplicate). The rest of the request goes on."""
    if in_flight is None:
        return _accept(index, bus, tenant, items, time.time() if now is None else now, window_s)
    with in_flight.hold(now) as stamped:
        return _accept(index, bus, tenant, items, stamped, window_s)


def _accept(
    index: CompletionIndex, bus: EventBus, tenant: str, items: list[Item], now: float, window_s: float | None
) -> Accepted:
    known = index.get_many([it.completion_id for it, _ in items])
    events: list[FeedbackEvent] = []
    fingerprints: dict[str, str] = {}
    first: dict[str, int] = {}
    for i, (item, key) in enumerate(items):
        entry = known.get(item.completion_id)
        if entry is None or entry.tenant != tenant:
            raise NotFound(f"No completion with id '{item.completion_id}'.", i)
        if item.user is not None and entry.user_id is not None and hash_user(tenant, item.user) != entry.user_id:
            why = f"Completion '{item.completion_id}' was served to another user"
            raise UserMismatch(f"{why}; feedback must come from the user it was served to.", i)
        event_id = new_event_id() if key is None else event_id_for(tenant, key)
        if key is not None:
            fp = fingerprint(item, tenant)
            if fingerprints.setdefault(event_id, fp) != fp:
                raise KeyReused(f"Idempotency key {key!r} is used twice for different events.", i)
            first.setdefault(event_id, i)
        what = item.model_dump(include={"completion_id", "kind", "value", "edit_distance"})
        what |= {"client_ts": item.ts, "served_ts": entry.ts, "served_user": entry.user_id}
        events.append(FeedbackEvent.received(event_id=event_id, tenant=tenant, now=now, **what))
    claimed, done = _claim(index, fingerprints, first)
    closed: list[int] = []
    if window_s is not None:  # received after the window: never published, its claim given back
        closed = [
            i
            for i, (it, _) in enumerate(items)
            if events[i].event_id not in done and now > known[it.completion_id].ts + window_s
        ]
        late_ids = {events[i].event_id for i in closed}
        index.release([e for e in claimed if e in late_ids])
        claimed = [e for e in claimed if e not in late_ids]
    # Keyed ids are now either claimed by this request or done; an id twice in the request is one event.
    new = list({ev.event_id: ev for i, ev in enumerate(events) if ev.event_id not in done and i not in closed}.values())
    try:
        bus.publish_many(TOPICS["feedback"], [(ev.completion_id, ev.model_dump_json().encode()) for ev in new])
    except Exception as e:  # nothing acknowledged: a retry may publish again (consumers drop repeated ids)
        index.release(claimed)
        log.exception("publishing %d feedback event(s) failed", len(new))
        raise PublishFailed(f"The feedback could not be published ({type(e).__name__}); retry.") from e
    index.confirm(claimed)
    return Accepted(len(new), len(events) - len(new) - len(closed), [ev.event_id for ev in events], closed)


def _claim(index: CompletionIndex, fingerprints: dict[str, str], first: dict[str, int]) -> tuple[list[str], set[str]]:
    """Claim the keyed event ids, waiting (bounded) for ids another request is still publishing.
    Returns (ids claimed, ids already accepted)."""
    claimed: list[str] = []
    done: set[str] = set()
    todo = dict(fingerprints)
    deadline = time.monotonic() + CLAIM_WAIT_S
    while todo:
        c = index.claim(todo)
        claimed += c.claimed
        done.update(c.done)
        if c.mismatched:
            index.release(claimed)
            raise KeyReused("This idempotency key was already used for a different event.", first[c.mismatched[0]])
        todo = {eid: fingerprints[eid] for eid in c.pending}
        if todo and time.monotonic() > deadline:
            index.release(claimed)
            raise KeyInUse("Another request with the same idempotency key is still being processed.")
        if todo:
            time.sleep(0.05)
    return claimed, done
