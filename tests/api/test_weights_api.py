"""`/v1/weights`: a gateway serves registered versions' files to replicas elsewhere, behind a
`weights:read` key, resumable, and nothing else in its models folder; the replica-side `Fetcher`
downloads through it and verifies against the registry's hash."""

from __future__ import annotations

import hashlib
import os

import httpx
import pytest

from api.main import create_app
from core.settings import Settings
from feedback.bus_embedded import EmbeddedBus
from feedback.completion_index import CompletionIndex
from registry.keys import KeyStore
from registry.registry import Registry
from serving.engine import EmbeddedEngine
from serving.fetch import Fetcher, HashMismatch
from tests.conftest import LiveServer

DATA = os.urandom(200_000)
PATH = "store/base.snapshot.fws"


@pytest.fixture
def live(tiny_checkpoint, tmp_path):
    settings = Settings(home=tmp_path, model_dir=tiny_checkpoint)
    (settings.learner_models_dir / "store").mkdir(parents=True)
    (settings.learner_models_dir / PATH).write_bytes(DATA)
    (settings.learner_models_dir / "learner.json").write_text("{}")  # in the folder, never registered
    engine = EmbeddedEngine(max_batch=2, max_model_len=128)
    engine.add_version(tiny_checkpoint.name, tiny_checkpoint, default=True)
    bus, reg = EmbeddedBus(tmp_path / "bus"), Registry(f"sqlite:///{tmp_path / 'registry.db'}")
    sha = hashlib.sha256(DATA).hexdigest()
    reg.bootstrap("base", files=[{"path": PATH, "sha256": sha, "bytes": len(DATA), "kind": "snapshot"}])
    keys, index = KeyStore(settings.db_url), CompletionIndex(tmp_path / "index.db")
    with LiveServer(create_app(settings, engine=engine, bus=bus, registry=reg, index=index)) as server:
        server.token = keys.create(["weights:read"], label="replicas-eu")[0]
        server.viewer = keys.create(["viewer"])[0]
        server.sha = sha
        yield server
    engine.shutdown()
    bus.close()
    reg.close()
    index.close()


def get(live, path: str, token: str | None, **headers) -> httpx.Response:
    if token:
        headers["Authorization"] = f"Bearer {token}"
    return httpx.get(f"{live.url}/v1/weights/{path}", headers=headers)


def test_a_weights_key_is_required_even_in_local_mode(live):
    assert get(live, PATH, None).status_code == 401
    r = get(live, PATH, live.viewer)
    assert r.status_code == 403 and r.json()["error"]["code"] == "insufficient_scope"


def test_registered_files_are_served_whole_or_from_an_offset(live):
    r = get(live, PATH, live.token)
    assert r.status_code == 200 and r.content == DATA and r.headers["accept-ranges"] == "bytes"
    r = get(live, PATH, live.token, Range="bytes=150000-")
    assert r.status_code == 206 and r.content == DATA[150_000:]
    assert r.headers["content-range"] == f"bytes 150000-{len(DATA) - 1}/{len(DATA)}"
    for bad in ("bytes=0-10", "bytes=-5", f"bytes={len(DATA)}-", "items=3-"):
        assert get(live, PATH, live.token, Range=bad).status_code == 416, bad


def test_nothing_but_registered_files_can_be_read(live):
    for path in ("learner.json", "store/../learner.json", "store/other.fws", "%2e%2e/registry.db"):
        r = get(live, path, live.token)
        assert r.status_code == 404 and r.json()["error"]["param"] == "path", path


def test_a_replica_fetches_through_the_gateway_and_checks_the_registry_hash(live, tmp_path):
    fetcher = Fetcher(f"{live.url}/v1/weights", token=live.token)
    dest = tmp_path / "elsewhere" / "base.snapshot.fws"
    assert fetcher.fetch(PATH, live.sha, dest, size=len(DATA)).read_bytes() == DATA
    with pytest.raises(HashMismatch):
        fetcher.fetch(PATH, hashlib.sha256(b"other").hexdigest(), tmp_path / "x.fws")
