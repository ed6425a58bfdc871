"""Reward baselines keyed by the completion's context: the key from the event, one baseline per key
with the global fallback for rare and absent keys, advantages centred per batch and per key, and the
per-update count of keyed vs fallback samples."""

import logging
import math
import random

import pytest
import torch
from pydantic import ValidationError

from feedback.events import CompletionEvent, RoutedExperts, SampleEvent
from learner.baselines import baseline_key, usage
from learner.objective import RunningBaseline
from learner.samples import sequence_from_sample
from learner.trainer import Trainer, TrainerConfig, center_advantages
from serving.checkpoint import load_checkpoint
from tests.conftest import approx_ulps, served_samples

MEANS = {"easy": 0.8, "hard": 0.2}  # two task families whose users are satisfied at very different rates


def sample(reward: float, context: str | None, tenant: str = "t") -> SampleEvent:
    c = CompletionEvent(
        tenant=tenant,
        completion_id="c",
        model_version="v1",
        endpoint="completions",
        prompt_ids=[1],
        output_ids=[2],
        logprobs=[-0.1],
        routed_experts=RoutedExperts.from_bytes((1, 1, 1), b"\x00"),
        text="x",
        finish_reason="stop",
        params={},
        latency_ms={},
        context=context,
    )
    return SampleEvent(tenant=tenant, completion=c, reward=reward, signals=[], reward_spec="default-v1")


@pytest.fixture(scope="module")
def model_of(tiny_checkpoint):
    return lambda: load_checkpoint(tiny_checkpoint)


def trainer(model_of, **cfg) -> Trainer:
    return Trainer(model_of(), TrainerConfig(**cfg), None, 0)


def batches(rng: random.Random, n_batches: int, size: int, keyed: bool = True):
    """Batches of samples from both families, rewards Bernoulli at the family's mean: the policy is the
    same everywhere, only the family decides how likely a reward is."""
    for _ in range(n_batches):
        fams = [rng.choice(sorted(MEANS)) for _ in range(size)]
        evs = [sample(float(rng.random() < MEANS[f]), f if keyed else None) for f in fams]
        yield fams, [sequence_from_sample(ev) for ev in evs]


def per_family_advantage(t: Trainer, warmup: int, keyed: bool = True) -> tuple[dict[str, float], list[float]]:
    """Mean advantage per family after `warmup` batches, and the mean advantage of every later batch."""
    sums, counts, batch_means = dict.fromkeys(MEANS, 0.0), dict.fromkeys(MEANS, 0), []
    for b, (fams, seqs) in enumerate(batches(random.Random(7), warmup + 150, 32, keyed)):
        adv = t.batch_advantages(seqs).tolist()
        if b < warmup:
            continue
        batch_means.append(sum(adv) / len(adv))
        for f, a in zip(fams, adv):
            sums[f] += a
            counts[f] += 1
    return {f: sums[f] / counts[f] for f in MEANS}, batch_means


def test_the_key_is_tenant_and_context_and_survives_the_wire():
    ev = sample(1.0, "add")
    assert baseline_key(ev) == "t:add" and sequence_from_sample(ev).key == "t:add"
    assert baseline_key(sample(1.0, "add", tenant="u")) == "u:add"  # tenants never share a baseline
    assert baseline_key(sample(1.0, None)) is None and sequence_from_sample(sample(1.0, None)).key is None
    assert sequence_from_sample(ev, key="other").key == "other"
    # The bus carries model_dump_json bytes (embedded and Kafka alike): the key rides inside the sample.
    back = SampleEvent.model_validate_json(ev.model_dump_json().encode())
    assert back.completion.context == "add" and baseline_key(back) == "t:add"
    # Without a context the JSON is what it was before the field existed, and such JSON still parses.
    plain = sample(1.0, None)
    assert "context" not in plain.completion.model_dump_json() and "context" not in plain.model_dump_json()
    assert CompletionEvent.model_validate_json(plain.completion.model_dump_json()).context is None
    for bad in ["", "a" * 65, "has space", "t:x", "é"]:
        with pytest.raises(ValidationError, match="context"):
            sample(1.0, bad)


def test_the_mean_advantage_of_a_batch_is_zero_and_unbiased_per_key(model_of):
    keyed, batch_means = per_family_advantage(trainer(model_of), warmup=5)
    # Centred per batch: every batch's advantages sum to 0 (float32 advantages of size ~1, 32 of them).
    assert max(abs(m) for m in batch_means) < 1e-6
    # ...and per key unbiased over the run (Monte Carlo: 150 batches of ~16 samples per family, reward
    # std ~0.45: the mean's standard error is ~0.009).
    assert keyed["easy"] == pytest.approx(0.0, abs=0.03) and keyed["hard"] == pytest.approx(0.0, abs=0.03)
    # Without the centring the batch means are the rewards' noise around the baselines.
    _, raw_means = per_family_advantage(trainer(model_of, advantage_norm="none"), warmup=5)
    assert 0.01 < max(abs(m) for m in raw_means) < 0.3


def test_center_advantages_is_weighted_and_leaves_offline_samples_alone():
    adv = torch.tensor([1.0, 2.0, 4.0, 10.0], dtype=torch.float64)
    w = torch.tensor([1.0, 1.0, 2.0, 1.0], dtype=torch.float64)
    online = torch.tensor([True, True, True, False])
    m = (1 + 2 + 8) / 4  # weighted mean of the online ones
    assert center_advantages(adv, w, online, "center").tolist() == [1 - m, 2 - m, 4 - m, 10.0]
    sd = math.sqrt((1 * (1 - m) ** 2 + (2 - m) ** 2 + 2 * (4 - m) ** 2) / 4)
    scaled = center_advantages(adv, w, online, "center_scale", eps=0.0).tolist()
    # float64, a handful of operations in another order than written here: a few ulps
    assert scaled == approx_ulps([(1 - m) / sd, (2 - m) / sd, (4 - m) / sd, 10.0], ulps=8)
    assert center_advantages(adv, w, online, "none") is adv
    assert torch.equal(center_advantages(adv, w, torch.zeros(4, dtype=torch.bool), "center"), adv)


def test_keyed_baselines_are_unbiased_per_key_where_the_global_one_is_not(model_of):
    keyed, _ = per_family_advantage(trainer(model_of), warmup=5)
    assert keyed["easy"] == pytest.approx(0.0, abs=0.03) and keyed["hard"] == pytest.approx(0.0, abs=0.03)
    # The same traffic without keys: one baseline near 0.5, so "easy" completions look good and "hard"
    # ones bad by about ±0.3 although no completion is better than another of its family.
    unkeyed, batch_means = per_family_advantage(trainer(model_of), warmup=5, keyed=False)
    assert unkeyed["easy"] == pytest.approx(0.3, abs=0.05) and unkeyed["hard"] == pytest.approx(-0.3, abs=0.05)
    assert max(abs(m) for m in batch_means) < 1e-6  # centred per batch all the same


def test_rare_and_absent_keys_fall_back_to_the_global_baseline(model_of, caplog):
    t = trainer(model_of, baseline_min_count=20)
    common = [sequence_from_sample(sample(1.0, "common")) for _ in range(20)]
    t.advantages(common)  # 20 rewards of 1.0: "common" now has its own baseline
    t.advantages([sequence_from_sample(sample(0.0, "rare")) for _ in range(19)])  # 19 of 0.0: still rare
    t.advantages([sequence_from_sample(sample(0.5, None)) for _ in range(10)])
    g = t.baseline.value()
    assert 0.0 < g < 1.0 and t.baseline.value("t:common") == pytest.approx(1.0)
    probe = [sequence_from_sample(sample(1.0, c)) for c in ["common", "rare", None, "new"]]
    with caplog.at_level(logging.INFO, logger="learner.trainer"):
        adv = t.advantages(probe).tolist()
    assert adv == pytest.approx([0.0, 1.0 - g, 1.0 - g, 1.0 - g])
    assert t.baseline_usage == {
        "baseline_keyed": 1.0,
        "baseline_fallback": 3.0,
        "baseline_unkeyed": 1.0,
        "baseline_keys": 2.0,
    }
    assert "baselines: 1 samples keyed, 3 fallback (1 without a key); 2 keys tracked" in caplog.text
    # "rare" reached 20 rewards with the probe: from the next batch on it has its own baseline.
    assert t.baseline.keyed("t:rare") and usage(t.baseline, ["t:rare", None])["baseline_keyed"] == 1.0
    # Offline samples bring their own (group) advantages: the baselines neither serve nor count them.
    t.advantages(probe[:2], group_advantages=[0.7, None])
    assert t.baseline_usage["baseline_keyed"] + t.baseline_usage["baseline_fallback"] == 1.0


def test_the_tracked_keys_are_bounded():
    b = RunningBaseline(decay=0.9, min_count=1, max_keys=2)
    for k in ["a", "b", "c", "a"]:
        b.update(1.0 if k == "c" else 0.0, k)
    assert sorted(b.counts) == ["a", "b"] and not b.keyed("c") and b.value("c") == b.value()
    again = RunningBaseline.from_state_dict(b.state_dict())
    assert again.max_keys == 2 and again.counts == b.counts
    old = {k: v for k, v in b.state_dict().items() if k != "max_keys"}  # a state saved before the bound
    assert RunningBaseline.from_state_dict(old).max_keys == RunningBaseline.max_keys
    assert not RunningBaseline(min_count=0).keyed("never-seen")  # a key without a reward has no value


def test_an_update_reports_keyed_and_fallback_samples(tiny_checkpoint, model_of):
    events = served_samples(tiny_checkpoint, [1.0, 0.0, 1.0, 0.0])
    keyed = [ev.model_copy(update={"completion": ev.completion.model_copy(update={"context": "add"})}) for ev in events]
    t = trainer(model_of, baseline_min_count=2, lr=1e-3)
    t.update([sequence_from_sample(ev) for ev in keyed[:2]])
    stats = t.update([sequence_from_sample(ev) for ev in keyed[2:] + events[:1]]).stats
    assert (stats["baseline_keyed"], stats["baseline_fallback"], stats["baseline_unkeyed"]) == (2.0, 1.0, 1.0)
