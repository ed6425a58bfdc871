"""Two gateways, two processes, one registry: both pick up a promotion and a rollback, and share keys.

Each gateway is `flywheel serve` in its own process with its own home (nothing shared but the
registry and the learner's models folder, which they fetch from as a folder). A candidate is
approved: both report its hash in their heartbeats and serve it on the alias; a rollback brings
both back to the base. This is how gateways scale out behind a load balancer.
"""

from __future__ import annotations

import time
from pathlib import Path

import httpx
import pytest

from core.harness import wait_until
from core.supervisor import Supervisor
from registry.keys import KeyStore
from registry.publish import publish_base
from registry.registry import Registry
from tests.api.test_swap_restart import PROMPT, Gateway, candidate, offline_verdict


@pytest.mark.slow  # two `flywheel serve` processes
def test_gateways_in_two_processes_follow_one_registry(tiny_checkpoint, tmp_path):
    learner = tmp_path / "learner"
    reg = Registry(f"sqlite:///{tmp_path / 'registry.db'}")
    base = publish_base(reg, learner, tiny_checkpoint).id
    with Supervisor("two-gateways") as sup:
        gateways = []
        for name in ("gw-a", "gw-b"):
            env = {
                "FLYWHEEL_HOME": str(tmp_path / name),
                "FLYWHEEL_MODEL_DIR": str(tiny_checkpoint),
                "FLYWHEEL_DATABASE_URL": reg.url,
                "FLYWHEEL_WEIGHTS_URL": str(learner),
                "FLYWHEEL_ENGINE": "embedded",
                "FLYWHEEL_REPLICAS": "1",
                "FLYWHEEL_HEARTBEAT_S": "0.5",
                "FLYWHEEL_GATEWAY_ID": name,
                "FLYWHEEL_MAX_BATCH": "4",
                "FLYWHEEL_MAX_MODEL_LEN": "128",
            }
            gateways.append(Gateway(env, log_path=tmp_path / f"{name}.log", supervisor=sup, name=name).start())
        for gw in gateways:  # each is ready once its replica synced
            assert (gw.health() or {}).get("default_version") == base

        def everyone_serves(vid: str) -> bool:
            fleet = reg.fleet(interval_s=0.5)
            sha = reg.get(vid).artifact_sha256
            beats = {b.gateway_id: b.holds.get(vid) for b in fleet.replicas if b.replica_id in fleet.up}
            return fleet.complete and fleet.promoted_id == vid and beats == {"gw-a": sha, "gw-b": sha}

        def alias_model(gw: Gateway) -> str:
            r = httpx.post(gw.url + "/v1/completions", json={"model": "flywheel", "prompt": PROMPT, "max_tokens": 2})
            assert r.status_code == 200, r.text
            return r.json()["model"]

        candidate(learner, reg, Path(tiny_checkpoint), "v2", base, seed=3)
        offline_verdict(reg, "v2", passed=True)
        reg.transition("v2", "canary", "gate", "offline passed")
        reg.transition("v2", "awaiting_approval", "gate", "canary passed")
        reg.approve("v2", "alice", "better")
        wait_until(lambda: everyone_serves("v2"), 30, what="both gateways on v2", check=sup.check)
        assert [alias_model(gw) for gw in gateways] == ["v2", "v2"]

        reg.rollback(None, "alice", "rolled back")
        wait_until(lambda: everyone_serves(base), 30, what="both gateways back on the base", check=sup.check)
        assert [alias_model(gw) for gw in gateways] == [base, base]

        # Keys live in the shared database: one made there (as `flywheel keys create` does against it) works
        # on both gateways; revoked, both refuse it within 5 s.
        keys = KeyStore(reg.url)
        token, key = keys.create(["viewer"], label="ops")

        def status(gw: Gateway) -> int:
            return httpx.get(gw.url + "/admin/versions", headers={"Authorization": f"Bearer {token}"}).status_code

        assert [status(gw) for gw in gateways] == [200, 200]
        keys.revoke(key.key_id)
        t0 = time.monotonic()
        wait_until(lambda: [status(gw) for gw in gateways] == [401, 401], 5, what="the revoke seen by both")
        assert time.monotonic() - t0 < 5
        keys.close()
    reg.close()
