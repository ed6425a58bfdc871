"""A gateway built from its settings runs replicas that follow the registry: it publishes and serves
the base, splits a canary's traffic by sticky user assignment, serves an approved version on every
replica (the fleet reports its hash) and returns to the previous one on a rollback."""

from __future__ import annotations

from datetime import UTC, datetime

import httpx
import pytest
import torch

from api.fleet import Canary
from api.main import create_app
from core.harness import wait_until
from core.settings import Settings
from feedback.bus_embedded import EmbeddedBus
from feedback.completion_index import CompletionIndex
from registry.keys import KeyStore
from registry.publish import SHIPPING_DTYPE, STORE, file_entry
from registry.registry import Registry
from serving.checkpoint import load_checkpoint
from serving.weight_store import WeightStore, shipping_state
from tests.conftest import LiveServer
from tests.gating.test_registry import pg_database  # noqa: F401  (a fixture)
from tests.serving.test_replica import pg_url  # noqa: F401  (a fixture)

PROMPT = "# add 1 to x\ndef f(x):\n"


def publish_candidate(settings: Settings, reg: Registry, vid: str, parent: str) -> None:
    """As the learner does: perturbed weights as a delta in the shared weight store, registered."""
    models = settings.home / "models" / "learner"
    model = load_checkpoint(settings.served_model_dir)
    with torch.no_grad():
        model.lm_head.weight.mul_(2.0)
    put = WeightStore(models / STORE).put(vid, shipping_state(model, SHIPPING_DTYPE), parent=parent)
    reg.register(version_id=vid, parent_id=parent, files=[file_entry(models, put.path, put.kind)])


@pytest.fixture(params=["sqlite", pytest.param("postgres", marks=pytest.mark.postgres)])
def gateway(request, tiny_checkpoint, tmp_path):
    """The registry on SQLite (replicas poll it), or on PostgreSQL (they LISTEN for its NOTIFY)."""
    db = None if request.param == "sqlite" else request.getfixturevalue("pg_url")
    settings = Settings(
        home=tmp_path, model_dir=tiny_checkpoint, engine="embedded", replicas=2, heartbeat_s=0.5, database_url=db
    )
    reg, bus, index = Registry(settings.db_url), EmbeddedBus(tmp_path / "bus"), CompletionIndex(tmp_path / "i.db")
    admin = {"Authorization": f"Bearer {KeyStore(settings.db_url).create(['admin'])[0]}"}
    app = create_app(settings, bus=bus, index=index, registry=reg)
    with LiveServer(app) as server:
        notifiers = {type(r.notifier).__name__ for r in app.state.gateway.fleet.replicas}
        assert notifiers == ({"NoneType"} if db is None else {"PgNotifier"})
        server.settings, server.reg, server.index, server.admin = settings, reg, index, admin
        server.fleet = app.state.gateway.fleet
        yield server
    bus.close()
    index.close()
    reg.close()


def complete(gw, user: str | None) -> dict:
    body = {"model": "flywheel", "prompt": PROMPT, "max_tokens": 3, **({"user": user} if user else {})}
    r = httpx.post(gw.url + "/v1/completions", json=body, timeout=30)
    assert r.status_code == 200, r.text
    return r.json()


def fleet(gw) -> dict:
    return httpx.get(gw.url + "/admin/fleet", headers=gw.admin, timeout=10).json()


def test_the_fleet_follows_the_registry_through_canary_approval_and_rollback(gateway):
    gw, reg = gateway, gateway.reg
    base = reg.promoted()
    assert base is not None and base.id == gw.settings.served_model_dir.name  # bootstrapped, audited
    assert reg.audit(base.id)[-1].actor == "bootstrap"
    wait_until(lambda: fleet(gw)["complete"] and len(fleet(gw)["replicas"]) == 2, 20, what="both replicas up")
    assert complete(gw, "u0")["model"] == base.id

    publish_candidate(gw.settings, reg, "v2", base.id)
    reg.transition("v2", "evaluating", "gate", "offline eval")
    verdict = {"passed": True, "incumbent_id": base.id, "artifact_sha256": reg.get("v2").artifact_sha256,
               "suite_version": "s1", "numbers": {}}  # fmt: skip
    reg.record_gate("v2", "offline", verdict, "gate")
    reg.transition("v2", "canary", "gate", "offline passed")
    reg.record_gate("v2", "canary", {"step": 0, "share": 0.5, "started_at": datetime.now(UTC)}, "gate")
    reg.beat_gate("test-gate", host="test", pid=0, beat_s=60)  # gateways route a canary only under a live gate lease
    wait_until(
        lambda: fleet(gw)["complete"] and all("v2" in r["holds"] for r in fleet(gw)["replicas"]),
        20,
        what="both replicas holding v2",
    )
    # The gateway's view of the canary is cached for CANARY_TTL_S: wait until it routes to v2.
    wait_until(lambda: gw.fleet.canary() == Canary("v2", 0.5), 20, what="the gateway routing the canary")

    served = {u: complete(gw, u) for u in (f"user-{i}" for i in range(24))}
    arms = {u: gw.index.get(r["id"]).arm for u, r in served.items()}
    assert {r["model"] for u, r in served.items() if arms[u] == "candidate"} == {"v2"}
    assert {r["model"] for u, r in served.items() if arms[u] == "incumbent"} == {base.id}
    assert 4 <= sum(a == "candidate" for a in arms.values()) <= 20  # about half of 24 users
    again = complete(gw, "user-3")  # sticky
    assert again["model"] == served["user-3"]["model"]
    anonymous = complete(gw, None)
    assert anonymous["model"] == base.id and gw.index.get(anonymous["id"]).arm == "anonymous"

    reg.transition("v2", "awaiting_approval", "gate", "canary passed")
    r = httpx.post(gw.url + "/admin/versions/v2/approve", json={"reason": "better"}, headers=gw.admin, timeout=10)
    assert r.status_code == 200, r.text
    v2_sha = reg.get("v2").artifact_sha256
    wait_until(
        lambda: fleet(gw)["complete"] and all(r["holds"].get("v2") == v2_sha for r in fleet(gw)["replicas"]),
        20,
        what="both replicas holding the approved v2",
    )
    assert {complete(gw, f"user-{i}")["model"] for i in range(6)} == {"v2"}

    r = httpx.post(gw.url + "/admin/versions/v2/rollback", json={"reason": "worse"}, headers=gw.admin, timeout=10)
    assert r.status_code == 200, r.text
    wait_until(
        lambda: complete(gw, "user-1")["model"] == base.id and fleet(gw)["complete"], 20, what="the base served again"
    )


def test_heartbeats_say_what_each_replica_served_per_version(gateway):
    gw, reg = gateway, gateway.reg
    base = reg.promoted().id
    wait_until(lambda: fleet(gw)["complete"] and len(fleet(gw)["replicas"]) == 2, 20, what="both replicas up")
    reported: dict[tuple, dict] = {}  # (replica, reported_at) -> its traffic for the base: each beat once

    def collect() -> float:
        for b in reg.fleet(interval_s=0.5).replicas:
            if base in b.traffic:
                reported[(b.replica_id, b.reported_at)] = b.traffic[base]
        return sum(t["requests"] for t in reported.values())

    for i in range(10):
        complete(gw, f"u{i}")
        collect()
    wait_until(lambda: collect() >= 10, 10, what="the 10 requests in heartbeats")
    beats: dict[str, set[float]] = {}  # every replica's beats from now on

    def two_more_beats_each() -> bool:
        collect()
        for b in reg.fleet(interval_s=0.5).replicas:
            beats.setdefault(b.replica_id, set()).add(b.reported_at)
        return len(beats) == 2 and all(len(at) >= 3 for at in beats.values())  # the current one and 2 more

    wait_until(two_more_beats_each, 10, what="two more heartbeats of each replica")
    assert collect() == 10  # what was reported is not reported again and len({r for r, _ in reported}) >= 1
    assert all(t["errors"] == 0 and 0 < t["tokens"] <= 3 * t["requests"] for t in reported.values())
    assert all(0 < t["window_s"] < 5 and t["seconds"] > 0 for t in reported.values())
