"""Re-scoring served completions in the trainer, with router replay.

Owns the step from recorded completions (prompt ids, output ids, the sampled log-probabilities,
the experts every fed token went to, the sampling parameters) to the trainer's log-probabilities
of the same tokens under the same sampling transform (`serving.sampling.sampling_logprobs`:
temperature, then top-p; every row on its own), with every
token routed to the experts it was routed to at serving time, computed with the model's
batch-invariant kernels as the engine's decode steps were (bit-identical at the behaviour
version). Without replay, a MoE trainer whose numerics differ from the server's (bf16, or the
default kernels) can send a token to other experts than the ones that produced it, and the
importance ratio then measures routing noise rather than policy change.

Also measures, per batch, what the learner logs every update: |Δ log-prob| between the recorded
values and the trainer's recomputation, and the share of (token, layer) routing decisions that
would differ without replay.

Layout of one sequence: tokens = prompt + output; routed experts are recorded for the P + N - 1
fed tokens; the last position predicts nothing used, so its replay slot is filled with experts
0..K-1 (any valid choice gives the same log-probabilities for the output tokens).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from serving.model import Transformer
from serving.sampling import sampling_logprobs


@dataclass
class Sequence:
    """One served completion, as the learner needs it."""

    prompt_ids: list[int]
    output_ids: list[int]
    logprobs: list[float]  # recorded: under the behaviour version's sampling distribution
    routed_experts: np.ndarray  # [P + N - 1, L, K] uint8 (may be [0, L, K]: not recorded)
    temperature: float
    top_p: float
    reward: float = 0.0
    version: str = ""
    key: str | None = None  # baseline key (task family, tenant)
    weight: float = 1.0

    def __post_init__(self) -> None:
        if not self.output_ids:
            raise ValueError("a training sequence needs at least one output token")
        if len(self.logprobs) != len(self.output_ids):
            raise ValueError(f"{len(self.logprobs)} logprobs for {len(self.output_ids)} output tokens")
        if self.temperature <= 0:
            raise ValueError(f"temperature {self.temperature} (greedy) carries no usable importance ratio")

    @property
    def has_routing(self) -> bool:
        return self.routed_experts.shape[0] == len(self.prompt_ids) + len(self.output_ids) - 1


@dataclass
class Batch:
    tokens_BS: torch.Tensor  # prompt + output, right-padded
    replay_BSLK: torch.Tensor | None  # None when some sequence has no recorded routing
    out_pos_BT: torch.Tensor  # position of the logits predicting each output token
    targets_BT: torch.Tensor
    mask_BT: torch.Tensor
    behaviour_BT: torch.Tensor
    temps_B: torch.Tensor
    top_p_B: torch.Tensor


def make_batch(seqs: list[Sequence], pad_id: int, n_layers: int, top_k: int, replay: bool = True) -> Batch:
    if not seqs:
        raise ValueError("empty batch")
    S = max(len(s.prompt_ids) + len(s.output_ids) for s in seqs)
    T = max(len(s.output_ids) for s in seqs)
    B = len(seqs)
    tokens = torch.full((B, S), pad_id, dtype=torch.long)
    out_pos = torch.zeros((B, T), dtype=torch.long)
    targets = torch.full((B, T), pad_id, dtype=torch.long)
    mask = torch.zeros((B, T))
    behaviour = torch.zeros((B, T))
    use_replay = replay and all(s.has_routing for s in seqs)
    filler = torch.arange(top_k, dtype=torch.long)
    routing = filler.expand(B, S, n_layers, top_k).clone() if use_replay else None
    for i, s in enumerate(seqs):
        P, N = len(s.prompt_ids), len(s.output_ids)
        tokens[i, : P + N] = torch.tensor(s.prompt_ids + s.output_ids)
        out_pos[i, :N] = torch.arange(P - 1, P + N - 1)
        targets[i, :N] = torch.tensor(s.output_ids)
        mask[i, :N] = 1.0
        behaviour[i, :N] = torch.tensor(s.logprobs)
        if routing is not None:
            rec = torch.from_numpy(np.ascontiguousarray(s.routed_experts)).long()
            if rec.shape[1:] != (n_layers, top_k):
                raise ValueError(
                    f"recorded routing has shape {tuple(rec.shape)}, the model needs [*, {n_layers}, {top_k}]"
                )
            routing[i, : P + N - 1] = rec
    return Batch(
        tokens,
        routing,
        out_pos,
        targets,
        mask,
        behaviour,
        torch.tensor([s.temperature for s in seqs]),
        torch.tensor([s.top_p for s in seqs]),
    )


def sampling_distribution(
    model: torch.nn.Module, batch: Batch, n_vocab: int | None = None, replay: bool = True, batch_invariant: bool = True
) -> tuple[torch.Tensor, torch.Tensor]:
    """(log-probabilities [B, T, V] of the distribution each output token was sampled from, under the
    sampling transform, routed experts [B, S, L, K]). Tokens cut by top-p are -inf.

    `batch_invariant`: the model's batch-invariant kernels (float32), the ones the engine decodes
    with by default, so the recomputation is bit-identical to the recorded values at the behaviour
    version whatever the micro-batch; off, the two differ by float32 rounding (a few 1e-6)."""
    out = model(
        batch.tokens_BS,
        replay_experts=batch.replay_BSLK if replay else None,
        return_experts=True,
        batch_invariant=batch_invariant,
    )
    B, T = batch.targets_BT.shape
    logits = out.logits.gather(1, batch.out_pos_BT[..., None].expand(B, T, out.logits.shape[-1]))
    logits = logits[..., :n_vocab] if n_vocab else logits
    V = logits.shape[-1]
    logp = sampling_logprobs(
        logits.reshape(B * T, V), batch.temps_B.repeat_interleave(T), batch.top_p_B.repeat_interleave(T)
    ).view(B, T, V)
    return logp, out.experts


def chosen_logprobs(logp_BTV: torch.Tensor, batch: Batch) -> torch.Tensor:
    """The log-probabilities [B, T] of the output tokens (0 on padding)."""
    chosen = logp_BTV.gather(-1, batch.targets_BT[..., None]).squeeze(-1)
    # A token cut by the trainer's own top-p has log-probability -inf: keep it finite and out of the loss.
    chosen = torch.where(torch.isfinite(chosen), chosen, torch.full_like(chosen, -30.0))
    return chosen * batch.mask_BT


def top_p_cut(logp_BTV: torch.Tensor, batch: Batch) -> torch.Tensor:
    """1.0 [B, T] where a real output token lies outside the trainer's own top-p set (its log-probability
    under the sampling transform is -inf; `chosen_logprobs` keeps it finite, and the objective masks it)."""
    chosen = logp_BTV.detach().gather(-1, batch.targets_BT[..., None]).squeeze(-1)
    return (~torch.isfinite(chosen)).to(batch.mask_BT.dtype) * batch.mask_BT


def token_entropy(logp_BTV: torch.Tensor) -> torch.Tensor:
    """-Σ p log p per position [B, T] of a (possibly top-p truncated) distribution: cut tokens add 0."""
    p = logp_BTV.exp()
    return -torch.where(torch.isfinite(logp_BTV), p * logp_BTV, torch.zeros_like(p)).sum(-1)


def trainer_logprobs(
    model: torch.nn.Module, batch: Batch, n_vocab: int | None = None, replay: bool = True, batch_invariant: bool = True
) -> tuple[torch.Tensor, torch.Tensor]:
    """(log-probabilities of the output tokens [B, T] under the sampling transform, routed experts
    [B, S, L, K]): `chosen_logprobs` of `sampling_distribution`."""
    logp_BTV, experts = sampling_distribution(model, batch, n_vocab, replay, batch_invariant)
    return chosen_logprobs(logp_BTV, batch), experts


@torch.no_grad()
def mismatch_stats(
    model: Transformer, batch: Batch, n_vocab: int | None = None, batch_invariant: bool = True
) -> dict[str, float]:
    """At the behaviour version: recorded vs recomputed log-probs (with replay), and how many
    (token, layer) routing decisions the trainer would make differently without replay."""
    stats: dict[str, float] = {}
    n = batch.mask_BT.sum().clamp(min=1)
    lp, _ = trainer_logprobs(
        model, batch, n_vocab, replay=batch.replay_BSLK is not None, batch_invariant=batch_invariant
    )
    d = (lp - batch.behaviour_BT).abs() * batch.mask_BT
    stats["abs_dlogp_mean"] = float(d.sum() / n)
    stats["abs_dlogp_max"] = float(d.max())
    if batch.replay_BSLK is not None:
        lp_free, experts = trainer_logprobs(model, batch, n_vocab, replay=False, batch_invariant=batch_invariant)
        fed = torch.zeros(batch.tokens_BS.shape, dtype=torch.bool)
        for i in range(fed.shape[0]):
            n_fed = int(batch.mask_BT[i].sum()) + int((batch.out_pos_BT[i, 0]).item())  # P + N - 1
            fed[i, :n_fed] = True
        same = (experts.sort(-1).values == batch.replay_BSLK.sort(-1).values).all(-1)  # [B, S, L]
        decisions = fed[..., None].expand_as(same)
        stats["routing_disagreement"] = float((~same & decisions).sum() / decisions.sum().clamp(min=1))
        d_free = (lp_free - batch.behaviour_BT).abs() * batch.mask_BT
        stats["abs_dlogp_mean_no_replay"] = float(d_free.sum() / n)
        stats["abs_dlogp_max_no_replay"] = float(d_free.max())
    return stats
