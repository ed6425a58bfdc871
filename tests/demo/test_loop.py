"""The whole online-RL loop on the demo product: served completions, simulated users' feedback, the
joiner's rewards, policy-gradient updates with router replay — held-out satisfaction goes up."""

import pytest

from demo.loop import DemoLoopConfig, run_demo_loop
from learner.trainer import TrainerConfig

pytestmark = pytest.mark.slow


def test_feedback_raises_held_out_satisfaction(small_trained_checkpoint, tmp_path):
    small_base = small_trained_checkpoint
    cfg = DemoLoopConfig(
        rounds=10, samples_per_round=128, eval_tasks=256, eval_every=10, trainer=TrainerConfig(lr=3e-4)
    )
    report = run_demo_loop(small_base, cfg, tmp_path / "report.json")
    base, final = report["base"], report["final"]
    assert final["satisfaction"] > base["satisfaction"] + 0.05, (base, final)
    assert final["pass_rate"] > base["pass_rate"], (base, final)
    rounds = [h for h in report["history"] if h["round"] > 0]
    assert all(h["samples"] == 128 for h in rounds)  # every served completion was joined and trained on
    # Router replay at the behaviour version, batch-invariant numerics in the engine and the trainer (the
    # defaults): the trainer reproduces the served log-probs bit for bit.
    assert max(h["abs_dlogp_max"] for h in rounds) == 0.0
    assert report["joiner"]["late"] == 0 and report["joiner"]["samples"] == 10 * 128
    assert (tmp_path / "report.json").is_file()
