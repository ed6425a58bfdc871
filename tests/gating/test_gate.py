"""The gate process (`gating.gate`): candidate → evaluating → canary or rejected, on a real registry
(SQLite) and a real engine with the tiny checkpoint; resuming after a kill; loading from the weight store.

Suite, verifier and `Rewrite` come from test_evals.py (GOOD 1, BAD 0, anything else 0.5)."""

from __future__ import annotations

import dataclasses
import hashlib
import os
import shutil
import threading
from types import SimpleNamespace

import pytest
import torch

from core.harness import wait_until
from gating.gate import RUN_KEY, Gate, GateConfig
from gating.gate_process import run_gate, weight_store_loader
from registry.registry import Registry
from serving.checkpoint import WEIGHTS, load_checkpoint
from serving.engine import EmbeddedEngine
from serving.weight_store import WeightStore, shipping_state
from tests.gating.test_evals import SUITE, Rewrite

CFG = GateConfig(G=2, max_tokens=8, seed=3, n_resamples=200, poll_s=0.05, nice=0)


def files(vid: str) -> list[dict]:
    sha = hashlib.sha256(vid.encode()).hexdigest()
    return [{"path": f"store/{vid}.snapshot.fws", "sha256": sha, "bytes": 1, "kind": "snapshot"}]


@pytest.fixture
def reg(tmp_path):
    r = Registry(f"sqlite:///{tmp_path / 'registry.db'}")
    yield r
    r.close()


def setup(reg: Registry, *candidates: str, incumbent: bool = True) -> None:
    if incumbent:
        reg.bootstrap("base", files=files("base"))
    for vid in candidates:
        reg.register(version_id=vid, parent_id="base" if incumbent else None, files=files(vid))


def engines(rewrite=None):
    def make():
        eng = EmbeddedEngine(max_batch=64, max_model_len=128)
        return Rewrite(eng, *rewrite) if rewrite else eng

    return make


def folders(tiny_checkpoint, calls=None):
    def load(v):
        if calls is not None:
            calls.append(v.id)
        return tiny_checkpoint

    return load


def audit(reg, vid):
    return [(a.action, a.from_status, a.to_status) for a in reg.audit(vid)]


def test_a_passing_candidate_goes_to_canary_with_its_verdict(reg, tiny_checkpoint):
    setup(reg, "v1", "v2")
    gate = Gate(reg, engines(), folders(tiny_checkpoint), SUITE, CFG)
    step = gate.step()
    assert (step.action, step.version_id) == ("passed", "v1") and step.result is not None  # the oldest first
    v = reg.get("v1")
    off = v.gate["offline"]
    assert v.status == "canary" and off["passed"] and off["incumbent_id"] == "base"
    assert off["artifact_sha256"] == v.artifact_sha256 and off["suite_version"] == SUITE.suite_version
    assert off["numbers"]["non_inferiority"]["mean_diff"] == 0.0 and off["numbers"]["sampling"]["G"] == 2
    assert v.gate[RUN_KEY]["attempt"] == 1 and v.gate[RUN_KEY]["error"] is None
    assert audit(reg, "v1") == [
        ("register", None, "candidate"),
        ("transition", "candidate", "evaluating"),
        ("record_gate", "evaluating", "evaluating"),  # the attempt
        ("record_gate", "evaluating", "evaluating"),  # the verdict
        ("transition", "evaluating", "canary"),
    ]
    assert reg.audit("v1")[-1].details["checks"]["kl"] is True
    # The canary stage is a hook: the version waits there, v2 is not picked while v1 is in flight.
    assert gate.step().action == "canary" and reg.get("v1").status == "canary" and reg.get("v2").status == "candidate"
    assert reg.promoted().id == "base"  # the gate never promotes


def test_a_worse_candidate_is_rejected_with_the_numbers(reg, tiny_checkpoint):
    setup(reg, "v1", "v2")
    bad = ("v1", lambda c, family, i: dataclasses.replace(c, text="BAD"))
    gate = Gate(reg, engines(bad), folders(tiny_checkpoint), SUITE, CFG)
    step = gate.step()
    assert step.action == "rejected" and "non_inferiority" in step.detail
    v = reg.get("v1")
    assert v.status == "rejected" and v.gate["offline"]["passed"] is False
    last = reg.audit("v1")[-1]
    assert (last.action, last.to_status) == ("reject", "rejected")
    assert last.details["non_inferiority"]["mean_diff"] == -0.5 and "non_inferiority" in last.details["failed"]
    assert gate.step().version_id == "v2"  # next candidate


class Killed(BaseException):
    """The process dies: nothing of the gate runs after it."""


def test_a_gate_killed_mid_eval_resumes_and_finishes(reg, tiny_checkpoint):
    setup(reg, "v1")

    def dies(v):
        raise Killed

    with pytest.raises(Killed):
        Gate(reg, engines(), dies, SUITE, CFG).step()
    v = reg.get("v1")
    assert v.status == "evaluating" and v.gate[RUN_KEY]["attempt"] == 1 and "offline" not in v.gate
    calls: list[str] = []
    step = Gate(reg, engines(), folders(tiny_checkpoint, calls), SUITE, CFG).step()  # a new gate process
    assert step.action == "passed" and not step.resumed and calls == ["v1", "base"]
    v = reg.get("v1")
    assert v.status == "canary" and v.gate[RUN_KEY]["attempt"] == 2 and v.gate["offline"]["passed"]


def test_a_verdict_recorded_before_the_kill_is_acted_on_without_evaluating_again(reg, tiny_checkpoint):
    setup(reg, "v1")
    first = Gate(reg, engines(), folders(tiny_checkpoint), SUITE, CFG)
    original = reg.transition

    def killed_before_moving(vid, to, *a, **kw):
        if str(to) == "canary":
            raise Killed
        return original(vid, to, *a, **kw)

    reg.transition = killed_before_moving  # type: ignore[method-assign]
    with pytest.raises(Killed):
        first.step()
    del reg.transition
    assert reg.get("v1").status == "evaluating" and reg.get("v1").gate["offline"]["passed"]

    def never(v):
        raise AssertionError("evaluated again")

    step = Gate(reg, engines(), never, SUITE, CFG).step()
    assert (step.action, step.resumed) == ("passed", True) and reg.get("v1").status == "canary"


def test_failed_attempts_are_counted_then_the_version_is_rejected(reg):
    setup(reg, "v1")

    def broken(v):
        raise ValueError(f"no folder for {v.id}")

    gate = Gate(reg, engines(), broken, SUITE, CFG.model_copy(update={"max_attempts": 2}))
    assert [gate.step().action for _ in range(2)] == ["error", "error"]
    assert reg.get("v1").status == "evaluating" and "no folder for v1" in reg.get("v1").gate[RUN_KEY]["error"]
    step = gate.step()
    assert step.action == "rejected" and "failed 2 times" in step.detail and reg.get("v1").status == "rejected"


def test_no_incumbent_nothing_is_evaluated(reg, tiny_checkpoint):
    setup(reg, "v1", incumbent=False)
    calls: list[str] = []
    gate = Gate(reg, engines(), folders(tiny_checkpoint, calls), SUITE, CFG)
    assert gate.step().action == "no_incumbent" and calls == []
    assert reg.get("v1").status == "candidate" and audit(reg, "v1") == [("register", None, "candidate")]
    reg.bootstrap("base", files=files("base"))
    assert Gate(reg, engines(), folders(tiny_checkpoint), SUITE, CFG).step().action == "passed"  # now it can


def test_weight_store_loader_rebuilds_the_artifact(tmp_path, tiny_checkpoint):
    models = tmp_path / "models"
    shutil.copytree(tiny_checkpoint, models / "v1")
    model = load_checkpoint(tiny_checkpoint)
    path = WeightStore(models / "store").put("v1", shipping_state(model)).path
    reg = Registry(f"sqlite:///{tmp_path / 'r.db'}")
    sha = hashlib.sha256(path.read_bytes()).hexdigest()
    art = {"path": f"store/{path.name}", "sha256": sha, "bytes": path.stat().st_size, "kind": "snapshot"}
    v = reg.register(version_id="v1", files=[art])
    load = weight_store_loader(models, tmp_path / "cache")
    folder = load(v)
    assert folder == load(v) and (folder / WEIGHTS).is_file()  # the second call finds it complete
    got = load_checkpoint(folder)
    for name, t in model.state_dict().items():  # the shipped bf16 values, in the folder's float32
        assert torch.equal(got.state_dict()[name], t.to(torch.bfloat16).to(t.dtype)), name
    wrong = reg.register(version_id="v2", files=[{**art, "sha256": "0" * 64}])
    with pytest.raises(ValueError, match="the registry says 0000"):
        load(wrong)
    reg.close()


def test_run_gate_loops_until_stopped(tmp_path, reg, tiny_checkpoint):
    setup(reg, "v1")
    settings = SimpleNamespace(db_url=f"sqlite:///{tmp_path / 'registry.db'}", home=tmp_path)
    stop = threading.Event()
    args = (settings, stop, SUITE, CFG)
    kw = {"engine_factory": engines(), "load_version": folders(tiny_checkpoint)}
    t = threading.Thread(target=run_gate, args=args, kwargs=kw, daemon=True)
    t.start()
    try:
        wait_until(lambda: reg.get("v1").status == "canary", 20, what="the gate loop passing v1 to its canary")
        lease = reg.gate_lease()  # the loop holds the gate's lease
        assert lease is not None and lease.pid == os.getpid() and lease.beat_s == CFG.lease_beat_s
    finally:
        stop.set()
        t.join(timeout=10)
    assert not t.is_alive() and reg.gate_leases() == []  # released on the way out


def test_the_gate_on_a_process_engine(reg, tiny_checkpoint):
    """As in production: the gate's own engine in a process of its own."""
    from serving.engine_process import ProcessEngine

    setup(reg, "v1")
    gate = Gate(reg, lambda: ProcessEngine(max_batch=64, max_model_len=128, threads=1), folders(tiny_checkpoint),
                SUITE, CFG)  # fmt: skip
    step = gate.step()
    assert step.action == "passed" and reg.get("v1").status == "canary"
    assert reg.get("v1").gate["offline"]["numbers"]["guardrails"]["kl"]["per_token"] == 0.0
