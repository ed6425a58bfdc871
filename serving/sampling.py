"""Sampling parameters and the sampling distribution, shared by the engine and the scorer.

The log-probability recorded for a sampled token is that of the distribution the token was
actually drawn from: logits / temperature, then top-p truncation and renormalisation. The same
function (`sampling_logprobs`) serves the engine while it samples and a full forward pass that
re-scores a completion, so the two agree by construction. Greedy decoding (temperature 0) draws
from a point mass: its recorded log-probability is 0.

Sampling is inverse-CDF with one uniform number per row, so a request with a `seed` draws the
same tokens whatever else shares its batch.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 1.0
    top_p: float = 1.0
    max_tokens: int = 64
    stop: tuple[str, ...] = ()
    seed: int | None = None
    logprobs: int = 0  # how many top alternatives to return per token (0: only the sampled one)
    ignore_eos: bool = False  # keep generating past end-of-sequence (benchmarks: fixed output length)

    def __post_init__(self) -> None:
        if (
            not isinstance(self.temperature, (int, float))
            or not 0.0 <= self.temperature <= 2.0
            or math.isnan(self.temperature)
        ):
            raise ValueError(f"temperature must be in [0, 2], got {self.temperature!r}")
        if not isinstance(self.top_p, (int, float)) or not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p!r}")
        if not isinstance(self.max_tokens, int) or isinstance(self.max_tokens, bool) or self.max_tokens < 1:
            raise ValueError(f"max_tokens must be a positive integer, got {self.max_tokens!r}")
        if len(self.stop) > 4 or any(not isinstance(s, str) or not s for s in self.stop):
            raise ValueError(f"stop must be at most 4 non-empty strings, got {self.stop!r}")
        if self.seed is not None and (not isinstance(self.seed, int) or isinstance(self.seed, bool)):
            raise ValueError(f"seed must be an integer, got {self.seed!r}")
        if not isinstance(self.logprobs, int) or not 0 <= self.logprobs <= 20:
            raise ValueError(f"logprobs must be an integer in [0, 20], got {self.logprobs!r}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


def sampling_logprobs(logits_NV: torch.Tensor, temperature_N: torch.Tensor, top_p_N: torch.Tensor) -> torch.Tensor:
    """Log-probabilities of the distribution sampled from, per row, float32 `[N, V]`.

    Rows with temperature 0 are returned as log_softmax of the raw logits (the caller takes their
    argmax, and records the model's own log-probability of it, as OpenAI and vLLM report it).
    Tokens cut by top-p get -inf. Every row's result depends on that row alone: only the
    rows with top_p < 1 go through the top-p cut and its renormalisation (renormalising a top_p = 1
    row too would move it by a float32 ulp or two, measured 4.8e-7 of a log-prob, so the recorded
    value would depend on the other requests of a decode step and the trainer's on its micro-batch).
    """
    t = torch.where(temperature_N > 0, temperature_N, torch.ones_like(temperature_N)).float()
    logp = torch.log_softmax(logits_NV.float() / t[:, None], dim=-1)
    cut_N = top_p_N < 1.0
    if not bool(cut_N.any()):
        return logp
    rows = None if bool(cut_N.all()) else cut_N.nonzero().squeeze(1)
    sub = logp if rows is None else logp[rows]
    top_p = (top_p_N if rows is None else top_p_N[rows]).float()
    sorted_lp, order = torch.sort(sub, dim=-1, descending=True)
    before = torch.cumsum(sorted_lp.exp(), dim=-1) - sorted_lp.exp()  # mass strictly before each token
    drop_sorted = before >= top_p[:, None]
    drop_sorted[:, 0] = False  # the most likely token always stays
    drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
    sub = sub.masked_fill(drop, float("-inf"))
    sub = sub - torch.logsumexp(sub, dim=-1, keepdim=True)
    return sub if rows is None else logp.index_put((rows,), sub)


def sample_rows(logp_NV: torch.Tensor, greedy_N: torch.Tensor, uniforms_N: torch.Tensor):
    """Draw one token per row by inverse CDF. Returns (tokens [N], logprobs [N])."""
    probs = logp_NV.exp()
    cdf = torch.cumsum(probs, dim=-1)
    total = cdf[:, -1]
    # u in (0, total): a zero-probability token can never be the first cdf >= u.
    u = torch.minimum(torch.maximum(uniforms_N.to(cdf.dtype) * total, total * 1e-9), total * (1 - 1e-7))[:, None]
    drawn = torch.searchsorted(cdf, u).squeeze(-1).clamp(max=logp_NV.shape[-1] - 1)
    tokens = torch.where(greedy_N, logp_NV.argmax(dim=-1), drawn)
    return tokens, logp_NV.gather(-1, tokens[:, None]).squeeze(-1)
