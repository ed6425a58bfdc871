"""Data-parallel learner: 2 gloo processes give the same update as one process on the same batch.

Real torch.distributed (gloo, CPU, `torch.multiprocessing.spawn`), real served completions from the
tiny checkpoint. The comparison covers the parameters after the update, the all-reduced gradients,
the combined loss and grad norm, and the running baseline.
"""

import pytest
import torch

from learner.distributed import shard_indices, spawn_update
from learner.objective import LossConfig, RunningBaseline
from learner.replay import Sequence
from learner.trainer import Trainer, TrainerConfig
from serving.checkpoint import load_checkpoint
from serving.engine import EmbeddedEngine
from serving.sampling import SamplingParams

TEXTS = ["# add 3 to x\ndef f(x):\n", "# count 'a' in s\ndef f(s):\n", "def", "# max of xs, or 2 if empty\n"]
LR = 1e-3
EPS = 1e-8  # AdamW's default
ULP = torch.finfo(torch.float32).eps  # one float32 ulp at 1.0 (the model trains in float32)
# Gradients, the loss and the grad norm: one process sums every token's term in one order, two ranks
# sum their shards and then all-reduce, so the float32 sums are rounded in another order: a few ulps
# of the largest term (3 seen), held to 64 ulps of it.
GRAD_RTOL = 64 * ULP  # of the largest gradient entry
LOSS_ATOL = 64 * ULP  # the loss's terms (ratio times advantage) are of size ~1, whatever their sum is
# Parameters: the largest weights are the norm gains at 1 +- LR after the step, where one ulp is ULP.
# Both runs round p - update once, from updates that differ in their last bits: 1 ulp apart (seen), 2
# allowed, as AdamW's decoupled weight decay rounds p once more.
PARAM_ATOL = 2 * ULP
# AdamW's first step moves a parameter by LR * g / (|g| + eps): about LR where |g| >> eps = 1e-8, but
# an entry whose gradient is ~1e-10 in one run and 0 in the other moves by ~1e-5 vs 0. The step is
# (1/eps)-Lipschitz in g, so every entry is held to |A - B| <= LR * |gA - gB| / eps + PARAM_ATOL, and
# entries with |g| > 100 eps (all but a few eps-level ones) to PARAM_ATOL outright.


@pytest.fixture(scope="module")
def served(tiny_checkpoint):
    eng = EmbeddedEngine(max_batch=8, max_model_len=128)
    try:
        eng.add_version("v1", tiny_checkpoint)
        tok = eng.tokenizer()
        params = [
            SamplingParams(temperature=1.0, max_tokens=6 + 2 * i, seed=i)
            if i % 2
            else SamplingParams(temperature=0.7, top_p=0.9, max_tokens=20 - i, seed=i)
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
            reward=[1.0, 0.0, 0.5, -1.0][i % 4] + 0.1 * i,
            key="ab"[i % 2],
        )
        for i, c in enumerate(outs)
    ]
    # A baseline that has seen rewards before: advantages are not just the rewards.
    baseline = RunningBaseline(0.9, min_count=2)
    for r, k in [(0.2, "a"), (0.4, "a"), (-0.3, "b"), (0.9, "b"), (0.1, None)]:
        baseline.update(r, k)
    return seqs, tok.vocab_size, tok.pad_id, baseline.state_dict()


def one_process(ckpt, seqs, cfg, n_vocab, pad, baseline_state):
    model = load_checkpoint(ckpt)
    trainer = Trainer(model, cfg, n_vocab, pad)
    if baseline_state is not None:
        trainer.baseline = RunningBaseline.from_state_dict(baseline_state)
    stats = trainer.update(seqs).stats
    assert trainer.opt.defaults["eps"] == EPS
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}
    return model.state_dict(), grads, stats, trainer.baseline.state_dict()


def max_diff(a: dict, b: dict) -> float:
    assert a.keys() == b.keys()
    return max(float((a[k] - b[k]).abs().max()) for k in a)


def check_same_update(ckpt, seqs, cfg, n_vocab, pad, baseline_state):
    init = load_checkpoint(ckpt).state_dict()
    sd_a, grads_a, stats_a, base_a = one_process(ckpt, seqs, cfg, n_vocab, pad, baseline_state)
    res = spawn_update(
        2, load_checkpoint(ckpt), seqs, cfg, n_vocab, pad, baseline_state=baseline_state, timeout_s=60
    )  # a rank stuck in a collective fails the test instead of hanging it
    sd_b = res.state_dict
    # Every rank ends with the very same parameters, baseline and statistics.
    for r in res.ranks[1:]:
        assert all(torch.equal(sd_b[k], r.state_dict[k]) for k in sd_b)
        assert r.baseline == res.ranks[0].baseline and r.stats == res.stats
    # The update is non-trivial: most tensors moved by about LR, thousands of times the tolerance.
    moved = {k: float((sd_a[k] - init[k]).abs().max()) for k in sd_a}
    assert sorted(moved.values())[len(moved) // 2] > 0.5 * LR, moved
    # The gradients (all-reduced, clipped: what AdamW saw) agree, as do the loss and the grad norm.
    grads_b = res.ranks[0].grads
    assert grads_a.keys() == grads_b.keys()
    gscale = max(float(g.abs().max()) for g in grads_a.values())
    assert max_diff(grads_a, grads_b) <= GRAD_RTOL * gscale
    # The parameters agree, entry by entry, within what float rounding and AdamW's eps allow.
    diff, diff_well = 0.0, 0.0
    for k in sd_a:
        gap = (sd_a[k] - sd_b[k]).abs()
        diff = max(diff, float(gap.max()))
        if k not in grads_a:  # no gradient in either run: untouched
            assert torch.equal(sd_a[k], init[k]) and torch.equal(sd_b[k], init[k]), k
            continue
        assert (gap <= LR * (grads_a[k] - grads_b[k]).abs() / EPS + PARAM_ATOL).all(), k
        well = grads_a[k].abs() > 100 * EPS
        diff_well = max(diff_well, float(gap[well].max()) if well.any() else 0.0)
    assert diff_well <= PARAM_ATOL
    assert res.stats["loss"] == pytest.approx(stats_a["loss"], rel=GRAD_RTOL, abs=LOSS_ATOL)
    assert res.stats["grad_norm"] == pytest.approx(stats_a["grad_norm"], rel=GRAD_RTOL)
    assert res.stats["samples"] == len(seqs) and res.stats["world_size"] == 2
    # The baseline learnt the whole batch on every rank, in the same order as one process.
    assert res.ranks[0].baseline == base_a
    print(
        f"max|A-B| {diff:.3g} (where |g| > 100 eps: {diff_well:.3g}), "
        f"max update {max(moved.values()):.3g}, "
        f"max|dgrad| {max_diff(grads_a, grads_b):.3g} of max|grad| {gscale:.3g}"
    )
    return diff, max(moved.values()), grads_a, res


@pytest.mark.slow  # two gloo ranks spawned, as below: seconds each
def test_two_ranks_equal_shards_match_one_process(served, tiny_checkpoint):
    seqs, n_vocab, pad, baseline = served
    # micro_batch 3: a rank's 4 sequences run as 3 + 1 (no_sync, then the all-reduce); gradients clipped.
    # One pass: the parameter bound below follows one AdamW step's gradient difference (a second pass
    # would start from parameters that already differ by rounding, and compound it).
    cfg = TrainerConfig(lr=LR, micro_batch=3, steps_per_update=1, loss=LossConfig(normalize="sequence"))
    check_same_update(tiny_checkpoint, seqs, cfg, n_vocab, pad, baseline)


@pytest.mark.slow
def test_two_ranks_unequal_shards_match_one_process(served, tiny_checkpoint):
    seqs, n_vocab, pad, baseline = served
    seqs = seqs[:7]  # shards of 4 and 3 sequences, and unequal token counts
    assert [len(shard_indices(7, 2, r)) for r in range(2)] == [4, 3]
    # Token normalisation, no clipping (the gradient is the raw one), micro-batches 3 + 1 vs 3.
    cfg = TrainerConfig(lr=LR, micro_batch=3, grad_clip=1e9, steps_per_update=1, loss=LossConfig(normalize="token"))
    _, _, grads_full, res = check_same_update(tiny_checkpoint, seqs, cfg, n_vocab, pad, baseline)
    # The check can tell: plain DDP (each rank's own token mean, averaged over ranks) is measurably off.
    halves = [
        one_process(tiny_checkpoint, [seqs[i] for i in shard_indices(7, 2, r)], cfg, n_vocab, pad, baseline)[1]
        for r in range(2)
    ]
    naive = {k: (halves[0].get(k, 0) + halves[1].get(k, 0)) / 2 for k in grads_full}
    gscale = max(float(g.abs().max()) for g in grads_full.values())
    assert max_diff(grads_full, res.ranks[0].grads) <= GRAD_RTOL * gscale
    assert max_diff(grads_full, naive) > 1e-2 * gscale  # 1% of the largest entry: a bias, not rounding


def test_shards_are_contiguous_and_cover_the_batch():
    assert [shard_indices(7, 3, r) for r in range(3)] == [[0, 1, 2], [3, 4], [5, 6]]
    assert [shard_indices(4, 2, r) for r in range(2)] == [[0, 1], [2, 3]]
    with pytest.raises(ValueError, match="at least one"):
        shard_indices(1, 2, 0)
    with pytest.raises(ValueError, match="outside"):
        shard_indices(4, 2, 2)


@pytest.mark.slow
def test_batch_smaller_than_the_ranks_is_trained_whole_by_every_rank(served, tiny_checkpoint):
    seqs, n_vocab, pad, baseline = served
    cfg = TrainerConfig(lr=LR, steps_per_update=1)
    sd_a, grads_a, stats_a, _ = one_process(tiny_checkpoint, seqs[:1], cfg, n_vocab, pad, baseline)
    res = spawn_update(
        2, load_checkpoint(tiny_checkpoint), seqs[:1], cfg, n_vocab, pad, baseline_state=baseline, timeout_s=60
    )
    assert all(torch.equal(res.state_dict[k], r.state_dict[k]) for r in res.ranks[1:] for k in res.state_dict)
    gscale = max(float(g.abs().max()) for g in grads_a.values())
    assert max_diff(grads_a, res.ranks[0].grads) <= GRAD_RTOL * gscale
    for k in sd_a:
        bound = LR * (grads_a[k] - res.ranks[0].grads[k]).abs() / EPS + PARAM_ATOL if k in grads_a else 0.0
        assert ((sd_a[k] - res.state_dict[k]).abs() <= bound).all(), k
    assert res.stats["samples"] == 1 and res.stats["world_size"] == 2
    assert res.stats["loss"] == pytest.approx(stats_a["loss"], rel=GRAD_RTOL, abs=LOSS_ATOL)
    with pytest.raises(ValueError, match="at least one"):
        spawn_update(2, load_checkpoint(tiny_checkpoint), [], cfg, n_vocab, pad)
