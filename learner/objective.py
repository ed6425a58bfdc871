"""The learner's objective: single-sample decoupled-PPO policy gradient, bounded behaviour correction.

Pure functions.

Three policies meet in one update (AReaL's decoupled PPO, Fu et al. 2025): the **behaviour** policy
μ that served the completion (its recorded log-probabilities), the **proximal** policy π_prox (the
learner's weights at the start of the update: `prox_logp_BT`, computed once per update before the
first optimizer step, no gradient) and the current policy π_θ (the weights being stepped). Every
log-probability is taken under the *same sampling transform* the server used (temperature, top-p;
see serving.sampling) and, with router replay, the same experts.

- **Single sample, no group.** Each completion has one scalar reward r (from user feedback). The
  advantage is A = r - b with b a running baseline per key (`RunningBaseline`), centred per batch by
  the trainer (`learner.trainer.center_advantages`). Offline rollouts come in groups of G samples per
  prompt with verifiable rewards; their advantage is group-relative (`group_advantages`).
- **Behaviour correction** (fixed for the update): ρ_t = π_prox(a_t|s_t) / μ(a_t|s_t), computed in
  log space, |log ρ_t| clamped to L = `max_log_ratio` before the exponential. Each kept token carries
  the truncated importance weight w_t = min(ρ_t, C), C = `is_cap`, detached.
- **Behaviour mask** (`behaviour_mask`): capping alone keeps a token whose behaviour probability says
  nothing about π_prox; such tokens are dropped from the objective (policy and KL terms), counted
  (`masked_frac`), never silently down-weighted. A token is masked when
    * its ratio leaves the band [`mask_ratio_low`, `mask_ratio_high`] = [1/8, 8] (the band of
      prime-rl's masked importance sampling), or
    * its probability moved too far in the direction of its advantage (prime-rl's default DPPO
      mask, Qi et al. 2026, thresholds `dppo_mask_low` / `dppo_mask_high` = 0.2 / 0.2): A > 0 and
      π_prox(a) - μ(a) > 0.2, or A < 0 and μ(a) - π_prox(a) > 0.2. A difference of probabilities,
      not a ratio: a rare token whose probability went from 0.001 to 0.01 is kept (its weight is
      capped), a likely one that went from 0.3 to 0.9 is not; or
    * the trainer's own top-p cut removed it at π_prox (`exclude_BT`; its log-probability is -inf).
- **Estimators.**
    * "ppo" (default): the decoupled clipped surrogate, r_t = π_θ / π_prox,
      loss_t = -w_t · min(r_t A, clip(r_t, 1-ε, 1+ε) A), with the dual clip (Ye et al. 2020) for
      A < 0: the objective is at least c·A, c = `dual_clip_c`. On an update's first optimizer step
      θ = prox, so r ≡ 1 and the clip cannot bind: with `steps_per_update` = 1 the whole correction
      is the truncated-and-masked importance weight (w_t · A · ∇log π_θ, REINFORCE). From the second
      step on, the clip bounds how far θ moves from π_prox on this batch.
    * "tis": REINFORCE with the truncated full ratio, loss_t = -min(π_θ/μ, C) · A · log π_θ (the
      weight detached), masked as above. No trust region: with several steps per update only the
      truncation bounds a token's weight.
  **Log-ratio clamp**: every log-ratio is clamped to [-L, L] before the exponential, so one wild
  token (a recorded log-prob of -80, a trainer top-p cut) cannot overflow to inf and the loss to nan.
- **KL to the promoted reference** (optional, `kl_coef` > 0). The penalty is the reverse KL,
  KL(π_θ || π_ref), per visited token state. Its gradient is g = E_{a~π_θ}[δ(a) ∇log π_θ(a)] with
  δ = log π_θ - log π_ref. The tokens were drawn from μ, so each kept token carries the importance
  weight v_t = min(π_θ/μ, C), detached (the full ratio: π_θ, not π_prox, is the policy whose KL this
  is). The loss per token is kl_t = v_t · ½ δ_t² (k2, weighted), whose gradient v_t δ_t ∇log π_θ(a_t)
  has expectation over a_t ~ μ exactly g, up to the truncation at C (and the mask); on-policy it is
  the plain k2 loss. `kl_k3` reports the weighted k3 estimate, the token mean of
  v_t · (e^{-δ_t} + δ_t - 1). Why not the alternatives:
    * k3 = e^{-δ} + δ - 1 *as a loss* has the gradient of the forward KL(π_ref || π_θ).
    * ρ·k3 with ρ differentiable (DeepSeek-V3.2) has the same gradient in exact arithmetic but forms
      it as two terms of size π_ref/π_θ that cancel, catastrophically in float32.
    * k1 folded into the advantage would be clipped with the reward term under "ppo".
  Scope: the gradient of Σ_t KL(π_θ(·|s_t) || π_ref(·|s_t)) at the visited states.
  `kl_estimator` = "exact" replaces the sampled k2 by the KL itself at each visited state, summed
  over the vocabulary: kl_t = Σ_a π_θ(a|s_t) (log π_θ(a|s_t) - log π_ref(a|s_t)) (`exact_kl`, from
  both models' full distributions, which the trainer has there). Same scope, no sampled action, so
  no importance weight and no mask; its gradient is exact. It charges probability that moves onto a
  token the samples did not carry, which the sampled k2 sees only once such a token is drawn
  (docs/demo.md: a `count` collapse put 0.85 on a token its parent gave 0.015).
- **Entropy bonus** (optional, `entropy_coef` > 0): minus `entropy_coef` times the reduced per-token
  entropy of the trainer's sampling distribution (`entropy`); exact at each visited state (no sampled
  action, so no importance weight and no mask). The statistic `entropy` is reported either way.
- **Normalisation.** "token": sum of per-token losses / number of tokens in the batch. "sequence"
  (default): mean over a sequence's tokens, then mean over sequences: one user judgement per
  completion moves the model by about the same amount whatever its length. Masked tokens stay in
  the denominators: masking removes a token's contribution, it does not re-weigh the others.

Statistics (`LossOutput.stats`, plain floats): the behaviour ratio's `ratio_mean`, `ratio_max`,
`abs_log_ratio_mean` (mean |log ρ|), `truncated_frac` (kept tokens with ρ > C), `masked_frac` (and
its parts `masked_ratio_frac`, `masked_dppo_frac`, `masked_top_p_frac`), all over the real tokens;
`clip_frac` (PPO clip active on r, or, under "tis", weight truncated), `dual_clip_frac`, `clamp_frac`,
`policy_ratio_max` / `policy_abs_log_ratio_mean` (r = π_θ/π_prox), `logp_mean`, `behaviour_logp_mean`.

Greedy completions (temperature 0) carry no usable ratio; callers drop them before building a batch.
Shapes: B sequences, T completion tokens (right-padded; `mask` is 1 on real tokens).
Called by learner.trainer; tested against values computed by hand, and the KL term's expected
gradient against the exact reverse-KL gradient of a small categorical policy (tests/learner/test_kl.py).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Literal

import torch
from pydantic import BaseModel, ConfigDict, Field


class LossConfig(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    estimator: Literal["ppo", "tis"] = Field(
        "ppo", description="Decoupled PPO (clip against the proximal policy) or truncated-IS REINFORCE."
    )
    is_cap: float = Field(
        2.0,
        gt=0,
        description="C in min(ρ, C): the behaviour weight (π_prox/μ), the 'tis' weight and the KL term's weight.",
    )
    mask_ratio_low: float = Field(
        0.125, ge=0, lt=1, description="Tokens whose behaviour ratio π_prox/μ is below this are masked."
    )
    mask_ratio_high: float = Field(
        8.0, gt=1, description="Tokens whose behaviour ratio π_prox/μ is above this are masked."
    )
    dppo_mask_low: float = Field(
        0.2, gt=0, le=1, description="A < 0: mask a token whose probability fell by more than this (μ - π_prox)."
    )
    dppo_mask_high: float = Field(
        0.2, gt=0, le=1, description="A > 0: mask a token whose probability rose by more than this (π_prox - μ)."
    )
    clip_eps: float = Field(0.2, gt=0, lt=1, description="ε of the PPO clip range [1-ε, 1+ε] on π_θ/π_prox.")
    dual_clip_c: float = Field(
        3.0, gt=1, description="c of the dual clip (PPO, negative advantages): the objective is at least c·A."
    )
    max_log_ratio: float = Field(
        20.0, gt=0, description="|log ratio| is clamped to this before the exponential (no overflow to inf)."
    )
    kl_coef: float = Field(
        0.0,
        ge=0,
        description="Weight of the reverse KL(π_θ || π_ref) penalty: importance-weighted k2 per token, whose "
        "gradient is the reverse KL's (see the module docstring).",
    )
    kl_estimator: Literal["k2", "exact"] = Field(
        "k2",
        description="The KL penalty's form: importance-weighted k2 on the sampled tokens, or the exact KL over "
        "the vocabulary at each visited state (the module docstring).",
    )
    entropy_coef: float = Field(
        0.0, ge=0, description="Weight of the entropy bonus: the loss is lowered by this times the mean entropy."
    )
    normalize: Literal["token", "sequence"] = Field("sequence", description="How per-token losses are averaged.")
    offline_weight: float = Field(1.0, ge=0, description="Weight of offline group-rollout samples vs online ones.")


@dataclass
class LossOutput:
    loss: torch.Tensor
    stats: dict[str, float] = field(default_factory=dict)


def _reduce(per_token_BT: torch.Tensor, mask_BT: torch.Tensor, weight_B: torch.Tensor, how: str) -> torch.Tensor:
    if how == "token":
        w = mask_BT * weight_B[:, None]
        return (per_token_BT * w).sum() / mask_BT.sum().clamp(min=1)
    per_seq = (per_token_BT * mask_BT).sum(-1) / mask_BT.sum(-1).clamp(min=1)
    return (per_seq * weight_B).sum() / weight_B.numel()


def entropy(logp_BTV: torch.Tensor) -> torch.Tensor:
    """-Σ_a p log p per position [B, T], differentiable; entries at -inf (cut by top-p) add 0 and
    send no nan back (their log-probability is replaced by 0 before the product, not after)."""
    finite_logp = torch.where(torch.isfinite(logp_BTV), logp_BTV, torch.zeros_like(logp_BTV))
    return -(logp_BTV.exp() * finite_logp).sum(-1)


def exact_kl(logp_BTV: torch.Tensor, ref_logp_BTV: torch.Tensor, max_log_ratio: float = 20.0) -> torch.Tensor:
    """KL(π_θ || π_ref) at each position [B, T], summed over the vocabulary, differentiable in `logp_BTV`
    (a log-softmax, so normalised). Its value is Σ_a p_a d_a (d = log π_θ - log π_ref); its gradient is
    taken through Σ_a sg(p_a d_a) log π_θ(a), which has the same gradient (p ⊙ (d - KL) in the logits:
    the two differ by p, which the log-softmax's Jacobian sends to 0), and which is exactly 0 where the
    policy equals its reference, not rounding noise for Adam to scale up. Entries where π_θ is 0 (-inf:
    cut by top-p) add 0 and send no nan back; each log-ratio is clamped to [-max_log_ratio,
    max_log_ratio] (a token the reference cut would otherwise make it inf)."""
    if logp_BTV.shape != ref_logp_BTV.shape:
        raise ValueError(f"logp {tuple(logp_BTV.shape)} and ref_logp {tuple(ref_logp_BTV.shape)} must have one shape")
    live = torch.isfinite(logp_BTV)
    zero = torch.zeros_like(logp_BTV)
    finite_logp = torch.where(live, logp_BTV, zero)
    ref = torch.where(live, ref_logp_BTV.to(logp_BTV.dtype), zero)
    with torch.no_grad():
        c = torch.where(live, finite_logp.exp() * torch.clamp(finite_logp - ref, -max_log_ratio, max_log_ratio), zero)
        value = c.sum(-1)
    surrogate = (c * finite_logp).sum(-1)
    return value + (surrogate - surrogate.detach())


def behaviour_mask(
    prox_logp_BT: torch.Tensor,
    behaviour_logp_BT: torch.Tensor,
    advantages_B: torch.Tensor,
    mask_BT: torch.Tensor,
    cfg: LossConfig,
    exclude_BT: torch.Tensor | None = None,
) -> dict[str, torch.Tensor]:
    """Which real tokens the behaviour correction keeps (module docstring), as float 0/1 [B, T]
    tensors: `keep`, and the reasons a token was masked (`ratio`, `dppo`, `top_p`; a token may have
    several). No gradient."""
    with torch.no_grad():
        real = mask_BT > 0
        L = cfg.max_log_ratio
        rho = torch.exp(torch.clamp(prox_logp_BT - behaviour_logp_BT, -L, L))
        by_ratio = real & ((rho < cfg.mask_ratio_low) | (rho > cfg.mask_ratio_high))
        dp = prox_logp_BT.exp() - behaviour_logp_BT.exp()
        A = advantages_B[:, None].expand_as(dp)
        by_dppo = real & (((A > 0) & (dp > cfg.dppo_mask_high)) | ((A < 0) & (-dp > cfg.dppo_mask_low)))
        by_top_p = real & (exclude_BT > 0) if exclude_BT is not None else torch.zeros_like(real)
        keep = real & ~(by_ratio | by_dppo | by_top_p)
        f = prox_logp_BT.dtype
        return {"keep": keep.to(f), "ratio": by_ratio.to(f), "dppo": by_dppo.to(f), "top_p": by_top_p.to(f)}


def policy_loss(
    logp_BT: torch.Tensor,
    behaviour_logp_BT: torch.Tensor,
    advantages_B: torch.Tensor,
    mask_BT: torch.Tensor,
    cfg: LossConfig,
    ref_logp_BT: torch.Tensor | None = None,
    weight_B: torch.Tensor | None = None,
    entropy_BT: torch.Tensor | None = None,
    prox_logp_BT: torch.Tensor | None = None,
    exclude_BT: torch.Tensor | None = None,
    kl_BT: torch.Tensor | None = None,
) -> LossOutput:
    """The loss to minimise and its statistics (`stats` are plain floats, for logging).

    `prox_logp_BT`: the proximal policy's log-probabilities of the same tokens (the weights at the
    start of the update); None means θ is the proximal policy (an update's first step):
    `logp_BT.detach()`. `exclude_BT`: tokens to mask whatever their ratio (1: cut by the trainer's
    top-p at π_prox). `ref_logp_BT`: the reference's log-probabilities (needed when `kl_coef` > 0;
    `kl_k3` is reported whenever it is given). `entropy_BT`: the per-token entropy of the trainer's
    distribution (`entropy`), with its graph when `entropy_coef` > 0 (needed then). `kl_BT`: the exact
    KL at each position (`exact_kl`), with its graph (needed when `kl_estimator` is "exact" and
    `kl_coef` > 0; `kl_exact` is reported whenever it is given)."""
    if logp_BT.shape != behaviour_logp_BT.shape or logp_BT.shape != mask_BT.shape:
        raise ValueError(
            f"logp {tuple(logp_BT.shape)}, behaviour_logp {tuple(behaviour_logp_BT.shape)} and "
            f"mask {tuple(mask_BT.shape)} must have the same shape"
        )
    if advantages_B.shape != logp_BT.shape[:1]:
        raise ValueError(f"advantages has shape {tuple(advantages_B.shape)}, expected ({logp_BT.shape[0]},)")
    prox = logp_BT.detach() if prox_logp_BT is None else prox_logp_BT.to(logp_BT.dtype).detach()
    if prox.shape != logp_BT.shape:
        raise ValueError(f"prox_logp {tuple(prox.shape)} must have the shape of logp {tuple(logp_BT.shape)}")
    mask = mask_BT.to(logp_BT.dtype)
    weight = torch.ones_like(advantages_B) if weight_B is None else weight_B.to(advantages_B.dtype)
    L = cfg.max_log_ratio
    behaviour = behaviour_logp_BT.to(logp_BT.dtype)
    parts = behaviour_mask(prox, behaviour, advantages_B, mask, cfg, exclude_BT)
    keep = parts["keep"]
    raw_behaviour_log_ratio = prox - behaviour
    rho = torch.exp(torch.clamp(raw_behaviour_log_ratio, -L, L))  # no gradient: prox is detached
    w = torch.clamp(rho, max=cfg.is_cap)
    truncated = keep * (rho > cfg.is_cap).to(mask.dtype)
    raw_full = logp_BT - behaviour  # π_θ / μ
    clamped = (raw_full.detach().abs() > L).to(logp_BT.dtype)
    full_ratio = torch.exp(torch.clamp(raw_full, -L, L)).detach()
    log_r = torch.clamp(logp_BT - prox, -L, L)
    r = torch.exp(log_r)  # π_θ / π_prox, with its gradient
    A = advantages_B[:, None]
    dual = torch.zeros_like(mask)
    if cfg.estimator == "tis":
        w_tis = torch.clamp(full_ratio, max=cfg.is_cap)
        per_token = -w_tis * A * logp_BT * keep
        clipped = keep * (full_ratio > cfg.is_cap).to(logp_BT.dtype)
    else:
        unclipped = r * A
        clipped_obj = torch.clamp(r, 1 - cfg.clip_eps, 1 + cfg.clip_eps) * A
        surrogate = torch.minimum(unclipped, clipped_obj)
        clipped = keep * (clipped_obj < unclipped).to(logp_BT.dtype)
        floor = (cfg.dual_clip_c * A).expand_as(surrogate)
        dual_active = (A < 0) & (surrogate < floor)
        per_token = -w * torch.where(dual_active, floor, surrogate) * keep
        dual = keep * dual_active.to(logp_BT.dtype)
    loss = _reduce(per_token, mask, weight, cfg.normalize)
    n = mask.sum().clamp(min=1)
    kl_estimate = 0.0
    if cfg.kl_coef > 0 and ref_logp_BT is None:
        raise ValueError(f"kl_coef={cfg.kl_coef} needs the reference log-probabilities (ref_logp_BT)")
    if ref_logp_BT is not None:
        if ref_logp_BT.shape != logp_BT.shape:
            raise ValueError(f"ref_logp {tuple(ref_logp_BT.shape)} must have the shape of logp {tuple(logp_BT.shape)}")
        w_kl = torch.clamp(full_ratio, max=cfg.is_cap) * keep
        delta = logp_BT - ref_logp_BT.to(logp_BT.dtype)
        if cfg.kl_coef > 0 and cfg.kl_estimator == "exact":
            if kl_BT is None:
                raise ValueError('kl_estimator="exact" needs the exact KL at each position (kl_BT)')
            loss = loss + cfg.kl_coef * _reduce(kl_BT, mask, weight, cfg.normalize)
        elif cfg.kl_coef > 0:
            loss = loss + cfg.kl_coef * _reduce(w_kl * 0.5 * delta.square(), mask, weight, cfg.normalize)
        with torch.no_grad():
            k3 = torch.expm1(-delta) + delta
            kl_estimate = float(torch.where(mask > 0, w_kl * k3, torch.zeros_like(k3)).sum() / n)
    if cfg.entropy_coef > 0 and entropy_BT is None:
        raise ValueError(f"entropy_coef={cfg.entropy_coef} needs the per-token entropy (entropy_BT)")
    if entropy_BT is not None:
        if entropy_BT.shape != logp_BT.shape:
            raise ValueError(f"entropy {tuple(entropy_BT.shape)} must have the shape of logp {tuple(logp_BT.shape)}")
        if cfg.entropy_coef > 0:
            loss = loss - cfg.entropy_coef * _reduce(entropy_BT, mask, weight, cfg.normalize)
    with torch.no_grad():

        def mean(x: torch.Tensor) -> float:
            return float((x * mask).sum() / n)

        def top(x: torch.Tensor) -> float:
            return float(x.masked_fill(mask == 0, float("-inf")).max()) if mask.any() else 1.0

        stats = {
            "loss": float(loss),
            "ratio_mean": mean(rho),
            "ratio_max": top(rho),
            "abs_log_ratio_mean": mean(torch.clamp(raw_behaviour_log_ratio, -L, L).abs()),
            "truncated_frac": mean(truncated),
            "masked_frac": mean(1 - keep),
            "masked_ratio_frac": mean(parts["ratio"]),
            "masked_dppo_frac": mean(parts["dppo"]),
            "masked_top_p_frac": mean(parts["top_p"]),
            "policy_ratio_max": top(r),
            "policy_abs_log_ratio_mean": mean(log_r.abs()),
            "clip_frac": mean(clipped),
            "dual_clip_frac": mean(dual),
            "clamp_frac": mean(clamped),
            "logp_mean": mean(logp_BT),
            "behaviour_logp_mean": mean(behaviour),
            "adv_mean": float(advantages_B.mean()),
            "adv_std": float(advantages_B.std()) if advantages_B.numel() > 1 else 0.0,
            "kl_k3": kl_estimate,
            "tokens": float(mask.sum()),
        }
        if entropy_BT is not None:
            stats["entropy"] = mean(entropy_BT)
        if kl_BT is not None:
            if kl_BT.shape != logp_BT.shape:
                raise ValueError(f"kl {tuple(kl_BT.shape)} must have the shape of logp {tuple(logp_BT.shape)}")
            stats["kl_exact"] = mean(kl_BT)
    return LossOutput(loss, stats)


def group_advantages(rewards: list[float], scale: bool = True, eps: float = 1e-6) -> list[float]:
    """GRPO-style: r_i - mean(group), divided by the group's (population) std when `scale`."""
    if not rewards:
        raise ValueError("a group needs at least one reward")
    mean = sum(rewards) / len(rewards)
    centred = [r - mean for r in rewards]
    if not scale:
        return centred
    std = math.sqrt(sum(c * c for c in centred) / len(rewards))
    return [c / (std + eps) for c in centred]


class RunningBaseline:
    """b(key): EMA of rewards per key, the global EMA until the key has `min_count` rewards.

    Updated *after* the advantage of a sample is computed, so a sample never baselines itself. At
    most `max_keys` keys are tracked; a key first seen beyond that updates the global EMA only (and
    so is always baselined by it): a stream of distinct keys cannot grow the state without bound.
    """

    max_keys: int = 10_000

    def __init__(self, decay: float = 0.99, min_count: int = 20, initial: float = 0.0, max_keys: int = 10_000):
        if not 0.0 < decay < 1.0:
            raise ValueError(f"decay must be in (0, 1), got {decay}")
        if min_count < 0:
            raise ValueError(f"min_count must be >= 0, got {min_count}")
        if max_keys < 0:
            raise ValueError(f"max_keys must be >= 0, got {max_keys}")
        self.decay, self.min_count, self.max_keys = decay, min_count, max_keys
        self.global_value, self.global_count = initial, 0
        self.values: dict[str, float] = {}
        self.counts: dict[str, int] = {}

    def keyed(self, key: str | None) -> bool:
        """`value(key)` is the key's own EMA (not the global fallback): it has `min_count` rewards, and one."""
        return key is not None and self.counts.get(key, 0) >= max(self.min_count, 1)

    def value(self, key: str | None = None) -> float:
        if key is not None and self.keyed(key):
            return self.values[key]
        return self.global_value

    def update(self, reward: float, key: str | None = None) -> None:
        d = self.decay
        # Bias-corrected start: the first rewards set the level instead of being shrunk towards `initial`.
        self.global_count += 1
        a = max(1.0 - d, 1.0 / self.global_count)
        self.global_value += a * (reward - self.global_value)
        if key is not None and (key in self.counts or len(self.counts) < self.max_keys):
            c = self.counts.get(key, 0) + 1
            self.counts[key] = c
            v = self.values.get(key, reward)
            self.values[key] = v + max(1.0 - d, 1.0 / c) * (reward - v)

    def state_dict(self) -> dict:
        return {
            "decay": self.decay,
            "min_count": self.min_count,
            "max_keys": self.max_keys,
            "global_value": self.global_value,
            "global_count": self.global_count,
            "values": dict(self.values),
            "counts": dict(self.counts),
        }

    @classmethod
    def from_state_dict(cls, state: dict) -> RunningBaseline:
        b = cls(state["decay"], state["min_count"], max_keys=state.get("max_keys", cls.max_keys))
        b.global_value, b.global_count = state["global_value"], state["global_count"]
        b.values, b.counts = dict(state["values"]), dict(state["counts"])
        return b
