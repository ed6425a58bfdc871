"""The KL term's expected gradient, computed exactly, is the gradient of the reverse KL(π_θ || π_ref).

A small categorical policy: logits θ [S contexts, V tokens] in float64, a fixed reference and a fixed
behaviour policy μ ≠ π_θ. The exact gradient of the mean over contexts of
KL(π_θ || π_ref) = Σ_a π_θ(a) (log π_θ(a) - log π_ref(a)) comes from autograd. The estimator's
expected gradient is computed without sampling: every token a of every context, as a one-token
sample drawn from μ, goes through `learner.objective.policy_loss` (advantage 0, so only the KL term
has a gradient); its gradient is weighted by μ(a|s) and summed.
"""

import pytest
import torch

from learner.objective import LossConfig, exact_kl, policy_loss

S, V = 4, 7
F64 = torch.float64
TOL = 1e-6


def logits(seed: int, scale: float = 1.0) -> torch.Tensor:
    return scale * torch.randn(S, V, generator=torch.Generator().manual_seed(seed), dtype=F64)


THETA = logits(0)
REF_LOGP = torch.log_softmax(logits(1), -1)
MU_LOGP = torch.log_softmax(THETA + logits(2, 0.6), -1)
CFG = LossConfig(kl_coef=1.0, is_cap=50.0)


def reverse_kl(theta: torch.Tensor) -> torch.Tensor:
    logp = torch.log_softmax(theta, -1)
    return (logp.exp() * (logp - REF_LOGP)).sum(-1).mean()


def forward_kl(theta: torch.Tensor) -> torch.Tensor:
    logp = torch.log_softmax(theta, -1)
    return (REF_LOGP.exp() * (REF_LOGP - logp)).sum(-1).mean()


def exact_gradient(kl) -> torch.Tensor:
    theta = THETA.clone().requires_grad_(True)
    (g,) = torch.autograd.grad(kl(theta), theta)
    return g


def objective_sample_loss(theta, s, a, behaviour_logp, cfg=CFG):
    """`policy_loss` on one sampled token a at context s, recorded with behaviour log-prob μ(a|s)."""
    logp = torch.log_softmax(theta, -1)
    one = lambda x: x[s, a].reshape(1, 1)  # noqa: E731
    out = policy_loss(
        one(logp), one(behaviour_logp), torch.zeros(1, dtype=F64), torch.ones(1, 1, dtype=F64), cfg, one(REF_LOGP)
    )
    return out.loss, out.stats


def plain_k3_sample_loss(theta, s, a, behaviour_logp):
    """The former term: k3 = e^d - d - 1, d = log π_ref - log π_θ, as a loss, no importance weight."""
    d = REF_LOGP[s, a] - torch.log_softmax(theta, -1)[s, a]
    return torch.exp(d) - d - 1, {}


def expected_gradient(sample_loss, behaviour_logp: torch.Tensor) -> torch.Tensor:
    """Σ_s (1/S) Σ_a μ(a|s) ∇_θ loss(a sampled at s), over every (s, a): exact, no sampling."""
    total = torch.zeros_like(THETA)
    for s in range(S):
        for a in range(V):
            theta = THETA.clone().requires_grad_(True)
            loss, stats = sample_loss(theta, s, a, behaviour_logp)
            assert stats.get("clip_frac", 0.0) == 0.0  # no truncated weight: the expectation is exact
            (g,) = torch.autograd.grad(loss, theta)
            total += behaviour_logp[s, a].exp() / S * g
    return total


def errors(estimate: torch.Tensor, exact: torch.Tensor) -> tuple[float, float]:
    """(max |difference|, max |difference| / max |exact|)."""
    diff = float((estimate - exact).abs().max())
    return diff, diff / float(exact.abs().max())


def report(name, err):
    print(f"{name}: max abs error {err[0]:.3e}, relative {err[1]:.3e}")


def test_behaviour_policy_differs_from_the_policy():
    ratio = (torch.log_softmax(THETA, -1) - MU_LOGP).exp()
    assert float((ratio - 1).abs().max()) > 0.3 and float(ratio.max()) < CFG.is_cap


def test_off_policy_expected_gradient_is_the_reverse_kl_gradient():
    exact = exact_gradient(reverse_kl)
    est = expected_gradient(objective_sample_loss, MU_LOGP)
    err = errors(est, exact)
    report("objective, samples from mu", err)
    assert err[0] < TOL and err[1] < TOL
    torch.testing.assert_close(est, exact, atol=TOL, rtol=TOL)


def test_on_policy_expected_gradient_is_the_reverse_kl_gradient():
    exact = exact_gradient(reverse_kl)
    on_policy = torch.log_softmax(THETA, -1)  # μ = π_θ: every weight is 1
    est = expected_gradient(objective_sample_loss, on_policy)
    err = errors(est, exact)
    report("objective, samples from pi_theta", err)
    assert err[0] < TOL and err[1] < TOL


def test_plain_k3_as_a_loss_is_not_the_reverse_kl_gradient():
    exact = exact_gradient(reverse_kl)
    off = errors(expected_gradient(plain_k3_sample_loss, MU_LOGP), exact)
    on = errors(expected_gradient(plain_k3_sample_loss, torch.log_softmax(THETA, -1)), exact)
    report("plain k3, samples from mu", off)
    report("plain k3, samples from pi_theta", on)
    assert off[1] > 0.05 and on[1] > 0.05
    # What it is: on-policy, the gradient of the forward KL(π_ref || π_θ).
    fwd = errors(expected_gradient(plain_k3_sample_loss, torch.log_softmax(THETA, -1)), exact_gradient(forward_kl))
    report("plain k3, samples from pi_theta, vs forward KL", fwd)
    assert fwd[0] < TOL


@pytest.mark.parametrize("estimator", ["tis", "ppo"])
@pytest.mark.parametrize("normalize", ["token", "sequence"])
def test_batched_kl_gradient_with_padding_and_a_policy_term(estimator, normalize):
    # All (s, a) in one batch, one real token per row plus a padded one (wild values, mask 0), with
    # non-zero advantages. The sample weights carry μ(a|s)·V so that either normalisation's mean is
    # the μ-expectation averaged over contexts. The KL term adds kl_coef times the reverse KL gradient.
    beta = 0.3
    rows = [(s, a) for s in range(S) for a in range(V)]
    si, ai = torch.tensor([r[0] for r in rows]), torch.tensor([r[1] for r in rows])
    pad = torch.full((len(rows), 1), -100.0, dtype=F64)
    weight = MU_LOGP[si, ai].exp() * V
    adv = torch.linspace(-1.0, 1.0, len(rows), dtype=F64)
    mask = torch.tensor([[1.0, 0.0]] * len(rows), dtype=F64)

    def grad(kl_coef):
        theta = THETA.clone().requires_grad_(True)
        logp = torch.log_softmax(theta, -1)[si, ai][:, None]
        cfg = LossConfig(estimator=estimator, normalize=normalize, is_cap=50.0, kl_coef=kl_coef)
        out = policy_loss(
            torch.cat([logp, pad], 1),
            torch.cat([MU_LOGP[si, ai][:, None], pad], 1),
            adv,
            mask,
            cfg,
            ref_logp_BT=torch.cat([REF_LOGP[si, ai][:, None], -pad], 1),
            weight_B=weight,
        )
        (g,) = torch.autograd.grad(out.loss, theta)
        return g, out.stats

    (g_kl, stats), (g_plain, _) = grad(beta), grad(0.0)
    exact = beta * exact_gradient(reverse_kl)
    err = errors(g_kl - g_plain, exact)
    assert err[0] < TOL and err[1] < TOL
    assert stats["clip_frac"] == 0.0 or estimator == "ppo"


def test_logged_estimate_is_unbiased_for_the_reverse_kl():
    # E_{a~μ}[kl_k3 of the one-token sample] = KL(π_θ || π_ref), exactly, averaged over contexts.
    expected = 0.0
    for s in range(S):
        for a in range(V):
            _, stats = objective_sample_loss(THETA.clone(), s, a, MU_LOGP)
            assert stats["kl_k3"] >= 0.0
            expected += float(MU_LOGP[s, a].exp()) / S * stats["kl_k3"]
    assert expected == pytest.approx(float(reverse_kl(THETA)), abs=1e-12, rel=1e-10)
    assert abs(expected - float(forward_kl(THETA))) > 1e-2


def test_truncated_weights_are_the_policy_terms():
    # Where ρ > C the KL term's weight is C, like the "tis" weight: the per-token gradient is C·δ.
    logp = torch.tensor([[-0.5, -2.0]], dtype=F64, requires_grad=True)
    behaviour = torch.tensor([[-3.0, -2.0]], dtype=F64)  # ρ = e^2.5, 1
    ref = torch.tensor([[-1.0, -1.5]], dtype=F64)  # δ = 0.5, -0.5
    cfg = LossConfig(kl_coef=1.0, is_cap=2.0, normalize="token", mask_ratio_high=1e9)  # truncated, not masked
    out = policy_loss(logp, behaviour, torch.zeros(1, dtype=F64), torch.ones(1, 2, dtype=F64), cfg, ref)
    out.loss.backward()
    assert logp.grad[0].tolist() == pytest.approx([2.0 * 0.5 / 2, 1.0 * -0.5 / 2], abs=1e-12)
    assert out.loss.item() == pytest.approx((2.0 * 0.125 + 0.125) / 2, abs=1e-12)
    with pytest.raises(ValueError, match="ref_logp"):
        policy_loss(logp, behaviour, torch.zeros(1, dtype=F64), torch.ones(1, 2, dtype=F64), cfg)


@pytest.mark.parametrize("normalize", ["token", "sequence"])
def test_exact_estimator_is_the_reverse_kl_and_its_gradient(normalize):
    # Every context one row (a real token, whichever was sampled, plus a padded position with wild
    # values): the exact per-state KL needs no sampled action. Its mean is KL(π_θ || π_ref) and its
    # gradient, through `policy_loss` beside a policy term with non-zero advantages, is the exact one.
    beta = 0.3
    adv = torch.linspace(-1.0, 1.0, S, dtype=F64)
    mask = torch.tensor([[1.0, 0.0]] * S, dtype=F64)
    a = torch.arange(S) % V  # the sampled token of each row: any, the KL term does not read it
    wild = torch.full((S, 1, V), -100.0, dtype=F64)

    def grad(kl_coef):
        theta = THETA.clone().requires_grad_(True)
        logp_BTV = torch.cat([torch.log_softmax(theta, -1)[:, None, :], wild], 1)
        ref_BTV = torch.cat([REF_LOGP[:, None, :], -wild], 1)
        chosen = logp_BTV.gather(-1, torch.stack([a, a], 1)[..., None])[..., 0]
        cfg = LossConfig(normalize=normalize, is_cap=50.0, kl_coef=kl_coef, kl_estimator="exact")
        out = policy_loss(
            chosen,
            MU_LOGP[torch.arange(S), a][:, None].expand(S, 2),
            adv,
            mask,
            cfg,
            ref_logp_BT=ref_BTV.gather(-1, torch.stack([a, a], 1)[..., None])[..., 0],
            kl_BT=exact_kl(logp_BTV, ref_BTV),
        )
        (g,) = torch.autograd.grad(out.loss, theta)
        return g, out.stats

    (g_kl, stats), (g_plain, _) = grad(beta), grad(0.0)
    assert stats["kl_exact"] == pytest.approx(float(reverse_kl(THETA)), abs=1e-12, rel=1e-12)
    err = errors(g_kl - g_plain, beta * exact_gradient(reverse_kl))
    assert err[0] < TOL and err[1] < TOL


def test_exact_kl_charges_what_the_samples_did_not_carry_and_survives_a_cut():
    # A near-certain step whose probability moved onto a token never sampled (docs/demo.md's `count`
    # collapse): 0.85 on a token the reference gives 0.015. The sampled k2, on the token that was drawn,
    # sees a small change; the exact KL sees about 3 nats.
    ref = torch.log(torch.tensor([[[0.98, 0.015, 0.005]]], dtype=F64))
    pol = torch.log(torch.tensor([[[0.14, 0.85, 0.01]]], dtype=F64))
    kl = exact_kl(pol, ref)
    assert float(kl) == pytest.approx(float((pol.exp() * (pol - ref)).sum()), rel=1e-12) and float(kl) > 2.5
    # A token cut by top-p (-inf) adds nothing and sends no nan back; one the reference cut is clamped.
    theta = torch.tensor([[[0.0, 1.0, 2.0]]], dtype=F64, requires_grad=True)
    logp = torch.log_softmax(theta, -1).clone()
    logp = torch.where(torch.tensor([False, False, True]), torch.tensor(float("-inf"), dtype=F64), logp)
    out = exact_kl(logp, torch.log(torch.tensor([[[0.5, 0.0, 0.5]]], dtype=F64)), max_log_ratio=20.0)
    (g,) = torch.autograd.grad(out.sum(), theta)
    assert torch.isfinite(out).all() and torch.isfinite(g).all()
    with pytest.raises(ValueError, match="one shape"):
        exact_kl(pol, ref[..., :2])
    cfg = LossConfig(kl_coef=1.0, kl_estimator="exact")
    one = torch.zeros(1, 1, dtype=F64)
    with pytest.raises(ValueError, match="kl_BT"):
        policy_loss(one, one, torch.zeros(1, dtype=F64), torch.ones(1, 1, dtype=F64), cfg, one)
