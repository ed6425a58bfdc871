"""The gate's anchor against creep and its sample cache (`gating.gate.Gate._anchor`, `gating.sample_cache`).

- The anchor is the best version promoted so far on the suite (by the pass rates its offline verdicts
  recorded); a candidate must be non-inferior to it as well as to the incumbent.
- A version is sampled on a suite once: its completions are read back, identical, at the next cycle.
- Creep, simulated on the demo base's measured per-prompt pass rates (bench/results/gate_sim_offline.json,
  the default suite: 504 prompts, G 8, margin 3 points): every candidate is 2 points worse than its parent
  (each prompt's rate scaled down), 20 candidates in a row, each version's per-prompt scores drawn once
  (as the cache keeps them). With the anchor, runs that end more than one margin below the anchor are
  at most α (about 2% measured); without it (the control) they are several times as many.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import numpy as np

from bench.common import binomial_ceiling
from gating.gate import Gate, GateConfig
from gating.stats import DEFAULT_ALPHA, DEFAULT_MARGIN, paired_t_non_inferiority
from registry.models import Status
from serving.engine import EmbeddedEngine
from tests.gating.test_evals import SUITE, Rewrite
from tests.gating.test_gate import files, folders, reg, setup  # noqa: F401  (reg is a fixture)

CFG = GateConfig(G=2, max_tokens=8, seed=3, n_resamples=200, poll_s=0.05, nice=0)
MEASURED = Path(__file__).resolve().parents[2] / "bench" / "results" / "gate_sim_offline.json"


def promote(reg, vid: str, parent: str, rate: float, parent_rate: float, cfg: GateConfig = CFG) -> None:
    """`vid` through evaluating, canary and approval, with an offline verdict recording these pass rates."""
    reg.register(version_id=vid, parent_id=parent, files=files(vid))
    reg.transition(vid, Status.evaluating, "gate", "test")
    sampling = {"G": cfg.G, "seed": cfg.seed, "max_tokens": cfg.max_tokens, "temperature": cfg.temperature}
    verdict = {
        "passed": True,
        "incumbent_id": parent,
        "artifact_sha256": reg.get(vid).artifact_sha256,
        "suite_version": SUITE.suite_version,
        "numbers": {"reward": {"candidate": rate, "incumbent": parent_rate}, "sampling": sampling},
    }
    reg.record_gate(vid, "offline", verdict, "gate", "test verdict")
    reg.transition(vid, Status.canary, "gate", "test")
    reg.transition(vid, Status.awaiting_approval, "gate", "test")
    reg.approve(vid, "key:test", "test")


def test_the_anchor_is_the_best_version_promoted_so_far(reg, tiny_checkpoint):
    setup(reg)
    promote(reg, "v1", "base", 0.60, 0.50)
    promote(reg, "v2", "v1", 0.58, 0.60)  # within the margin of v1: promoted, but below it
    gate = Gate(reg, lambda: EmbeddedEngine(max_batch=64, max_model_len=128), folders(tiny_checkpoint), SUITE, CFG)
    assert gate._anchor(reg.incumbent()).id == "v1"
    assert Gate(reg, None, None, SUITE, CFG.model_copy(update={"anchor": False}))._anchor(reg.incumbent()) is None
    promote(reg, "v3", "v2", 0.65, 0.58)
    assert gate._anchor(reg.incumbent()) is None  # the incumbent is the best: nothing more to check
    other = CFG.model_copy(update={"G": 4})
    assert Gate(reg, None, None, SUITE, other)._anchor(reg.get("v2")) is None  # other settings: no rates known


def test_a_candidate_worse_than_the_anchor_is_rejected(reg, tiny_checkpoint):
    setup(reg)
    promote(reg, "v1", "base", 0.9, 0.5)
    promote(reg, "v2", "v1", 0.88, 0.9)
    reg.register(version_id="v3", parent_id="v2", files=files("v3"))
    good = ("v1", lambda c, family, i: dataclasses.replace(c, text="GOOD"))  # the anchor scores 1, others 0.5

    def make():
        return Rewrite(EmbeddedEngine(max_batch=64, max_model_len=128), *good)

    step = Gate(reg, make, folders(tiny_checkpoint), SUITE, CFG).step()
    n = reg.get("v3").gate["offline"]["numbers"]
    assert step.action == "rejected" and n["failed"] == ["anchor"], n["failed"]
    assert n["checks"]["non_inferiority"] and n["anchor"]["id"] == "v1" and n["anchor"]["pass_rate"] == 1.0
    assert n["anchor"]["mean_diff"] == -0.5 and "vs anchor v1" in step.detail


class Counting:
    def __init__(self, engine, calls):
        self.engine, self.calls = engine, calls

    def __getattr__(self, name):
        return getattr(self.engine, name)

    def generate(self, prompt_ids, params, version=None):
        self.calls.append(version)
        return self.engine.generate(prompt_ids, params, version)


def test_a_version_is_sampled_once_on_a_suite(reg, tiny_checkpoint, tmp_path):
    setup(reg, "v1", "v2")
    calls: list[str] = []
    cfg = CFG.model_copy(update={"sample_cache_dir": tmp_path / "samples"})
    gate = Gate(
        reg,
        lambda: Counting(EmbeddedEngine(max_batch=64, max_model_len=128), calls),
        folders(tiny_checkpoint),
        SUITE,
        cfg,
    )
    assert gate.step().action == "passed" and sorted(calls) == ["base", "v1"]
    first = reg.get("v1").gate["offline"]["numbers"]
    reg.transition("v1", Status.aborted, "test", "make room for v2")
    calls.clear()
    assert gate.step().version_id == "v2" and calls == ["v2"]  # the incumbent's samples are read back
    second = reg.get("v2").gate["offline"]["numbers"]
    assert second["sampling"]["from_cache"] == ["base"] and first["sampling"]["from_cache"] == []
    assert second["per_prompt"]["incumbent"] == first["per_prompt"]["incumbent"]
    assert second["examples"] == first["examples"]  # same model, same seeds: the same texts side by side
    assert (gate.versions_sampled, gate.versions_from_cache) == (3, 1)
    for entry in (tmp_path / "samples").iterdir():  # a damaged entry is a miss, sampled afresh
        entry.write_text("{not json")
    reg.transition("v2", Status.aborted, "test", "again")
    reg.register(version_id="v3", parent_id="base", files=files("v3"))
    calls.clear()
    assert gate.step().version_id == "v3" and sorted(calls) == ["base", "v3"]


def _creep(reps: int, anchored: bool, seed: int, candidates: int = 20, step: float = 0.02) -> np.ndarray:
    """Per replicate: how far the final incumbent's true pass rate ends below the anchor's."""
    rates = np.asarray(json.loads(MEASURED.read_text())["measured"]["per_prompt_pass_rate"][:504])
    rng, G, gaps = np.random.default_rng(seed), GateConfig().G, []
    for _ in range(reps):
        true, seen, promoted, inc = [rates], [rng.binomial(G, rates) / G], [0], 0
        for _ in range(candidates):
            p = true[inc]
            true.append(np.clip(p * (1 - step / p.mean()), 0, 1))
            seen.append(rng.binomial(G, true[-1]) / G)
            ok = paired_t_non_inferiority(seen[-1], seen[inc], DEFAULT_MARGIN).passed
            best = max(promoted, key=lambda i: (seen[i].mean(), -i))
            if anchored and best != inc:
                ok = ok and paired_t_non_inferiority(seen[-1], seen[best], DEFAULT_MARGIN).passed
            if ok:
                promoted.append(len(true) - 1)
                inc = len(true) - 1
        best = max(promoted, key=lambda i: (seen[i].mean(), -i))
        gaps.append(true[best].mean() - true[inc].mean())
    return np.asarray(gaps)


def test_the_anchor_bounds_creep():
    reps = 200
    anchored = _creep(reps, True, seed=5)
    control = _creep(reps, False, seed=5)
    slid = int((anchored > DEFAULT_MARGIN + 1e-9).sum())
    slid_control = int((control > DEFAULT_MARGIN + 1e-9).sum())
    assert slid < binomial_ceiling(reps, DEFAULT_ALPHA), slid
    assert slid_control > 2 * slid + 10, (slid_control, slid)  # the control slides: the check has teeth
    assert anchored.max() <= 2 * DEFAULT_MARGIN


def test_an_idle_gate_samples_the_incumbent_ahead_of_its_candidates(reg, tiny_checkpoint, tmp_path):
    setup(reg)
    calls: list[str] = []
    cfg = CFG.model_copy(update={"sample_cache_dir": tmp_path / "samples"})
    make = lambda: Counting(EmbeddedEngine(max_batch=64, max_model_len=128), calls)  # noqa: E731
    gate = Gate(reg, make, folders(tiny_checkpoint), SUITE, cfg)
    step = gate.step()
    assert (step.action, step.detail, calls) == ("idle", "incumbent sampled", ["base"])
    assert gate.step().detail == "" and calls == ["base"]  # once per incumbent
    reg.register(version_id="v1", parent_id="base", files=files("v1"))
    assert gate.step().action == "passed" and calls == ["base", "v1"]
    assert reg.get("v1").gate["offline"]["numbers"]["sampling"]["from_cache"] == ["base"]
