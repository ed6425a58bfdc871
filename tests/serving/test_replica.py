"""Replicas following the real registry (SQLite; PostgreSQL for the notifications) with real weight
stores, the embedded engine and tiny checkpoints: bootstrap, canary, approval, a corrupted artifact,
rollbacks, and two replicas following one registry (one of them over HTTP)."""

from __future__ import annotations

import hashlib
import os
import signal
import threading
import time
import uuid
from datetime import UTC, datetime
from pathlib import Path

import pytest
import torch
from sqlalchemy import text

from core.harness import wait_until
from registry.db import make_engine
from registry.registry import Registry
from serving.checkpoint import load_checkpoint
from serving.engine import EmbeddedEngine
from serving.engine_process import ProcessEngine
from serving.fetch import Fetcher
from serving.replica import PgNotifier, Replica, ReplicaRegistry
from serving.sampling import SamplingParams
from serving.scoring import score
from serving.weight_store import DELTA_SUFFIX, WeightStore, shipping_state
from tests.gating.test_registry import pg_database  # noqa: F401  (a fixture)
from tests.serving.test_fetch import TOKEN, FileServer


def _sha(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


class World:
    """What the learner leaves behind: a models folder whose weight store holds v1 (snapshot) and
    deltas v2 (on v1) and v3 (on v2), all float32, and a registry on SQLite."""

    def __init__(self, tmp_path: Path, checkpoint: Path):
        self.tmp, self.checkpoint = tmp_path, checkpoint
        self.models = tmp_path / "models"
        self.src = WeightStore(self.models / "store")
        self.weights = {"v1": load_checkpoint(checkpoint)}
        g = torch.Generator().manual_seed(7)
        for vid, parent in (("v2", "v1"), ("v3", "v2")):
            m = load_checkpoint(checkpoint)
            m.load_state_dict(self.weights[parent].state_dict())
            with torch.no_grad():
                for p in m.parameters():
                    p.add_(torch.randn(p.shape, generator=g) * 0.02)
            self.weights[vid] = m
        self.src.put("v1", shipping_state(self.weights["v1"], dtype=torch.float32))
        for vid, parent in (("v2", "v1"), ("v3", "v2")):
            assert self.src.put(vid, shipping_state(self.weights[vid], dtype=torch.float32), parent).kind == "delta"
        self.reg = Registry(f"sqlite:///{tmp_path / 'registry.db'}")
        _: ReplicaRegistry = self.reg  # structurally a ReplicaRegistry (checked by mypy)
        self.engines: list[EmbeddedEngine] = []

    def entry(self, vid: str, sha: str | None = None) -> dict:
        path = self.src.path(vid)
        assert path is not None
        kind = "delta" if path.name.endswith(DELTA_SUFFIX) else "snapshot"
        rel = str(path.relative_to(self.models))
        return {"path": rel, "sha256": sha or _sha(path), "bytes": path.stat().st_size, "kind": kind}

    def register(self, vid: str, parent: str, sha: str | None = None) -> None:
        self.reg.register(version_id=vid, parent_id=parent, files=[self.entry(vid, sha)])

    def advance(self, vid: str, to: str, share: float = 0.25) -> None:
        """Along the gate's happy path up to `to` (canary, awaiting_approval or promoted)."""
        steps = ["evaluating", "canary", "awaiting_approval", "promoted"]
        cur = str(self.reg.get(vid).status)
        for st in steps[steps.index(cur) + 1 if cur in steps else 0 : steps.index(to) + 1]:
            if st == "promoted":
                self.reg.approve(vid, "alice", "canary won")
                continue
            self.reg.transition(vid, st, "gate", f"to {st}")
            if st == "evaluating":
                verdict = {
                    "passed": True,
                    "incumbent_id": self.reg.incumbent().id,
                    "artifact_sha256": self.reg.get(vid).artifact_sha256,
                    "suite_version": "suite-1",
                }
                self.reg.record_gate(vid, "offline", verdict, "gate")
            if st == "canary":
                record = {"step": 0, "share": share, "started_at": datetime.now(UTC).isoformat()}
                self.reg.record_gate(vid, "canary", record, "gate")

    def replica(self, name: str, fetcher: Fetcher | None = None, **kw) -> Replica:
        eng = EmbeddedEngine(max_batch=4, max_model_len=128)
        self.engines.append(eng)
        return Replica(
            name,
            "gw-1",
            eng,
            WeightStore(self.tmp / name / "store"),
            self.reg,
            fetcher or Fetcher(self.models),
            self.checkpoint,
            host="host-1",
            **kw,
        )

    def close(self) -> None:
        for e in self.engines:
            e.shutdown()
        self.reg.close()


@pytest.fixture
def world(tmp_path, tiny_checkpoint):
    w = World(tmp_path, tiny_checkpoint)
    yield w
    w.close()


def served_exactly(w: World, r: Replica, vid: str) -> None:
    """A request naming no version goes to `vid`, with exactly `vid`'s log-probs (float32, bit for bit)."""
    tok = r.engine.tokenizer()
    params = SamplingParams(max_tokens=8, seed=3)
    c = r.engine.submit(tok.encode_prompt("# add 3 to x\ndef f(x):\n"), params).result()
    assert c.version == vid
    lp, _ = score(w.weights[vid], c.prompt_ids, c.output_ids, c.params, n_vocab=tok.vocab_size)
    assert torch.equal(lp, torch.tensor(c.logprobs)), vid
    for other in set(w.weights) - {vid}:  # and not by accident
        lp, _ = score(w.weights[other], c.prompt_ids, c.output_ids, c.params, n_vocab=tok.vocab_size)
        assert not torch.equal(lp, torch.tensor(c.logprobs)), other


def test_a_replica_follows_promotion_canary_a_bad_artifact_and_rollbacks(world):
    w = world
    w.reg.bootstrap("v1", files=[w.entry("v1")])
    r = w.replica("r1")
    res = r.sync()
    assert (res.default, res.loaded, res.error) == ("v1", ["v1"], None)
    r.heartbeat()
    assert w.reg.fleet().complete and r.report() == ({"v1": w.entry("v1")["sha256"]}, {"v1": 1.0})
    served_exactly(w, r, "v1")
    assert r.sync().loaded == []  # nothing changed: nothing fetched or loaded

    # Canary: v2 (a delta on v1) loads beside v1 and serves its share; new requests still go to v1.
    w.register("v2", "v1")
    w.advance("v2", "canary", share=0.25)
    res = r.sync()
    assert (res.default, sorted(res.held), res.error) == ("v1", ["v1", "v2"], None)
    assert r.report()[1] == {"v1": 0.75, "v2": 0.25}
    r.heartbeat()
    fleet = w.reg.fleet()
    assert fleet.complete and fleet.canary_id == "v2" and not fleet.errors

    # Approval: v2 becomes the default and v1 is retired (it goes once nothing is in flight on it).
    w.advance("v2", "promoted")
    res = r.sync()
    assert (res.default, res.loaded, res.retired, res.error) == ("v2", [], ["v1"], None)
    served_exactly(w, r, "v2")
    r.heartbeat()
    fleet = w.reg.fleet()
    assert fleet.complete and fleet.state == "complete"
    assert fleet.replicas[0].holds == {"v2": w.reg.get("v2").artifact_sha256}

    # v3 registered under a wrong hash: the replica keeps serving v2 and says why.
    w.register("v3", "v2", sha=hashlib.sha256(b"not v3").hexdigest())
    w.advance("v3", "promoted")
    res = r.sync()
    assert res.default == "v2" and "v3:" in res.error and "the registry records" in res.error
    assert not list(r.store.folder.glob("v3*")), "nothing of the refused download is kept"
    served_exactly(w, r, "v2")
    r.heartbeat()
    fleet = w.reg.fleet()
    assert not fleet.complete and fleet.state == "pending" and "v3" in fleet.errors["r1"]

    # Rollback to v2: the replica already serves it; the error clears.
    w.reg.rollback("v2", "alice", "bad artifact")
    res = r.sync()
    assert (res.default, res.error) == ("v2", None)
    r.heartbeat()
    assert w.reg.fleet().complete and not w.reg.fleet().errors

    # Rollback to v1 (retired before): rebuilt from the replica's own store, served exactly again.
    w.reg.rollback("v1", "alice", "v2 regressed")
    res = r.sync()
    assert (res.default, res.loaded, res.retired, res.error) == ("v1", ["v1"], ["v2"], None)
    served_exactly(w, r, "v1")
    r.heartbeat()
    assert w.reg.fleet().complete


def test_a_replica_that_cannot_fetch_keeps_what_it_serves(world, tmp_path):
    w = world
    w.reg.bootstrap("v1", files=[w.entry("v1")])
    r = w.replica("r1")
    assert r.sync().default == "v1"
    w.register("v2", "v1")
    w.advance("v2", "promoted")
    r.fetcher = Fetcher(tmp_path / "nowhere")
    res = r.sync()
    assert res.default == "v1" and "cannot copy the artifact" in res.error
    served_exactly(w, r, "v1")
    r.fetcher = Fetcher(w.models)
    assert r.sync().default == "v2"


def test_a_partial_download_left_by_a_crash_is_resumed_or_redone_and_always_verified(world):
    """A `.part` left by a crash: a true prefix is continued; one whose bytes are not the artifact's
    (a power loss with the part not yet on disk) fails verification, is deleted and downloaded again
    in the same sync, so the replica serves the promoted version, and only its verified bytes."""
    w = world
    w.reg.bootstrap("v1", files=[w.entry("v1")])
    w.register("v2", "v1")
    w.register("v3", "v2")
    for vid, garbage in (("v2", False), ("v3", True)):
        r = w.replica(f"r-{vid}")
        assert r.sync().error is None  # serving the promoted version before `vid`
        data = (w.models / w.entry(vid)["path"]).read_bytes()
        part = r.store.folder / f"{vid}{DELTA_SUFFIX}.part"
        part.write_bytes(bytes(len(data) // 2) if garbage else data[: len(data) // 2])
        w.advance(vid, "promoted")
        res = r.sync()
        assert (res.default, res.error) == (vid, None)
        assert not part.exists() and _sha(r.store.folder / f"{vid}{DELTA_SUFFIX}") == w.entry(vid)["sha256"]
        served_exactly(w, r, vid)


def test_two_replicas_following_one_registry_pick_up_a_promotion(world):
    w = world
    w.reg.bootstrap("v1", files=[w.entry("v1")])
    files = {str(p.relative_to(w.models)): p.read_bytes() for p in (w.models / "store").glob("*.fws")}
    stop = threading.Event()
    with FileServer({f"models/{k}": v for k, v in files.items()}) as srv:
        replicas = [
            w.replica("r-http", Fetcher(srv.url, token=TOKEN), heartbeat_s=1.0, retry_s=1.0),
            w.replica("r-local", heartbeat_s=1.0, retry_s=1.0),
        ]
        threads = [threading.Thread(target=r.run, args=(stop,), daemon=True) for r in replicas]
        for t in threads:
            t.start()
        try:

            def wait_for(vid: str) -> None:
                def on(fleet) -> bool:
                    return fleet.complete and fleet.promoted_id == vid and len(fleet.up) == 2

                wait_until(
                    lambda: on(w.reg.fleet()) and all(r.engine.default_version == vid for r in replicas),
                    20,
                    what=f"both replicas serving {vid}",
                )

            wait_for("v1")
            w.register("v2", "v1")
            w.advance("v2", "promoted")
            wait_for("v2")
        finally:
            stop.set()
            for t in threads:
                t.join(10)
    assert any("Range" not in h and h.get("Authorization") == f"Bearer {TOKEN}" for h in srv.requests)
    for r in replicas:
        served_exactly(w, r, "v2")


def test_a_follower_reports_right_after_a_swap_not_at_its_next_heartbeat(world):
    """Heartbeats every minute; a promotion is still reported within a poll or two of the registry."""
    w = world
    w.reg.bootstrap("v1", files=[w.entry("v1")])
    r = w.replica("r1", heartbeat_s=60.0)
    stop = threading.Event()
    t = threading.Thread(target=r.run, args=(stop,), daemon=True)
    t.start()
    try:
        wait_until(lambda: w.reg.fleet().complete, 20, what="the replica serving v1")
        w.register("v2", "v1")
        w.advance("v2", "promoted")
        sha = w.reg.get("v2").artifact_sha256
        wait_until(  # 20 s is a third of the heartbeat interval: the report did not wait for the beat
            lambda: w.reg.fleet(interval_s=60.0).replicas[0].serves == {"v2": 1.0}, 20, what="v2 reported"
        )
        assert w.reg.fleet(interval_s=60.0).replicas[0].holds == {"v2": sha}
    finally:
        stop.set()
        t.join(10)


def test_a_replica_whose_engine_process_is_killed_reports_nothing_then_restarts_it(world):
    """The engine's process SIGKILLed: the heartbeat stops claiming what it cannot serve, and the
    follower starts a fresh engine, loads the promoted version again (verified) and reports it."""
    w = world
    w.reg.bootstrap("v1", files=[w.entry("v1")])
    engines: list[ProcessEngine] = []

    def make_engine() -> ProcessEngine:
        engines.append(ProcessEngine(max_batch=4, max_model_len=128, threads=1))
        return engines[-1]

    r = Replica("r1", "gw-1", make_engine(), WeightStore(w.tmp / "r1" / "store"), w.reg, Fetcher(w.models),
                w.checkpoint, heartbeat_s=60.0)  # fmt: skip
    try:
        assert r.sync().default == "v1"
        os.kill(engines[0]._proc.pid, signal.SIGKILL)
        engines[0]._proc.join(10)
        wait_until(lambda: not engines[0].alive, 10, what="the proxy noticing the pipe closing", interval_s=0.01)
        assert r.report() == ({}, {})
        r.make_engine = None
        res = r.sync()
        assert (res.default, res.held) == (None, {}) and "engine is not running" in res.error
        r.heartbeat()
        row = w.reg.fleet(interval_s=60.0).replicas[0]
        assert (row.holds, row.serves) == ({}, {}) and "engine is not running" in row.error
        r.make_engine = make_engine
        stop = threading.Event()
        t = threading.Thread(target=r.run, args=(stop,), daemon=True)
        t.start()
        try:
            wait_until(
                lambda: w.reg.fleet(interval_s=60.0).replicas[0].serves == {"v1": 1.0}, 30, what="the replica back"
            )
        finally:
            stop.set()
            t.join(10)
        assert r.restarts == 1 and r.engine is engines[1] and r.engine.default_version == "v1"
        assert w.reg.fleet(interval_s=60.0).replicas[0].error is None
    finally:
        for e in engines:
            e.shutdown()


@pytest.fixture
def pg_url(pg_database):  # noqa: F811
    schema = f"t_{uuid.uuid4().hex[:10]}"
    engine = make_engine(pg_database)
    with engine.begin() as c:
        c.execute(text(f'CREATE SCHEMA "{schema}"'))
    engine.dispose()
    return f"{pg_database}?options=-csearch_path%3D{schema}"


@pytest.mark.postgres
def test_on_postgresql_a_change_wakes_the_follower(pg_url):
    reg = Registry(pg_url)
    notifier = PgNotifier(pg_url)
    try:
        assert notifier.wait(0.1) is False  # connects and listens; nothing announced
        woke: list[bool] = []
        t = threading.Thread(target=lambda: woke.append(notifier.wait(10)))
        t0 = time.monotonic()
        t.start()
        time.sleep(0.3)  # the follower is blocked in `wait` when the change comes, not after it
        assert woke == [] and t.is_alive()
        reg.bootstrap(
            "base", files=[{"path": "store/base.snapshot.fws", "sha256": "a" * 64, "bytes": 1, "kind": "snapshot"}]
        )
        t.join(10)
        assert woke == [True] and time.monotonic() - t0 < 5
    finally:
        notifier.close()
        reg.close()


def test_a_lent_replica_holds_a_candidate_for_lent_work_without_serving_it(world):
    w = world
    w.reg.bootstrap("v1", files=[w.entry("v1")])
    r = w.replica("r1")
    r.sync()
    w.register("v2", "v1")
    w.advance("v2", "evaluating")  # the gate's candidate: no replica serves it
    r.lend_version("v2")
    res = r.sync()
    assert (res.default, sorted(res.held), res.error) == ("v1", ["v1", "v2"], None)
    holds, serves = r.report()
    assert holds["v2"] == w.reg.get("v2").artifact_sha256 and serves == {"v1": 1.0}  # held, never served
    r.heartbeat()
    assert w.reg.fleet().complete  # a lent version held under its registry hash is no split
    c = r.engine.submit(r.engine.tokenizer().encode_prompt("def"), SamplingParams(max_tokens=4, seed=1), "v2").result()
    lp, _ = score(w.weights["v2"], c.prompt_ids, c.output_ids, c.params, n_vocab=r.engine.tokenizer().vocab_size)
    assert torch.equal(lp, torch.tensor(c.logprobs))  # lent work on v2 gets exactly v2
    r.lend_version(None)
    res = r.sync()
    assert res.retired == ["v2"] and res.default == "v1"
    r.lend_version("v2")
    w.reg.transition("v2", "rejected", "gate", "offline regression")
    res = r.sync()
    assert "v2" not in res.held and res.error is None  # a rejected candidate is not held, and no error


def test_a_lent_replica_holds_the_learners_rollout_version_until_it_is_withdrawn(world):
    w = world
    w.reg.bootstrap("v1", files=[w.entry("v1")])
    r = w.replica("r1")
    r.sync()
    w.src.put("v2.rollout", shipping_state(w.weights["v2"], dtype=torch.float32), "v1")  # as the learner does
    w.reg.register(
        version_id="v2.rollout", parent_id="v1", files=[w.entry("v2.rollout")], delta_base_id="v1", status="rollout"
    )
    r.lend_version("v2.rollout")
    res = r.sync()
    assert (res.default, sorted(res.held), res.error) == ("v1", ["v1", "v2.rollout"], None)
    holds, serves = r.report()
    assert holds["v2.rollout"] == w.reg.get("v2.rollout").artifact_sha256 and serves == {"v1": 1.0}
    r.heartbeat()
    assert w.reg.fleet().complete  # held under its registry hash, never served: no split
    w.reg.transition("v2.rollout", "withdrawn", "learner", "its rollout jobs are over")
    res = r.sync()
    assert "v2.rollout" not in res.held and res.error is None
