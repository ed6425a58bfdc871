"""Router replay in the trainer: recomputed log-probs equal the served ones; routing is really replayed."""

import numpy as np
import pytest
import torch

from learner.replay import Sequence, make_batch, mismatch_stats, trainer_logprobs
from serving.checkpoint import load_checkpoint
from serving.engine import EmbeddedEngine
from serving.sampling import SamplingParams
from tests.conftest import F32_EPS

TEXTS = ["# add 3 to x\ndef f(x):\n", "# count 'a' in s\ndef f(s):\n", "def", "# max of xs, or 2 if empty\n"]


@pytest.fixture(scope="module")
def served(tiny_checkpoint):
    eng = EmbeddedEngine(max_batch=8, max_model_len=128)
    try:
        eng.add_version("v1", tiny_checkpoint)
        tok = eng.tokenizer()
        params = [
            SamplingParams(temperature=1.0, max_tokens=12, seed=i)
            if i % 2
            else SamplingParams(temperature=0.7, top_p=0.9, max_tokens=20, seed=i)
            for i in range(8)
        ]
        outs = eng.generate([tok.encode_prompt(TEXTS[i % 4]) for i in range(8)], params)
    finally:
        eng.shutdown()
    seqs = [
        Sequence(
            c.prompt_ids,
            c.output_ids,
            c.logprobs,
            c.routed_experts,
            c.params.temperature,
            c.params.top_p,
            reward=float(i % 2),
        )
        for i, c in enumerate(outs)
    ]
    return seqs, tok.vocab_size, tok.pad_id


def test_replayed_recompute_matches_serving_in_fp32(served, tiny_checkpoint):
    seqs, n_vocab, pad = served
    model = load_checkpoint(tiny_checkpoint)
    batch = make_batch(seqs, pad, model.args.n_layers, model.args.top_k)
    stats = mismatch_stats(model, batch, n_vocab)
    # Batch-invariant numerics on both sides: bit-identical, whatever the micro-batch.
    assert stats["abs_dlogp_max"] == 0.0, stats
    assert stats["routing_disagreement"] == 0.0  # same numerics: the router agrees with itself
    for size in (1, 3):
        for i in range(0, len(seqs), size):
            part = make_batch(seqs[i : i + size], pad, model.args.n_layers, model.args.top_k)
            assert mismatch_stats(model, part, n_vocab)["abs_dlogp_max"] == 0.0, (size, i)
    # The default kernels round differently in a decode step and a full forward, but only by float32 noise.
    scale = float((batch.behaviour_BT.abs() * batch.mask_BT).max())  # the largest served |logprob|
    default = mismatch_stats(model, batch, n_vocab, batch_invariant=False)["abs_dlogp_max"]
    assert default <= 16 * F32_EPS * scale, (default, scale)  # 1.25 ulps seen
    # bf16: the gap replay exists for
    bf = load_checkpoint(tiny_checkpoint).to(torch.bfloat16)
    stats_bf = mismatch_stats(bf, batch, n_vocab)
    assert stats_bf["abs_dlogp_mean"] > stats["abs_dlogp_mean"]


def test_replay_is_used(served, tiny_checkpoint):
    seqs, n_vocab, pad = served
    model = load_checkpoint(tiny_checkpoint)
    batch = make_batch(seqs, pad, model.args.n_layers, model.args.top_k)
    with torch.no_grad():
        lp, _ = trainer_logprobs(model, batch, n_vocab)
        shifted = make_batch(seqs, pad, model.args.n_layers, model.args.top_k)
        shifted.replay_BSLK = (shifted.replay_BSLK + 1) % model.args.n_experts
        lp2, _ = trainer_logprobs(model, shifted, n_vocab)
    scale = (lp.abs() * batch.mask_BT).max()
    assert ((lp2 - lp).abs() * batch.mask_BT).max() > 0.1 * scale  # other experts, not rounding: 4 times the scale seen


def test_gradient_flows_through_replayed_forward(served, tiny_checkpoint):
    seqs, n_vocab, pad = served
    model = load_checkpoint(tiny_checkpoint).train()
    batch = make_batch(seqs, pad, model.args.n_layers, model.args.top_k)
    lp, _ = trainer_logprobs(model, batch, n_vocab)
    (lp.sum()).backward()
    assert model.layers[0].block_sparse_moe.gate.weight.grad.abs().sum() > 0


def test_bad_sequences_refused():
    with pytest.raises(ValueError, match="greedy"):
        Sequence([1], [2], [0.0], np.zeros((1, 2, 2), np.uint8), 0.0, 1.0)
    with pytest.raises(ValueError, match="logprobs"):
        Sequence([1], [2, 3], [0.0], np.zeros((2, 2, 2), np.uint8), 1.0, 1.0)
    with pytest.raises(ValueError, match="empty"):
        make_batch([], 0, 2, 2)
