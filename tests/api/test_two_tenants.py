"""Two tenants on one gateway, through every route and through the bus.

Tenant acme calls with a key-store key, tenant globex with a `FLYWHEEL_API_KEYS` pair (so the gateway
is out of local mode); an operator holds a viewer and an admin key. Each tenant:
- is served completions (plain and chat), and sends feedback on its own completions only: the
  other's completion is as unknown as a made-up id, alone or inside a batch;
- is refused the operator's routes (admin API, dashboard sign-in, `/metrics`) and the weights;
- sees only the promoted alias in `/v1/models`.
`/metrics`, read with the viewer key, names neither tenant nor any user. On the bus, every completion
and feedback event carries its caller's tenant; a feedback event forged onto the bus by another
tenant is rejected by the joiner (`tenant_mismatch`), and each sample carries only its own tenant's
signals.
"""

from __future__ import annotations

import time

import httpx
import pytest

from api.main import create_app
from core.settings import Settings
from feedback.bus_embedded import EmbeddedBus
from feedback.completion_index import CompletionIndex
from feedback.events import TOPICS, CompletionEvent, FeedbackEvent
from feedback.joiner import JoinerService
from feedback.rewards import RewardSpec
from registry.keys import KeyStore
from registry.registry import Registry
from serving.engine import EmbeddedEngine
from tests.api.test_admin_api import files
from tests.conftest import LiveServer

GLOBEX_TOKEN = "globex-env-token-0123456789"
WINDOW = 60.0


@pytest.fixture
def live(tiny_checkpoint, tmp_path):
    settings = Settings(
        home=tmp_path,
        model_dir=tiny_checkpoint,
        max_batch=4,
        max_model_len=128,
        api_keys=[f"globex:{GLOBEX_TOKEN}"],
        session_secret="t" * 40,
    )
    engine = EmbeddedEngine(max_batch=4, max_model_len=128)
    engine.add_version(tiny_checkpoint.name, tiny_checkpoint, default=True)
    bus, reg = EmbeddedBus(tmp_path / "bus"), Registry(f"sqlite:///{tmp_path / 'registry.db'}")
    reg.bootstrap("base", files=files("base"))
    keys, index = KeyStore(settings.db_url), CompletionIndex(tmp_path / "index.db")
    with LiveServer(create_app(settings, engine=engine, bus=bus, registry=reg, index=index)) as server:
        server.bus = bus
        server.acme = {"Authorization": f"Bearer {keys.create(['completions', 'feedback:write'], tenant='acme')[0]}"}
        server.globex = {"Authorization": f"Bearer {GLOBEX_TOKEN}"}
        server.viewer = {"Authorization": f"Bearer {keys.create(['viewer'], tenant='ops')[0]}"}
        yield server
    engine.shutdown()
    bus.close()
    reg.close()
    index.close()


def read(bus, topic: str, model):
    c = bus.consumer(topic, f"read-{topic}-{time.monotonic_ns()}")
    out = []
    while recs := c.poll(1000, timeout_s=0.2):
        out += [model.model_validate_json(r.value) for r in recs]
    c.close()
    return out


def test_two_tenants_through_every_route_and_the_bus(live):
    url = live.url
    body = {"model": "flywheel", "prompt": "def", "max_tokens": 4, "user": "alice"}
    r = httpx.post(url + "/v1/completions", json=body, headers=live.acme, timeout=30)
    assert r.status_code == 200, r.text
    acme_c = r.json()["id"]
    chat = {"model": "flywheel", "messages": [{"role": "user", "content": "def"}], "max_tokens": 4, "user": "bob"}
    r = httpx.post(url + "/v1/chat/completions", json=chat, headers=live.globex, timeout=30)
    assert r.status_code == 200, r.text
    globex_c = r.json()["id"]

    def feedback(payload, headers):
        return httpx.post(url + "/v1/feedback", json=payload, headers=headers, timeout=30)

    # Feedback only on one's own completions: the other tenant's is as unknown as a made-up one.
    theirs = feedback({"completion_id": acme_c, "kind": "thumb_down"}, live.globex)
    made_up = feedback({"completion_id": "cmpl-made-up", "kind": "thumb_down"}, live.globex)
    assert theirs.status_code == made_up.status_code == 404
    assert theirs.json()["error"]["code"] == made_up.json()["error"]["code"]
    batch = feedback(
        {"events": [{"completion_id": globex_c, "kind": "copied"}, {"completion_id": acme_c, "kind": "copied"}]},
        live.globex,
    )
    assert batch.status_code == 404, batch.text  # the batch names another tenant's completion: none of it is taken
    assert feedback({"completion_id": acme_c, "kind": "thumb_up", "user": "alice"}, live.acme).status_code == 200
    assert feedback({"completion_id": globex_c, "kind": "accepted", "user": "bob"}, live.globex).status_code == 200

    # The operator's routes and the weights are not the tenants'.
    for headers in (live.acme, live.globex):
        for method, path in (
            ("GET", "/admin/versions"),
            ("GET", "/admin/fleet"),
            ("POST", "/admin/versions/base/rollback"),
            ("GET", "/v1/weights/base/x.snapshot.fws"),
            ("GET", "/metrics"),
        ):
            r = httpx.request(method, url + path, headers=headers, json={"reason": "x"}, timeout=30)
            assert r.status_code in (401, 403), (path, r.status_code, r.text)
        models = httpx.get(url + "/v1/models", headers=headers, timeout=30).json()["data"]
        assert [m["id"] for m in models] == ["flywheel"] or all(not m["id"].startswith("v") for m in models)
    page = httpx.get(url + "/dashboard/login", timeout=30)
    csrf = page.text.split('name="csrf" value="')[1].split('"')[0]
    token = live.acme["Authorization"].split()[1]
    r = httpx.post(url + "/dashboard/login", data={"key": token, "csrf": csrf}, cookies=page.cookies, timeout=30)
    assert r.status_code == 403 and "fw_session" not in r.headers.get("set-cookie", "")

    # /metrics is the operator's, and names no tenant and no user.
    metrics = httpx.get(url + "/metrics", headers=live.viewer, timeout=30)
    assert metrics.status_code == 200
    for name in ("acme", "globex", "alice", "bob"):
        assert name not in metrics.text

    # The bus: each event carries its caller's tenant.
    completions = {c.completion_id: c for c in read(live.bus, TOPICS["completion"], CompletionEvent)}
    assert completions[acme_c].tenant == "acme" and completions[globex_c].tenant == "globex"
    fb = read(live.bus, TOPICS["feedback"], FeedbackEvent)
    assert {(f.completion_id, f.tenant, f.kind) for f in fb} == {
        (acme_c, "acme", "thumb_up"),
        (globex_c, "globex", "accepted"),
    }
    # A feedback event forged onto the bus by globex, naming acme's completion, is rejected by the joiner.
    forged = fb[0].model_copy(
        update={"event_id": "forged-1", "tenant": "globex", "completion_id": acme_c, "kind": "thumb_down"}
    )
    live.bus.publish(TOPICS["feedback"], acme_c, forged.model_dump_json().encode())
    joiner = JoinerService(live.bus, RewardSpec(), window_s=WINDOW, clock=lambda: time.time() + 2 * WINDOW)
    samples = {s.completion.completion_id: s for s in joiner.run_once(1.0)}
    assert joiner.stats["tenant_mismatch"] == 1
    assert samples[acme_c].completion.tenant == "acme" and [s.kind for s in samples[acme_c].signals] == ["thumb_up"]
    assert samples[globex_c].completion.tenant == "globex"
    assert [s.kind for s in samples[globex_c].signals] == ["accepted"]
    joiner.close()
