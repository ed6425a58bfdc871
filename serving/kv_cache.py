"""The slot KV cache the embedded engine decodes with, and the records of one cached pass.

Owns `KVCache` (one slot per running sequence; the batch-invariant attention's value layout),
`CacheStep` (one group of sequences in a `serving.model.Transformer.forward_steps` call: a prefill or
a decode step), `StepGroup` (what every layer needs of a step, built once per call; it rebuilds a
compact prefill's `[B, T]` grid for attention) and `StepOutput` (a step's logits and experts).
The network itself is `serving/model.py`; the engine (`serving/engine.py`) builds the steps.
Shape legend as in `serving/model.py`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from serving.batch_invariant import value_width

if TYPE_CHECKING:
    from serving.model import ModelArgs


@dataclass
class StepOutput:
    """What `Transformer.forward_steps` gives for one `CacheStep`."""

    logits: torch.Tensor  # [B, V]: at each row's `logits_at_B`
    experts: torch.Tensor  # [B, T, L, K] int64


@dataclass(frozen=True)
class CacheStep:
    """One group of sequences in a `Transformer.forward_steps` call: their new tokens `[B, T]` (padded),
    the positions those take in each sequence `[B, T]`, each sequence's cache slot `[B]`, and per row
    the index into T of the one token whose logits are wanted `[B]` (a prefill's last prompt token;
    0 for a decode step).

    `valid_BT` (bool `[B, T]`, optional) marks the real tokens of a padded group: the row-wise layers
    (norms, projections, router, experts) then run on those tokens only, and the `[B, T]` grid is
    rebuilt for attention alone, with zeros where the pads were. A pad is never a key a real token
    sees (it sits after the sequence's last real token), so the real tokens' logits and experts are
    the same bits either way; the pads' expert entries come back as 0 and their cache entries hold
    zeros (never read: `KVCache`)."""

    tokens_BT: torch.Tensor
    positions_BT: torch.Tensor
    slots_B: torch.Tensor
    logits_at_B: torch.Tensor
    valid_BT: torch.Tensor | None = None


@dataclass
class StepRows:
    """Every row of a `Transformer.forward_steps` call (all groups' real tokens, in order), built once per
    call: where each row's key and value go in the cache, and its RoPE tables `[N, 1, Dh]`."""

    positions_N: torch.Tensor
    slots_N: torch.Tensor
    cos: torch.Tensor
    sin: torch.Tensor


@dataclass
class StepGroup:
    """What every layer needs of one `CacheStep`, built once per `Transformer.forward_steps` call."""

    positions_BT: torch.Tensor
    slots_B: torch.Tensor
    mask_B1TS: torch.Tensor
    rows: torch.Tensor | None  # the grid indices (into B * T) of the rows this group passes on; None: all
    memo: dict = field(default_factory=dict)  # what the attention of every layer shares (the key mask...)

    @property
    def n_rows(self) -> int:
        B, T = self.positions_BT.shape
        return B * T if self.rows is None else int(self.rows.shape[0])

    def to_grid(self, x_ND: torch.Tensor) -> torch.Tensor:
        """This group's rows on its [B * T] grid, zero rows at the pads."""
        if self.rows is None:
            return x_ND
        B, T = self.positions_BT.shape
        return x_ND.new_zeros((B * T,) + tuple(x_ND.shape[1:])).index_copy_(0, self.rows, x_ND)

    def from_grid(self, x_ND: torch.Tensor) -> torch.Tensor:
        return x_ND if self.rows is None else x_ND.index_select(0, self.rows)


@dataclass
class KVCache:
    """A slot cache: each running sequence owns one slot; position p of slot s holds its p-th token.

    Writes happen before reads inside a layer, and a query at position p only sees keys at
    positions <= p, so whatever a slot's previous owner left beyond p is never used (the
    batch-invariant attention reads whole key blocks past p and gives those keys weight exactly 0).
    Values carry `value_width(Dh) - Dh` extra columns, the first of them all ones: the
    batch-invariant attention multiplies its probabilities by [v | 1 | 0...] to get the weighted
    values and the softmax denominator in one reduction (`invariant_attention`).
    """

    k: torch.Tensor  # [L, slots, G, S_max, Dh]
    v: torch.Tensor  # [L, slots, G, S_max, value_width(Dh)]
    extra: dict = field(default_factory=dict)

    @classmethod
    def empty(
        cls,
        args: ModelArgs,
        n_slots: int,
        max_len: int | None = None,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
    ) -> KVCache:
        length = max_len or args.max_seq_len
        shape = (args.n_layers, n_slots, args.n_kv_heads, length, args.head_dim)
        v = torch.zeros(shape[:-1] + (value_width(args.head_dim),), dtype=dtype, device=device)
        v[..., args.head_dim] = 1.0
        return cls(torch.zeros(shape, dtype=dtype, device=device), v)

    @property
    def n_slots(self) -> int:
        return self.k.shape[1]

    @property
    def max_len(self) -> int:
        return self.k.shape[3]

    def read(
        self, layer: int, slots_B: torch.Tensor, length: int, dtype: torch.dtype
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Positions [0, length) of the slots, copied: (keys [B, G, length, Dh], values
        [B, G, length, value_width(Dh)]), both contiguous."""
        length = min(length, self.max_len)
        # index_select copies each slot's rows whole (advanced indexing gathered element by element: 4x slower)
        k_BGSd = torch.index_select(self.k[layer][:, :, :length], 0, slots_B)
        v_BGSW = torch.index_select(self.v[layer][:, :, :length], 0, slots_B)
        return k_BGSd.to(dtype), v_BGSW.to(dtype)

    def write(
        self, layer: int, slots: torch.Tensor, positions: torch.Tensor, k_PGd: torch.Tensor, v_PGd: torch.Tensor
    ) -> None:
        """Store keys/values `[*P, G, Dh]` at their slots and positions: `slots` and `positions` are integer
        tensors that broadcast to the shape P (`[B, 1]` and `[B, T]` for a grid, `[N]` and `[N]` for rows)."""
        Dh = self.k.shape[-1]
        self.k[layer][slots, :, positions] = k_PGd.to(self.k.dtype)
        self.v[layer][slots, :, positions, :Dh] = v_PGd.to(self.v.dtype)

    def view(self, layer: int, length: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Positions [0, length) of every slot, in place (no copy): keys `[slots, G, length, Dh]`, values
        `[slots, G, length, value_width(Dh)]`. A slot's rows are contiguous; the slots are `max_len` apart."""
        length = min(length, self.max_len)
        return self.k[layer][:, :, :length], self.v[layer][:, :, :length]
