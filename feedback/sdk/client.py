"""The product's feedback client: one call per user signal, batched and retried in the background.

A call validates its event (a `ValueError` naming the value), fixes its idempotency key and timestamp
and appends it to a bounded queue: it never blocks and does no I/O. The client's thread posts batches
to `POST /v1/feedback` when `batch_size` events wait, when the oldest has waited `flush_interval_s`,
on `flush()`, and at close or exit. 429, 5xx and connection errors are retried (full-jitter backoff,
honouring `Retry-After`) up to `max_retries`, with the same keys, so nothing counts twice; an error
naming one event of a batch (`events.3.value`) drops only that one, and events the gateway received
after their attribution window (its answer's `window_closed`) are given up as `WindowClosedError`.
What is given up goes to
`on_error(exc, events)` (logged without one), never raised into the product. Fork-safe: a child
starts empty, with its own lock, thread and connection.
"""

from __future__ import annotations

import asyncio
import atexit
import json
import logging
import math
import os
import random
import threading
import time
import weakref
from collections import deque
from collections.abc import Callable
from email.utils import parsedate_to_datetime
from typing import Any

import httpx
from pydantic import ValidationError

from feedback.events import FeedbackEvent

log = logging.getLogger("flywheel.feedback.sdk")
OnError = Callable[[BaseException, list[dict]], None]
MAX_BATCH = 1000  # the gateway's limit per request
MAX_RETRY_AFTER_S = 60.0  # a longer Retry-After is shortened to this


class FeedbackError(Exception):
    """Base of what the client hands to `on_error`."""


class QueueFullError(FeedbackError):
    """The bounded queue was full: the event was dropped."""


class ClientClosedError(FeedbackError):
    """The client was closed before the event could be sent."""


class RetriesExhaustedError(FeedbackError):
    """Every retry failed; `__cause__` is the last failure."""


class WindowClosedError(FeedbackError):
    """The gateway received the events after their completions' attribution windows had closed: they
    were not recorded and can never count (the answer's `window_closed`)."""


class FeedbackAPIError(FeedbackError):
    """The gateway refused the events (OpenAI error shape: message, param, code)."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None):
        super().__init__(f"{status} {code or ''}: {message}" + (f" (param {param})" if param else ""))
        self.status, self.message, self.param, self.code = status, message, param, code

    @classmethod
    def from_response(cls, r: httpx.Response) -> FeedbackAPIError:
        try:
            err = r.json()["error"]
            return cls(r.status_code, str(err.get("message")), err.get("param"), err.get("code"))
        except (ValueError, KeyError, TypeError, AttributeError):
            return cls(r.status_code, r.text[:500])

    @property
    def event_index(self) -> int | None:
        """The batch index this error names (`events.3.value` → 3), if any."""
        parts = (self.param or "").split(".")
        return int(parts[1]) if len(parts) >= 2 and parts[0] == "events" and parts[1].isdigit() else None


def _is_number(x: Any) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool)


def make_event(
    kind: str,
    completion_id: str,
    value: float | None = None,
    *,
    edit_distance: int | None = None,
    user: str | None = None,
    ts: float | None = None,
    idempotency_key: str | None = None,
) -> dict:
    """One event as the gateway expects it; `ValueError` naming the value when it is not valid."""
    if value is not None and not _is_number(value):  # the model would take "4" or True; its rules do the rest
        raise ValueError(f"feedback value must be a number, got value={value!r}")
    if user is not None and not (isinstance(user, str) and len(user) <= 256):
        raise ValueError(f"user must be a string of at most 256 characters, got user={user!r}")
    if ts is not None and not (_is_number(ts) and ts > 0):
        raise ValueError(f"ts must be seconds since the epoch, got ts={ts!r}")
    if idempotency_key is not None and not (isinstance(idempotency_key, str) and 1 <= len(idempotency_key) <= 256):
        raise ValueError(f"idempotency_key must be a string of 1-256 characters, got {idempotency_key!r}")
    given = {"kind": kind, "completion_id": completion_id, "value": value, "edit_distance": edit_distance}
    try:  # the gateway's rules, from the event model itself
        ev = FeedbackEvent(event_id="sdk-validation", tenant="sdk", ts=1.0, **given)
    except ValidationError as e:
        err = e.errors()[0]
        field = ".".join(str(p) for p in err["loc"]) or "event"
        got = given.get(field, err.get("input"))
        raise ValueError(f"invalid feedback {field}={got!r} (kind {kind!r}): {err['msg']}") from None
    out = {"completion_id": completion_id, "kind": kind, "ts": time.time() if ts is None else float(ts)}
    out["idempotency_key"] = idempotency_key or os.urandom(16).hex()
    optional = {"value": ev.value, "edit_distance": ev.edit_distance, "user": user}
    return out | {k: v for k, v in optional.items() if v is not None}


def _window_closed(r: httpx.Response, n: int) -> list[int]:
    """The indices the gateway's answer lists as received after their window (none if it says nothing)."""
    try:
        got = r.json().get("window_closed") or []
    except (ValueError, AttributeError):
        return []
    return sorted({i for i in got if isinstance(i, int) and 0 <= i < n})


def retry_after_s(headers: httpx.Headers) -> float | None:
    """`Retry-After` in seconds (a number or an HTTP date), capped at MAX_RETRY_AFTER_S; None if absent."""
    if (raw := headers.get("retry-after")) is None:
        return None
    try:
        s = float(raw)
    except ValueError:
        try:
            s = parsedate_to_datetime(raw).timestamp() - time.time()
        except (TypeError, ValueError):
            return None
    return min(max(s, 0.0), MAX_RETRY_AFTER_S) if math.isfinite(s) else None


class _Client:
    """The calls, the queue and the sender thread; `FeedbackClient` and `AsyncFeedbackClient` add `flush`
    and `close`, called or awaited. Thread-safe; one client per process is enough. Counters: `dropped`
    (at enqueue: queue full, closed), `sent` (acknowledged by the gateway, also as duplicates), `failed`
    (given up after enqueue), `pending` (queued or in flight)."""

    def __init__(
        self,
        base_url: str,
        api_key: str | None = None,
        tenant: str | None = None,
        batch_size: int = 100,
        flush_interval_s: float = 1.0,
        max_queue: int = 10_000,
        max_retries: int = 8,
        backoff_s: float = 0.2,
        max_backoff_s: float = 10.0,
        timeout_s: float = 10.0,
        on_error: OnError | None = None,
    ):
        rules = {
            "batch_size": (batch_size, 1 <= batch_size <= MAX_BATCH, f"in [1, {MAX_BATCH}]"),
            "flush_interval_s": (flush_interval_s, flush_interval_s > 0, "> 0"),
            "max_queue": (max_queue, max_queue >= 1, ">= 1"),
            "max_retries": (max_retries, max_retries >= 0, ">= 0"),
            "backoff_s": (backoff_s, backoff_s >= 0, ">= 0"),
            "max_backoff_s": (max_backoff_s, max_backoff_s >= 0, ">= 0"),
            "timeout_s": (timeout_s, timeout_s > 0, "> 0"),
        }
        for name, (got, ok, rule) in rules.items():
            if not ok:
                raise ValueError(f"{name} must be {rule}, got {got}")
        self.url = base_url.rstrip("/") + "/v1/feedback"
        self.batch_size, self.flush_interval_s, self.max_queue = batch_size, flush_interval_s, max_queue
        self.max_retries, self.backoff_s, self.max_backoff_s = max_retries, backoff_s, max_backoff_s
        self.timeout_s, self.on_error = timeout_s, on_error
        self.headers = {"content-type": "application/json", "user-agent": "flywheel-feedback-sdk/0.1"}
        self.headers |= {"authorization": f"Bearer {api_key}"} if api_key else {}
        self.headers |= {"x-flywheel-tenant": tenant} if tenant else {}
        self._closed = False
        self._reset()
        _LIVE.add(self)

    def _reset(self) -> None:
        """Fresh state: at construction, and in a forked child (where the parent's lock may be held)."""
        self._lock = threading.Lock()
        self._progress = threading.Condition(self._lock)
        self._wake, self._stop = threading.Event(), threading.Event()  # _stop: close's timeout ran out
        self._queue: deque[tuple[float, dict]] = deque()
        self._sender: threading.Thread | None = None  # started by the first event
        self._dead: BaseException | None = None  # why the sender died (a bug): enqueue refuses, flush raises
        self._enqueued = self._resolved = self._flush_to = 0
        self.dropped = self.sent = self.failed = 0

    @property
    def pending(self) -> int:
        return self._enqueued - self._resolved

    # ---- the calls ------------------------------------------------------------------------------
    def send(
        self,
        kind: str,
        completion_id: str,
        value: float | None = None,
        *,
        edit_distance: int | None = None,
        user: str | None = None,
        ts: float | None = None,
        idempotency_key: str | None = None,
    ) -> str | None:
        """Queue one event; returns its idempotency key, or None when it was dropped (queue full, closed)."""
        event = make_event(
            kind, completion_id, value, edit_distance=edit_distance, user=user, ts=ts, idempotency_key=idempotency_key
        )
        return self._enqueue(event)

    def shown(self, completion_id: str, user: str | None = None) -> str | None:
        """The completion was displayed to its user: an exposure. Report it for every completion you
        show; with it, silence inside the attribution window counts (as the reward spec's `silence`)."""
        return self.send("shown", completion_id, user=user)

    def thumbs_up(self, completion_id: str, user: str | None = None) -> str | None:
        return self.send("thumb_up", completion_id, user=user)

    def thumbs_down(self, completion_id: str, user: str | None = None) -> str | None:
        return self.send("thumb_down", completion_id, user=user)

    def rating(self, completion_id: str, stars: int, user: str | None = None) -> str | None:
        return self.send("rating", completion_id, stars, user=user)

    def accepted(self, completion_id: str, user: str | None = None) -> str | None:
        return self.send("accepted", completion_id, user=user)

    def rejected(self, completion_id: str, user: str | None = None) -> str | None:
        return self.send("rejected", completion_id, user=user)

    def edited(
        self, completion_id: str, kept_fraction: float, edit_distance: int | None = None, user: str | None = None
    ) -> str | None:
        return self.send("edited", completion_id, kept_fraction, edit_distance=edit_distance, user=user)

    def copied(self, completion_id: str, user: str | None = None) -> str | None:
        return self.send("copied", completion_id, user=user)

    def regenerated(self, completion_id: str, user: str | None = None) -> str | None:
        return self.send("regenerated", completion_id, user=user)

    def dwell(self, completion_id: str, seconds: float, user: str | None = None) -> str | None:
        return self.send("dwell", completion_id, seconds, user=user)

    def _flush(self, timeout: float | None = None) -> bool:
        """Send everything queued so far now; True once it is all delivered or given up, False on timeout."""
        with self._lock:
            target = self._flush_to = max(self._flush_to, self._enqueued)
        self._wake.set()
        with self._progress:
            self._progress.wait_for(lambda: self._resolved >= target or self._dead is not None, timeout)
            if self._resolved < target and self._dead is not None:
                raise RuntimeError("the feedback sender died") from self._dead
            return self._resolved >= target

    def _close(self, timeout: float | None = None) -> None:
        """Stop taking events, send what is queued (for up to `timeout` s), then give up the rest."""
        with self._lock:
            self._closed = True
            thread = self._sender
        _LIVE.discard(self)
        self._wake.set()
        if thread is not None:
            thread.join(timeout)
            if thread.is_alive():
                self._stop.set()  # what is still queued goes to on_error; a request in flight may finish
                thread.join(self.timeout_s + 1.0)

    # ---- the queue and the sender ---------------------------------------------------------------
    def _enqueue(self, event: dict) -> str | None:
        with self._lock:
            if self._closed or self._dead is not None:
                err: FeedbackError = ClientClosedError("the feedback client is closed")
            elif len(self._queue) >= self.max_queue:
                err = QueueFullError(f"the feedback queue holds {self.max_queue} events; event dropped")
            else:
                self._queue.append((time.monotonic(), event))
                self._enqueued += 1
                if self._sender is None:
                    self._sender = threading.Thread(target=self._run, name="flywheel-feedback", daemon=True)
                    self._sender.start()
                if len(self._queue) in (1, self.batch_size):  # the interval starts, or a batch is full
                    self._wake.set()
                return event["idempotency_key"]
            self.dropped += 1
        self._report(err, [event])
        return None

    def _run(self) -> None:
        try:
            with httpx.Client(timeout=self.timeout_s, headers=self.headers) as http:
                while batch := self._next_batch():
                    self._deliver(http, batch)
                    with self._progress:
                        self._resolved += len(batch)
                        self._progress.notify_all()
        except BaseException as e:  # a bug: fail loudly
            self._dead = e
            log.exception("feedback sender died")
            with self._progress:
                self._progress.notify_all()
            raise

    def _next_batch(self) -> list[dict]:
        """Waits for a full batch, the oldest event `flush_interval_s` old, flush or close; [] once closed, drained."""
        while True:
            self._wake.clear()
            with self._lock:
                q, wait = self._queue, None
                if q:
                    wait = self.flush_interval_s - (time.monotonic() - q[0][0])
                    if len(q) >= self.batch_size or self._flush_to > self._resolved or self._closed or wait <= 0:
                        return [q.popleft()[1] for _ in range(min(self.batch_size, len(q)))]
                elif self._closed:
                    return []
            self._wake.wait(wait)

    def _deliver(self, http: httpx.Client, events: list[dict]) -> None:
        attempt = 0
        err: Exception  # the last failure: a transport error or the gateway's answer
        while events and not self._stop.is_set():
            try:
                r = http.post(self.url, content=json.dumps({"events": events}).encode())
            except httpx.TransportError as e:  # retried at the I/O boundary
                err, delay = e, None
            else:
                if r.status_code == 200:
                    closed = _window_closed(r, len(events))
                    self.sent += len(events) - len(closed)
                    if closed:
                        late = [events[i] for i in closed]
                        self._give_up(late, WindowClosedError(f"{len(late)} event(s) came after their window"))
                    return
                err = api_err = FeedbackAPIError.from_response(r)
                if r.status_code != 429 and r.status_code < 500:
                    i = api_err.event_index
                    if i is not None and i < len(events) and len(events) > 1:  # drop that one, resend the rest
                        self._give_up([events[i]], err)
                        events = events[:i] + events[i + 1 :]
                        continue
                    return self._give_up(events, err)
                delay = retry_after_s(r.headers)
            if attempt >= self.max_retries:
                exhausted = RetriesExhaustedError(f"{len(events)} event(s) not delivered in {attempt + 1} attempts")
                exhausted.__cause__ = err
                return self._give_up(events, exhausted)
            if delay is None:  # full jitter
                delay = random.uniform(0.0, min(self.max_backoff_s, self.backoff_s * 2 ** min(attempt, 30)))
            attempt += 1
            what = (len(events), err, attempt, self.max_retries, delay)
            log.warning("feedback: %d event(s) not delivered (%r); retry %d/%d in %.2f s", *what)
            self._stop.wait(delay)
        if events:
            self._give_up(events, ClientClosedError("closed before these events could be sent"))

    def _give_up(self, events: list[dict], exc: BaseException) -> None:
        self.failed += len(events)
        self._report(exc, events)

    def _report(self, exc: BaseException, events: list[dict]) -> None:
        """Hand given-up events to on_error (a failing on_error is logged, never raised into the product)."""
        if self.on_error is None:
            log.warning("feedback: %d event(s) given up: %r", len(events), exc)
            return
        try:
            self.on_error(exc, events)
        except Exception:
            log.exception("feedback: on_error raised")


class FeedbackClient(_Client):
    """The client for threaded code: `flush()` and `close()` block (for up to `timeout` s)."""

    flush, close = _Client._flush, _Client._close

    def __enter__(self) -> FeedbackClient:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class AsyncFeedbackClient(_Client):
    """The client for asyncio code: calls queue as `FeedbackClient`'s do (no I/O, sent by the client's
    thread, not the event loop); `flush()` and `aclose()` are `_flush` and `_close` awaited in a thread."""

    async def flush(self, timeout: float | None = None) -> bool:
        return await asyncio.to_thread(self._flush, timeout)

    async def aclose(self, timeout: float | None = None) -> None:
        await asyncio.to_thread(self._close, timeout)

    async def __aenter__(self) -> AsyncFeedbackClient:
        return self

    async def __aexit__(self, *exc) -> None:
        await self.aclose()


# ---- process lifecycle: close at exit, fresh state in a forked child -----------------------------
_LIVE: weakref.WeakSet[_Client] = weakref.WeakSet()
AT_EXIT_TIMEOUT_S = 10.0


@atexit.register
def _close_all_at_exit() -> None:
    for client in list(_LIVE):
        client._close(timeout=AT_EXIT_TIMEOUT_S)


def _reset_in_child() -> None:
    for client in list(_LIVE):
        client._reset()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_reset_in_child)
