"""The per-family harm test (`gating.stats.family_regressions`, as `gating.evals.evaluate_offline` calls
it) simulated at the size the gate runs it: the default suite (`demo.suite.demo_suite()`, 28 prompts of
each of 18 families) at the gate's G 8 and margin, on the demo base's measured per-prompt pass rates
(bench/results/gate_sim_offline.json: 64 samples of each gate prompt).

Each replicate draws both versions' G outcomes per prompt independently (Binomial(G, p_i): a candidate
with other weights, no common random numbers, which is the harder case for both rates). Bounds are
checked with a one-in-a-million binomial tolerance (`bench.common`), so a failure means the test is wrong.
- equally good: some family flagged at most α = 5% of the time;
- one family whose incumbent passes at least 30% dropped by 25 points (p_i -> max(p_i - 0.25, 0)), the
  rest equal: that family flagged at least 80% of the time, for every such family.
- the control at 2 prompts per family (the CI demo's suite): a dropped family is seldom caught, which
  is why the default suite is stratified.
About 5 s here.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from bench.common import binomial_ceiling, binomial_floor
from demo.suite import GATE_PER_FAMILY, demo_suite
from gating.gate import GateConfig
from gating.stats import DEFAULT_ALPHA, family_regressions

MEASURED = Path(__file__).resolve().parents[2] / "bench" / "results" / "gate_sim_offline.json"
G = GateConfig().G
MARGIN = GateConfig().margin


def _pool() -> tuple[np.ndarray, list[str]]:
    rates = json.loads(MEASURED.read_text())["measured"]["per_prompt_pass_rate"]
    families = [it.family for it in demo_suite().items]
    assert len(rates) >= len(families)  # the measured 512-prompt list extends the 504-prompt suite
    return np.asarray(rates[: len(families)], dtype=np.float64), families


RATES, FAMILIES = _pool()


def _flagged(p_inc: np.ndarray, p_cand: np.ndarray, families: list[str], reps: int, seed: int) -> list[set[str]]:
    rng = np.random.default_rng(seed)
    inc = rng.binomial(G, p_inc, (reps, p_inc.size)) / G
    cand = rng.binomial(G, p_cand, (reps, p_cand.size)) / G
    out = []
    for j in range(reps):
        r = family_regressions(cand[j] - inc[j], families, MARGIN, DEFAULT_ALPHA)
        out.append({f for f, bad in r.regressed.items() if bad})
    return out


def test_the_default_suite_is_stratified():
    assert set(demo_suite().family_sizes.values()) == {GATE_PER_FAMILY} and GATE_PER_FAMILY >= 16


def test_an_equally_good_candidate_is_seldom_flagged():
    reps = 1000
    flagged = _flagged(RATES, RATES, FAMILIES, reps, seed=11)
    k = sum(bool(f) for f in flagged)
    assert k < binomial_ceiling(reps, DEFAULT_ALPHA), k


def test_a_family_dropped_by_25_points_is_caught():
    reps = 200
    eligible = sorted({f for f in FAMILIES if RATES[[i for i, x in enumerate(FAMILIES) if x == f]].mean() >= 0.3})
    assert len(eligible) >= 15  # the measured base passes >= 30% on most families
    floor = binomial_floor(reps, 0.8)
    for n, fam in enumerate(eligible):
        mask = np.array([x == fam for x in FAMILIES])
        worse = np.where(mask, np.maximum(RATES - 0.25, 0.0), RATES)
        caught = sum(fam in f for f in _flagged(RATES, worse, FAMILIES, reps, seed=100 + n))
        assert caught > floor, (fam, caught, reps)


@pytest.mark.parametrize("per_family", [2])
def test_two_prompts_per_family_have_no_such_power(per_family):
    reps = 200
    idx = [i for f in sorted(set(FAMILIES)) for i in [k for k, x in enumerate(FAMILIES) if x == f][:per_family]]
    rates, fams = RATES[idx], [FAMILIES[i] for i in idx]
    target = max(set(fams), key=lambda f: rates[[i for i, x in enumerate(fams) if x == f]].mean())
    worse = np.where(np.array([x == target for x in fams]), np.maximum(rates - 0.25, 0.0), rates)
    caught = sum(target in f for f in _flagged(rates, worse, fams, reps, seed=7))
    assert caught < reps // 2, caught
