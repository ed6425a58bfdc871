"""The feedback SDK against a live gateway (real embedded bus), through a real fault-injecting proxy.

The proxy forwards every request to the gateway and, for the attempts it is told to spoil, answers
503 / 429 (some with Retry-After) or drops the connection AFTER the gateway processed the request:
the response is lost, the SDK retries, and the bus must still hold each logical event exactly once.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import httpx
import pytest

from api.main import create_app
from core.harness import wait_until
from core.settings import Settings
from feedback.bus_embedded import EmbeddedBus
from feedback.completion_index import CompletionIndex
from feedback.events import TOPICS, FeedbackEvent, hash_user
from feedback.sdk import (
    AsyncFeedbackClient,
    ClientClosedError,
    FeedbackAPIError,
    FeedbackClient,
    QueueFullError,
    RetriesExhaustedError,
    make_event,
)
from serving.engine import EmbeddedEngine
from tests.conftest import LiveServer

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def live(tiny_checkpoint, tmp_path_factory):
    home = tmp_path_factory.mktemp("sdkhome")
    settings = Settings(home=home, model_dir=tiny_checkpoint, max_batch=8, max_model_len=128)
    engine = EmbeddedEngine(max_batch=8, max_model_len=128)
    engine.add_version(tiny_checkpoint.name, tiny_checkpoint, default=True)
    bus = EmbeddedBus(home / "bus")
    index = CompletionIndex(home / "index.db")
    with LiveServer(create_app(settings, engine=engine, bus=bus, index=index)) as server:
        server.bus, server.index = bus, index
        yield server
    engine.shutdown()
    bus.close()
    index.close()


def new_completion(live, tenant: str = "default", user: str | None = None) -> str:
    body = {"model": "flywheel", "prompt": "def f(x):\n", "max_tokens": 2, **({"user": user} if user else {})}
    r = httpx.post(live.url + "/v1/completions", json=body, headers={"X-Flywheel-Tenant": tenant}, timeout=30)
    assert r.status_code == 200, r.text
    return r.json()["id"]


def on_bus(live, completion_ids) -> list[FeedbackEvent]:
    ids, out = set(completion_ids), []
    consumer = live.bus.consumer(TOPICS["feedback"], f"sdk-test-{time.monotonic_ns()}")
    try:
        while recs := consumer.poll(max_records=1000, timeout_s=0.05):
            events = [FeedbackEvent.model_validate_json(r.value) for r in recs]
            out += [ev for ev in events if ev.completion_id in ids]
    finally:
        consumer.close()
    return out


class FaultProxy:
    """A real HTTP proxy in a thread. `faults[i]` spoils the i-th attempt after forwarding it:
    "503", "503+ra" (Retry-After: 1), "429" (Retry-After: 0), "drop" (connection closed, no answer)."""

    def __init__(self, upstream: str, faults: list[str] | None = None):
        self.upstream, self.faults, self.lock = upstream, list(faults or []), threading.Lock()
        self.attempts: list[dict] = []  # t, n events, idempotency keys, fault, the gateway's answer
        proxy = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args):
                pass

            def do_POST(self):
                body = self.rfile.read(int(self.headers["Content-Length"]))
                keep = ("content-type", "authorization", "x-flywheel-tenant", "idempotency-key")
                fwd = {k: v for k, v in self.headers.items() if k.lower() in keep}
                r = httpx.post(proxy.upstream + self.path, content=body, headers=fwd, timeout=30)
                with proxy.lock:
                    fault = proxy.faults.pop(0) if proxy.faults else "ok"
                    events = json.loads(body).get("events", [])
                    proxy.attempts.append(
                        {
                            "t": time.monotonic(),
                            "n": len(events),
                            "fault": fault,
                            "keys": [e.get("idempotency_key") for e in events],
                            "status": r.status_code,
                            "answer": r.json(),
                        }
                    )
                if fault == "drop":
                    self.close_connection = True
                    return
                status, content, headers = r.status_code, r.content, {}
                if fault != "ok":
                    status = 429 if fault == "429" else 503
                    err = {"message": "injected", "type": "server_error", "param": None, "code": "injected"}
                    content = json.dumps({"error": err}).encode()
                    if fault in ("503+ra", "429"):
                        headers["Retry-After"] = "1" if fault == "503+ra" else "0"
                self.send_response(status)
                headers.update({"Content-Type": "application/json", "Content-Length": str(len(content))})
                for k, v in headers.items():
                    self.send_header(k, v)
                self.end_headers()
                self.wfile.write(content)

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server.server_address[1]}"

    def __enter__(self):
        self.thread.start()
        return self

    def __exit__(self, *exc):
        self.server.shutdown()
        self.server.server_close()


class Errors(list):
    def __call__(self, exc, events):
        self.append((exc, events))


# ---- calls and validation -----------------------------------------------------------------------
def test_every_call_is_delivered_once_with_its_value(live):
    c = new_completion(live, user="u1")
    errors = Errors()
    with FeedbackClient(live.url, batch_size=100, flush_interval_s=60, on_error=errors) as fb:
        keys = [
            fb.shown(c),
            fb.thumbs_up(c, user="u1"),
            fb.thumbs_down(c),
            fb.rating(c, 4),
            fb.accepted(c),
            fb.rejected(c),
            fb.edited(c, kept_fraction=0.7, edit_distance=3),
            fb.copied(c),
            fb.regenerated(c),
            fb.dwell(c, 12.5),
            fb.send("rating", c, 2, ts=1_700_000_000.0),
        ]
        assert fb.flush(timeout=10) and fb.sent == 11 and fb.pending == 0
    assert not errors and len(set(keys)) == 11
    got = on_bus(live, [c])
    assert len(got) == 11 and len({e.event_id for e in got}) == 11
    assert sorted((e.kind, e.value) for e in got) == sorted(
        [
            ("shown", None),
            ("thumb_up", None),
            ("thumb_down", None),
            ("rating", 4),
            ("accepted", None),
            ("rejected", None),
            ("edited", 0.7),
            ("copied", None),
            ("regenerated", None),
            ("dwell", 12.5),
            ("rating", 2),
        ]
    )
    assert {e.user_id for e in got} == {hash_user("default", "u1")}  # the completion's user
    assert [e.edit_distance for e in got if e.kind == "edited"] == [3]
    served = live.index.get(c).ts
    assert [e.ts for e in got if e.kind == "rating" and e.value == 2] == [served]  # ts before serving: clamped


@pytest.mark.parametrize(
    "call,match",
    [
        (lambda fb: fb.rating("c", 7), "value=7"),
        (lambda fb: fb.rating("c", 2.5), "value=2.5"),
        (lambda fb: fb.rating("c", float("inf")), "value=inf"),
        (lambda fb: fb.dwell("c", -1), "value=-1"),
        (lambda fb: fb.edited("c", kept_fraction=1.2), "value=1.2"),
        (lambda fb: fb.edited("c", kept_fraction=0.5, edit_distance=-2), "edit_distance=-2"),
        (lambda fb: fb.send("smile", "c"), "kind='smile'"),
        (lambda fb: fb.send("thumb_up", "c", 1), "value=1"),
        (lambda fb: fb.thumbs_up(""), "completion_id=''"),
        (lambda fb: fb.thumbs_up("c", user=5), "user=5"),
    ],
)
def test_invalid_calls_raise_value_error_naming_the_value(call, match):
    fb = FeedbackClient("http://127.0.0.1:9", max_retries=0)
    with pytest.raises(ValueError, match=match.replace("(", r"\(")):
        call(fb)
    assert fb.pending == 0 and fb.dropped == 0
    fb.close()


# ---- batching -----------------------------------------------------------------------------------
def test_batches_by_size_then_flush(live):
    c = new_completion(live)
    with FaultProxy(live.url) as proxy, FeedbackClient(proxy.url, batch_size=5, flush_interval_s=60) as fb:
        for _ in range(12):
            fb.copied(c)
        wait_until(lambda: fb.sent == 10, 10, what="two full batches", interval_s=0.01)
        assert [a["n"] for a in proxy.attempts] == [5, 5] and fb.pending == 2  # 2 left: not a full batch
        assert fb.flush(timeout=10)
        assert [a["n"] for a in proxy.attempts] == [5, 5, 2]
    assert len(on_bus(live, [c])) == 12


def test_batches_by_interval(live):
    c = new_completion(live)
    with FaultProxy(live.url) as proxy, FeedbackClient(proxy.url, batch_size=100, flush_interval_s=0.4) as fb:
        t0 = time.monotonic()
        for _ in range(3):
            fb.copied(c)
        wait_until(lambda: len(proxy.attempts) == 1, 5, what="the batch of the interval", interval_s=0.01)
        assert proxy.attempts[0]["n"] == 3 and proxy.attempts[0]["t"] - t0 >= 0.4  # not before the interval
    assert len(on_bus(live, [c])) == 3


def test_an_event_after_the_queue_emptied_goes_out_by_the_interval(live):
    # The sender sleeps while the queue is empty: the next event must wake it to time its interval.
    # Until 2026-12-04 only a full batch woke it, so after the first batch an event waited for
    # batch_size more (or for close): a third of the demo's feedback arrived after its window.
    c = new_completion(live)
    with FaultProxy(live.url) as proxy, FeedbackClient(proxy.url, batch_size=100, flush_interval_s=0.2) as fb:
        for expected in (1, 2, 3):
            fb.copied(c)
            wait_until(lambda: len(proxy.attempts) == expected, 10, what=f"batch {expected}", interval_s=0.01)  # noqa: B023
            wait_until(lambda: fb.pending == 0, 10, what="nothing pending", interval_s=0.01)
        assert [a["n"] for a in proxy.attempts] == [1, 1, 1]
    assert len(on_bus(live, [c])) == 3


# ---- queue overflow and enqueue ----------------------------------------------------------------
def test_full_queue_drops_without_blocking_and_reports(live):
    c = new_completion(live)
    errors = Errors()
    fb = FeedbackClient(live.url, batch_size=1000, flush_interval_s=60, max_queue=50, on_error=errors)
    results = [fb.copied(c) for _ in range(500)]  # nothing is sent for 60 s: the surplus is dropped, not waited on
    assert fb.dropped == 450 and sum(r is None for r in results) == 450 and fb.pending == 50
    assert len(errors) == 450 and all(isinstance(e, QueueFullError) and len(evs) == 1 for e, evs in errors)
    fb.close()
    assert fb.sent == 50 and len(on_bus(live, [c])) == 50
    assert fb.copied(c) is None and isinstance(errors[-1][0], ClientClosedError) and fb.dropped == 451


def test_enqueue_does_no_io():
    """Nothing listens on port 9: every call still queues at once; the sender fails them in the background."""
    errors = Errors()
    fb = FeedbackClient(
        "http://127.0.0.1:9", batch_size=1000, flush_interval_s=600, max_queue=100_000, max_retries=0, on_error=errors
    )
    n = 20_000
    for i in range(n):
        fb.rating("cmpl-bench", 1 + i % 5, user="u")
    assert fb.pending + fb.failed == n and fb.dropped == 0  # full batches already went (and failed)
    fb.close(timeout=5)
    assert fb.failed == n and sum(len(evs) for _, evs in errors) == n


# ---- failures -----------------------------------------------------------------------------------
def test_retry_storm_delivers_each_event_exactly_once(live):
    cids = [new_completion(live) for _ in range(4)]
    faults = ["503", "503+ra", "drop", "429", "503", "drop", "503", "drop"]
    kinds = ["thumb_up", "copied", "accepted", "regenerated", "rejected"]
    with FaultProxy(live.url, faults) as proxy:
        with FeedbackClient(
            proxy.url, batch_size=8, flush_interval_s=60, backoff_s=0.01, max_backoff_s=0.05, on_error=Errors()
        ) as fb:
            for i in range(40):
                fb.send(kinds[i % 5], cids[i % 4], user=f"u{i}")
            assert fb.flush(timeout=30)
            assert fb.sent == 40 and fb.failed == 0 and fb.on_error == []
    got = on_bus(live, cids)
    assert len(got) == 40 and len({e.event_id for e in got}) == 40  # one event per call, none twice
    attempts = proxy.attempts
    assert len(attempts) == 5 + len(faults)  # 5 batches, every spoiled attempt retried
    assert all(a["status"] == 200 for a in attempts)  # the gateway processed every attempt...
    assert sum(a["answer"]["accepted"] for a in attempts) == 40  # ...and published each event once
    assert sum(a["answer"]["duplicates"] for a in attempts) == 8 * len(faults)
    i = next(i for i, a in enumerate(attempts) if a["fault"] == "503+ra")
    assert attempts[i + 1]["keys"] == attempts[i]["keys"] and attempts[i + 1]["t"] - attempts[i]["t"] >= 0.95


def test_client_errors_are_not_retried_and_drop_only_the_bad_event(live):
    c = new_completion(live)
    errors = Errors()
    with FaultProxy(live.url) as proxy:
        with FeedbackClient(proxy.url, batch_size=3, flush_interval_s=60, on_error=errors) as fb:
            fb.copied(c)
            fb.copied("cmpl-no-such-completion")
            fb.accepted(c)
            assert fb.flush(timeout=10)
        assert [a["n"] for a in proxy.attempts] == [3, 2]  # no retry of the refused batch; the rest resent
    [(err, events)] = errors
    assert isinstance(err, FeedbackAPIError) and err.status == 404 and err.code == "completion_not_found"
    assert [e["completion_id"] for e in events] == ["cmpl-no-such-completion"]
    assert sorted(e.kind for e in on_bus(live, [c])) == ["accepted", "copied"]
    assert fb.failed == 1 and fb.sent == 2


def test_retries_exhausted_are_reported(live):
    c = new_completion(live)
    errors = Errors()
    with FaultProxy(live.url, ["503"] * 3) as proxy:
        fb = FeedbackClient(proxy.url, batch_size=1, max_retries=2, backoff_s=0.01, on_error=errors)
        fb.copied(c)
        assert fb.flush(timeout=10)
        fb.close()
    assert len(proxy.attempts) == 3 and fb.failed == 1 and fb.sent == 0
    [(err, events)] = errors
    assert isinstance(err, RetriesExhaustedError) and isinstance(err.__cause__, FeedbackAPIError)
    assert err.__cause__.status == 503 and len(events) == 1
    assert len(on_bus(live, [c])) == 1  # the gateway had it all along: the answers were lost


# ---- process lifecycle --------------------------------------------------------------------------
def test_fork_child_sends_its_own_events_parent_sends_its_pending_once(live):
    c = new_completion(live)
    fb = FeedbackClient(live.url, batch_size=100, flush_interval_s=60)
    for _ in range(3):
        fb.copied(c)  # pending in the parent at the fork
    pid = os.fork()
    if pid == 0:  # the child: a fresh queue; sends only its own event
        code = 3
        try:
            fb.accepted(c)
            code = 0 if fb.flush(timeout=10) and fb.sent == 1 and fb.pending == 0 else 1
        finally:
            os._exit(code)
    exit_code: list[int] = []

    def reaped() -> bool:
        got, status = os.waitpid(pid, os.WNOHANG)
        if got:
            exit_code.append(os.waitstatus_to_exitcode(status))
        return bool(got)

    try:
        wait_until(reaped, 30, what="the forked child's exit", interval_s=0.02)
    except TimeoutError:
        os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)
        raise
    assert exit_code == [0]
    assert fb.pending == 3 and fb.flush(timeout=10) and fb.sent == 3
    fb.close()
    assert sorted(e.kind for e in on_bus(live, [c])) == ["accepted", "copied", "copied", "copied"]


def test_pending_events_are_sent_at_interpreter_exit(live):
    c = new_completion(live)
    script = (
        f"import asyncio\nfrom feedback.sdk import AsyncFeedbackClient, FeedbackClient\n"
        f"fb = FeedbackClient({live.url!r}, batch_size=100, flush_interval_s=600)\n"
        f"fb.rating({c!r}, 5)\nfb.dwell({c!r}, 3.0)\n"  # no flush, no close
        f"async def main():\n"
        f"    AsyncFeedbackClient({live.url!r}, batch_size=100, flush_interval_s=600).accepted({c!r})\n"
        f"asyncio.run(main())\n"
    )  # the loop is gone at exit: the client's thread sends it
    subprocess.run([sys.executable, "-c", script], cwd=REPO, check=True, timeout=60)
    assert sorted(e.kind for e in on_bus(live, [c])) == ["accepted", "dwell", "rating"]


# ---- asyncio ------------------------------------------------------------------------------------
def test_async_client_batches_retries_and_flushes_without_blocking_the_loop(live):
    """Sent by the sync client's thread; `await flush()` waits in a worker thread while the loop runs on."""
    c = new_completion(live)
    errors = Errors()

    async def main(url):
        fb = AsyncFeedbackClient(url, batch_size=3, flush_interval_s=60, backoff_s=0.01, on_error=errors)
        keys = [fb.thumbs_up(c), fb.rating(c, 3), fb.edited(c, kept_fraction=0.5), fb.dwell(c, 2.0)]
        # Waited on in a worker thread, so the loop runs on (the client's thread sends).
        await asyncio.to_thread(wait_until, lambda: fb.sent >= 3, 10, what="the full batch of 3, after its retries")
        first = fb.sent  # the full batch of 3 went without a flush
        ticks = []
        ticker = asyncio.create_task(tick(ticks))
        t0 = time.monotonic()
        assert await fb.flush(timeout=10)  # the last event: 503 with Retry-After 1, then delivered
        flush_s = time.monotonic() - t0
        ticker.cancel()
        assert flush_s >= 0.9 and len(ticks) >= 10  # the loop ran on while flush waited
        await fb.aclose()
        assert fb.thumbs_down(c) is None and fb.dropped == 1
        with pytest.raises(ValueError, match="value=9"):
            fb.rating(c, 9)
        return keys, first, fb.sent

    async def tick(ticks):
        while True:
            await asyncio.sleep(0.01)
            ticks.append(time.monotonic())

    with FaultProxy(live.url, ["503", "drop", "ok", "503+ra"]) as proxy:
        keys, first, sent = asyncio.run(main(proxy.url))
    assert first == 3 and sent == 4 and len(set(keys)) == 4
    assert [a["n"] for a in proxy.attempts] == [3, 3, 3, 1, 1]
    assert len(errors) == 1 and isinstance(errors[0][0], ClientClosedError)
    got = on_bus(live, [c])
    assert sorted(e.kind for e in got) == ["dwell", "edited", "rating", "thumb_up"]


@pytest.mark.parametrize(
    ("kind", "value", "edit"),
    [
        ("thumb_up", None, None),
        ("rating", 3, None),
        ("rating", 5.0, None),
        ("edited", 0, 7),
        ("edited", 1, None),
        ("dwell", 0.25, None),
        ("dwell", 86400, None),
        ("regenerated", None, None),
        ("edited", 0.5, True),
    ],
)
def test_make_event_checks_as_the_event_model_does(kind, value, edit):
    """What the SDK queues is what the event model makes of the same call."""
    ev = make_event(kind, "cmpl-x", value, edit_distance=edit, ts=5.0, idempotency_key="k")
    model = FeedbackEvent(
        event_id="e" * 8, tenant="t", ts=1.0, completion_id="cmpl-x", kind=kind, value=value, edit_distance=edit
    )
    assert ev == {
        "completion_id": "cmpl-x",
        "kind": kind,
        "ts": 5.0,
        "idempotency_key": "k",
        **({"value": model.value} if model.value is not None else {}),
        **({"edit_distance": model.edit_distance} if model.edit_distance is not None else {}),
    }
    assert type(ev.get("value", 0.0)) is float


def test_events_received_after_their_window_go_to_on_error_and_the_rest_count(live):
    """The gateway's answer lists events received after their completion's attribution window: the
    client gives exactly those up (`WindowClosedError`) and counts the others as sent."""
    gw = live.app.state.gateway
    old = new_completion(live)
    gw.feedback_window_s = 1.0
    try:
        time.sleep(1.1)
        fresh = new_completion(live)
        errors = Errors()
        with FeedbackClient(live.url, batch_size=100, flush_interval_s=60, on_error=errors) as fb:
            late = fb.accepted(old)
            fb.accepted(fresh)
            assert fb.flush(timeout=10) and fb.sent == 1 and fb.failed == 1
    finally:
        gw.feedback_window_s = None
    assert [(type(e).__name__, [x["idempotency_key"] for x in evs]) for e, evs in errors] == [
        ("WindowClosedError", [late])
    ]
    assert [e.completion_id for e in on_bus(live, [old, fresh])] == [fresh]
