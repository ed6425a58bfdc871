"""The Mixture-of-Experts model: the Mixtral architecture in plain PyTorch.

Owns the network (RMSNorm, RoPE, grouped-query attention; the top-k router and SwiGLU experts are in
`serving/moe.py`).
The slot KV cache it decodes against, and the steps of a cached pass, live in `serving/kv_cache.py`;
checkpoint I/O (the Hugging Face Mixtral folder format) in `serving/checkpoint.py`. The engine,
trainer and parity tests call this.

Two things a plain LM does not need, and this one does:
- `return_experts=True` returns the experts every token was routed to, `[B, T, L, K]` integers;
- `replay_experts=...` takes such a record and routes every token to *those* experts instead of
  its own top-k. The mixing weights still come from the router's softmax (gathered at the replayed
  experts and renormalised over them, exactly as top-k renormalises), so the router keeps its
  gradient. Replaying the model's own routing reproduces its logits bit for bit.

Batch-invariant mode (`batch_invariant=True`, float32 only; the engine and the trainer turn it on):
a token gets bit-identical logits whatever else is in the batch, whether it is computed in a
prefill, a decode step against the KV cache or one full forward, so the log-probs recorded at
serving equal the trainer's recomputation. The kernels that do it (row-padded matmuls, blocked
attention, SiLU through exp) live in `serving/batch_invariant.py`, which says how.

Numerics follow `transformers.MixtralForCausalLM` on purpose (router softmax in float32, the
renormalised top-k weights kept in float32 when multiplying the expert output, RoPE in the
rotate-half layout) so that the same folder gives the same logits in both.

Shape legend: B batch, T query tokens, S key/value positions, D model dim, H query heads,
G kv heads, Dh head dim, F expert hidden dim, E experts, K experts per token, L layers, V vocab.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, replace

import torch
import torch.nn.functional as F
from torch import nn

from serving.batch_invariant import (
    KEY_BLOCK,
    invariant_attention,
    invariant_linear,
    kept_copy,
    query_columns,
    value_width,
)
from serving.kv_cache import CacheStep, KVCache, StepGroup, StepOutput, StepRows
from serving.moe import SparseMoE


@dataclass(frozen=True)
class ModelArgs:
    vocab_size: int = 512
    dim: int = 128
    n_layers: int = 4
    n_heads: int = 4
    n_kv_heads: int = 2
    hidden_dim: int = 256  # F: the hidden size of one expert's SwiGLU
    n_experts: int = 4
    top_k: int = 2
    max_seq_len: int = 256
    rope_theta: float = 10000.0
    norm_eps: float = 1e-5
    tie_embeddings: bool = False
    bos_id: int = 1
    eos_id: int = 2
    pad_id: int = 0

    def __post_init__(self) -> None:
        for name in (
            "vocab_size",
            "dim",
            "n_layers",
            "n_heads",
            "n_kv_heads",
            "hidden_dim",
            "n_experts",
            "top_k",
            "max_seq_len",
        ):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise ValueError(f"ModelArgs.{name} must be a positive integer, got {value!r}")
        if self.dim % self.n_heads:
            raise ValueError(f"ModelArgs.dim={self.dim} is not divisible by n_heads={self.n_heads}")
        if self.n_heads % self.n_kv_heads:
            raise ValueError(f"ModelArgs.n_heads={self.n_heads} is not divisible by n_kv_heads={self.n_kv_heads}")
        if self.top_k > self.n_experts:
            raise ValueError(f"ModelArgs.top_k={self.top_k} exceeds n_experts={self.n_experts}")
        if (self.head_dim % 2) != 0:
            raise ValueError(f"ModelArgs head_dim={self.head_dim} must be even for RoPE")

    @property
    def head_dim(self) -> int:
        return self.dim // self.n_heads

    @classmethod
    def from_name(cls, name: str, **overrides) -> ModelArgs:
        if name not in PRESETS:
            raise ValueError(f"unknown model preset {name!r}; known: {sorted(PRESETS)}")
        return replace(PRESETS[name], **overrides)

    def to_dict(self) -> dict:
        return asdict(self)


PRESETS: dict[str, ModelArgs] = {
    # For unit tests: every code path, a few kB of weights.
    "tiny": ModelArgs(
        vocab_size=64, dim=32, n_layers=2, n_heads=4, n_kv_heads=2, hidden_dim=48, n_experts=4, top_k=2, max_seq_len=64
    ),
    # The demo product's model: pre-trained from scratch on this machine in minutes.
    "demo": ModelArgs(
        vocab_size=512,
        dim=128,
        n_layers=4,
        n_heads=4,
        n_kv_heads=2,
        hidden_dim=256,
        n_experts=4,
        top_k=2,
        max_seq_len=256,
    ),
    # The real thing, for reference (never instantiated here).
    "mixtral-8x7b": ModelArgs(
        vocab_size=32000,
        dim=4096,
        n_layers=32,
        n_heads=32,
        n_kv_heads=8,
        hidden_dim=14336,
        n_experts=8,
        top_k=2,
        max_seq_len=32768,
        rope_theta=1e6,
    ),
}


@dataclass
class ModelOutput:
    logits: torch.Tensor  # [B, T, V]
    experts: torch.Tensor | None = None  # [B, T, L, K] int64, when asked for


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Normalise in float32 whatever the activation dtype (as HF does).
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(x.dtype)


def rope_cos_sin(positions: torch.Tensor, head_dim: int, theta: float, dtype: torch.dtype):
    """RoPE's tables for `positions` (any shape P): cos and the *signed* sin, each [*P, Dh], in the
    rotate-half layout (as HF). The sin's first half is negated so that `apply_rope` rotates with one
    roll instead of splitting, negating and joining: x2 * -s is exactly -(x2 * s), the same bits."""
    inv_freq = 1.0 / (
        theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64, device=positions.device).float() / head_dim)
    )
    freqs = positions.float()[..., None] * inv_freq  # [*P, Dh/2]
    emb = torch.cat((freqs, freqs), dim=-1)
    sin = emb.sin()
    sin[..., : head_dim // 2].neg_()
    return emb.cos().to(dtype), sin.to(dtype)


def _project(x: torch.Tensor, weight: torch.Tensor, invariant: bool) -> torch.Tensor:
    """x @ weight^T: batch-invariant (`invariant_linear`) or torch's own `F.linear`."""
    return invariant_linear(x, weight) if invariant else F.linear(x, weight)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x * cos + rotate_half(x) * sin, with `rope_cos_sin`'s tables broadcast against x (rotate_half(x) =
    [-x2, x1]: the roll [x2, x1] times the signed sin)."""
    return x * cos + x.roll(x.shape[-1] // 2, -1) * sin


class Attention(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        self.n_heads, self.n_kv, self.head_dim = args.n_heads, args.n_kv_heads, args.head_dim
        self.q_proj = nn.Linear(args.dim, args.n_heads * args.head_dim, bias=False)
        self.k_proj = nn.Linear(args.dim, args.n_kv_heads * args.head_dim, bias=False)
        self.v_proj = nn.Linear(args.dim, args.n_kv_heads * args.head_dim, bias=False)
        self.o_proj = nn.Linear(args.n_heads * args.head_dim, args.dim, bias=False)

    def qkv_weight(self) -> torch.Tensor:
        """q's, k's and v's weights as one `[(H + 2G) * Dh, D]` matrix: one projection instead of three, and
        RoPE once over q's and k's heads together. Every path (serving, scoring, the trainer) projects
        with it, so they get the same bits. Under autograd it is a `cat` in the graph (the three weights
        get their gradients); otherwise one copy kept on the module (`kept_copy`)."""
        ws = [self.q_proj.weight, self.k_proj.weight, self.v_proj.weight]
        if torch.is_grad_enabled() and any(w.requires_grad for w in ws):
            return torch.cat(ws)
        return kept_copy(self, "_qkv", ws, lambda: torch.cat([w.detach() for w in ws]))

    def forward(
        self,
        x_BTD,
        cos,
        sin,
        cache: KVCache | None,
        layer: int,
        slots_B,
        positions_BT,
        mask_B1TS,
        invariant: bool = False,
    ):
        B, T, _ = x_BTD.shape
        H, G, Dh = self.n_heads, self.n_kv, self.head_dim
        qkv = _project(x_BTD, self.qkv_weight(), invariant)
        qk_BTXd = apply_rope(qkv[..., : (H + G) * Dh].view(B, T, H + G, Dh), cos[:, :, None], sin[:, :, None])
        q_BHTd, k_BGTd = qk_BTXd[:, :, :H].transpose(1, 2), qk_BTXd[:, :, H:].transpose(1, 2)
        v_BTGd = qkv[..., (H + G) * Dh :].view(B, T, G, Dh)
        if invariant and cache is None:  # a full forward: causal over this call's tokens
            v_BGTW = F.pad(v_BTGd.transpose(1, 2), (0, value_width(self.head_dim) - self.head_dim))
            v_BGTW[..., self.head_dim] = 1.0
            query_pos_BT = torch.arange(T, device=x_BTD.device).expand(B, T)
            out_BTE = invariant_attention(q_BHTd, k_BGTd, v_BGTW, query_pos_BT, True)
            return invariant_linear(out_BTE, self.o_proj.weight)
        if cache is None:
            # Training / full forward: plain causal attention over this call's tokens.
            out = F.scaled_dot_product_attention(
                q_BHTd, k_BGTd, v_BTGd.transpose(1, 2), is_causal=True, enable_gqa=True
            )
            return F.linear(out.transpose(1, 2).reshape(B, T, self.n_heads * self.head_dim), self.o_proj.weight)
        out_BTE = self._attend_cached(q_BHTd, k_BGTd, v_BTGd, cache, layer, slots_B, positions_BT, mask_B1TS, invariant)
        return _project(out_BTE, self.o_proj.weight, invariant)

    def _attend_cached(
        self, q_BHTd, k_BGTd, v_BTGd, cache: KVCache, layer: int, slots_B, positions_BT, mask_B1TS, invariant: bool
    ) -> torch.Tensor:
        """Write this call's keys/values into the slots, then attend to what each slot holds up to the
        query's position: [B, T, H * Dh], before the output projection."""
        cache.write(layer, slots_B[:, None], positions_BT, k_BGTd.transpose(1, 2), v_BTGd)
        return self._attend_written(q_BHTd, cache, layer, slots_B, positions_BT, mask_B1TS, invariant)

    def _attend_written(
        self, q_BHTd, cache: KVCache, layer: int, slots_B, positions_BT, mask_B1TS, invariant: bool, memo=None
    ) -> torch.Tensor:
        """Attention of queries whose keys/values the cache already holds: [B, T, H * Dh]. `memo`: a dict
        the layers of one pass share for one group of queries (what does not change between layers)."""
        B, _, T, _ = q_BHTd.shape
        if invariant:  # whole key blocks from the cache: the keys past each position get weight 0
            length = -(-mask_B1TS.shape[-1] // KEY_BLOCK) * KEY_BLOCK
            if T == 1 and 2 * B >= cache.n_slots and cache.k.dtype == q_BHTd.dtype:
                return self._decode_in_place(q_BHTd, cache, layer, slots_B, positions_BT, length, memo)
            k_BGSd, v_BGSW = cache.read(layer, slots_B, length, q_BHTd.dtype)
            return invariant_attention(q_BHTd, k_BGSd, v_BGSW, positions_BT, False, memo)
        k_BGSd, v_BGSW = cache.read(layer, slots_B, mask_B1TS.shape[-1], q_BHTd.dtype)
        out = F.scaled_dot_product_attention(
            q_BHTd, k_BGSd, v_BGSW[..., : self.head_dim], attn_mask=mask_B1TS, enable_gqa=True
        )
        return out.transpose(1, 2).reshape(B, T, self.n_heads * self.head_dim)

    @staticmethod
    def _decode_in_place(q_BHTd, cache: KVCache, layer: int, slots_B, positions_BT, length: int, memo=None):
        """A batch-invariant decode step over most of the cache's slots: attention runs over every slot's
        keys where they lie (`KVCache.view`), the queries scattered to their slots (an idle slot's query is
        zeros at position 0, its result dropped), instead of gathering the step's slots into a copy. Each
        (slot, kv head) is the same fixed-size matmul either way, so every query's result is the same bits
        (tests/serving/test_model.py); what it saves is the copy of the keys, read from memory once more.
        The query is scattered with the attention's repeated columns (`query_columns`); with a `memo`, the
        slots' positions and the query buffer are made once per pass (the same slots in every layer)."""
        k_SGLd, v_SGLW = cache.view(layer, length)
        memo = {} if memo is None else memo
        if "q_SHTd" not in memo:
            B, H, _, Dh = q_BHTd.shape
            n, T_mm = cache.n_slots, query_columns(1, H, k_SGLd.shape[1])
            memo["q_SHTd"] = q_BHTd.new_zeros((n, H, T_mm, Dh))
            memo["pos_S1"] = positions_BT.new_zeros((n, 1)).index_copy_(0, slots_B, positions_BT)
        q_SHTd = memo["q_SHTd"].index_copy_(0, slots_B, q_BHTd.expand(-1, -1, memo["q_SHTd"].shape[2], -1))
        out = invariant_attention(q_SHTd, k_SGLd, v_SGLW, memo["pos_S1"], False, memo)
        return out.index_select(0, slots_B)

    def forward_steps(
        self, h_ND: torch.Tensor, groups: list[StepGroup], rows: StepRows, cache: KVCache, layer: int, invariant: bool
    ):
        """Everything row-wise over every group's rows at once (the projections, RoPE, the cache writes:
        rows are independent); attention group by group, each against its own slots."""
        N, H, G, Dh = h_ND.shape[0], self.n_heads, self.n_kv, self.head_dim
        qkv = _project(h_ND, self.qkv_weight(), invariant)
        qk_NXd = apply_rope(qkv[:, : (H + G) * Dh].view(N, H + G, Dh), rows.cos, rows.sin)
        q_NHd = qk_NXd[:, :H]
        cache.write(layer, rows.slots_N, rows.positions_N, qk_NXd[:, H:], qkv[:, (H + G) * Dh :].view(N, G, Dh))
        outs, row = [], 0
        for g in groups:
            B, T = g.positions_BT.shape
            q_BTHd = g.to_grid(q_NHd[row : row + g.n_rows]).view(B, T, self.n_heads, self.head_dim)
            row += g.n_rows
            out_BTE = self._attend_written(
                q_BTHd.transpose(1, 2), cache, layer, g.slots_B, g.positions_BT, g.mask_B1TS, invariant, g.memo
            )
            outs.append(g.from_grid(out_BTE.reshape(B * T, -1)))
        return _project(outs[0] if len(outs) == 1 else torch.cat(outs), self.o_proj.weight, invariant)


class Block(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        self.input_layernorm = RMSNorm(args.dim, args.norm_eps)
        self.self_attn = Attention(args)
        self.post_attention_layernorm = RMSNorm(args.dim, args.norm_eps)
        self.block_sparse_moe = SparseMoE(args)

    def forward(
        self, x_BTD, cos, sin, cache, layer, slots_B, positions_BT, mask_B1TS, replay_BTK, invariant: bool = False
    ):
        x_BTD = x_BTD + self.self_attn(
            self.input_layernorm(x_BTD), cos, sin, cache, layer, slots_B, positions_BT, mask_B1TS, invariant
        )
        B, T, D = x_BTD.shape
        h_ND = self.post_attention_layernorm(x_BTD).reshape(B * T, D)
        replay_NK = None if replay_BTK is None else replay_BTK.reshape(B * T, -1)
        moe_ND, idx_NK = self.block_sparse_moe(h_ND, replay_NK, invariant)
        return x_BTD + moe_ND.view(B, T, D), idx_NK.view(B, T, -1)

    def forward_steps(
        self, x_ND: torch.Tensor, groups: list[StepGroup], rows: StepRows, cache: KVCache, layer: int, invariant: bool
    ):
        x_ND = x_ND + self.self_attn.forward_steps(self.input_layernorm(x_ND), groups, rows, cache, layer, invariant)
        moe_ND, idx_NK = self.block_sparse_moe(self.post_attention_layernorm(x_ND), None, invariant)
        return x_ND + moe_ND, idx_NK


class Transformer(nn.Module):
    def __init__(self, args: ModelArgs, batch_invariant: bool = False):
        super().__init__()
        self.args = args
        # The default of `forward(batch_invariant=None)`; the engine and the trainer pass theirs.
        self.batch_invariant = batch_invariant
        # padding_idx as HF: the pad row never receives a gradient.
        self.embed_tokens = nn.Embedding(args.vocab_size, args.dim, padding_idx=args.pad_id)
        self.layers = nn.ModuleList(Block(args) for _ in range(args.n_layers))
        self.norm = RMSNorm(args.dim, args.norm_eps)
        self.lm_head = nn.Linear(args.dim, args.vocab_size, bias=False)
        if args.tie_embeddings:
            self.lm_head.weight = self.embed_tokens.weight

    def init_weights(self, seed: int, std: float = 0.02) -> Transformer:
        gen = torch.Generator().manual_seed(seed)
        for name, p in self.named_parameters():
            if name.endswith("layernorm.weight") or name == "norm.weight":
                nn.init.ones_(p)
            else:
                with torch.no_grad():
                    p.copy_(torch.randn(p.shape, generator=gen) * std)
            if name.endswith(("o_proj.weight", "w2.weight")):  # scale residual writes by depth (GPT-2)
                with torch.no_grad():
                    p.mul_(1.0 / math.sqrt(2 * self.args.n_layers))
        return self

    def forward(
        self,
        tokens_BT: torch.Tensor,
        *,
        positions_BT: torch.Tensor | None = None,
        cache: KVCache | None = None,
        slots_B: torch.Tensor | None = None,
        replay_experts: torch.Tensor | None = None,
        return_experts: bool = False,
        batch_invariant: bool | None = None,
    ) -> ModelOutput:
        """Logits for every position of `tokens_BT`.

        Without `cache`: a causal forward over the tokens given (training, scoring, parity).
        With `cache`: the tokens are appended to each sequence's slot at `positions_BT` and attend
        to everything that slot holds up to their own position (prefill and decode).
        `replay_experts` `[B, T, L, K]` routes every token to the recorded experts.
        `batch_invariant` (None: `self.batch_invariant`): the batch-invariant kernels of the module
        docstring; float32 only (other dtypes always take the default kernels).
        """
        B, T = tokens_BT.shape
        args = self.args
        if positions_BT is None:
            positions_BT = torch.arange(T, device=tokens_BT.device).expand(B, T)
        if replay_experts is not None:
            want = (B, T, args.n_layers, args.top_k)
            if tuple(replay_experts.shape) != want:
                raise ValueError(f"replay_experts has shape {tuple(replay_experts.shape)}, expected {want}")
            if replay_experts.numel() and (
                int(replay_experts.min()) < 0 or int(replay_experts.max()) >= args.n_experts
            ):
                raise ValueError(f"replay_experts holds an expert id outside [0, {args.n_experts})")
        mask_B1TS = None
        if cache is not None:
            if slots_B is None:
                raise ValueError("a forward with a KV cache needs slots_B")
            attn_len = int(positions_BT.max()) + 1
            if attn_len > cache.max_len:
                raise ValueError(f"position {attn_len - 1} is beyond the cache length {cache.max_len}")
            # A query at position p sees the slot's keys at positions <= p (built once for all layers).
            key_pos_S = torch.arange(attn_len, device=tokens_BT.device)
            mask_B1TS = key_pos_S[None, None, None, :] <= positions_BT[:, None, :, None]
        x_BTD = self.embed_tokens(tokens_BT)
        invariant = self.batch_invariant if batch_invariant is None else batch_invariant
        invariant = bool(invariant) and x_BTD.dtype == torch.float32
        cos, sin = rope_cos_sin(positions_BT, args.head_dim, args.rope_theta, x_BTD.dtype)
        routed = []
        for i, layer in enumerate(self.layers):
            replay_BTK = None if replay_experts is None else replay_experts[:, :, i]
            x_BTD, idx_BTK = layer(x_BTD, cos, sin, cache, i, slots_B, positions_BT, mask_B1TS, replay_BTK, invariant)
            routed.append(idx_BTK)
        h_BTD = self.norm(x_BTD)
        logits = _project(h_BTD, self.lm_head.weight, invariant)
        experts = torch.stack(routed, dim=2) if return_experts else None  # [B, T, L, K]
        return ModelOutput(logits=logits, experts=experts)

    def forward_steps(
        self, steps: list[CacheStep], cache: KVCache, batch_invariant: bool | None = None
    ) -> list[StepOutput]:
        """Several groups of sequences through the model in one pass against the KV cache: a prefill of
        new prompts and a decode step of running sequences, say. Every row-wise layer (norms,
        projections, the router and the experts, the LM head) runs once over all groups' tokens; only
        attention runs group by group. With batch-invariant kernels each token's logits and experts are
        bit-identical to what `forward` gives it in a call of its own group alone.

        Returns one `StepOutput` per step."""
        if not steps:
            raise ValueError("forward_steps needs at least one step")
        args = self.args
        groups, flat = [], []
        for st in steps:
            B, T = st.tokens_BT.shape
            if tuple(st.positions_BT.shape) != (B, T) or tuple(st.slots_B.shape) != (B,):
                raise ValueError(
                    f"a step's positions {tuple(st.positions_BT.shape)} and slots {tuple(st.slots_B.shape)} "
                    f"do not match its tokens {(B, T)}"
                )
            attn_len = int(st.positions_BT.max()) + 1
            if attn_len > cache.max_len:
                raise ValueError(f"position {attn_len - 1} is beyond the cache length {cache.max_len}")
            key_pos_S = torch.arange(attn_len, device=st.tokens_BT.device)
            rows = None
            if st.valid_BT is not None:
                if tuple(st.valid_BT.shape) != (B, T) or st.valid_BT.dtype != torch.bool:
                    raise ValueError(
                        f"a step's valid_BT must be a bool tensor of its tokens' shape {(B, T)}, "
                        f"got {st.valid_BT.dtype} {tuple(st.valid_BT.shape)}"
                    )
                if not bool(st.valid_BT.gather(1, st.logits_at_B[:, None]).all()):
                    raise ValueError("a step's logits_at_B points at a token its valid_BT marks as padding")
                rows = st.valid_BT.reshape(-1).nonzero().squeeze(1)
            tokens_N, positions_N = st.tokens_BT.reshape(-1), st.positions_BT.reshape(-1)
            slots_N = st.slots_B[:, None].expand(B, T).reshape(-1)
            if rows is not None:
                tokens_N, positions_N, slots_N = tokens_N[rows], positions_N[rows], slots_N[rows]
            mask = key_pos_S[None, None, None, :] <= st.positions_BT[:, None, :, None]
            groups.append(StepGroup(st.positions_BT, st.slots_B, mask, rows))
            flat.append((tokens_N, positions_N, slots_N))
        tokens_N, positions_N, slots_N = (torch.cat(f) if len(flat) > 1 else f[0] for f in zip(*flat))
        x_ND = self.embed_tokens(tokens_N)
        cos, sin = rope_cos_sin(positions_N, args.head_dim, args.rope_theta, x_ND.dtype)
        step_rows = StepRows(positions_N, slots_N, cos[:, None], sin[:, None])
        invariant = self.batch_invariant if batch_invariant is None else batch_invariant
        invariant = bool(invariant) and x_ND.dtype == torch.float32
        routed = []
        for i, layer in enumerate(self.layers):
            assert isinstance(layer, Block)
            x_ND, idx_NK = layer.forward_steps(x_ND, groups, step_rows, cache, i, invariant)
            routed.append(idx_NK)
        experts_NLK = torch.stack(routed, dim=1)
        picks, row = [], 0
        for st, g in zip(steps, groups):
            B, T = st.tokens_BT.shape
            at_B = torch.arange(B, device=x_ND.device) * T + st.logits_at_B  # grid indices
            if g.rows is not None:  # their places among the group's rows
                at_B = torch.searchsorted(g.rows, at_B)
            picks.append(row + at_B)
            row += g.n_rows
        h_MD = self.norm(x_ND[torch.cat(picks)])
        logits_MV = _project(h_MD, self.lm_head.weight, invariant)
        outs, row, at = [], 0, 0
        for st, g in zip(steps, groups):
            B, T = st.tokens_BT.shape
            experts = g.to_grid(experts_NLK[row : row + g.n_rows]).view(B, T, args.n_layers, -1)
            outs.append(StepOutput(logits=logits_MV[at : at + B], experts=experts))
            row += g.n_rows
            at += B
        return outs


def token_logprobs(logits_BTV: torch.Tensor, targets_BT: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    """log p(target) under softmax(logits / temperature), in float32. [B, T]."""
    if temperature <= 0:
        raise ValueError(f"temperature must be > 0 for a log-probability, got {temperature}")
    logp = F.log_softmax(logits_BTV.float() / temperature, dim=-1)
    return logp.gather(-1, targets_BT[..., None]).squeeze(-1)


def lm_step(model: Transformer, opt: torch.optim.Optimizer, seqs: list[list[int]], clip: float = 1.0) -> float:
    """One next-token (pre-training / SFT) step on token sequences, padded with the model's pad id,
    which is never a target: forward, mean cross-entropy over real targets, backward, grad-norm clip,
    optimizer step. Returns the loss. The bootstrap and the benchmarks' candidate makers use it."""
    pad = model.args.pad_id
    T = max(len(s) for s in seqs)
    tokens_BT = torch.tensor([s + [pad] * (T - len(s)) for s in seqs])
    logits_BTV = model(tokens_BT[:, :-1]).logits
    targets_BT = tokens_BT[:, 1:].masked_fill(tokens_BT[:, 1:] == pad, -100)
    loss = F.cross_entropy(logits_BTV.reshape(-1, logits_BTV.shape[-1]), targets_BT.reshape(-1), ignore_index=-100)
    opt.zero_grad(set_to_none=True)
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
    opt.step()
    return float(loss.item())
