"""The trainer's update on real served completions: a non-finite update changes nothing, the KL term
needs and uses its reference, and the entropy it logs is the sampling distribution's."""

import copy
import dataclasses

import pytest
import torch

from learner.objective import LossConfig
from learner.replay import make_batch, sampling_distribution
from learner.samples import sequence_from_sample
from learner.trainer import NonFiniteUpdate, Trainer, TrainerConfig
from serving.checkpoint import load_checkpoint
from serving.tokenizer import Tokenizer
from tests.conftest import F32_EPS, served_samples


@pytest.fixture(scope="module")
def served(tiny_checkpoint):
    events = served_samples(tiny_checkpoint, [1.0, -0.5, 0.25, 0.0, 0.5, -1.0])
    tok = Tokenizer.from_file(tiny_checkpoint)
    return [sequence_from_sample(ev) for ev in events], tok.vocab_size, tok.pad_id


def make(ckpt, served, reference=None, **cfg):
    _, n_vocab, pad = served
    return Trainer(load_checkpoint(ckpt), TrainerConfig(lr=1e-2, **cfg), n_vocab, pad, reference=reference)


def state_of(trainer):
    return (
        {k: v.clone() for k, v in trainer.model.state_dict().items()},
        copy.deepcopy(trainer.opt.state_dict()),
        trainer.baseline.state_dict(),
        trainer.updates,
    )


def assert_same_state(a, b):
    params_a, opt_a, base_a, n_a = a
    params_b, opt_b, base_b, n_b = b
    assert params_a.keys() == params_b.keys() and all(torch.equal(params_a[k], params_b[k]) for k in params_a)
    assert opt_a["param_groups"] == opt_b["param_groups"] and opt_a["state"].keys() == opt_b["state"].keys()
    for i, st in opt_a["state"].items():
        assert st.keys() == opt_b["state"][i].keys()
        assert all(torch.equal(torch.as_tensor(st[k]), torch.as_tensor(opt_b["state"][i][k])) for k in st)
    assert base_a == base_b and n_a == n_b


@pytest.mark.parametrize("steps", [1, 2])
def test_a_non_finite_update_changes_nothing(tiny_checkpoint, served, steps):
    seqs = served[0]
    trainer = make(tiny_checkpoint, served, steps_per_update=steps)
    trainer.update(seqs[:3])  # the optimizer has state, the baseline has seen rewards
    before = state_of(trainer)
    # A reward of 3e38 is a finite float, but its advantage times a log-prob overflows float32.
    poisoned = [dataclasses.replace(s, reward=3e38) if i == 1 else s for i, s in enumerate(seqs[3:])]
    with pytest.raises(NonFiniteUpdate, match="step 1: nothing was changed"):
        trainer.update(poisoned)
    assert_same_state(state_of(trainer), before)
    assert all(p.grad is None for p in trainer.model.parameters())
    trainer.update(seqs[3:])  # and the next batch trains as if the poisoned one had never come
    assert trainer.updates == 2


def test_a_later_step_that_is_not_finite_restores_the_first(tiny_checkpoint, served):
    seqs = served[0]
    trainer = make(tiny_checkpoint, served, steps_per_update=2)
    trainer.update(seqs[:3])
    before = state_of(trainer)
    for group in trainer.opt.param_groups:  # the first step (finite) throws the weights to ~1e36
        group["lr"] = 1e36
    before[1]["param_groups"][0]["lr"] = 1e36
    with pytest.raises(NonFiniteUpdate, match="step 2: nothing was changed"):
        trainer.update(seqs[3:])
    assert_same_state(state_of(trainer), before)


def test_kl_needs_a_reference_and_uses_it(tiny_checkpoint, served):
    seqs = served[0]
    kl = {"loss": LossConfig(kl_coef=0.5)}
    with pytest.raises(ValueError, match="kl_coef"):
        make(tiny_checkpoint, served, **kl)
    plain = make(tiny_checkpoint, served, steps_per_update=1)  # one step: θ is the reference throughout it
    same = make(tiny_checkpoint, served, reference=load_checkpoint(tiny_checkpoint), steps_per_update=1, **kl)
    # Reference = policy (and the same replayed routing): k3 is 0 with zero gradient, so the update is the plain one.
    s_plain, s_same = plain.update(seqs).stats, same.update(seqs).stats
    assert s_same["kl_k3"] == 0.0 and s_same["loss"] == s_plain["loss"]
    assert all(torch.equal(a, b) for a, b in zip(plain.model.parameters(), same.model.parameters()))
    # Now the policy moved away from its reference (the base): the KL is positive and changes the update.
    s_moved = same.update(seqs).stats
    s_plain = plain.update(seqs).stats
    assert s_moved["kl_k3"] > 0 and s_moved["loss"] > s_plain["loss"]
    assert all(not p.requires_grad for p in same.reference.parameters())


def test_the_exact_kl_estimator_in_an_update(tiny_checkpoint, served):
    seqs = served[0]
    kl = {"loss": LossConfig(kl_coef=0.5, kl_estimator="exact")}
    plain = make(tiny_checkpoint, served, steps_per_update=1)
    same = make(tiny_checkpoint, served, reference=load_checkpoint(tiny_checkpoint), steps_per_update=1, **kl)
    s_plain, s_same = plain.update(seqs).stats, same.update(seqs).stats  # reference = policy: KL 0, no pull
    assert s_same["kl_exact"] == 0.0 and s_same["loss"] == s_plain["loss"]
    assert all(torch.equal(a, b) for a, b in zip(plain.model.parameters(), same.model.parameters()))
    s_moved, s_plain = same.update(seqs).stats, plain.update(seqs).stats
    assert s_moved["kl_exact"] > 0 and s_moved["loss"] > s_plain["loss"]
    assert s_moved["kl_k3"] > 0  # the sampled estimate is still logged beside it


def test_entropy_and_sampled_logprob_are_the_sampling_distributions(tiny_checkpoint, served):
    seqs, n_vocab, pad = served
    trainer = make(tiny_checkpoint, served, steps_per_update=1)  # the statistics of one pass, before its step
    model = load_checkpoint(tiny_checkpoint)  # an independent computation, before the update
    args = model.args
    batch = make_batch(seqs, pad, args.n_layers, args.top_k)
    with torch.no_grad():
        logp_BTV, _ = sampling_distribution(model, batch, n_vocab)
        # Categorical over the sampling transform's probabilities (temperature 1, top-p 1 here: a plain softmax).
        ent_BT = torch.distributions.Categorical(logits=logp_BTV).entropy()
        chosen = logp_BTV.gather(-1, batch.targets_BT[..., None]).squeeze(-1)
    m = batch.mask_BT
    stats = trainer.update(seqs).stats
    # "sequence" normalisation weighs the one micro-batch's stats by its share (1): plain token means.
    # The trainer's means of the same float32 terms, summed maybe in another order (equal here).
    assert stats["entropy"] == pytest.approx(float((ent_BT * m).sum() / m.sum()), rel=8 * F32_EPS)
    assert stats["logp_mean"] == pytest.approx(float((chosen * m).sum() / m.sum()), rel=8 * F32_EPS)
    # Served by this model, batch-invariant numerics on both sides: the same log-probs, bit for bit.
    assert stats["logp_mean"] == stats["behaviour_logp_mean"]
