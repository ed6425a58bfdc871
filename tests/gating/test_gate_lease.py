"""The gate's lease: the registry's table (SQLite and PostgreSQL, test_registry.py's fixtures), the
beating thread (`gating.lease.GateLease`), the gateway's lapse of a canary no gate holds
(`api.fleet.GatewayFleet.canary`), and a real gate process SIGKILLed mid-canary, then restarted."""

from __future__ import annotations

import logging
import re
import sys
import threading
import time
from datetime import UTC, datetime, timedelta
from types import SimpleNamespace

import pytest

from api.fleet import CANARY_TTL_S, Canary, GatewayFleet
from api.metrics import Metrics
from core.harness import wait_until
from core.supervisor import Supervisor
from gating.lease import GateLease
from registry.gate_lease import LAPSE_AFTER
from registry.models import utcnow
from registry.registry import Registry
from tests.gating.gate_child import SHARE, bus_at
from tests.gating.test_canary import publish_traffic
from tests.gating.test_gate import setup
from tests.gating.test_registry import advance, base, files, pg_database, reg, url  # noqa: F401

USERS = [f"user-{i}" for i in range(400)]


def gateway(reg: Registry) -> GatewayFleet:
    """The gateway's routing on `reg`, its one replica a stand-in whose engine holds `base` and `v1`."""
    engine = SimpleNamespace(versions=("base", "v1"), default_version="base", alive=True)
    gw = GatewayFleet(reg, [SimpleNamespace(engine=engine)], threading.Event())  # type: ignore[list-item]
    gw.metrics = Metrics()
    return gw


def routed(gw: GatewayFleet, users: list[str]) -> set[str]:
    """The users the gateway routes to the candidate (each request as `route` sees it, cache included)."""
    return {u for u in users if gw.route("t1", u)[0] == "v1"}


def in_canary(reg: Registry, share: float = SHARE) -> None:
    reg.register(version_id="v1", parent_id="base", files=files("v1"))
    advance(reg, "v1", "canary")
    reg.record_gate("v1", "canary", {"step": 0, "share": share, "started_at": datetime.now(UTC)}, "gate")


# -- the registry's table ---------------------------------------------------------------------------


def test_a_beat_renews_the_lease_and_three_missed_lapse_it(reg):
    t0 = datetime(2026, 1, 1, tzinfo=UTC)
    first = reg.beat_gate("g1", host="h", pid=7, beat_s=2.0, at=t0)
    assert (first.lease_s, first.started_at, first.beat_at) == (LAPSE_AFTER * 2.0, t0, t0)
    again = reg.beat_gate("g1", host="h", pid=7, beat_s=2.0, at=t0 + timedelta(seconds=2))
    assert again.started_at == t0 and again.beat_at == t0 + timedelta(seconds=2)  # one row per gate
    assert [g.gate_id for g in reg.gate_leases()] == ["g1"]
    assert reg.gate_lease(now=t0 + timedelta(seconds=8)).gate_id == "g1"  # 3 beats after the last one
    assert reg.gate_lease(now=t0 + timedelta(seconds=8.01)) is None
    reg.beat_gate("g2", host="h", pid=8, beat_s=1.0, at=t0 + timedelta(seconds=7))
    assert reg.gate_lease(now=t0 + timedelta(seconds=9)).gate_id == "g2"  # the live one with the latest beat
    assert reg.gate_lease(now=t0 + timedelta(seconds=10.5)) is None
    assert reg.forget_lapsed_gates(now=t0 + timedelta(days=1, seconds=9)) == 1  # g1 lapsed over a day ago
    assert reg.release_gate("g2") and not reg.release_gate("g2") and reg.gate_leases() == []
    with pytest.raises(ValueError, match="lease_s 1.0 must be finite and at least beat_s 2.0"):
        reg.beat_gate("g3", host="h", pid=9, beat_s=2.0, lease_s=1.0)
    with pytest.raises(ValueError, match="needs a timezone"):
        reg.beat_gate("g3", host="h", pid=9, beat_s=2.0, at=datetime(2026, 1, 1))


# -- the beating thread -----------------------------------------------------------------------------


def test_the_thread_beats_while_the_main_loop_is_busy_and_stop_releases(reg):
    with GateLease(reg, beat_s=0.05, stuck_s=60) as lease:
        first = reg.gate_lease()
        assert first is not None and first.gate_id == lease.gate_id and first.lease_s == pytest.approx(0.15)
        wait_until(lambda: lease.beats >= 4, 10, what="beats from the thread alone")  # no progress() called
        assert reg.gate_lease().beat_at > first.beat_at and reg.gate_lease().started_at == first.started_at
    assert reg.gate_leases() == []  # released, not left to lapse


def test_a_stuck_main_loop_lets_the_lease_lapse_and_moving_again_renews_it(reg, caplog):
    caplog.set_level(logging.WARNING, logger="gating.lease")
    with GateLease(reg, beat_s=0.05, stuck_s=0.3) as lease:
        wait_until(lambda: lease.stuck, 10, what="the thread to see the main loop stuck")
        wait_until(lambda: reg.gate_lease() is None, 10, what="the lease to lapse")
        beats = lease.beats
        time.sleep(0.2)
        assert lease.beats <= beats + 1  # no more beats for a stuck loop (one may have been in flight)
        lease.progress()
        assert reg.gate_lease() is not None and not lease.stuck
    stuck = [r for r in caplog.records if "has not moved" in r.message]
    assert len(stuck) == 1 and stuck[0].levelname == "ERROR"
    assert any("moving again" in r.message and r.levelname == "WARNING" for r in caplog.records)


def test_a_failed_beat_is_logged_and_the_next_one_tried(reg, caplog, monkeypatch):
    real, calls = reg.beat_gate, []

    def flaky(*a, **kw):
        calls.append(1)
        if len(calls) == 2:
            raise ConnectionError("database unreachable")
        return real(*a, **kw)

    monkeypatch.setattr(reg, "beat_gate", flaky)
    with GateLease(reg, beat_s=0.05, stuck_s=60) as lease:
        wait_until(lambda: lease.beats >= 3, 10, what="beats after the failed one")
    assert lease.failures == 1 and any("database unreachable" in r.message for r in caplog.records)


# -- the gateway ------------------------------------------------------------------------------------


def test_the_gateway_lapses_a_canary_without_a_live_lease_and_resumes_it(reg, caplog):
    caplog.set_level(logging.WARNING, logger="api.fleet")
    base(reg)
    in_canary(reg)
    gw = gateway(reg)
    assert gw.canary(fresh=True) is None and routed(gw, USERS) == set()  # no gate ever beat
    assert gw.canary(fresh=True) is None and gw.lapses == 1  # one lapse, not one per read
    lapsed = [r for r in caplog.records if r.message.startswith("canary lapsed")]
    assert len(lapsed) == 1 and "no gate ever beat" in lapsed[0].message
    assert gw.metrics.canary_lapsed._value.get() == 1 and gw.metrics.canary_lapses._value.get() == 1

    reg.beat_gate("g1", host="h", pid=1, beat_s=5.0)
    assert gw.canary(fresh=True) == Canary("v1", SHARE)
    candidates = routed(gw, USERS)
    assert 150 <= len(candidates) <= 250  # about half of 400
    assert any(r.message.startswith("canary lapse over: a gate beats again") for r in caplog.records)
    assert gw.metrics.canary_lapsed._value.get() == 0

    reg.beat_gate("g1", host="h", pid=1, beat_s=1.0, at=utcnow() - timedelta(seconds=3.5))  # 3 beats missed
    assert gw.canary(fresh=True) is None and gw.lapses == 2
    last = [r.message for r in caplog.records if r.message.startswith("canary lapsed")][-1]
    assert re.search(r"gate g1 \(h pid 1\), is 3\.\d s old \(lease 3 s\)", last), last
    v = reg.get("v1")
    assert v.status == "canary" and v.gate["canary"]["share"] == SHARE  # the gateway writes nothing
    assert all(a.actor == "gate" for a in reg.audit("v1")[1:])

    reg.transition("v1", "awaiting_approval", "gate", "canary passed")
    assert gw.canary(fresh=True) is None and gw.lapses == 2
    assert caplog.records[-1].message.startswith("canary lapse over: v1 is no longer in canary")


# -- a real gate, killed mid-canary -----------------------------------------------------------------


@pytest.mark.slow
def test_a_killed_gate_lapses_its_canary_within_the_lease_and_a_restarted_gate_resumes_it(tmp_path, tiny_checkpoint):
    beat_s = 0.5
    db = f"sqlite:///{tmp_path / 'registry.db'}"
    reg = Registry(db)
    setup(reg, "v1")
    bus = bus_at(tmp_path)  # made here first: the gates open it with the same partitions
    gw = gateway(reg)
    argv = [sys.executable, "-m", "tests.gating.gate_child", str(tmp_path), db, str(tiny_checkpoint), str(beat_s)]
    sup = Supervisor("gate-lease-test")
    try:
        first = sup.start("gate-1", argv, log_path=tmp_path / "gate-1.log")
        wait_until(lambda: gw.canary() == Canary("v1", SHARE), 60, what="gate 1's canary routed", check=sup.check)
        assert reg.gate_lease().pid == first.pid
        candidates = routed(gw, USERS)
        assert 150 <= len(candidates) <= 250
        progress = reg.get("v1").gate["canary"]

        first.proc.kill()  # SIGKILL: no finally runs, the lease is not released
        killed_at = time.monotonic()
        first.proc.wait()
        sup.stop_child("gate-1")
        wait_until(lambda: gw.canary() is None, 10, what="the canary to lapse", interval_s=0.02)
        lapse_s = time.monotonic() - killed_at
        print(f"canary lapsed {lapse_s:.2f} s after the SIGKILL (lease {LAPSE_AFTER * beat_s:g} s, "
              f"cache {CANARY_TTL_S:g} s)")  # fmt: skip
        assert lapse_s <= LAPSE_AFTER * beat_s + CANARY_TTL_S + 0.5
        new_users = [f"new-{i}" for i in range(400)]
        assert routed(gw, new_users) == set() and routed(gw, USERS) == set() and gw.lapses == 1
        v = reg.get("v1")
        assert v.status == "canary" and v.gate["canary"] == progress  # nothing written meanwhile

        second = sup.start("gate-2", argv, log_path=tmp_path / "gate-2.log")
        wait_until(lambda: gw.canary() == Canary("v1", SHARE), 60, what="gate 2's canary routed", check=sup.check)
        assert reg.gate_lease().pid == second.pid
        assert routed(gw, USERS) == candidates  # the same users as before: sticky, at the stored share
        publish_traffic(bus, SHARE, cand_reward=1.0)  # the users' samples: the canary goes on where it was
        wait_until(lambda: reg.get("v1").status == "awaiting_approval", 30, what="gate 2 ending the canary",
                   check=sup.check)  # fmt: skip
        done = reg.get("v1").gate["canary"]
        assert done["started_at"] == progress["started_at"] and done["step"] == progress["step"] == 0
        last = reg.audit("v1")[-1]
        assert last.actor == "gate" and last.details["users"] == {"candidate": 40, "incumbent": 40}
    finally:
        sup.stop()
        bus.close()
        reg.close()
