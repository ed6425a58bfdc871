"""Feedback ingestion: POST /v1/feedback.

Thin: parse the body (one event or a batch), validate it as `feedback.ingest.FeedbackIn`, call
`feedback.ingest.accept` on a worker thread, map its errors to the OpenAI error shape. What parsing
costs is bounded before it starts: the body by the gateway's size limit (413 from
`api.errors.BodyLimit`), each string field and the batch length by `FeedbackIn`/`FeedbackBatch`.
"""

from __future__ import annotations

import asyncio

from fastapi import APIRouter, Request
from fastapi.exceptions import RequestValidationError
from pydantic import Field, ValidationError

from api.deps import FeedbackCaller, GatewayDep, off_the_loop_if_large, parse_json
from api.errors import APIError
from api.schemas import first_unknown_only
from feedback import ingest
from feedback.ingest import MAX_BATCH, FeedbackBatch, FeedbackIn

router = APIRouter(prefix="/v1")


class _Batch(FeedbackBatch):
    """`FeedbackBatch`, validated up to its first bad event (so a bounded number of errors)."""

    events: list[FeedbackIn] = Field(min_length=1, max_length=MAX_BATCH, fail_fast=True)


def _openapi_body() -> dict:
    """The request body as /openapi.json documents it (the route reads the raw body itself, so
    FastAPI cannot infer it): one event, or `{"events": [...]}`."""
    one = FeedbackIn.model_json_schema()
    batch = FeedbackBatch.model_json_schema()
    batch.pop("$defs", None)
    batch["properties"]["events"]["items"] = one
    return {"requestBody": {"required": True, "content": {"application/json": {"schema": {"oneOf": [one, batch]}}}}}


@router.post("/feedback", openapi_extra=_openapi_body())
async def post_feedback(request: Request, gw: GatewayDep, caller: FeedbackCaller) -> dict:
    """Accept one feedback event, or a batch of 1..1000 as `{"events": [...]}`.

    An event: `completion_id`, `kind` (shown — the exposure —, thumb_up, thumb_down, rating, accepted,
    rejected, edited, copied, regenerated, dwell), `value` (rating 1..5, edited kept fraction, dwell seconds),
    optional `edit_distance`, `user`, `ts`, `idempotency_key` (or the `Idempotency-Key` header; in
    a batch, event i without a key gets `<header>#<i>`). Answer: `{"accepted", "duplicates",
    "event_ids", "window_closed"}`; `window_closed` lists the indices of events received after their
    completion's attribution window (`rewards.window_s`): not published, they can never count.
    Errors: 400 naming the parameter, 403 `user_mismatch`, 404
    `completion_not_found`, 409 `idempotency_key_reused`, 413 `request_too_large` (a body over
    FLYWHEEL_MAX_REQUEST_BYTES), 429 `rate_limit_exceeded` (over `limits.feedback_events_per_s`, with
    Retry-After), 503 (retry).
    """
    items, batch = await off_the_loop_if_large(await request.body(), _parse, request.headers.get("idempotency-key"))
    gw.limit("feedback", caller, "/v1/feedback", len(items))  # every event counts, before anything is written
    try:
        done = await asyncio.to_thread(
            ingest.accept, gw.index, gw.bus, caller.tenant, items, None, gw.in_flight, gw.feedback_window_s
        )
    except ingest.IngestError as e:
        param = None if e.field is None else _param(batch, e.index, e.field)
        headers = {"Retry-After": "1"} if e.status == 503 else None
        raise APIError(e.status, str(e), param, e.code, headers=headers) from None
    gw.metrics.feedback_events.labels("accepted").inc(done.accepted)
    gw.metrics.feedback_events.labels("duplicate").inc(done.duplicates)
    gw.metrics.feedback_events.labels("window_closed").inc(len(done.window_closed))
    answer = {"accepted": done.accepted, "duplicates": done.duplicates, "event_ids": done.event_ids}
    return answer | {"window_closed": done.window_closed}


def _param(batch: bool, i: int | None, name: str) -> str:
    return f"events.{i}.{name}" if batch and i is not None else name


def _parse(raw: bytes, header_key: str | None) -> tuple[list[tuple[FeedbackIn, str | None]], bool]:
    """The events with their idempotency keys, and whether the body was a batch."""
    try:
        body = parse_json(raw)
    except ValueError as e:
        raise APIError(400, f"We could not parse the JSON body of your request: {e}", None, "invalid_json") from None
    if not isinstance(body, dict):
        raise APIError(400, 'The body must be a JSON object: one event or {"events": [...]}.', None, "invalid_request")
    if header_key is not None and not 1 <= len(header_key) <= 256:
        raise APIError(400, "Idempotency-Key must be 1-256 characters", "Idempotency-Key", "invalid_value")
    batch = "events" in body
    if batch:
        body = first_unknown_only(body, _Batch)
        if isinstance(body["events"], list):  # past MAX_BATCH + 1 events, the batch is refused anyway
            body["events"] = [first_unknown_only(e, FeedbackIn) for e in body["events"][: MAX_BATCH + 1]]
    else:
        body = first_unknown_only(body, FeedbackIn)
    try:
        items = _Batch.model_validate(body).events if batch else [FeedbackIn.model_validate(body)]
    except ValidationError as e:
        raise RequestValidationError(e.errors()) from None
    if batch:
        return [
            (it, it.idempotency_key or (f"{header_key}#{i}" if header_key else None)) for i, it in enumerate(items)
        ], True
    key = items[0].idempotency_key
    if key is not None and header_key is not None and key != header_key:
        raise APIError(400, "idempotency_key and the Idempotency-Key header differ", "idempotency_key", "invalid_value")
    return [(items[0], key or header_key)], False
