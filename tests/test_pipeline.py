"""The loop across process boundaries' interfaces: HTTP completions → bus → SDK feedback over HTTP →
joiner → samples → learner → a new candidate version trained on exactly those samples."""

import json

import openai

from api.main import create_app
from core.harness import wait_until
from core.settings import Settings
from feedback.bus_embedded import EmbeddedBus
from feedback.events import TOPICS, SampleEvent
from feedback.joiner import JoinerService
from feedback.rewards import RewardSpec
from feedback.sdk import FeedbackClient
from learner.service import LearnerConfig, LearnerService
from registry.registry import Registry
from tests.conftest import LiveServer


def test_completions_and_feedback_become_a_trained_candidate(tiny_checkpoint, tmp_path):
    bus = EmbeddedBus(tmp_path / "bus")
    settings = Settings(home=tmp_path / "home", model_dir=tiny_checkpoint, max_batch=8, max_model_len=128)
    with LiveServer(create_app(settings, bus=bus)) as server:
        client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)
        ids = []
        for i in range(12):
            r = client.completions.create(
                model="flywheel",
                prompt=f"# add {i % 9} to x\ndef f(x):\n",
                max_tokens=8,
                temperature=1.0,
                user=f"user-{i % 4}",
            )
            ids.append(r.choices[0].completion_id)
        fb = FeedbackClient(server.url, flush_interval_s=0.05)
        for i, cid in enumerate(ids[:10]):  # two completions get no feedback
            (fb.accepted if i % 2 else fb.rejected)(cid, user=f"user-{i % 4}")
            if i % 3 == 0:
                fb.rating(cid, 5 if i % 2 else 1, user=f"user-{i % 4}")
        assert fb.flush(timeout=10)
        fb.close()
        # A client that retries by hand (same idempotency key, three times) still counts once.
        import httpx

        for _ in range(3):
            r = httpx.post(
                server.url + "/v1/feedback",
                json={"completion_id": ids[10], "kind": "thumb_up", "user": "user-2", "idempotency_key": "retry-1"},
            )
            assert r.status_code == 200, r.text

    now = [1e12]  # long after every event: every attribution window is closed
    joiner = JoinerService(bus, RewardSpec(), window_s=60.0, clock=lambda: now[0])
    samples = []

    def joined_all() -> bool:
        samples.extend(joiner.run_once(timeout_s=0.2))
        return len(samples) >= 11

    wait_until(joined_all, 30, what="the 11 completions with feedback joined", interval_s=0)
    assert sorted(s.completion.completion_id for s in samples) == sorted(ids[:11])
    assert joiner.stats["no_feedback"] == 1
    retried = next(s for s in samples if s.completion.completion_id == ids[10])
    assert len(retried.signals) == 1 and retried.reward == 0.5  # one thumb up, not three
    by_id = {s.completion.completion_id: s for s in samples}
    assert by_id[ids[1]].reward > 0 > by_id[ids[0]].reward  # accepted vs rejected (+ ratings)
    # what the joiner published is on the sample topic
    c = bus.consumer(TOPICS["sample"], "check")
    published = [SampleEvent.model_validate_json(r.value) for r in c.poll(timeout_s=0.5)]
    c.close()
    assert {s.event_id for s in published} == {s.event_id for s in samples}

    learner = LearnerService(
        bus,
        Registry(f"sqlite:///{tmp_path}/registry.db"),
        tmp_path / "models",
        tiny_checkpoint,
        LearnerConfig(update_every_samples=11, min_samples=1),
    )
    assert learner.run_once(timeout_s=0.5) == "v0001"
    v1 = learner.registry.get("v0001")
    assert v1.status == "candidate" and v1.parent_id == tiny_checkpoint.name and v1.metrics["samples"] == 11
    state = json.loads((tmp_path / "models" / "learner.json").read_text())
    assert sorted(state["trained_ids"]) == sorted(s.event_id for s in samples)
    learner.close()
    joiner.close()
    bus.close()
