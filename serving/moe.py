"""The Mixture-of-Experts layer of `serving/model.py`: the router, the SwiGLU experts, and how a batch of
tokens reaches its experts.

Owns `Expert` and `SparseMoE` (names as in the Mixtral checkpoint). Two ways to the same bits in
batch-invariant mode: dispatching each token to its own top-k experts (any number of rows, autograd),
or, for up to `DENSE_MOE_ROWS` rows with gradients off (a decode step, with or without a short prompt
beside it), every expert on every row (`SparseMoE._every_expert`). Replay (`replay_NK`) routes every
token to recorded experts.
Shape legend as in `serving/model.py`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn

from serving.batch_invariant import invariant_linear, invariant_silu, kept_copy, matmul_t, pad_rows

if TYPE_CHECKING:
    from serving.model import ModelArgs


class Expert(nn.Module):
    """SwiGLU: w2(silu(w1 x) * w3 x). Names as in the Mixtral checkpoint."""

    def __init__(self, dim: int, hidden_dim: int):
        super().__init__()
        self.w1 = nn.Linear(dim, hidden_dim, bias=False)
        self.w2 = nn.Linear(hidden_dim, dim, bias=False)
        self.w3 = nn.Linear(dim, hidden_dim, bias=False)

    def forward(self, x: torch.Tensor, invariant: bool = False) -> torch.Tensor:
        if invariant:  # x: [M, D] contiguous rows (the tokens routed here), padded once for all three
            xp = pad_rows(x)
            h = invariant_silu(matmul_t(xp, self.w1.weight)) * matmul_t(xp, self.w3.weight)
            return matmul_t(h, self.w2.weight)[: x.shape[0]]
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


# Up to this many rows (tokens) the batch-invariant MoE runs every expert on every row instead of
# dispatching each row to its own (`SparseMoE._every_expert`), with gradients off only: a decode step
# of up to 64 sequences, or one of about 30 with a prompt admitted beside it (docs/benchmarks.md).
DENSE_MOE_ROWS = 64


class SparseMoE(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        self.top_k = args.top_k
        self.gate = nn.Linear(args.dim, args.n_experts, bias=False)  # the router
        self.experts = nn.ModuleList(Expert(args.dim, args.hidden_dim) for _ in range(args.n_experts))

    def forward(self, x_ND: torch.Tensor, replay_NK: torch.Tensor | None = None, invariant: bool = False):
        router_ND = invariant_linear(x_ND, self.gate.weight) if invariant else self.gate(x_ND)
        probs_NE = F.softmax(router_ND.float(), dim=-1)
        if replay_NK is None:
            w_NK, idx_NK = torch.topk(probs_NE, self.top_k, dim=-1)
        else:
            idx_NK = replay_NK.to(torch.int64)
            w_NK = probs_NE.gather(-1, idx_NK)  # the router's own weights at the replayed experts
        w_NK = w_NK / w_NK.sum(dim=-1, keepdim=True)
        N, K = idx_NK.shape
        if invariant and N <= DENSE_MOE_ROWS and not torch.is_grad_enabled():  # no gradient: weights detached
            return self._every_expert(x_ND, w_NK, idx_NK), idx_NK
        # Dispatch by one sort: each token's experts in ascending order (rank j), then all (token, j) pairs
        # grouped by expert, so that an expert's rows are one contiguous slice of a single gather.
        e_NJ, j2k_NJ = idx_NK.sort(dim=-1, stable=True)
        order_M = torch.argsort(e_NJ.reshape(-1), stable=True)  # M = N * K pairs, by expert
        counts = torch.bincount(e_NJ.reshape(-1), minlength=len(self.experts)).tolist()
        x_MD = x_ND.index_select(0, torch.div(order_M, K, rounding_mode="floor"))
        ys, start = [], 0
        for expert, c in zip(self.experts, counts):
            if c:
                ys.append(expert(x_MD[start : start + c], invariant))
                start += c
        y_MD = (ys[0] if len(ys) == 1 else torch.cat(ys)) * w_NK.gather(-1, j2k_NJ).reshape(-1)[order_M, None]
        # Back to (token, rank) order, then summed in ascending expert order: (0 + y_lowest) + ... as a
        # token's experts were always added, so the sum never depends on the batch or on the order of slots.
        y_NJD = y_MD.new_empty(y_MD.shape).index_copy_(0, order_M, y_MD).view(N, K, -1).to(x_ND.dtype)
        out_ND = torch.zeros_like(x_ND)
        for j in range(K):
            out_ND = out_ND + y_NJD[:, j]
        return out_ND, idx_NK

    def _every_expert(self, x_ND: torch.Tensor, w_NK: torch.Tensor, idx_NK: torch.Tensor) -> torch.Tensor:
        """The batch-invariant MoE of a few rows (a decode step): every expert on every row, then each row
        takes its own experts' outputs. The same bits as dispatching: an expert's matmul rows are
        independent from `MIN_GEMM_ROWS` on, the experts' matmuls run as one batched matmul per weight
        (`_stacked_t`) that rounds each expert's matrix as its own matmul does (asserted by
        tests/serving/test_model.py), every elementwise op is exact or the same for an element wherever it
        lies, and the mixing is the same products summed in the same order. In a fraction of the operators:
        no sort of the pairs, no gathers, three matmuls and one SiLU for all experts. An expert padded to
        `MIN_GEMM_ROWS` rows anyway costs nothing more; up to `DENSE_MOE_ROWS` rows the operators saved
        cost more than the extra rows (docs/benchmarks.md)."""
        N, K = idx_NK.shape
        w1_EDF, w3_EDF, w2_EFD = self._stacked_t()
        E, D, _ = w1_EDF.shape
        xp = pad_rows(x_ND.contiguous())
        M = xp.shape[0]
        x_EMD = xp.expand(E, M, D)
        h_EMF = invariant_silu(torch.bmm(x_EMD, w1_EDF)).mul_(torch.bmm(x_EMD, w3_EDF))
        y_EMD = torch.bmm(h_EMF, w2_EFD)
        # Each row's experts in ascending order (rank j) with their mixing weights, as the dispatch sums them.
        e_NJ, j2k_NJ = idx_NK.sort(dim=-1, stable=True)
        rows_NJ = e_NJ * M + torch.arange(N, device=x_ND.device)[:, None]
        y_NJD = y_EMD.view(E * M, D).index_select(0, rows_NJ.view(-1)).view(N, K, D)
        y_NJD = (y_NJD * w_NK.gather(-1, j2k_NJ)[..., None]).to(x_ND.dtype)
        out_ND = torch.zeros_like(x_ND)
        for j in range(K):
            out_ND = out_ND + y_NJD[:, j]
        return out_ND

    def _stacked_t(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The experts' weights transposed (as `row_major_t`) and stacked, `[E, D, F]` for w1 and w3 and
        `[E, F, D]` for w2: kept on the module, made again once any of them changed (`kept_copy`)."""
        ws = [w for e in self.experts if isinstance(e, Expert) for w in (e.w1.weight, e.w3.weight, e.w2.weight)]

        def stack() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
            w1, w3, w2 = (torch.stack([w.detach().t() for w in ws[i::3]]) for i in range(3))
            return w1, w3, w2

        return kept_copy(self, "_stacked", ws, stack)
