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

import hashlib
import logging
import time
from dataclasses import dataclass

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


def fingerprint(item: FeedbackIn, tenant: str) -> str:
    """What an idempotency key stands for: everything the client said but the key ("v1:" + 32 hex)."""
    value, ts = (None if x is None else float(x) for x in (item.value, item.ts))
    what = [item.completion_id, hash_user(tenant, item.user), item.kind, value, item.edit_distance, ts]
    return "v1:" + hashlib.sha256(repr(what).encode()).hexdigest()[:32]


def accept(index: CompletionIndex, bus: EventBus, tenant: str, items: list[Item], now: float | None = None) -> Accepted:
    """Accept one request's events, `(event, idempotency key or None)`, all or nothing."""
    now = time.time() if now is None else now
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
    # Keyed ids are now either claimed by this request or done; an id twice in the request is one event.
    new = list({ev.event_id: ev for ev in events if ev.event_id not in done}.values())
    try:
        bus.publish_many(TOPICS["feedback"], [(ev.completion_id, ev.model_dump_json().encode()) for ev in new])
    except Exception as e:  # nothing acknowledged: a retry may publish again (consumers drop repeated ids)
        index.release(claimed)
        log.exception("publishing %d feedback event(s) failed", len(new))
        raise PublishFailed(f"The feedback could not be published ({type(e).__name__}); retry.") from e
    index.confirm(claimed)
    return Accepted(len(new), len(events) - len(new), [ev.event_id for ev in events])


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
