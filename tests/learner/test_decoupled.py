"""The decoupled-PPO update on real served completions: the proximal clip binds from the second pass on,
the behaviour correction and its mask are the proximal policy's, sequences without routing are trained
apart and counted, tokens the trainer's top-p cuts are masked and counted."""

import dataclasses

import numpy as np
import pytest
import torch

from learner.replay import make_batch, trainer_logprobs
from learner.samples import sequence_from_sample
from learner.trainer import Trainer, TrainerConfig
from serving.checkpoint import load_checkpoint
from serving.tokenizer import Tokenizer
from tests.conftest import F32_EPS, approx_ulps, served_samples


@pytest.fixture(scope="module")
def served(tiny_checkpoint):
    events = served_samples(tiny_checkpoint, [1.0, -0.5, 0.25, 0.0, 0.5, -1.0])
    tok = Tokenizer.from_file(tiny_checkpoint)
    return [sequence_from_sample(ev) for ev in events], tok.vocab_size, tok.pad_id


def make(ckpt, served, **cfg) -> Trainer:
    _, n_vocab, pad = served
    return Trainer(load_checkpoint(ckpt), TrainerConfig(**cfg), n_vocab, pad)


def test_the_proximal_clip_binds_on_the_second_pass_not_the_first(tiny_checkpoint, served):
    seqs = served[0]
    assert TrainerConfig().steps_per_update == 2  # the default
    stats = make(tiny_checkpoint, served, lr=3e-2, steps_per_update=2).update(seqs).stats
    # Pass 1: θ is the proximal policy, r ≡ 1, nothing to clip. Pass 2: the first step moved θ far
    # enough (lr 3e-2) that the clip on π_θ/π_prox holds some tokens.
    assert stats["clip_frac_step1"] == 0.0 and stats["clip_frac_step2"] > 0.05
    assert stats["policy_ratio_max"] > 1.2  # the largest π_θ/π_prox seen: in pass 2
    # Served by these weights, bit for bit: the behaviour ratio π_prox/μ is 1, nothing masked or truncated.
    assert stats["ratio_max"] == 1.0 and stats["masked_tokens"] == 0.0 and stats["truncated_tokens"] == 0.0
    one = make(tiny_checkpoint, served, lr=3e-2, steps_per_update=1).update(seqs).stats
    assert one["clip_frac"] == 0.0 and "clip_frac_step2" not in one


def test_stale_samples_are_corrected_by_the_proximal_policy_not_the_current_one(tiny_checkpoint, served):
    seqs = served[0]
    trainer = make(tiny_checkpoint, served, lr=3e-2, steps_per_update=3)
    trainer.update(seqs)  # the weights moved: the served log-probs are now stale
    args, (_, n_vocab, pad) = trainer.model.args, served
    batch = make_batch(seqs, pad, args.n_layers, args.top_k)
    with torch.no_grad():
        prox, _ = trainer_logprobs(trainer.model, batch, n_vocab)  # the weights at the start of update 2
    log_rho = (prox - batch.behaviour_BT) * batch.mask_BT
    stats = trainer.update(seqs).stats
    m = batch.mask_BT
    # Every pass of update 2 reports the same behaviour ratio: π_prox/μ, taken before its first step.
    # float32 statistics over a few hundred tokens, summed in another order here: within 128 float32 ulps
    mean = float(log_rho.abs().sum() / m.sum())
    assert stats["abs_log_ratio_mean"] == approx_ulps(mean, ulps=128, eps=F32_EPS)
    assert stats["ratio_max"] == approx_ulps(
        float(log_rho.masked_fill(m == 0, -1e9).max().exp()), ulps=128, eps=F32_EPS
    )
    assert stats["ratio_max"] > 1.0 and stats["abs_log_ratio_mean"] > 0.01
    n = stats["tokens"]
    # a count, recovered from its float32 share: the share's rounding (n × 1 ulp) is far below 1e-3
    assert stats["masked_tokens"] == pytest.approx(stats["masked_frac"] * n, abs=1e-3)
    assert stats["truncated_tokens"] <= n and stats["masked_tokens"] <= n


def test_sequences_without_routing_are_trained_apart_and_counted(tiny_checkpoint, served):
    seqs, n_vocab, pad = served
    bare = dataclasses.replace(seqs[2], routed_experts=np.zeros((0, *seqs[2].routed_experts.shape[1:]), np.uint8))
    mixed = seqs[:2] + [bare] + seqs[3:]
    stats = make(tiny_checkpoint, served, lr=1e-3).update(mixed).stats
    # Five sequences replayed in one micro-batch, the bare one alone without replay.
    assert stats["missing_routing_sequences"] == 1.0 and stats["replay_off_micro_batches"] == 1.0
    full = make(tiny_checkpoint, served, lr=1e-3).update(seqs).stats
    assert full["missing_routing_sequences"] == 0.0 and full["replay_off_micro_batches"] == 0.0
    assert stats["samples"] == full["samples"] == 6.0


def test_tokens_the_trainers_top_p_cuts_are_masked_and_counted(tiny_checkpoint, served):
    seqs = served[0]
    # Served at top-p 1; re-scored as if served at top-p 0.05, most sampled tokens fall outside the
    # trainer's nucleus: -inf under the sampling transform, masked, counted.
    narrow = [dataclasses.replace(s, top_p=0.05) for s in seqs]
    stats = make(tiny_checkpoint, served, lr=1e-3).update(narrow).stats
    assert stats["masked_top_p_tokens"] > 0 and stats["masked_tokens"] >= stats["masked_top_p_tokens"]
    assert make(tiny_checkpoint, served, lr=1e-3).update(seqs).stats["masked_top_p_tokens"] == 0.0
