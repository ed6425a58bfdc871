"""Per-key rate limits (`api.limits`): the token bucket's arithmetic on a scripted clock, and a live
gateway refusing a key over its completions or feedback rate with 429 and Retry-After while another
key goes on, with nothing of a refused request done or kept."""

from __future__ import annotations

import math

import httpx
import pytest

from api.limits import TokenBuckets, retry_after
from api.main import create_app
from core.settings import Settings
from feedback.bus_embedded import EmbeddedBus
from feedback.completion_index import CompletionIndex
from registry.keys import KeyStore
from registry.registry import Registry
from serving.engine import EmbeddedEngine
from tests.api.test_admin_api import files
from tests.conftest import LiveServer


def test_a_bucket_pays_its_burst_then_refills_at_its_rate():
    now = [0.0]
    b = TokenBuckets(rate=2.0, burst=3.0, clock=lambda: now[0])
    assert [b.take("k") for _ in range(3)] == [0.0, 0.0, 0.0]  # the burst
    assert b.take("k") == pytest.approx(0.5)  # empty: one token in half a second
    assert b.take("other") == 0.0  # each key its own bucket
    now[0] = 0.5
    assert b.take("k") == 0.0 and b.take("k") == pytest.approx(0.5)
    now[0] = 10.0
    assert b.take("k", 3) == 0.0 and b.take("k", 2) == pytest.approx(1.0)  # full again, never above burst
    assert b.take("k", 4) == math.inf  # more than a burst: never payable
    assert (retry_after(0.01), retry_after(1.0), retry_after(1.2)) == ("1", "1", "2")
    for bad in ({"rate": 0, "burst": 1}, {"rate": 1, "burst": 0.5}):
        with pytest.raises(ValueError, match="must be positive|at least one request"):
            TokenBuckets(**bad)


def test_buckets_past_max_keys_drop_the_longest_unused():
    now = [0.0]
    b = TokenBuckets(rate=1.0, burst=1.0, max_keys=2, clock=lambda: now[0])
    b.take("a"), b.take("b"), b.take("c")  # "a" is dropped: at most 2 buckets
    assert b.take("a") == 0.0 and b.take("c") > 0


@pytest.fixture
def live(tiny_checkpoint, tmp_path):
    settings = Settings(
        home=tmp_path,
        model_dir=tiny_checkpoint,
        limit_completions_per_s=0.5,
        limit_completions_burst=2,
        limit_feedback_events_per_s=0.5,
        limit_feedback_burst=3,
    )
    engine = EmbeddedEngine(max_batch=4, max_model_len=128)
    engine.add_version(tiny_checkpoint.name, tiny_checkpoint, default=True)
    bus, reg = EmbeddedBus(tmp_path / "bus"), Registry(settings.db_url)
    reg.bootstrap("base", files=files("base"))
    keys, index = KeyStore(settings.db_url), CompletionIndex(tmp_path / "index.db")
    with LiveServer(create_app(settings, engine=engine, bus=bus, registry=reg, index=index)) as server:
        server.index = index
        server.a, _ = keys.create(["completions", "feedback:write"], tenant="acme", label="a")
        server.b, _ = keys.create(["completions", "feedback:write"], tenant="acme", label="b")
        yield server
    engine.shutdown()
    bus.close()
    reg.close()
    index.close()


def complete(live, token: str, n: int = 1) -> httpx.Response:
    body = {"model": "flywheel", "prompt": "def", "max_tokens": 2, "n": n}
    return httpx.post(live.url + "/v1/completions", json=body, headers={"Authorization": f"Bearer {token}"}, timeout=30)


def test_a_key_over_its_rate_gets_429_with_retry_after_and_another_key_goes_on(live):
    a = {"Authorization": f"Bearer {live.a}"}
    first = complete(live, live.a)
    assert first.status_code == 200
    assert complete(live, live.a).status_code == 200  # the burst of 2
    r = complete(live, live.a)
    assert r.status_code == 429 and r.headers["retry-after"] in ("1", "2"), r.text
    err = r.json()["error"]
    assert (err["type"], err["code"]) == ("rate_limit_error", "rate_limit_exceeded") and "per key" in err["message"]
    assert complete(live, live.b, n=2).status_code == 200  # key b: its own bucket (n=2 takes 2)
    assert complete(live, live.b).status_code == 429
    # feedback: each event of a batch counts; a refused batch writes nothing
    cid = first.json()["id"]
    events = [{"completion_id": cid, "kind": "thumb_up", "idempotency_key": f"e{i}"} for i in range(4)]
    r = httpx.post(live.url + "/v1/feedback", json={"events": events}, headers=a, timeout=30)
    assert r.status_code == 400 and "more than one key's burst (3)" in r.text  # never payable: no Retry-After
    r = httpx.post(live.url + "/v1/feedback", json={"events": events[:3]}, headers=a, timeout=30)
    assert r.status_code == 200 and r.json()["accepted"] == 3  # nothing of the refused batch was kept
    r = httpx.post(live.url + "/v1/feedback", json={"events": events[3:]}, headers=a, timeout=30)
    assert r.status_code == 429 and int(r.headers["retry-after"]) >= 1, r.text
    metrics = httpx.get(live.url + "/metrics", timeout=30).text
    assert 'flywheel_rate_limited_total{route="/v1/completions"} 2.0' in metrics
    assert 'flywheel_rate_limited_total{route="/v1/feedback"} 1.0' in metrics
    assert "acme" not in [line for line in metrics.splitlines() if "rate_limited" in line].__str__()


def test_production_refuses_to_start_without_rate_limits(tmp_path):
    base = {"home": tmp_path, "env": "production", "api_keys": ["t:" + "k" * 32], "session_secret": "s" * 32}
    with pytest.raises(ValueError, match="limits.completions_per_s and limits.feedback_events_per_s must be set"):
        Settings(**base).check_production()
    Settings(**base, limit_completions_per_s=10, limit_feedback_events_per_s=100).check_production()


def test_metrics_are_for_operators_outside_local_mode(tiny_checkpoint, tmp_path):
    """With FLYWHEEL_API_KEYS set, /metrics needs a key-store key with the viewer scope (a scraper's
    bearer token); a product key is refused. Local mode keeps it open (the tests above read it)."""
    settings = Settings(home=tmp_path, model_dir=tiny_checkpoint, api_keys=["acme:" + "k" * 32])
    engine = EmbeddedEngine(max_batch=4, max_model_len=128)
    engine.add_version(tiny_checkpoint.name, tiny_checkpoint, default=True)
    bus, reg = EmbeddedBus(tmp_path / "bus"), Registry(settings.db_url)
    keys, index = KeyStore(settings.db_url), CompletionIndex(tmp_path / "index.db")
    viewer, _ = keys.create(["viewer"], label="prometheus")
    try:
        with LiveServer(create_app(settings, engine=engine, bus=bus, registry=reg, index=index)) as server:

            def get(token: str | None) -> httpx.Response:
                headers = {"Authorization": f"Bearer {token}"} if token else {}
                return httpx.get(server.url + "/metrics", headers=headers, timeout=30)

            assert get(None).status_code == 401
            assert get("k" * 32).status_code == 401  # a FLYWHEEL_API_KEYS product key is no operator's
            r = get(viewer)
            assert r.status_code == 200 and "flywheel_requests" in r.text and "acme" not in r.text
    finally:
        engine.shutdown()
        bus.close()
        reg.close()
        index.close()
