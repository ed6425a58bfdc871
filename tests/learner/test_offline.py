"""GRPO-style offline groups mixed into the single-sample learner."""

import sys

import pytest

from demo.checker import DemoVerifier
from demo.split import sample_tasks
from learner.offline import rollout_groups
from learner.replay import Sequence
from learner.trainer import Trainer, TrainerConfig
from product.suites import Verifier
from serving.checkpoint import load_checkpoint
from serving.engine import EmbeddedEngine
from serving.sampling import SamplingParams

LR = 1e-3


@pytest.fixture(scope="module")
def engine(tiny_checkpoint):
    eng = EmbeddedEngine(max_batch=32, max_model_len=128)
    eng.add_version("v0", tiny_checkpoint)
    yield eng
    eng.shutdown()


class Parity:
    """A stand-in verifier the untrained test model can pass (its code never passes a test)."""

    def verify(self, prompts, completions):
        return [float(len(text) % 2) for text in completions]


def prompts(n, seed):
    return [t.prompt for t in sample_tasks(n, seed=seed)]


def test_groups_have_relative_advantages(engine):
    assert isinstance(Parity(), Verifier) and isinstance(DemoVerifier(), Verifier)
    batch = rollout_groups(engine, "v0", prompts(6, seed=1), Parity(), group_size=4, weight=0.5, temperature=1.5)
    assert batch.groups + batch.dropped_flat_groups == 6 and batch.groups >= 2
    assert len(batch.sequences) == 4 * batch.groups == len(batch.advantages)
    for g in range(batch.groups):
        adv = batch.advantages[4 * g : 4 * g + 4]
        assert abs(sum(adv)) <= 8 * sys.float_info.epsilon  # centred per group: four rounded float64 quotients < 2
    assert all(s.weight == 0.5 for s in batch.sequences)
    with pytest.raises(ValueError, match="group_size"):
        rollout_groups(engine, "v0", prompts(1, seed=1), Parity(), group_size=1)


def _online(engine, n=8):
    tok = engine.tokenizer("v0")
    outs = engine.generate(
        [tok.encode_prompt("# add 1 to x\ndef f(x):\n")] * n,
        [SamplingParams(max_tokens=8, seed=i) for i in range(n)],
        "v0",
    )
    return [
        Sequence(o.prompt_ids, o.output_ids, o.logprobs, o.routed_experts, 1.0, 1.0, reward=float(i % 2))
        for i, o in enumerate(outs)
    ]


def _grads_after(tiny_checkpoint, engine, seqs, advs):
    tok = engine.tokenizer("v0")
    model = load_checkpoint(tiny_checkpoint)
    # One pass: Adam's invariance to the loss's scale is checked on one step (a second one amplifies the
    # first's rounding in entries whose gradient is ~0).
    tr = Trainer(model, TrainerConfig(lr=LR, steps_per_update=1), tok.vocab_size, tok.pad_id)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    tr.update(seqs, group_advantages=advs)
    return {k: (model.state_dict()[k] - before[k]) for k in before}


def test_offline_mixing_weight(tiny_checkpoint, engine):
    online = _online(engine)
    offline = [
        Sequence(s.prompt_ids, s.output_ids, s.logprobs, s.routed_experts, 1.0, 1.0, reward=1.0, weight=0.0)
        for s in _online(engine, 4)
    ]
    only = _grads_after(tiny_checkpoint, engine, online, None)
    # weight 0: the offline samples contribute nothing (sequence normalisation over all sequences scales the
    # online part by 8/12; Adam's update is invariant to that scale up to epsilon)
    mixed0 = _grads_after(tiny_checkpoint, engine, online + offline, [None] * 8 + [1.0, -1.0, 1.0, -1.0])
    # (entries whose gradient is ~0 may flip Adam's first step, +-lr, under the different summation order)
    assert _changed(only, mixed0) < 1e-3, _changed(only, mixed0)
    weighted = [
        Sequence(s.prompt_ids, s.output_ids, s.logprobs, s.routed_experts, 1.0, 1.0, reward=1.0, weight=1.0)
        for s in offline
    ]
    mixed1 = _grads_after(tiny_checkpoint, engine, online + weighted, [None] * 8 + [1.0, -1.0, 1.0, -1.0])
    assert _changed(only, mixed1) > 0.05, _changed(only, mixed1)


def _changed(a: dict, b: dict) -> float:
    """The share of parameter entries whose update differs by more than a hundredth of a step: far above
    float32 rounding of an update of about LR (~1e-10), far below an update that changed (~LR)."""
    diff = sum(int((a[k] - b[k]).abs().gt(LR / 100).sum()) for k in a)
    return diff / sum(a[k].numel() for k in a)


@pytest.mark.slow
def test_verified_groups_on_a_trained_model(small_trained_checkpoint):
    eng = EmbeddedEngine(max_batch=64, max_model_len=256)
    try:
        eng.add_version("v0", small_trained_checkpoint)
        tasks = sample_tasks(16, seed=5)
        batch = rollout_groups(
            eng, "v0", [t.prompt for t in tasks], DemoVerifier(), group_size=8, keys=[t.family for t in tasks]
        )
    finally:
        eng.shutdown()
    assert 0.0 < batch.pass_rate < 1.0 and batch.groups > 0  # real pass/fail signal inside groups
    for g in range(batch.groups):
        rewards = [s.reward for s in batch.sequences[8 * g : 8 * g + 8]]
        adv = batch.advantages[8 * g : 8 * g + 8]
        assert all((a > 0) == (r == 1.0) for a, r in zip(adv, rewards))
