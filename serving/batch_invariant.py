"""Batch-invariant kernels: a row's result does not depend on what else is in the batch.

Owns the float32 kernels of the model's batch-invariant mode (`Transformer(batch_invariant=True)`,
`forward(batch_invariant=...)`): a token gets bit-identical logits whatever else is in the batch,
whether it is computed in a prefill, a decode step against the KV cache or one full forward, so the
log-probs recorded at serving equal the trainer's recomputation. torch's default CPU kernels do not
give that (SDPA, MKL's small-matrix path, fused SiLU and long reductions all round by shape;
docs/numerics.md says which and by how much). These kernels therefore:
- compute every linear layer and expert matmul with at least `MIN_GEMM_ROWS` rows, padding small
  inputs with zero rows (`invariant_linear`, `pad_rows`), so a row's result is independent of the
  batch and of its place in it;
- compute attention (`InvariantAttention`) so that what varies between a decode step and a full
  forward is never a matmul's row count or reduction length: scores = keys @ queries^T over key
  blocks of `KEY_BLOCK`, then [v | 1 | 0...]^T @ p per block (the weighted values and the softmax
  denominator in one fixed-size reduction), blocks summed pairwise; the KV cache keeps the 1 column
  (`value_width`);
- compute SiLU as x / (1 + exp(-x)) (`InvariantSiLU`).
Gradients come from torch's own kernels: only the forward values need to be invariant.

Called by `serving/model.py` (its layers), `serving/kv_cache.py` (`value_width`) and the model tests.
Shape legend as in `serving/model.py`.
"""

from __future__ import annotations

import logging
import math

import torch
import torch.nn.functional as F

log = logging.getLogger(__name__)

# A float32 matmul with fewer rows than this takes MKL's small-matrix path (measured: up to 15 rows
# for an inner dimension of 384 and more), which rounds differently.
MIN_GEMM_ROWS = 16
# Attention reduces over keys in blocks of this many (the key axis is padded to a multiple): MKL
# splits a long reduction into pieces whose size depends on its length (measured: past ~400), so a
# decode step and a full forward would otherwise group the same terms differently.
KEY_BLOCK = 32
# Scores are [KEY_BLOCK, Dh] @ [Dh, queries]; torch computes a matmul of fewer than 400 multiply-adds
# with its own naive kernel, which rounds differently: smaller heads are padded with zero columns.
_MIN_HEAD_DIM = 16


def value_width(head_dim: int) -> int:
    """Columns of a value row in the cache and in the batch-invariant attention: v, a 1, zeros up to
    `MIN_GEMM_ROWS` (that matmul's rows)."""
    return max(head_dim + 1, MIN_GEMM_ROWS)


def invariant_linear(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """`F.linear(x, weight)` whose rows do not depend on how many rows there are (batch-invariant mode).

    Inputs with fewer than `MIN_GEMM_ROWS` rows are padded with zero rows, so every call takes the
    same blocked MKL path; from there on a row's result depends only on the row itself."""
    m = x.numel() // x.shape[-1]
    if m >= MIN_GEMM_ROWS and x.is_contiguous():
        return F.linear(x, weight)  # one [m, K] matmul, as the 2-D call below
    y = F.linear(pad_rows(x.reshape(m, x.shape[-1]).contiguous()), weight)[:m]
    return y.reshape(*x.shape[:-1], weight.shape[0])


def matmul_t(x_MK: torch.Tensor, weight_NK: torch.Tensor) -> torch.Tensor:
    """x @ weight^T as a plain matmul against the row-major transpose of `weight` ([K, N]): with cold
    weights (every expert's between two passes) that layout reads faster than `F.linear`'s (a 16-row
    SwiGLU expert: 83-86 against 105-107 us, docs/benchmarks.md). The serving pass and the trainer both
    compute an expert this way, so the bits they get are the same whichever layout MKL rounds how.
    `x_MK` has at least `MIN_GEMM_ROWS` rows, as for `invariant_linear`."""
    return torch.mm(x_MK, row_major_t(weight_NK))


# Copies of weights made afresh because the weights were inference tensors (`kept_copy`'s slow path).
fresh_transposes = 0


def kept_copy(owner, name: str, weights: list[torch.Tensor], make):
    """`make()` (a copy derived from `weights`: a transpose, a stack) kept on `owner` as attribute `name`
    and made again once any of the weights changed: an in-place write bumps a tensor's version counter
    (`load_state_dict`, an optimizer step), a new storage changes its address. An inference tensor has
    no version counter: the copy is made afresh every call, a slow path counted in `fresh_transposes`
    and logged once (the engine loads its weights as normal tensors for this reason)."""
    global fresh_transposes
    if any(w.is_inference() for w in weights):
        if not fresh_transposes:
            log.warning("a model's weights are inference tensors: copies of them made afresh in every pass (slower)")
        fresh_transposes += 1
        return make()
    key = tuple((w._version, w.data_ptr()) for w in weights)
    kept = getattr(owner, name, None)
    if kept is None or kept[0] != key:
        kept = (key, make())
        setattr(owner, name, kept)
    return kept[1]


def row_major_t(weight: torch.Tensor) -> torch.Tensor:
    """`weight.t().contiguous()`. Under autograd (the trainer) a fresh copy in the graph; otherwise (a
    serving pass, a scoring pass) one copy kept on the weight tensor (`kept_copy`)."""
    if torch.is_grad_enabled() and weight.requires_grad:
        return weight.t().contiguous()
    return kept_copy(weight, "_row_major_t", [weight], lambda: weight.detach().t().contiguous())


def pad_rows(x_MK: torch.Tensor) -> torch.Tensor:
    m = x_MK.shape[0]
    return F.pad(x_MK, (0, 0, 0, MIN_GEMM_ROWS - m)) if m < MIN_GEMM_ROWS else x_MK


def _silu_values(x: torch.Tensor) -> torch.Tensor:
    d = torch.neg(x).exp_().add_(1.0)
    return torch.div(x, d, out=d)


def invariant_silu(x: torch.Tensor) -> torch.Tensor:
    """SiLU with batch-invariant values (`InvariantSiLU`); without autograd when no gradient is wanted."""
    return InvariantSiLU.apply(x) if torch.is_grad_enabled() and x.requires_grad else _silu_values(x)


class InvariantSiLU(torch.autograd.Function):
    """SiLU as x / (1 + exp(-x)): exp is MKL's vector math, which rounds an element the same wherever
    it falls (torch's fused silu kernel rounds its vectorised body and scalar tail differently).
    The gradient is torch's own silu gradient: only the forward values need to be invariant."""

    @staticmethod
    def forward(ctx, x: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(x)
        return _silu_values(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> torch.Tensor:
        (x,) = ctx.saved_tensors
        return torch.ops.aten.silu_backward(grad, x)


def _batched_rows(x_BGSd: torch.Tensor) -> bool:
    """Can the matmul take `x_BGSd` as it lies: each [S, d] matrix row-major and contiguous, and B, G one
    batch axis (a slot's rows of the KV cache, read in place, are; the slots lie `max_len` apart)."""
    B, G, S, d = x_BGSd.shape
    st = x_BGSd.stride()
    return st[3] == 1 and (S == 1 or st[2] == d) and (B == 1 or st[0] == G * st[1])


def query_columns(T: int, n_heads: int, n_kv_heads: int) -> int:
    """How many query columns per head the attention's matmuls take for T queries (`_attend`'s T_mm)."""
    return max(T, -(-MIN_GEMM_ROWS // (n_heads // n_kv_heads)))


def _attend(
    q_BHTd: torch.Tensor,
    k_BGSd: torch.Tensor,
    v_BGSW: torch.Tensor,
    query_pos_BT: torch.Tensor,
    memo: dict | None = None,
) -> torch.Tensor:
    """The batch-invariant attention's forward (no autograd). Key s is visible to query t of sequence b
    iff s <= query_pos_BT[b, t]. `v_BGSW` holds [v | 1 | 0...] rows (`value_width`). Returns [B, T, H * Dh].
    `q_BHTd` may already carry the repeated columns below (T_mm of them, `query_columns`; T is the
    positions' length). `memo`: a dict shared by the calls of one pass over the same queries' positions
    (every layer of a step), which keeps the key mask built by the first."""
    B, H, _, Dh = q_BHTd.shape
    T = query_pos_BT.shape[1]
    # Few query columns per matmul (a decode step, a short prompt) take other MKL kernels, which round
    # differently (one column: a matrix-vector product; 2 columns differed too on an AVX-512 Zen 4):
    # both matmuls get at least MIN_GEMM_ROWS columns, the last query repeated (`T_mm`), while the
    # softmax in between runs on the T real columns only (a column's result never depends on another's).
    T_mm = query_columns(T, H, k_BGSd.shape[1])
    if q_BHTd.shape[2] != T_mm:
        q_BHTd = torch.cat([q_BHTd, q_BHTd[:, :, -1:].expand(B, H, T_mm - T, Dh)], dim=2)
    G, S, W = k_BGSd.shape[1], k_BGSd.shape[2], v_BGSW.shape[-1]
    R = H // G
    S_pad = -(-S // KEY_BLOCK) * KEY_BLOCK
    Dk = max(Dh, _MIN_HEAD_DIM)  # a small head is padded with zero columns (the scores do not change)
    if S_pad != S or Dk != Dh or not _batched_rows(k_BGSd):
        k_BGSd = F.pad(k_BGSd, (0, Dk - Dh, 0, S_pad - S)).contiguous()
    if S_pad != S or not _batched_rows(v_BGSW):
        v_BGSW = F.pad(v_BGSW, (0, 0, 0, S_pad - S)).contiguous()  # padded keys get weight 0 anyway
    q_BGRTd = torch.empty((B, G, R, T_mm, Dk), dtype=q_BHTd.dtype, device=q_BHTd.device)
    if Dk != Dh:
        q_BGRTd[..., Dh:] = 0.0
    torch.mul(q_BHTd.view(B, G, R, T_mm, Dh), 1.0 / math.sqrt(Dh), out=q_BGRTd[..., :Dh])
    # Scores with the keys as the rows, [S_pad, Dk] @ [Dk, R*T_mm]: never few rows (S_pad is a multiple of
    # KEY_BLOCK), and a score does not depend on how many query columns there are.
    scores = torch.matmul(k_BGSd, q_BGRTd.view(B, G, R * T_mm, Dk).transpose(-1, -2)).view(B, G, S_pad, R, T_mm)
    # Softmax numerators down the key axis of the T real columns (the repeated columns keep their raw
    # scores, go through the second matmul only for its kernel's sake, and their results are dropped):
    # masked keys -inf, minus the max of the visible ones, exp. All exact or elementwise (exp is MKL's
    # vector math, the same for an element wherever it falls), so where the columns lie does not change a
    # bit: with repeated columns (a decode step) the real ones are copied out to [B, G, R, T, S_pad], keys
    # innermost, and back, which costs less than the same operators on the strided view.
    hidden_BTS = None if memo is None else memo.get(("hidden", S_pad))
    if hidden_BTS is None:
        hidden_BTS = torch.arange(S_pad, device=q_BHTd.device)[None, None, :] > query_pos_BT[:, :, None]
        if memo is not None:
            memo[("hidden", S_pad)] = hidden_BTS
    if T_mm == T:
        scores.masked_fill_(hidden_BTS.transpose(1, 2)[:, None, :, None, :], float("-inf"))
        scores.sub_(scores.amax(dim=2, keepdim=True))
        scores.exp_()
    else:
        s_BGRTS = scores[..., :T].permute(0, 1, 3, 4, 2).contiguous()
        s_BGRTS.masked_fill_(hidden_BTS[:, None, None], float("-inf"))
        s_BGRTS.sub_(s_BGRTS.amax(dim=-1, keepdim=True))
        scores[..., :T] = s_BGRTS.exp_().permute(0, 1, 4, 2, 3)
    N = R * T_mm
    # [v | 1 | 0...]^T @ p per block of KEY_BLOCK keys, [W, KEY_BLOCK] @ [KEY_BLOCK, R*T_mm]: the weighted
    # values and the softmax denominator from the same fixed-size reductions; the blocks are then
    # summed pairwise (0+1, 2+3, ..., then again), a tree that trailing all-masked blocks (p exactly 0)
    # do not change. So neither how many keys the cache read nor how long the batch was matters. One
    # matmul per block, each on the block's rows where they lie: the values may be the KV cache itself.
    p_BGSN = scores.view(B, G, S_pad, N)  # the numerators, and the repeated columns' raw scores
    blocks = [
        torch.matmul(v_BGSW[:, :, i : i + KEY_BLOCK].transpose(-1, -2), p_BGSN[:, :, i : i + KEY_BLOCK])
        for i in range(0, S_pad, KEY_BLOCK)
    ]
    while len(blocks) > 1:  # an odd last block is added to zeros, as if a block of zeros followed it
        blocks = [blocks[i] + (blocks[i + 1] if i + 1 < len(blocks) else 0.0) for i in range(0, len(blocks), 2)]
    o_BGWRT = blocks[0].view(B, G, W, R, T_mm)[..., :T]
    out_BTGRd = torch.empty((B, T, G, R, Dh), dtype=q_BHTd.dtype, device=q_BHTd.device)
    torch.div(
        o_BGWRT[:, :, :Dh].permute(0, 4, 1, 3, 2), o_BGWRT[:, :, Dh : Dh + 1].permute(0, 4, 1, 3, 2), out=out_BTGRd
    )
    return out_BTGRd.view(B, T, H * Dh)


def invariant_attention(
    q_BHTd: torch.Tensor,
    k_BGSd: torch.Tensor,
    v_BGSW: torch.Tensor,
    query_pos_BT: torch.Tensor,
    causal: bool,
    memo: dict | None = None,
) -> torch.Tensor:
    """`InvariantAttention`; without autograd when no gradient is wanted (decode steps; `memo` as `_attend`)."""
    if torch.is_grad_enabled() and (q_BHTd.requires_grad or k_BGSd.requires_grad or v_BGSW.requires_grad):
        return InvariantAttention.apply(q_BHTd, k_BGSd, v_BGSW, query_pos_BT, causal)
    return _attend(q_BHTd, k_BGSd, v_BGSW, query_pos_BT, memo)


class InvariantAttention(torch.autograd.Function):
    """softmax(q k^T / sqrt(Dh)) v, computed the same way for a decode step, a prefill and a full forward.

    Inputs: q [B, H, T, Dh]; keys [B, G, S, Dh]; values [B, G, S, value_width(Dh)] as [v | 1 | 0...];
    query positions [B, T] (key s is visible to query t iff s <= position); `causal`: the keys are the
    queries' own tokens (a full forward), which the gradient uses. Output [B, T, H * Dh].
    Queries of the R = H / G heads sharing a kv head are R * T columns of the same matmuls.
    The gradient is SDPA's, recomputed in the backward: only the forward values need to be invariant.
    """

    @staticmethod
    def forward(ctx, q_BHTd, k_BGSd, v_BGSW, query_pos_BT, causal: bool):
        ctx.save_for_backward(q_BHTd, k_BGSd, v_BGSW, query_pos_BT)
        ctx.causal = causal
        return _attend(q_BHTd, k_BGSd, v_BGSW, query_pos_BT)

    @staticmethod
    def backward(ctx, grad_BTE):
        q_BHTd, k_BGSd, v_BGSW, query_pos_BT = ctx.saved_tensors
        B, H, T, Dh = q_BHTd.shape
        wanted = ctx.needs_input_grad[:3]
        with torch.enable_grad():
            q, k, v = (t.detach().requires_grad_(w) for t, w in zip((q_BHTd, k_BGSd, v_BGSW), wanted))
            if ctx.causal:
                out = F.scaled_dot_product_attention(q, k, v[..., :Dh], is_causal=True, enable_gqa=True)
            else:
                mask_B1TS = (torch.arange(k.shape[2], device=q.device)[None, None, :] <= query_pos_BT[..., None])[
                    :, None
                ]
                out = F.scaled_dot_product_attention(q, k, v[..., :Dh], attn_mask=mask_B1TS, enable_gqa=True)
            out = out.transpose(1, 2).reshape(B, T, H * Dh)
            inputs = [t for t, w in zip((q, k, v), wanted) if w]
            grads = iter(torch.autograd.grad(out, inputs, grad_BTE) if inputs else ())
        return (*(next(grads) if w else None for w in wanted), None, None)
