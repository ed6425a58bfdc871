"""Feedback ingestion: POST /v1/feedback.

Thin: validate every event (schema, kind/value rules of `feedback.events.FeedbackEvent`, that the
completion exists for this tenant), drop retries already accepted (idempotency claims in the
`CompletionIndex`), publish the rest to the feedback topic keyed by completion id, answer.
A batch is all-or-nothing: nothing is published unless every event is valid.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import Callable
from hashlib import sha256

from fastapi import APIRouter, Request, Response
from fastapi.exceptions import RequestValidationError
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from api.deps import GatewayDep, TenantDep
from api.errors import APIError
from feedback.completion_index import CompletionIndex
from feedback.events import (TOPICS, VALUED_KINDS, FeedbackKind, check_value, feedback_core_json, feedback_wire,
                             hash_user, json_str, new_event_id)

log = logging.getLogger(__name__)
router = APIRouter(prefix="/v1")
MAX_BATCH = 1000
MAX_BODY_BYTES = 4 << 20
MAX_CLOCK_SKEW_S = 300.0  # an event may not claim to come from further in the future than this
LOOP_WRITE_MAX_BYTES = 64 << 10  # larger requests hand their events to the log's writer thread
CLAIM_WAIT_S = 10.0  # how long a retry waits for the same key still being published by another request


class FeedbackIn(BaseModel):
    """One feedback event as the product sends it."""

    model_config = ConfigDict(extra="forbid", strict=True)
    completion_id: str = Field(min_length=1, max_length=128)
    kind: FeedbackKind
    value: float | None = Field(None, allow_inf_nan=False)
    edit_distance: int | None = Field(None, ge=0)
    user: str | None = Field(None, max_length=256)
    ts: float | None = Field(None, gt=0, allow_inf_nan=False)
    idempotency_key: str | None = Field(None, min_length=1, max_length=256)


class FeedbackBatch(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    events: list[FeedbackIn] = Field(min_length=1, max_length=MAX_BATCH)


def event_id_for(tenant: str, idempotency_key: str) -> str:
    """Deterministic: the same key from the same tenant always names the same event. The hashed text
    is `json.dumps(["flywheel.feedback", tenant, idempotency_key])`, spelled out (3x faster; ids
    must never change, or a retry across an upgrade would count twice)."""
    return _event_id(_id_head(tenant), idempotency_key)


def _id_head(tenant: str) -> str:
    return f'["flywheel.feedback", {json_str(tenant)}, '


def _event_id(head: str, idempotency_key: str) -> str:
    return sha256(f"{head}{json_str(idempotency_key)}]".encode()).hexdigest()[:32]


def _openapi_body() -> dict:
    """The request body as /openapi.json documents it (the route reads the raw body itself, so
    FastAPI cannot infer it): one event, or `{"events": [...]}`."""
    one = FeedbackIn.model_json_schema()
    batch = FeedbackBatch.model_json_schema()
    batch.pop("$defs", None)
    batch["properties"]["events"]["items"] = one
    return {"requestBody": {"required": True, "content": {"application/json": {"schema": {"oneOf": [one, batch]}}}}}


@router.post("/feedback", openapi_extra=_openapi_body())
async def post_feedback(request: Request, gw: GatewayDep, tenant: TenantDep):
    """Accept one feedback event, or a batch of 1..1000.

    Body, one event (or `{"events": [event, ...]}`):

        {"completion_id": "cmpl-…",      # from a completion this tenant was served
         "kind": "thumb_up" | "thumb_down" | "rating" | "accepted" | "rejected" | "edited"
                 | "copied" | "regenerated" | "dwell",
         "value": 4,                     # rating: integer 1..5; edited: kept fraction [0, 1];
                                         # dwell: seconds [0, 86400]; every other kind: absent
         "edit_distance": 12,            # optional, edited only: characters changed
         "user": "u-42",                 # optional; hashed per tenant before it is stored
         "ts": 1718000000.5,             # optional, seconds since the epoch; default: now
         "idempotency_key": "…"}         # optional; a retry with the same key is not counted twice

    A single event may carry its key in the `Idempotency-Key` header instead (for a batch, event i
    without its own key gets `<header>#<i>`). Errors (OpenAI shape): 400 naming the parameter
    (`events.3.value` in a batch), 404 `completion_not_found` (also for another tenant's completion),
    409 `idempotency_key_reused` (same key, different event), 503 when the bus refuses the events.
    Answer: `{"accepted": n_published, "duplicates": n_already_accepted, "event_ids": [...]}`, one id
    per event in request order, with a `Server-Timing` header (`validate;dur=<ms>, commit;dur=<ms>`:
    the time before the publish, and the wait for the events to be on disk; also the histogram
    `flywheel_feedback_stage_seconds` at /metrics).
    """
    t0 = time.perf_counter()
    items, prefix = _parse(await request.body(), request.headers.get("idempotency-key"))
    now = time.time()
    # Per event, each field is formatted once (~10 us an event less than building FeedbackEvent):
    # `core` (what the event says) makes both its wire form and its key's fingerprint.
    too_late, tenant_json, now_repr, id_head = now + MAX_CLOCK_SKEW_S, json_str(tenant), repr(now), _id_head(tenant)
    events: list[tuple[str, str, bytes]] = []  # (event id, completion id = the record's key, wire form)
    fingerprints: dict[str, str] = {}  # keyed events: event id -> fingerprint
    first: dict[str, int] = {}  # keyed events: event id -> index of its first event in the request
    for i, (item, key) in enumerate(items):
        ts, kind, value = item.ts, item.kind, item.value
        if ts is not None and ts > too_late:
            raise APIError(400, f"ts {ts} is in the future", _param(prefix, i, "ts"), "invalid_value")
        if value is not None or kind in VALUED_KINDS:
            try:
                value = check_value(kind, value)
            except ValueError as e:  # the same error FeedbackEvent's own validation gives
                raise RequestValidationError([{"type": "value_error", "loc": (*prefix, i, "value") if prefix else ("value",),
                                               "msg": f"Value error, {e}", "input": item.value}]) from None
        # Every field is checked by now (FeedbackIn, the tenant dependency, check_value).
        core = feedback_core_json(item.completion_id, hash_user(tenant, item.user), kind, value, item.edit_distance)
        ts_repr = now_repr if ts is None else repr(float(ts))
        if key:
            event_id = _event_id(id_head, key)
            fp = _fingerprint(core, None if ts is None else ts_repr)
            if fingerprints.setdefault(event_id, fp) != fp:
                raise APIError(409, f"idempotency key {key!r} is used twice for different events",
                               _param(prefix, i, "idempotency_key"), "idempotency_key_reused")
            first.setdefault(event_id, i)
        else:
            event_id = new_event_id()
        events.append((event_id, item.completion_id, feedback_wire(f'"{event_id}"', tenant_json, ts_repr, core)))

    # Are the completions this tenant's? If so, claim the keys. On the loop, not a worker thread:
    # recent completions are in the index's memory, the claim is one indexed SELECT of the new ids
    # (~0.3 ms for 100); at the maximum rate of bench/feedback.py the hop to the thread pool and
    # back waited ~10 ms at p50 for the interpreter lock.
    unknown, first_claim = _lookup_and_claim(gw.index, events, tenant, fingerprints)
    if unknown is not None:  # another tenant's id is as unknown as a made-up one
        raise APIError(404, f"No completion with id '{events[unknown][1]}'.",
                       _param(prefix, unknown, "completion_id"), "completion_not_found")
    claimed, done = await _claim(gw.index, fingerprints, lambda eid: items[first[eid]][0],
                                 lambda eid: _param(prefix, first[eid], "idempotency_key"), first_claim)
    if not done and len(first) == sum(1 for _, key in items if key):
        new = events  # no retry, no key twice in the request: every event is new
    else:
        new, seen = [], set(done)  # keyed ids are now either claimed by this request or done
        for ev in events:
            if ev[0] not in seen:
                new.append(ev)
                seen.add(ev[0])
    t_publish = time.perf_counter()
    records = [(cid, wire) for _, cid, wire in new]
    gw.feedback_publishing += 1
    try:
        if await _alone_to_publish(gw, records) and gw.bus.publish_many_now(TOPICS["feedback"], records):
            pass  # written on this thread: the log's writer was idle
        else:  # awaited on the loop, no thread parked: the writer thread resolves it once on disk
            await asyncio.wrap_future(gw.bus.publish_many_async(TOPICS["feedback"], records))
    except Exception as e:  # nothing acknowledged: a retry may publish again (consumers drop event ids seen)
        gw.index.release(claimed)  # in memory: a retry may claim them again
        log.exception("publishing %d feedback event(s) failed", len(new))
        raise APIError(503, f"The feedback could not be published ({type(e).__name__}); retry.", None,
                       "publish_failed", headers={"Retry-After": "1"}) from e
    except asyncio.CancelledError:  # the server is stopping: the write may still land; a retry may
        gw.index.release(claimed)   # publish again, and the consumers drop the second copy by event id
        raise
    finally:
        gw.feedback_publishing -= 1
    t_durable = time.perf_counter()
    gw.index.confirm(claimed)  # in memory (written behind by the index's thread)
    validate_s, commit_s = t_publish - t0, t_durable - t_publish
    gw.metrics.feedback_validate.observe(validate_s)
    gw.metrics.feedback_commit.observe(commit_s)
    # Written directly: FastAPI's encoder walked the answer (100 ids) for ~4 us an event.
    ids = ",".join([f'"{ev[0]}"' for ev in events])  # hex: nothing to escape
    return Response(f'{{"accepted":{len(new)},"duplicates":{len(events) - len(new)},"event_ids":[{ids}]}}',
                    media_type="application/json",
                    headers={"server-timing": f"validate;dur={validate_s * 1e3:.2f}, commit;dur={commit_s * 1e3:.2f}"})


async def _alone_to_publish(gw, records: list[tuple[str, bytes]]) -> bool:
    """Should this request write its events on the event loop (`publish_many_now`)? Only when
    `settings.feedback_write_on_loop`, its events are at most `LOOP_WRITE_MAX_BYTES` (the loop waits
    for the disk as long as the write takes), and no other feedback request is publishing: one pass
    of the loop first lets the requests already received reach their publish too. A request alone
    saves the hand-offs to the log's writer thread and back (half-rate p99 of bench/feedback.py ~20 ->
    ~16 ms); several go to the writer thread together and share one group commit (written one by
    one on the loop, single-event requests at full load fell from ~1300 to ~920 a second)."""
    if not gw.settings.feedback_write_on_loop or sum(len(v) for _, v in records) > LOOP_WRITE_MAX_BYTES:
        return False
    await asyncio.sleep(0)
    return gw.feedback_publishing == 1


def _parse(raw: bytes, header_key: str | None) -> tuple[list[tuple[FeedbackIn, str | None]], tuple]:
    """The events with their idempotency keys, and the param prefix for errors (`("events",)` or `()`)."""
    if len(raw) > MAX_BODY_BYTES:
        raise APIError(413, f"The body is larger than {MAX_BODY_BYTES} bytes; send smaller batches.", None,
                       "request_too_large")
    if raw[:16].lstrip().startswith(b'{"events"'):  # a batch, as the SDK sends it: validated from the
        try:                                          # bytes in one pass (~2 us an event less than below)
            items = FeedbackBatch.model_validate_json(raw).events
        except ValidationError:
            pass  # the path below parses it again, to say what is wrong exactly as it always has
        else:
            _check_header_key(header_key)
            return _keyed(items, header_key), ("events",)
    try:
        body = json.loads(raw)
    except ValueError as e:
        raise APIError(400, f"We could not parse the JSON body of your request: {e}", None,
                       "invalid_json") from None
    if not isinstance(body, dict):
        raise APIError(400, "The body must be a JSON object: one event or {\"events\": [...]}.", None,
                       "invalid_request")
    _check_header_key(header_key)
    batch = "events" in body
    try:
        items = FeedbackBatch.model_validate(body).events if batch else [FeedbackIn.model_validate(body)]
    except ValidationError as e:
        raise RequestValidationError(e.errors()) from None
    if not batch:
        key = items[0].idempotency_key
        if key is not None and header_key is not None and key != header_key:
            raise APIError(400, "idempotency_key and the Idempotency-Key header differ", "idempotency_key",
                           "invalid_value")
        return [(items[0], key or header_key)], ()
    return _keyed(items, header_key), ("events",)


def _check_header_key(header_key: str | None) -> None:
    if header_key is not None and not 1 <= len(header_key) <= 256:
        raise APIError(400, "Idempotency-Key must be 1-256 characters", "Idempotency-Key", "invalid_value")


def _keyed(items: list[FeedbackIn], header_key: str | None) -> list[tuple[FeedbackIn, str | None]]:
    """A batch's events with their keys: their own, else `<Idempotency-Key header>#<i>`, else none."""
    return [(it, it.idempotency_key or (f"{header_key}#{i}" if header_key else None)) for i, it in enumerate(items)]


_NOT_FINGERPRINTED = {"idempotency_key"}


def _param(prefix: tuple, i: int, name: str) -> str:
    return ".".join([*prefix, str(i), name]) if prefix else name


def fingerprint(item: FeedbackIn, tenant: str) -> str:
    """What an idempotency key stands for (everything but the key): "f3" and 16 hex digits of the
    SHA-256 of `feedback_core_json(...)` (completion, hashed user, kind, value, edit distance, as the
    wire form writes them: numbers as floats, so 4 and 4.0 are one event), a comma and the event's
    own `ts` (`repr(float)`, or `null` when it has none). The gateway makes it from the parts it
    formats for the wire anyway (~2 us an event, where "f2" took ~5 us on the 2-core dev VM). Its
    form may never change: ids accepted within the index's TTL are compared with it."""
    core = feedback_core_json(item.completion_id, hash_user(tenant, item.user), item.kind,
                              None if item.value is None else float(item.value), item.edit_distance)
    return _fingerprint(core, None if item.ts is None else repr(float(item.ts)))


def _fingerprint(core: str, ts_repr: str | None) -> str:
    return "f3" + sha256(f"{core},{ts_repr or 'null'}".encode()).hexdigest()[:16]


def fingerprint_f2(item: FeedbackIn) -> str:
    """The fingerprint of ids accepted by versions before "f3": "f2" and 16 hex digits of the SHA-256
    of the fields' `repr` (numbers as floats)."""
    v, ts = item.value, item.ts
    what = repr((item.completion_id, item.kind, None if v is None else float(v), item.edit_distance, item.user,
                 None if ts is None else float(ts)))
    return "f2" + sha256(what.encode()).hexdigest()[:16]


def legacy_fingerprint(item: FeedbackIn) -> str:
    """The fingerprint of ids accepted by versions before "f2" (16 hex digits)."""
    return sha256(item.model_dump_json(exclude=_NOT_FINGERPRINTED).encode()).hexdigest()[:16]


def _same_event(stored: str, item: FeedbackIn, fp: str) -> bool:
    """Is `item` (fingerprint `fp`) the event whose stored fingerprint is `stored`, whichever
    version of the fingerprint stored it (a retry of an id accepted before an upgrade)?"""
    if stored == fp:
        return True
    if len(stored) == 16:  # legacy: 16 hex digits, which may themselves start with "f2" or "f3"
        return stored == legacy_fingerprint(item)
    return stored.startswith("f2") and stored == fingerprint_f2(item)


def _lookup_and_claim(index: CompletionIndex, events: list[tuple[str, str, bytes]], tenant: str,
                      fingerprints: dict[str, str]):
    """(index of the first event whose completion is not this tenant's, or None; the first claim)."""
    cids = list(dict.fromkeys([ev[1] for ev in events]))  # a batch names each completion ~twice
    known = index.get_many(cids)
    if len(known) < len(cids) or any(entry.tenant != tenant for entry in known.values()):
        for i, ev in enumerate(events):
            entry = known.get(ev[1])
            if entry is None or entry.tenant != tenant:
                return i, None
    return None, index.claim(fingerprints) if fingerprints else None


async def _claim(index: CompletionIndex, fingerprints: dict[str, str], item_of: Callable[[str], FeedbackIn],
                 param_of: Callable[[str], str], first=None) -> tuple[list[str], set[str]]:
    """Claim the keyed event ids; wait (bounded) for ids another request is still publishing.
    `item_of(id)`, `param_of(id)`: the event an id stands for, its key's parameter name (for the
    error). `first`: the result of a claim already made for all of them. Returns (claimed ids, ids
    already accepted)."""
    claimed: list[str] = []
    done: set[str] = set()
    todo = dict(fingerprints)
    deadline = time.monotonic() + CLAIM_WAIT_S
    while todo:
        c, first = (first, None) if first is not None else (index.claim(todo), None)  # on the loop, as the first
        claimed += c.claimed
        for eid, fp in c.done.items():
            if not _same_event(fp, item_of(eid), fingerprints[eid]):
                index.release(claimed)
                raise APIError(409, "This idempotency key was already used for a different event.",
                               param_of(eid), "idempotency_key_reused")
            done.add(eid)
        todo = {eid: fingerprints[eid] for eid in c.pending}
        if todo and time.monotonic() > deadline:
            index.release(claimed)
            raise APIError(503, "Another request with the same idempotency key is still being processed.",
                           None, "idempotency_key_in_use", headers={"Retry-After": "1"})
        if todo:
            await asyncio.sleep(0.05)
    return claimed, done
