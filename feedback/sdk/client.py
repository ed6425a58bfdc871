"""The product team's feedback client: one call per user signal, batched and retried in the background.

`FeedbackClient(base_url)` validates each event on the caller's thread (a `ValueError` naming the
value, by the rules of `feedback.events.FeedbackEvent`), gives it an idempotency key and a
timestamp, and appends it to a bounded in-memory queue: O(1), never blocking, never doing I/O.
A sender thread posts batches to the gateway's `POST /v1/feedback` when `batch_size` events are
waiting, when the oldest has waited `flush_interval_s`, on `flush()`, and at `close()` /
interpreter exit. Because the key is fixed at enqueue time, a retried batch is never counted twice.

Failures: 429, 5xx and connection errors are retried with exponential backoff and full jitter
(honouring `Retry-After`), up to `max_retries`; any other 4xx is not retried. An error that names
one event of the batch (`events.3.value`) drops only that event and sends the rest. Whatever is
given up (a full queue, a refused event, retries exhausted, a client closed) is counted and handed
to `on_error(exc, events)` (logged when there is no `on_error`), never raised into the product.

Fork-safe: a child process starts with an empty queue and its own lock, thread and connection;
what the parent queued before the fork is sent by the parent only. Also shared by `aio.py`.
"""

from __future__ import annotations

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
from typing import get_args

import httpx
from pydantic import ValidationError

from feedback.events import FeedbackEvent, FeedbackKind, check_value

log = logging.getLogger("flywheel.feedback.sdk")
OnError = Callable[[BaseException, list[dict]], None]
MAX_BATCH = 1000  # the gateway's limit per request
MAX_RETRY_AFTER_S = 60.0  # a Retry-After longer than this is shortened to it


class FeedbackError(Exception):
    """Base of what the client hands to `on_error`."""


class QueueFullError(FeedbackError):
    """The bounded queue was full: the event was dropped."""


class ClientClosedError(FeedbackError):
    """The client was closed before the event could be sent."""


class RetriesExhaustedError(FeedbackError):
    """Every retry failed; `__cause__` is the last failure."""


class FeedbackAPIError(FeedbackError):
    """The gateway refused the events (OpenAI error shape: message, param, code)."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None):
        super().__init__(f"{status} {code or ''}: {message}" + (f" (param {param})" if param else ""))
        self.status, self.message, self.param, self.code = status, message, param, code

    @classmethod
    def from_response(cls, r: httpx.Response) -> "FeedbackAPIError":
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


_KINDS = frozenset(get_args(FeedbackKind))


def make_event(kind: str, completion_id: str, value: float | None = None, *, edit_distance: int | None = None,
               user: str | None = None, ts: float | None = None, idempotency_key: str | None = None) -> dict:
    """One event as the gateway expects it; `ValueError` naming the value when it is not valid."""
    if value is not None and (isinstance(value, bool) or not isinstance(value, (int, float))
                              or not math.isfinite(value)):
        raise ValueError(f"feedback value must be a finite number, got value={value!r}")
    if user is not None and (not isinstance(user, str) or len(user) > 256):
        raise ValueError(f"user must be a string of at most 256 characters, got user={user!r}")
    if ts is not None and (isinstance(ts, bool) or not isinstance(ts, (int, float)) or not ts > 0):
        raise ValueError(f"ts must be seconds since the epoch, got ts={ts!r}")
    key = idempotency_key
    if key is not None and (not isinstance(key, str) or not 1 <= len(key) <= 256):
        raise ValueError(f"idempotency_key must be a string of 1-256 characters, got {idempotency_key!r}")
    # FeedbackEvent's rules, checked directly (building the model cost ~5 us of the ~10 us an enqueue
    # took); anything they refuse goes through the model, whose error names the field and the value.
    fast = (kind in _KINDS and type(completion_id) is str and 1 <= len(completion_id) <= 128
            and (edit_distance is None or (type(edit_distance) is int and edit_distance >= 0)))
    if fast:
        try:
            checked, edit = check_value(kind, value), edit_distance
        except ValueError:
            fast = False
    if not fast:
        try:
            ev = FeedbackEvent(event_id="sdk-validation", tenant="sdk", ts=1.0, completion_id=completion_id,
                               kind=kind, value=value, edit_distance=edit_distance)
        except ValidationError as e:
            err = e.errors()[0]
            field = ".".join(str(p) for p in err["loc"]) or "event"
            given = {"kind": kind, "completion_id": completion_id, "value": value, "edit_distance": edit_distance}
            raise ValueError(f"invalid feedback {field}={given.get(field, err.get('input'))!r} "
                             f"(kind {kind!r}): {err['msg']}") from None
        checked, edit = ev.value, ev.edit_distance
    out: dict = {"completion_id": completion_id, "kind": kind, "ts": time.time() if ts is None else float(ts),
                 "idempotency_key": idempotency_key or os.urandom(16).hex()}
    if checked is not None:
        out["value"] = checked
    if edit is not None:
        out["edit_distance"] = edit
    if user is not None:
        out["user"] = user
    return out


def retry_after_s(headers: httpx.Headers) -> float | None:
    """`Retry-After` in seconds (a number or an HTTP date), capped at MAX_RETRY_AFTER_S; None if absent."""
    raw = headers.get("retry-after")
    if raw is None:
        return None
    try:
        s = float(raw)
    except ValueError:
        try:
            s = parsedate_to_datetime(raw).timestamp() - time.time()
        except (TypeError, ValueError):
            return None
    return min(max(s, 0.0), MAX_RETRY_AFTER_S) if math.isfinite(s) else None


def backoff_s(attempt: int, base: float, cap: float) -> float:
    """Full jitter: uniform in [0, min(cap, base * 2**attempt)]."""
    return random.uniform(0.0, min(cap, base * (2 ** min(attempt, 30))))


def is_retryable(status: int) -> bool:
    return status == 429 or status >= 500


class Delivery:
    """One batch's way through the retry policy, shared by the sync and async senders.

    After each attempt, `after(response or transport error)` returns the delay before the next one,
    or None once the batch is settled; what is given up goes to `give_up(events, exc)`, and
    `events` shrinks when the gateway refuses one event of the batch (the rest are resent at once).
    """

    def __init__(self, cfg: ClientConfig, events: list[dict],
                 give_up: Callable[[list[dict], BaseException], None]):
        self.cfg, self.events, self.give_up = cfg, list(events), give_up
        self.attempt = self.sent = 0

    def body(self) -> bytes:
        return json.dumps({"events": self.events}).encode()

    def after(self, outcome: httpx.Response | Exception) -> float | None:
        events, retry_after = self.events, None
        if isinstance(outcome, httpx.Response):
            if outcome.status_code == 200:
                self.sent, self.events = len(events), []
                return None
            err: Exception = FeedbackAPIError.from_response(outcome)
            if not is_retryable(outcome.status_code):
                i = err.event_index  # type: ignore[attr-defined]
                if i is not None and i < len(events) and len(events) > 1:  # drop that one, resend the rest
                    self.give_up([events.pop(i)], err)
                    return 0.0
                return self._settle(err)
            retry_after = retry_after_s(outcome.headers)
        else:
            err = outcome
        if self.attempt >= self.cfg.max_retries:
            exhausted = RetriesExhaustedError(
                f"{len(events)} event(s) not delivered in {self.attempt + 1} attempts")
            exhausted.__cause__ = err
            return self._settle(exhausted)
        cfg = self.cfg
        if retry_after is None:
            delay = backoff_s(self.attempt, cfg.backoff_s, cfg.max_backoff_s)
        else:
            delay = retry_after
        self.attempt += 1
        log.warning("feedback: %d event(s) not delivered (%r); retry %d/%d in %.2f s", len(events), err,
                    self.attempt, cfg.max_retries, delay)
        return delay

    def abandon(self) -> None:
        self._settle(ClientClosedError("closed before these events could be sent"))

    def _settle(self, exc: BaseException) -> None:
        self.give_up(self.events, exc)
        self.events = []
        return None


class FeedbackCalls:
    """The calls, one per kind of signal; subclasses implement `send`'s queueing (`_enqueue`)."""

    def send(self, kind: str, completion_id: str, value: float | None = None, *,
             edit_distance: int | None = None, user: str | None = None, ts: float | None = None,
             idempotency_key: str | None = None) -> str | None:
        """Queue one event; returns its idempotency key, or None when it was dropped (queue full, closed)."""
        return self._enqueue(make_event(kind, completion_id, value, edit_distance=edit_distance, user=user,
                                        ts=ts, idempotency_key=idempotency_key))

    def _enqueue(self, event: dict) -> str | None:
        raise NotImplementedError

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

    def edited(self, completion_id: str, kept_fraction: float, edit_distance: int | None = None,
               user: str | None = None) -> str | None:
        return self.send("edited", completion_id, kept_fraction, edit_distance=edit_distance, user=user)

    def copied(self, completion_id: str, user: str | None = None) -> str | None:
        return self.send("copied", completion_id, user=user)

    def regenerated(self, completion_id: str, user: str | None = None) -> str | None:
        return self.send("regenerated", completion_id, user=user)

    def dwell(self, completion_id: str, seconds: float, user: str | None = None) -> str | None:
        return self.send("dwell", completion_id, seconds, user=user)


class ClientConfig:
    """Arguments shared by the sync and async clients, checked once."""

    def __init__(self, base_url: str, api_key: str | None, tenant: str | None, batch_size: int,
                 flush_interval_s: float, max_queue: int, max_retries: int, backoff_s: float,
                 max_backoff_s: float, timeout_s: float, on_error: OnError | None):
        if not 1 <= batch_size <= MAX_BATCH:
            raise ValueError(f"batch_size must be in [1, {MAX_BATCH}], got {batch_size}")
        if not flush_interval_s > 0:
            raise ValueError(f"flush_interval_s must be > 0, got {flush_interval_s}")
        if max_queue < 1:
            raise ValueError(f"max_queue must be >= 1, got {max_queue}")
        if max_retries < 0:
            raise ValueError(f"max_retries must be >= 0, got {max_retries}")
        if backoff_s < 0 or max_backoff_s < 0:
            raise ValueError(f"backoff_s and max_backoff_s must be >= 0, got {backoff_s}, {max_backoff_s}")
        if not timeout_s > 0:
            raise ValueError(f"timeout_s must be > 0, got {timeout_s}")
        self.url = base_url.rstrip("/") + "/v1/feedback"
        self.batch_size, self.flush_interval_s, self.max_queue = batch_size, flush_interval_s, max_queue
        self.max_retries, self.backoff_s, self.max_backoff_s = max_retries, backoff_s, max_backoff_s
        self.timeout_s, self.on_error = timeout_s, on_error
        self.headers = {"content-type": "application/json", "user-agent": "flywheel-feedback-sdk/0.1"}
        if api_key:
            self.headers["authorization"] = f"Bearer {api_key}"
        if tenant:
            self.headers["x-flywheel-tenant"] = tenant

    def report(self, exc: BaseException, events: list[dict]) -> None:
        """Hand given-up events to on_error (a failing on_error is logged, never raised into the product)."""
        if self.on_error is None:
            log.warning("feedback: %d event(s) given up: %r", len(events), exc)
            return
        try:
            self.on_error(exc, events)
        except Exception:
            log.exception("feedback: on_error raised")


class FeedbackClient(FeedbackCalls):
    """Thread-safe; one per process is enough. See the module docstring."""

    def __init__(self, base_url: str, api_key: str | None = None, tenant: str | None = None,
                 batch_size: int = 100, flush_interval_s: float = 1.0, max_queue: int = 10_000,
                 max_retries: int = 8, backoff_s: float = 0.2, max_backoff_s: float = 10.0,
                 timeout_s: float = 10.0, on_error: OnError | None = None):
        self.cfg = ClientConfig(base_url, api_key, tenant, batch_size, flush_interval_s, max_queue,
                                max_retries, backoff_s, max_backoff_s, timeout_s, on_error)
        self._closed = False
        self._reset()
        _LIVE.add(self)

    def _reset(self) -> None:
        """Fresh state: at construction, and in a forked child (where the parent's lock may be held
        and its thread does not exist)."""
        self._lock = threading.Lock()
        self._progress = threading.Condition(self._lock)
        self._queue: deque[tuple[float, dict]] = deque()
        self._wake = threading.Event()
        self._stop = threading.Event()  # give up what is left now (close's timeout ran out)
        self._thread: threading.Thread | None = None
        self._enqueued = self._resolved = self._flush_to = 0
        self._dropped = self._sent = self._failed = 0
        self._dead: BaseException | None = None

    # ---- counters ---------------------------------------------------------------------------
    @property
    def dropped(self) -> int:
        """Events dropped at enqueue (queue full, client closed)."""
        return self._dropped

    @property
    def sent(self) -> int:
        """Events the gateway acknowledged (accepted or recognised as duplicates)."""
        return self._sent

    @property
    def failed(self) -> int:
        """Events given up after enqueue (refused by the gateway, retries exhausted, closed)."""
        return self._failed

    @property
    def pending(self) -> int:
        return self._enqueued - self._resolved

    # ---- the caller's side ------------------------------------------------------------------
    def _enqueue(self, event: dict) -> str | None:
        with self._lock:
            if self._closed or self._dead is not None:
                err: FeedbackError = ClientClosedError("the feedback client is closed")
            elif len(self._queue) >= self.cfg.max_queue:
                err = QueueFullError(f"the feedback queue holds {self.cfg.max_queue} events; event dropped")
            else:
                self._queue.append((time.monotonic(), event))
                self._enqueued += 1
                if self._thread is None:
                    self._thread = threading.Thread(target=self._run, name="flywheel-feedback", daemon=True)
                    self._thread.start()
                if len(self._queue) == self.cfg.batch_size:
                    self._wake.set()
                return event["idempotency_key"]
            self._dropped += 1
        self.cfg.report(err, [event])
        return None

    def flush(self, timeout: float | None = None) -> bool:
        """Send everything queued so far now; True once all of it is delivered or given up, False on
        timeout."""
        with self._lock:
            target = self._flush_to = max(self._flush_to, self._enqueued)
        self._wake.set()
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._progress:
            while self._resolved < target:
                if self._dead is not None:
                    raise RuntimeError("the feedback sender died") from self._dead
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    return False
                self._progress.wait(0.5 if left is None else min(left, 0.5))
        return True

    def close(self, timeout: float | None = None) -> None:
        """Stop taking events, send what is queued (for up to `timeout` s), then give up the rest."""
        with self._lock:
            self._closed = True
            thread = self._thread
        _LIVE.discard(self)
        self._wake.set()
        if thread is None:
            return
        thread.join(timeout)
        if thread.is_alive():
            self._stop.set()  # whatever is still queued goes to on_error; a request in flight may finish
            thread.join(self.cfg.timeout_s + 1.0)

    def __enter__(self) -> "FeedbackClient":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # ---- the sender thread ------------------------------------------------------------------
    def _run(self) -> None:
        http = httpx.Client(timeout=self.cfg.timeout_s, headers=self.cfg.headers)
        try:
            while (batch := self._next_batch()) is not None:
                self._deliver(http, batch)
                with self._progress:
                    self._resolved += len(batch)
                    self._progress.notify_all()
        except BaseException as e:  # a bug: fail loudly; flush() raises from now on, enqueue drops
            self._dead = e
            log.exception("feedback sender died")
            with self._progress:
                self._progress.notify_all()
            raise
        finally:
            http.close()

    def _next_batch(self) -> list[dict] | None:
        """Wait until a batch is due (size, age, flush, close); None once closed and empty."""
        cfg = self.cfg
        while True:
            self._wake.clear()
            with self._lock:
                q = self._queue
                if not q:
                    if self._closed:
                        return None
                    timeout = None
                else:
                    age = time.monotonic() - q[0][0]
                    if (len(q) >= cfg.batch_size or self._flush_to > self._resolved or self._closed
                            or age >= cfg.flush_interval_s):
                        return [q.popleft()[1] for _ in range(min(cfg.batch_size, len(q)))]
                    timeout = cfg.flush_interval_s - age
            self._wake.wait(timeout)

    def _deliver(self, http: httpx.Client, events: list[dict]) -> None:
        d = Delivery(self.cfg, events, self._give_up)
        while d.events:
            if self._stop.is_set():
                d.abandon()
                break
            try:
                delay = d.after(http.post(self.cfg.url, content=d.body()))
            except httpx.TransportError as e:  # deliberate retry at the I/O boundary (Delivery logs it)
                delay = d.after(e)
            if delay:
                self._stop.wait(delay)
        self._sent += d.sent

    def _give_up(self, events: list[dict], exc: BaseException) -> None:
        self._failed += len(events)
        self.cfg.report(exc, events)


# ---- process lifecycle: flush at exit, fresh state in a forked child ---------------------------
_LIVE: weakref.WeakSet = weakref.WeakSet()
AT_EXIT_TIMEOUT_S = 10.0


def _close_all_at_exit() -> None:
    for client in list(_LIVE):
        close = getattr(client, "close_at_exit", None) or client.close
        close(timeout=AT_EXIT_TIMEOUT_S)


def _reset_in_child() -> None:
    for client in list(_LIVE):
        client._reset()


atexit.register(_close_all_at_exit)
if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_reset_in_child)
