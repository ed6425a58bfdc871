"""The policy-gradient objective against numbers computed by hand (see the comments)."""

import math

import pytest
import torch

from learner.objective import LossConfig, RunningBaseline, entropy, group_advantages, policy_loss

LOGP = [[-1.0, -2.0], [-0.5, 0.0]]
BEHAVIOUR = [[-1.2, -1.5], [-0.5, 0.0]]
MASK = [[1.0, 1.0], [1.0, 0.0]]
ADV = [1.0, -2.0]
F32_EPS, F64_EPS = torch.finfo(torch.float32).eps, torch.finfo(torch.float64).eps
R00, R01 = math.exp(0.2), math.exp(-0.5)  # the ratios e^(logp - behaviour) of the first sequence's tokens


def f32(x: float, scale: float = 1.0):
    """A float32 result of a few operations on float32 inputs (-1.2 is rounded too) of size ~`scale`:
    within 8 ulps of that scale, whatever the size of the result (sums of such terms may cancel)."""
    return pytest.approx(x, rel=0, abs=8 * F32_EPS * scale)


def f64(x: float):
    """The same, for float64 computations on values of size ~1."""
    return pytest.approx(x, rel=0, abs=8 * F64_EPS)


def run(cfg, ref=None):
    logp = torch.tensor(LOGP, requires_grad=True)
    out = policy_loss(
        logp,
        torch.tensor(BEHAVIOUR),
        torch.tensor(ADV),
        torch.tensor(MASK),
        cfg,
        ref_logp_BT=None if ref is None else torch.tensor(ref),
    )
    out.loss.backward()
    return out, logp.grad


def test_truncated_is_sequence_normalised():
    # ratios: e^0.2 = 1.221403, e^-0.5 = 0.606531, e^0 = 1
    # per token -w·A·logp: 1.221403, 1.213061, -1.0 ; per sequence: 1.217232, -1.0 ; mean: 0.108616
    out, grad = run(LossConfig(estimator="tis", is_cap=1.5, normalize="sequence"))
    assert out.loss.item() == f32((R00 + 2 * R01) / 4 - 0.5)
    # d/dlogp: -w·A / (tokens in seq) / (sequences)
    assert grad[0, 0].item() == f32(-R00 / 4)
    assert grad[0, 1].item() == f32(-R01 / 4)
    assert grad[1, 0].item() == f32(1.0)
    assert grad[1, 1].item() == 0.0  # padding
    assert out.stats["clip_frac"] == 0.0
    assert out.stats["ratio_mean"] == f32((R00 + R01 + 1) / 3)


def test_truncation_and_token_normalisation():
    out, grad = run(LossConfig(estimator="tis", is_cap=1.1, normalize="token"))
    # first token's weight truncated to 1.1: (1.1 + 1.213061 - 1.0) / 3
    assert out.loss.item() == f32((1.1 + 2 * R01 - 1.0) / 3)
    assert out.stats["clip_frac"] == f32(1 / 3)
    assert grad[0, 0].item() == f32(-1.1 / 3)


def test_decoupled_ppo_clips_against_the_proximal_policy_and_weighs_by_the_behaviour_ratio():
    # θ = LOGP, π_prox = PROX, μ = MU. r = π_θ/π_prox: e^0.2, e^-0.5, 1; ρ = π_prox/μ: e^0.1, 1, e^-0.1
    # (all inside the masks: probability moves of 0.029 and 0.064 < 0.2), weights w = ρ (< C = 2).
    # tok(0,0): A=1, min(r, 1.2) = 1.2, clipped (no gradient), times w = e^0.1.
    # tok(0,1): A=1, min(0.606531, 0.8) = r, w = 1. tok(1,0): A=-2, r = 1, w = e^-0.1.
    prox, mu = [[-1.2, -1.5], [-0.5, 0.0]], [[-1.3, -1.5], [-0.4, 0.0]]
    logp = torch.tensor(LOGP, dtype=torch.float64, requires_grad=True)
    f = lambda x: torch.tensor(x, dtype=torch.float64)  # noqa: E731
    cfg = LossConfig(estimator="ppo", clip_eps=0.2, normalize="sequence")
    out = policy_loss(logp, f(mu), f(ADV), f(MASK), cfg, prox_logp_BT=f(prox))
    out.loss.backward()
    e = math.exp
    assert out.loss.item() == f64((-(1.2 * e(0.1) + R01) / 2 + 2 * e(-0.1)) / 2)
    assert logp.grad.tolist() == [[0.0, f64(-R01 / 4)], [f64(e(-0.1)), 0.0]]  # -w·A·r / tokens / sequences
    assert out.stats["clip_frac"] == f64(1 / 3) and out.stats["masked_frac"] == 0.0
    assert out.stats["ratio_max"] == f64(e(0.1)) and out.stats["abs_log_ratio_mean"] == f64(0.2 / 3)
    assert out.stats["policy_ratio_max"] == f64(R00) and out.stats["truncated_frac"] == 0.0


def test_on_the_first_step_ppo_is_the_truncated_weight_and_never_clips():
    # No proximal log-probs given: θ is π_prox, r ≡ 1 and the clip cannot bind, whatever ε; the gradient
    # is REINFORCE weighted by w = min(π_θ/μ, C): the "tis" gradient exactly (same ratios e^0.2, e^-0.5, 1).
    _, tis_grad = run(LossConfig(estimator="tis", is_cap=1.5))
    out, grad = run(LossConfig(estimator="ppo", is_cap=1.5, clip_eps=0.01))
    assert out.stats["clip_frac"] == 0.0 and out.stats["policy_ratio_max"] == 1.0
    assert grad.tolist() == [[f32(-R00 / 4), f32(-R01 / 4)], [f32(1.0), 0.0]]
    assert torch.allclose(grad, tis_grad, rtol=0, atol=8 * F32_EPS)


def test_extreme_behaviour_ratios_are_masked_with_zero_gradient_and_counted():
    # One sequence, A = +1, π_prox = π_θ (first step). Probabilities (π_prox, μ) per token:
    #   0: (0.9, 0.6)    ρ 1.5, inside the band, but up by 0.3 > 0.2 in the advantage's direction: DPPO-masked
    #   1: (0.01, 0.001) ρ 10 > 8: ratio-masked (its probability moved only 0.009)
    #   2: (0.03, 0.01)  ρ 3: kept, its weight truncated to C = 2
    #   3: (0.5, 0.5)    ρ 1: kept, weight 1
    #   4: (0.4, 0.4)    kept by the ratios, but cut by the trainer's top-p (exclude): masked
    p = torch.tensor([[0.9, 0.01, 0.03, 0.5, 0.4]], dtype=torch.float64)
    m = torch.tensor([[0.6, 0.001, 0.01, 0.5, 0.4]], dtype=torch.float64)
    cut = torch.tensor([[0.0, 0.0, 0.0, 0.0, 1.0]], dtype=torch.float64)
    ones = torch.ones(1, 5, dtype=torch.float64)
    for estimator in ("ppo", "tis"):
        logp = p.log().requires_grad_(True)
        cfg = LossConfig(estimator=estimator, is_cap=2.0, normalize="token")
        out = policy_loss(logp, m.log(), torch.ones(1, dtype=torch.float64), ones, cfg, exclude_BT=cut)
        out.loss.backward()
        assert logp.grad.tolist() == [[0.0, 0.0, f64(-2 / 5), f64(-1 / 5), 0.0]]  # -w·A / 5 tokens
        st = out.stats
        assert (st["masked_frac"], st["masked_dppo_frac"], st["masked_ratio_frac"]) == (0.6, 0.2, 0.2)
        assert st["masked_top_p_frac"] == 0.2 and st["truncated_frac"] == 0.2 and st["ratio_max"] == f64(10.0)
    # The same rise with a negative advantage is not masked (the DPPO mask follows the advantage's sign):
    # token 0 keeps its weight ρ = 1.5; the probability that fell (token-wise: none here) would be.
    logp = p.log().requires_grad_(True)
    out = policy_loss(logp, m.log(), -torch.ones(1, dtype=torch.float64), ones, LossConfig(normalize="token"))
    out.loss.backward()
    assert logp.grad[0, 0].item() == f64(1.5 / 5) and out.stats["masked_dppo_frac"] == 0.0
    fell = policy_loss(m.log(), p.log(), -torch.ones(1, dtype=torch.float64), ones, LossConfig())
    assert fell.stats["masked_dppo_frac"] == 0.2  # token 0 fell from 0.9 to 0.6 under A < 0


def test_kl_penalty_is_importance_weighted_k2():
    ref = [[-1.0, -1.0], [-0.5, 0.0]]  # δ = logp - ref = (0, -1, 0): one token differs
    base, base_grad = run(LossConfig(estimator="tis", is_cap=1.5))
    out, grad = run(LossConfig(estimator="tis", is_cap=1.5, kl_coef=0.1), ref=ref)
    # That token's weight is its ratio e^-0.5 = 0.606531; k2 = ½δ² = 0.5; sequence means, then /2.
    assert out.loss.item() - base.loss.item() == f32(0.1 * (R01 * 0.5 / 2) / 2)  # two losses of terms ~1
    # Its gradient: kl_coef · w · δ / (tokens in seq) / (sequences); the others are unchanged.
    extra = (grad - base_grad).tolist()
    assert extra[0] == [f32(0.0), f32(0.1 * R01 * -1.0 / 4)]
    assert extra[1] == [f32(0.0), f32(0.0)]
    # Logged: the weighted k3, w · (e^-δ + δ - 1), over the 3 tokens.
    assert out.stats["kl_k3"] == f32(R01 * (math.e - 2) / 3)
    assert base.stats["kl_k3"] == 0.0  # no reference given


def test_entropy_is_the_categorical_one_and_safe_under_top_p():
    logits = torch.tensor([[[0.3, -1.0, 2.0, 0.0]]], dtype=torch.float64)
    logp = torch.log_softmax(logits, -1)
    want = torch.distributions.Categorical(logits=logits).entropy()
    assert entropy(logp).item() == f64(want.item())
    # A top-p cut: -inf entries, the rest renormalised. They add 0, and the gradient is finite.
    cut = logits.clone().requires_grad_(True)
    masked = torch.where(torch.tensor([True, False, True, True]), cut, torch.tensor(float("-inf"), dtype=cut.dtype))
    h = entropy(torch.log_softmax(masked, -1))
    h.sum().backward()
    kept = torch.distributions.Categorical(logits=logits[..., [0, 2, 3]]).entropy()
    assert h.item() == f64(kept.item())
    assert torch.isfinite(cut.grad).all() and cut.grad[0, 0, 1] == 0.0


def test_entropy_bonus_raises_entropy():
    # Policy term off (A = 0): the loss is -β · mean entropy, so its gradient is -β ∇H.
    beta = 0.05
    logits = torch.tensor([[[2.0, 0.0, -1.0], [0.5, 0.4, -3.0]]], dtype=torch.float64, requires_grad=True)

    def mean_entropy(x):
        return torch.distributions.Categorical(logits=x).entropy().mean()

    logp_BTV = torch.log_softmax(logits, -1)
    sampled = logp_BTV[..., 0]
    cfg = LossConfig(entropy_coef=beta, normalize="token")
    out = policy_loss(
        sampled,
        sampled.detach(),
        torch.zeros(1, dtype=torch.float64),
        torch.ones(1, 2),
        cfg,
        entropy_BT=entropy(logp_BTV),
    )
    (g,) = torch.autograd.grad(out.loss, logits)
    (g_h,) = torch.autograd.grad(mean_entropy(logits), logits)
    assert float((g + beta * g_h).abs().max()) <= 8 * F64_EPS  # float64 throughout
    assert out.stats["entropy"] == f64(float(mean_entropy(logits.detach())))
    assert out.loss.item() == f64(-beta * out.stats["entropy"])
    with torch.no_grad():  # one descent step on the loss raises the entropy
        assert mean_entropy(logits - 1.0 * g) > mean_entropy(logits)
    with pytest.raises(ValueError, match="entropy"):
        policy_loss(sampled, sampled.detach(), torch.zeros(1, dtype=torch.float64), torch.ones(1, 2), cfg)


def test_on_policy_tis_is_plain_reinforce():
    logp = torch.tensor([[-0.3, -0.7]], requires_grad=True)
    out = policy_loss(logp, logp.detach().clone(), torch.tensor([0.5]), torch.ones(1, 2), LossConfig())
    out.loss.backward()
    assert logp.grad.tolist() == [[-0.25, -0.25]]  # -A / 2 tokens: exact in binary


def test_shapes_are_checked():
    with pytest.raises(ValueError, match="same shape"):
        policy_loss(torch.zeros(2, 3), torch.zeros(2, 2), torch.zeros(2), torch.ones(2, 3), LossConfig())
    with pytest.raises(ValueError, match="advantages"):
        policy_loss(torch.zeros(2, 3), torch.zeros(2, 3), torch.zeros(3), torch.ones(2, 3), LossConfig())
    with pytest.raises(ValueError):
        LossConfig(is_cap=0)


def test_group_advantages():
    # centred ±0.5 over a std of 0.5, plus the function's eps of 1e-6: the same float64 operations, exact
    assert group_advantages([1.0, 0.0, 0.0, 1.0]) == [c / (0.5 + 1e-6) for c in (0.5, -0.5, -0.5, 0.5)]
    assert group_advantages([2.0, 4.0], scale=False) == [-1.0, 1.0]
    assert group_advantages([1.0, 1.0, 1.0]) == [0.0, 0.0, 0.0]
    with pytest.raises(ValueError):
        group_advantages([])


def test_running_baseline():
    b = RunningBaseline(decay=0.9, min_count=2)
    assert b.value("a") == 0.0
    b.update(1.0, "a")  # first reward sets the level
    assert b.value() == 1.0 and b.value("a") == 1.0  # "a" has 1 < 2 rewards: global
    b.update(0.0, "a")  # step 1/2 on both
    assert b.value() == f64(0.5) and b.value("a") == f64(0.5)
    b.update(1.0, "b")  # global: 0.5 + (1/3)(0.5)
    assert b.value() == f64(2 / 3) and b.value("b") == f64(2 / 3)
    for _ in range(100):
        b.update(1.0, "a")
    assert b.value("a") > 0.99
    again = RunningBaseline.from_state_dict(b.state_dict())
    assert again.value("a") == b.value("a") and again.value() == b.value()
    with pytest.raises(ValueError, match="decay"):
        RunningBaseline(decay=1.0)


def one_row(logp, prox, adv, cfg):
    """One sequence at a later step: θ = `logp`, π_prox = μ = `prox` (the behaviour ratio is 1)."""
    lp = torch.tensor([logp], requires_grad=True)
    p = torch.tensor([prox])
    out = policy_loss(lp, p, torch.tensor([adv]), torch.ones(1, len(logp)), cfg, prox_logp_BT=p)
    out.loss.backward()
    return out, lp.grad[0]


def test_ppo_dual_clip_bounds_negative_advantages():
    # A = -1, ratios e^1.5 = 4.481689, 1, e^-0.1 = 0.904837; c = 3, ε = 0.2.
    # tok 0: min(ρA, clip(ρ)A) = min(-4.481689, -1.2) = -4.481689 < cA = -3: the objective is -3, no gradient.
    # tok 1: -1 (gradient of -ρA w.r.t. logp: -Aρ = 1). tok 2: inside the clip range: -0.904837 (gradient 0.904837).
    cfg = LossConfig(estimator="ppo", clip_eps=0.2, dual_clip_c=3.0)
    out, grad = one_row([-0.5, -1.0, -2.0], [-2.0, -1.0, -1.9], -1.0, cfg)
    assert out.loss.item() == f32((3.0 + 1.0 + math.exp(-0.1)) / 3, scale=3)
    assert grad.tolist() == [f32(0.0), f32(1 / 3), f32(math.exp(-0.1) / 3)]
    assert out.stats["dual_clip_frac"] == f32(1 / 3) and out.stats["clip_frac"] == 0.0
    # Without the dual clip (c huge) the first token's surrogate is ρA: loss (4.481689 + 1 + 0.904837) / 3.
    loose, g = one_row([-0.5, -1.0, -2.0], [-2.0, -1.0, -1.9], -1.0, LossConfig(estimator="ppo", dual_clip_c=100.0))
    assert loose.loss.item() == f32((math.exp(1.5) + 1.0 + math.exp(-0.1)) / 3, scale=5)
    assert g[0].item() == f32(math.exp(1.5) / 3, scale=5) and loose.stats["dual_clip_frac"] == 0.0
    # A positive advantage is never dual-clipped: ρ = e^1.5 is PPO-clipped to 1.2 (loss -1.2, no gradient).
    pos, g = one_row([-0.5], [-2.0], 1.0, cfg)
    assert pos.loss.item() == f32(-1.2) and g[0].item() == 0.0
    assert pos.stats["dual_clip_frac"] == 0.0 and pos.stats["clip_frac"] == 1.0


def test_log_ratio_clamp_keeps_one_wild_token_finite():
    # log ρ = -1 - (-100) = 99: e^99 overflows float32 (max ~e^88.7). Clamped to 20: ρ = e^20 = 4.851652e8.
    # PPO, A = -1: surrogate -e^20, dual-clipped to cA = -3: loss (3 + 1) / 2 with the second token at ρ = 1.
    cfg = LossConfig(estimator="ppo", max_log_ratio=20.0, dual_clip_c=3.0)
    out, grad = one_row([-1.0, -0.5], [-100.0, -0.5], -1.0, cfg)
    assert out.loss.item() == f32(2.0, scale=3) and grad.tolist() == [f32(0.0), f32(0.5)]
    # e^20 in float32: a few ulps of itself
    assert out.stats["clamp_frac"] == 0.5
    assert out.stats["policy_ratio_max"] == pytest.approx(math.exp(20), rel=8 * F32_EPS)
    # What the clamp prevents: ρ = inf, so even the dual-clipped token's gradient is 0 · inf = nan.
    unclamped, g = one_row([-1.0, -0.5], [-100.0, -0.5], -1.0, LossConfig(estimator="ppo", max_log_ratio=1000.0))
    assert math.isnan(g[0].item()) and unclamped.stats["policy_ratio_max"] == math.inf
    # TIS, A = 1, cap 2: the weight is min(e^20, 2) = 2: per token -w·A·logp = 2, 0.5; mean 1.25.
    out, grad = one_row([-1.0, -0.5], [-40.0, -0.5], 1.0, LossConfig(estimator="tis", is_cap=2.0))
    assert out.loss.item() == f32(1.25, scale=2) and grad.tolist() == [f32(-1.0), f32(-0.5)]
    assert out.stats["clamp_frac"] == 0.5 and out.stats["clip_frac"] == 0.5 and out.stats["dual_clip_frac"] == 0.0


def test_sampled_logprob_means():
    out, _ = run(LossConfig())
    assert out.stats["logp_mean"] == f32((-1.0 - 2.0 - 0.5) / 3, scale=2)
    assert out.stats["behaviour_logp_mean"] == f32((-1.2 - 1.5 - 0.5) / 3, scale=2)
    with pytest.raises(ValueError, match="dual_clip_c"):
        LossConfig(dual_clip_c=1.0)
