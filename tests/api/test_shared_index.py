"""Two gateways sharing one PostgreSQL completion index (as behind a load balancer): feedback for a
completion that one served is accepted by the other, and a retry through either is a duplicate."""

from __future__ import annotations

import httpx
import pytest

from api.main import create_app
from core.settings import Settings
from feedback.bus_embedded import EmbeddedBus
from feedback.completion_index import CompletionIndex
from feedback.events import TOPICS, FeedbackEvent
from serving.engine import EmbeddedEngine
from tests.conftest import LiveServer
from tests.feedback.test_completion_index import url  # noqa: F401 (the fixture)

pytestmark = pytest.mark.postgres


@pytest.mark.parametrize("url", [pytest.param("postgres", marks=pytest.mark.postgres)], indirect=True)
def test_any_gateway_accepts_feedback_for_a_completion_another_served(url, tiny_checkpoint, tmp_path):  # noqa: F811
    engine = EmbeddedEngine(max_batch=4, max_model_len=128)
    engine.add_version(tiny_checkpoint.name, tiny_checkpoint, default=True)
    buses = [EmbeddedBus(tmp_path / f"bus{i}") for i in range(2)]
    indexes = [CompletionIndex(url) for _ in range(2)]  # each gateway its own connection pool
    apps = [
        create_app(
            Settings(home=tmp_path / f"home{i}", model_dir=tiny_checkpoint),
            engine=engine,
            bus=buses[i],
            index=indexes[i],
        )
        for i in range(2)
    ]
    try:
        with LiveServer(apps[0]) as a, LiveServer(apps[1]) as b:
            r = httpx.post(
                a.url + "/v1/completions",
                timeout=30,
                json={"model": "flywheel", "prompt": "# add 1 to x\ndef f(x):\n", "max_tokens": 2, "user": "alice"},
            )
            cid = r.json()["id"]
            event = {"completion_id": cid, "kind": "thumb_up", "user": "alice", "idempotency_key": "k"}
            first = httpx.post(b.url + "/v1/feedback", json=event, timeout=30).json()
            retry = httpx.post(a.url + "/v1/feedback", json=event, timeout=30).json()
            forged = httpx.post(
                b.url + "/v1/feedback", json={**event, "user": "bob", "idempotency_key": "k2"}, timeout=30
            )
        assert (first["accepted"], retry["duplicates"]) == (1, 1) and first["event_ids"] == retry["event_ids"]
        assert forged.status_code == 403
        c = buses[1].consumer(TOPICS["feedback"], "check")
        [rec] = c.poll(timeout_s=1)
        c.close()
        assert FeedbackEvent.model_validate_json(rec.value).completion_id == cid
    finally:
        engine.shutdown()
        for x in buses + indexes:
            x.close()
