"""The soak benchmark's code (`bench/soak.py`) on a CI-sized run: a `flywheel serve` process on the
tiny checkpoint, 4 clients sending completions and their feedback for 15 seconds. Every request gets
200, both routes are exercised every second window, and the gateway's memory is sampled from its
process tree. The 10-minute run and its memory target are the benchmark's (docs/benchmarks.md)."""

from __future__ import annotations

import pytest

from bench import common
from bench.soak import gateway_env, growth, per_minute, soak, tree_rss_kb
from core.supervisor import Supervisor


@pytest.mark.slow
@pytest.mark.long  # about 25 s of load: `./scripts/test.sh -m long`
def test_a_short_soak_has_no_errors_and_samples_the_gateways_memory(tiny_checkpoint, tmp_path):
    home = tmp_path / "home"
    env = gateway_env(home) | {"FLYWHEEL_MODEL_DIR": str(tiny_checkpoint), "FLYWHEEL_MAX_MODEL_LEN": "128"}
    with Supervisor("test-soak") as sup:
        gw = common.gateway(home, env, sup)
        r = soak(gw.url, gw.child.pid, seconds=15.0, clients=4, warmup_s=5.0)
    assert r["errors"] == {}, r["errors"]
    assert r["requests"]["completions"] >= 20 and r["requests"]["feedback"] >= 20
    (minute,) = r["per_minute"]
    assert minute["completions"]["p99_ms"] >= minute["completions"]["p50_ms"] > 0
    assert len(r["rss_kib"]) >= 3 and all(kb > 10_000 for _, kb in r["rss_kib"])  # the gateway and its engines
    assert r["memory"]["max_kib"] >= r["memory"]["last_kib"] > 0


def test_the_figures_are_computed_as_documented():
    recs = [{"t": t, "route": "completions", "status": 200, "s": 0.01 * (1 + t % 3)} for t in range(120)]
    recs += [{"t": 70.0, "route": "feedback", "status": 503, "s": 0.5}]
    rows = per_minute(recs, 120.0)
    assert [r["completions"]["requests"] for r in rows] == [60, 60]
    assert rows[1]["feedback"] == {"requests": 1, "errors": 1, "p50_ms": None, "p99_ms": None}
    rss = [(0.0, 100), (30.0, 200), (65.0, 400), (90.0, 600), (130.0, 550)]
    g = growth(rss, warmup_s=60.0)  # the minute after warm-up averages 500; the last sample is 550
    assert g["warm_kib"] == 500 and abs(g["growth"] - 0.1) < 1e-12 and g["max_kib"] == 600
    assert tree_rss_kb(1 << 30) == 0  # no such process
