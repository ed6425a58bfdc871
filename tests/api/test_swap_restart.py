"""A gateway process killed (SIGKILL) mid-swap and started again converges to what the registry says.

The gateway runs as `flywheel serve` in a subprocess; its replica fetches versions over HTTP from a
weight server in this process that serves the learner's models folder (Range resume as
`/v1/weights` does) and can hold a download after some bytes. The candidate v2 enters its canary,
the replica's download of it stalls halfway, and v2 is approved meanwhile: the gateway is killed
while its replica fetches the newly promoted version. Until then it served the base, never v2. The
restarted gateway resumes the `.part` (a `Range` request from where the part ends), verifies it
against the registry's hash, serves v2 and heartbeats v2's hash; the registry is unchanged (nothing
was promoted by a restart) and v3, which failed its gate, is never fetched.
"""

from __future__ import annotations

import threading
from datetime import UTC, datetime
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import unquote

import httpx
import pytest
import torch

from core.harness import LiveGateway, wait_until
from registry.publish import SHIPPING_DTYPE, STORE, file_entry, publish_base, sha256_of
from registry.registry import Registry
from serving.checkpoint import load_checkpoint
from serving.weight_store import WeightStore, shipping_state

PROMPT = "# add 1 to x\ndef f(x):\n"


class WeightServer:
    """Files of `root` over HTTP with Range. `hold(name, after)`: the next GET of a path ending in
    `name` sends `after` bytes and then waits for `release()` (the connection is then dropped)."""

    def __init__(self, root: Path):
        self.root, self.requests = root, []  # (path, Range header or None) of every GET
        self._hold: tuple[str, int] | None = None
        self.holding, self._release = threading.Event(), threading.Event()
        server = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args) -> None:
                pass

            def do_GET(self) -> None:
                rel = unquote(self.path.lstrip("/"))
                rng = self.headers.get("Range")
                server.requests.append((rel, rng))
                path = server.root / rel
                if ".." in rel or not path.is_file():
                    self.send_response(404)
                    self.send_header("Content-Length", "0")
                    self.end_headers()
                    return
                data = path.read_bytes()
                start = int(rng.removeprefix("bytes=").rstrip("-")) if rng else 0
                self.send_response(206 if rng else 200)
                if rng:
                    self.send_header("Content-Range", f"bytes {start}-{len(data) - 1}/{len(data)}")
                self.send_header("Content-Length", str(len(data) - start))
                self.end_headers()
                held, server._hold = server._hold, None
                if held is not None and rel.endswith(held[0]):
                    self.wfile.write(data[start : start + held[1]])
                    self.wfile.flush()
                    server.holding.set()
                    server._release.wait(60)
                    self.close_connection = True
                    return
                self.wfile.write(data[start:])

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.httpd.daemon_threads = True
        threading.Thread(target=self.httpd.serve_forever, args=(0.05,), daemon=True).start()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.httpd.server_port}"

    def hold(self, name: str, after: int) -> None:
        self._hold = (name, after)

    def release(self) -> None:
        self._release.set()

    def close(self) -> None:
        self._release.set()
        self.httpd.shutdown()
        self.httpd.server_close()


def candidate(models: Path, reg: Registry, template: Path, vid: str, parent: str, seed: int) -> None:
    """As the learner ships one: every weight moved a little, a delta on `parent` in the weight store."""
    model = load_checkpoint(template)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=g) * 0.01)
    put = WeightStore(models / STORE).put(vid, shipping_state(model, SHIPPING_DTYPE), parent=parent)
    reg.register(version_id=vid, parent_id=parent, files=[file_entry(models, put.path, put.kind)])


def offline_verdict(reg: Registry, vid: str, passed: bool) -> None:
    reg.transition(vid, "evaluating", "gate", "offline eval")
    verdict = {"passed": passed, "incumbent_id": reg.incumbent().id, "artifact_sha256": reg.get(vid).artifact_sha256,
               "suite_version": "s1", "numbers": {}}  # fmt: skip
    reg.record_gate(vid, "offline", verdict, "gate")


class Gateway(LiveGateway):
    """`flywheel serve` in its own process (`LiveGateway`), which a test can kill outright."""

    def health(self) -> dict | None:
        try:
            return httpx.get(self.url + "/healthz", timeout=2).json()
        except httpx.HTTPError:
            return None

    def died(self) -> None:
        """For `wait_until(check=...)`: fail at once if the gateway exited."""
        if not self.child.alive():
            raise AssertionError(f"the gateway exited ({self.child.returncode}):\n{self.child.tail()}")

    def kill(self) -> None:
        """SIGKILL: no shutdown runs; its engine and workers die with it (parent-death signal)."""
        self.child.proc.kill()
        self.stop()


@pytest.fixture
def world(tiny_checkpoint, tmp_path):
    learner = tmp_path / "learner"  # the machine with the learner's models folder
    reg = Registry(f"sqlite:///{tmp_path / 'registry.db'}")
    base = publish_base(reg, learner, tiny_checkpoint).id
    server = WeightServer(learner)
    env = {
        "FLYWHEEL_HOME": str(tmp_path / "gateway"),
        "FLYWHEEL_MODEL_DIR": str(tiny_checkpoint),
        "FLYWHEEL_DATABASE_URL": reg.url,
        "FLYWHEEL_WEIGHTS_URL": server.url,
        "FLYWHEEL_ENGINE": "embedded",
        "FLYWHEEL_REPLICAS": "1",
        "FLYWHEEL_HEARTBEAT_S": "0.5",
        "FLYWHEEL_GATEWAY_ID": "gw",
        "FLYWHEEL_MAX_BATCH": "4",
        "FLYWHEEL_MAX_MODEL_LEN": "128",
    }
    yield reg, learner, server, env, base
    server.close()
    reg.close()


@pytest.mark.slow  # `flywheel serve` started twice
def test_a_gateway_killed_while_fetching_a_promoted_version_resumes_verifies_and_serves_it(world, tmp_path):
    reg, learner, server, env, base = world
    template = Path(env["FLYWHEEL_MODEL_DIR"])
    log = tmp_path / "gateway.log"
    part = tmp_path / "gateway" / "models" / "learner" / STORE / "v2.delta.fws.part"
    with Gateway(env, log_path=log) as gw:  # ready once its replica synced
        wait_until(lambda: (gw.health() or {}).get("default_version") == base, 30, what="the base", check=gw.died)

        candidate(learner, reg, template, "v2", base, seed=1)
        v2_file = learner / STORE / "v2.delta.fws"
        server.hold("v2.delta.fws", v2_file.stat().st_size // 2)
        offline_verdict(reg, "v2", passed=True)
        reg.transition("v2", "canary", "gate", "offline passed")  # the replica starts fetching v2
        reg.record_gate("v2", "canary", {"step": 0, "share": 0.5, "started_at": datetime.now(UTC)}, "gate")
        assert server.holding.wait(20), "the replica never asked for v2"
        reg.transition("v2", "awaiting_approval", "gate", "canary passed")
        reg.approve("v2", "alice", "better")  # promoted while the replica is still fetching it
        wait_until(lambda: part.is_file() and part.stat().st_size > 0, 30, what="the partial download", check=gw.died)
        served = httpx.post(gw.url + "/v1/completions", json={"model": "flywheel", "prompt": PROMPT, "max_tokens": 2})
        assert served.json()["model"] == base and gw.health()["versions"] == [base]  # nothing unverified served
        gw.kill()
    kept = part.stat().st_size
    assert 0 < kept < v2_file.stat().st_size
    # v3 failed its gate while the gateway was down: the restarted gateway must not touch it.
    candidate(learner, reg, template, "v3", "v2", seed=2)
    offline_verdict(reg, "v3", passed=False)
    reg.reject("v3", "gate", "offline regression")
    promotions = [(a.version_id, a.actor) for a in reg.audit() if a.to_status == "promoted"]
    assert promotions == [(base, "bootstrap"), ("v2", "alice")]
    server.release()

    with Gateway(env, log_path=log) as gw:  # the same gateway id: its replica's heartbeat row is replaced
        health = gw.health()  # it answers once its replica synced
        assert health is not None
        assert (health["default_version"], health["versions"]) == ("v2", ["v2"]), log.read_text()[-3000:]
        assert ("store/v2.delta.fws", f"bytes={kept}-") in server.requests  # resumed where the part ended
        local = tmp_path / "gateway" / "models" / "learner" / STORE / "v2.delta.fws"
        assert not part.exists() and sha256_of(local) == reg.get("v2").artifact_sha256
        assert not [p for p, _ in server.requests if "v3" in p]
        r = httpx.post(gw.url + "/v1/completions", json={"model": "flywheel", "prompt": PROMPT, "max_tokens": 2})
        assert r.status_code == 200 and r.json()["model"] == "v2"
        sha = reg.get("v2").artifact_sha256
        beat = wait_until(
            lambda: next((b for b in reg.fleet(interval_s=0.5).replicas if "v2" in b.holds), None), 30, what="a beat"
        )
        assert (beat.replica_id, beat.holds, beat.serves, beat.error) == ("gw-r0", {"v2": sha}, {"v2": 1.0}, None)
        assert reg.fleet(interval_s=0.5).complete
    assert [(a.version_id, a.actor) for a in reg.audit() if a.to_status == "promoted"] == promotions
