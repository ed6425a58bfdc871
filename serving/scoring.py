"""Scoring completions with a full forward pass: the reference every engine's recorded log-probs and routed
experts are checked against (`score`), and the gate's batched scoring of many completions (`score_many`)."""

from __future__ import annotations

import numpy as np
import torch

from serving.model import Transformer
from serving.sampling import SamplingParams, sampling_logprobs


def score(
    model: Transformer,
    prompt_ids: list[int],
    output_ids: list[int],
    params: SamplingParams,
    replay_experts: np.ndarray | None = None,
    n_vocab: int | None = None,
    batch_invariant: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    """A full forward pass over prompt + output: (sampling log-probs of the output tokens [N],
    routed experts of every fed token [P + N - 1, L, K]). The reference the engine is tested against."""
    seq = torch.tensor([prompt_ids + output_ids[:-1]])
    replay = None if replay_experts is None else torch.as_tensor(replay_experts, dtype=torch.int64)[None]
    with torch.inference_mode():
        out = model(seq, replay_experts=replay, return_experts=True, batch_invariant=batch_invariant)
    P = len(prompt_ids)
    logits = out.logits[0, P - 1 :, :n_vocab]
    n = logits.shape[0]
    logp = sampling_logprobs(logits, torch.full((n,), float(params.temperature)), torch.full((n,), float(params.top_p)))
    return logp.gather(-1, torch.tensor(output_ids)[:, None]).squeeze(-1), out.experts[0]


def score_many(
    model: Transformer,
    requests: list[tuple[list[int], list[int], SamplingParams]],
    n_vocab: int | None = None,
    batch_invariant: bool = True,
    micro_batch: int = 32,
) -> list[torch.Tensor]:
    """`score`'s log-probabilities for many (prompt ids, output ids, params), `micro_batch` sequences per
    forward: each right-padded to the longest of its batch, so causal attention never sees the padding.
    With `batch_invariant` (float32) every row equals its own `score` bit for bit (tests/serving)."""
    if micro_batch < 1:
        raise ValueError(f"micro_batch must be at least 1, got {micro_batch}")
    out: list[torch.Tensor] = []
    for start in range(0, len(requests), micro_batch):
        chunk = requests[start : start + micro_batch]
        fed = [p + o[:-1] for p, o, _ in chunk]
        tokens = torch.zeros((len(chunk), max(len(f) for f in fed)), dtype=torch.int64)
        for i, f in enumerate(fed):
            tokens[i, : len(f)] = torch.tensor(f, dtype=torch.int64)
        with torch.inference_mode():
            logits_BTV = model(tokens, batch_invariant=batch_invariant).logits
        for i, (prompt, output, params) in enumerate(chunk):
            P, N = len(prompt), len(output)
            logits = logits_BTV[i, P - 1 : P - 1 + N, :n_vocab]
            logp = sampling_logprobs(
                logits, torch.full((N,), float(params.temperature)), torch.full((N,), float(params.top_p))
            )
            chosen = logp.gather(-1, torch.tensor(output, dtype=torch.int64)[:, None]).squeeze(-1)
            out.append(chosen)
    return out
