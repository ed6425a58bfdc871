"""The admin API against a live gateway: keys and scopes (401/403, even in local mode), approve,
reject and roll back through the registry's lifecycle, audited, and refused steps that change nothing;
and no way around the gate for completions keys."""

from __future__ import annotations

import hashlib

import httpx
import pytest

from api.main import create_app
from core.settings import Settings
from feedback.bus_embedded import EmbeddedBus
from feedback.completion_index import CompletionIndex
from registry.keys import KeyStore
from registry.registry import Registry
from serving.engine import EmbeddedEngine
from tests.conftest import LiveServer


def files(name: str) -> list[dict]:
    sha = hashlib.sha256(name.encode()).hexdigest()
    return [{"path": f"{name}/x.snapshot.fws", "sha256": sha, "bytes": 10, "kind": "snapshot"}]


def to_awaiting_approval(reg: Registry, vid: str) -> None:
    """As the gate would take a candidate through its offline eval and canary."""
    reg.transition(vid, "evaluating", "gate", "offline eval")
    verdict = {
        "passed": True,
        "incumbent_id": reg.incumbent().id,
        "artifact_sha256": reg.get(vid).artifact_sha256,
        "suite_version": "s1",
        "numbers": {"lower": -0.01},
    }
    reg.record_gate(vid, "offline", verdict, "gate")
    reg.transition(vid, "canary", "gate", "offline passed")
    reg.transition(vid, "awaiting_approval", "gate", "canary passed")


@pytest.fixture
def live(tiny_checkpoint, tmp_path):
    settings = Settings(home=tmp_path, model_dir=tiny_checkpoint)
    engine = EmbeddedEngine(max_batch=4, max_model_len=128)
    engine.add_version(tiny_checkpoint.name, tiny_checkpoint, default=True)
    engine.add_version("ungated", tiny_checkpoint)  # held by the engine, never promoted
    engine.add_version("v9.rollout", tiny_checkpoint)  # the learner's weights, held for lent rollouts
    bus, reg = EmbeddedBus(tmp_path / "bus"), Registry(f"sqlite:///{tmp_path / 'registry.db'}")
    reg.bootstrap("base", files=files("base"))
    keys, index = KeyStore(settings.db_url), CompletionIndex(tmp_path / "index.db")
    with LiveServer(create_app(settings, engine=engine, bus=bus, registry=reg, index=index)) as server:
        server.reg, server.index = reg, index
        server.admin = {"Authorization": f"Bearer {keys.create(['admin'], label='ops')[0]}"}
        server.viewer = {"Authorization": f"Bearer {keys.create(['viewer'])[0]}"}
        server.eval = {"Authorization": f"Bearer {keys.create(['eval', 'completions'], tenant='lab')[0]}"}
        server.promoted = tiny_checkpoint.name
        yield server
    engine.shutdown()
    bus.close()
    reg.close()
    index.close()


def post(live, path: str, headers: dict | None, body: dict | None = None) -> httpx.Response:
    return httpx.post(live.url + path, json={"reason": "looks good"} if body is None else body, headers=headers)


def test_keys_and_scopes_are_required_even_in_local_mode(live):
    for headers, status, code in (
        (None, 401, "invalid_api_key"),
        ({"Authorization": "Bearer fw_nope"}, 401, "invalid_api_key"),
        (live.viewer, 403, "insufficient_scope"),
    ):
        r = post(live, "/admin/versions/base/rollback", headers)
        assert r.status_code == status and r.json()["error"]["code"] == code, r.text
    assert httpx.get(live.url + "/admin/versions", headers=live.viewer).status_code == 200
    assert httpx.get(live.url + "/admin/versions").status_code == 401
    assert httpx.get(live.url + "/healthz").status_code == 200  # always anonymous
    assert live.reg.promoted().id == "base"


def test_approve_then_roll_back_over_http_is_audited(live):
    live.reg.register(version_id="v1", parent_id="base", files=files("v1"))
    to_awaiting_approval(live.reg, "v1")
    r = post(live, "/admin/versions/v1/approve", live.admin)
    assert r.status_code == 200 and r.json()["status"] == "promoted", r.text
    detail = httpx.get(live.url + "/admin/versions/v1", headers=live.viewer).json()
    approval = detail["audit"][-1]
    assert approval["to_status"] == "promoted" and approval["reason"] == "looks good"
    assert approval["actor"].startswith("key:") and "(ops)" in approval["actor"]
    r = post(live, "/admin/versions/v1/rollback", live.admin, {"reason": "users complain"})
    assert r.status_code == 200 and r.json()["id"] == "base" and live.reg.promoted().id == "base"
    assert live.reg.get("v1").status == "rolled_back"


def test_reject_and_refused_steps_change_nothing(live):
    live.reg.register(version_id="v2", parent_id="base", files=files("v2"))
    r = post(live, "/admin/versions/v2/approve", live.admin)  # still a candidate: not approvable
    assert r.status_code == 409 and r.json()["error"]["code"] == "invalid_transition"
    assert live.reg.get("v2").status == "candidate"
    r = post(live, "/admin/versions/v2/rollback", live.admin)
    assert r.status_code == 409 and r.json()["error"]["code"] == "not_promoted"
    assert post(live, "/admin/versions/nope/approve", live.admin).status_code == 404
    assert post(live, "/admin/versions/v2/reject", live.admin, {}).status_code == 400  # a reason is required
    to_awaiting_approval(live.reg, "v2")
    r = post(live, "/admin/versions/v2/reject", live.admin, {"reason": "worse on count"})
    assert r.status_code == 200 and r.json()["status"] == "rejected"
    assert live.reg.promoted().id == "base"


def complete(live, model: str, headers: dict | None = None) -> httpx.Response:
    body = {"model": model, "prompt": "# add 1 to x\ndef f(x):\n", "max_tokens": 2}
    return httpx.post(live.url + "/v1/completions", json=body, headers=headers, timeout=30)


def test_no_way_around_the_gate(live):
    """A completions caller gets the alias or the promoted version; naming any other version needs an
    eval key, and such completions are marked as the eval arm (left out of canary statistics)."""
    assert complete(live, "flywheel").status_code == 200 and complete(live, live.promoted).status_code == 200
    r = complete(live, "ungated")
    assert r.status_code == 403 and r.json()["error"]["code"] == "model_not_allowed", r.text
    names = [m["id"] for m in httpx.get(live.url + "/v1/models").json()["data"]]
    assert "ungated" not in names and "flywheel" in names
    r = complete(live, "ungated", live.eval)
    assert r.status_code == 200 and r.json()["model"] == "ungated"
    assert live.index.get(r.json()["id"]).arm == "eval"
    assert live.index.get(complete(live, "flywheel").json()["id"]).arm is None
    assert "ungated" in [m["id"] for m in httpx.get(live.url + "/v1/models", headers=live.eval).json()["data"]]
    r = complete(live, "v9.rollout", live.eval)  # lent work's weights: no key reaches them
    assert r.status_code == 403 and r.json()["error"]["code"] == "model_not_allowed", r.text
    assert "v9.rollout" not in [m["id"] for m in httpx.get(live.url + "/v1/models", headers=live.eval).json()["data"]]
    r = complete(live, "flywheel", live.viewer)  # a key without the completions scope
    assert r.status_code == 403 and r.json()["error"]["code"] == "insufficient_scope"
    assert complete(live, "flywheel", {"Authorization": "Bearer fw_revoked-or-made-up"}).status_code == 401


def test_an_unknown_status_filter_is_bad_input_naming_it(live):
    r = httpx.get(live.url + "/admin/versions", params={"status": "shipped"}, headers=live.viewer)
    assert (
        r.status_code == 400 and r.json()["error"]["param"] == "status" and "promoted" in r.json()["error"]["message"]
    )
    ok = httpx.get(live.url + "/admin/versions", params={"status": "promoted"}, headers=live.viewer)
    assert [v["id"] for v in ok.json()] == ["base"]
