"""Weight-delta benchmark: how small and how fast lossless deltas are on real updates of the demo model.

What is measured (one run, one machine, numbers as they come):
- Dtype: what the product ships, `registry.publish.SHIPPING_DTYPE` (float32: replicas serve the
  trainer's own weights). Every size, word and throughput below is in that dtype.
- Parent: the shipped demo base, `models/demo-base` (`demo.bootstrap.SHIPPED_BASE`; float32 master
  weights), as shipped (`shipping_state` in the shipping dtype).
- Update: a trainer copy keeps the float32 masters and a fresh AdamW with pre-training's recipe
  (`demo.bootstrap`: betas (0.9, 0.95), weight decay 0.01 on matrices, gradient clipping at 1.0)
  and takes k optimizer steps at learning rate lr on pre-training's LM objective: next-token
  cross-entropy on fresh demo-corpus batches (`demo.corpus.make_corpus` with a seed the bootstrap
  never used, `--batch` sequences a step; the same batches for every lr). Child: the masters as
  shipped.
- Sweep: lr in {1e-6, 1e-5, 1e-4, 3e-4 (the demo learner's), 3e-3 (pre-training's peak)} x steps
  in {1, 4}. Nothing is tuned per cell; the demo's ratio is reported as measured.
- Sizes are ratios to the snapshot (raw bytes of every tensor): zstd(snapshot) at level 3;
  the naive baseline, zstd of the XOR of the raw bytes, at level 3 and at our sparse level (the
  better of the two is the baseline in "ours/naive"); ours: the whole `encode_delta` file,
  manifest (names, shapes, per-tensor SHA-256 of parent and child) included.
- Throughput in MB of snapshot per second, median of `--reps` runs: encode = `encode_delta`
  (hashing both versions included); decode = `apply_delta` with the base's hashes known (as a
  replica holds them), every blob and rebuilt tensor verified by SHA-256; "+base hash" also
  hashes the base. Bit-exact: every rebuilt tensor equals the child's bits.
- Ablation on the lr 1e-6 / 1e-5 one-step deltas: exponent classes and zstd level, the two
  codec knobs whose defaults these numbers choose.
The peers, in the same run: zstd of the snapshot, and the naive XOR + zstd delta.
"""

from __future__ import annotations

import copy
import time
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
import zstandard

from bench import common
from demo.bootstrap import SHIPPED_BASE, encode_example
from demo.corpus import make_corpus
from registry.publish import SHIPPING_DTYPE
from serving.checkpoint import load_checkpoint
from serving.codec import Codec, apply_delta, encode_delta, encode_snapshot, read_manifest
from serving.tokenizer import Tokenizer
from serving.weight_store import shipping_state

NAME = "deltas"
LRS = (1e-6, 1e-5, 1e-4, 3e-4, 3e-3)  # 3e-4: the demo learner's; 3e-3: pre-training's peak
STEPS = (1, 4)
CORPUS_SEED = 4242  # the bootstrap trained on seed 0 (train-split prompts, as these)


def update(master, seqs, lr: float, steps: int, batch: int, seed: int):
    """k AdamW steps on the demo LM loss from the given float32 masters (pre-training's optimizer recipe)."""
    model = copy.deepcopy(master).train()
    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    groups = [{"params": decay, "weight_decay": 0.01}, {"params": no_decay, "weight_decay": 0.0}]
    opt = torch.optim.AdamW(groups, lr=lr, betas=(0.9, 0.95))
    gen = torch.Generator().manual_seed(seed)
    pad = model.args.pad_id
    losses = []
    for _ in range(steps):
        idx = torch.randint(len(seqs), (batch,), generator=gen).tolist()
        T = max(len(seqs[i]) for i in idx)
        tokens = torch.tensor([seqs[i] + [pad] * (T - len(seqs[i])) for i in idx])
        logits = model(tokens[:, :-1]).logits
        targets = tokens[:, 1:].masked_fill(tokens[:, 1:] == pad, -100)
        loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1), ignore_index=-100)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        losses.append(loss.item())
    return model.eval(), losses


def shipped(model) -> dict[str, torch.Tensor]:
    return shipping_state(model, SHIPPING_DTYPE)


WORD = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def bits(t):
    """The tensor's raw words (an integer view of its width), to compare and XOR bits."""
    return t.view(WORD[t.element_size()])


def raw_bytes(state) -> bytes:
    return b"".join(bits(state[k]).numpy().tobytes() for k in sorted(state))


def naive_xor_delta(parent, child, level: int) -> bytes:
    """The baseline: zstd of the XOR of the raw bytes (no planes, no positions)."""
    p = bits(torch.cat([parent[k].reshape(-1) for k in sorted(parent)]))
    c = bits(torch.cat([child[k].reshape(-1) for k in sorted(child)]))
    return zstandard.ZstdCompressor(level=level).compress((p ^ c).numpy().tobytes())


def measure(parent, child, parent_hashes, codec: Codec, reps: int, snapshot_bytes: int) -> dict:
    enc_s, data = common.timed(lambda: encode_delta("child", "parent", parent, child, codec), max(1, reps // 2))
    dec_s, (rebuilt, manifest) = common.timed(lambda: apply_delta(parent, data, base_hashes=parent_hashes), reps)
    dec_full_s, _ = common.timed(lambda: apply_delta(parent, data), reps)
    exact = all(torch.equal(bits(rebuilt[k]), bits(child[k])) for k in child)
    mb = snapshot_bytes / 1e6
    return {
        "bytes": len(data),
        "ratio": snapshot_bytes / len(data),
        "encode_MBps": mb / enc_s,
        "decode_MBps": mb / dec_s,
        "decode_with_base_hash_MBps": mb / dec_full_s,
        "bit_exact": exact,
        "manifest_bytes": read_manifest(data)["_data_start"],
        "streams": {
            k: {x: v[x] for x in ("mode", "changed", "classes") if x in v} for k, v in manifest["streams"].items()
        },
    }


def main() -> None:
    ap = common.parser(__doc__)
    ap.add_argument("--model", type=Path, default=SHIPPED_BASE, help="the parent (default: models/demo-base)")
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--batch", type=int, default=64)
    args = ap.parse_args()
    st = common.stamp()
    torch.manual_seed(0)
    master = load_checkpoint(args.model)
    tok = Tokenizer.from_file(args.model)
    seqs = [encode_example(tok, t.prompt, c) for t, c in make_corpus(4096, seed=CORPUS_SEED)]
    parent = shipped(master)
    snapshot = encode_snapshot("parent", parent)
    parent_hashes = {k: e["sha256"] for k, e in read_manifest(snapshot)["tensors"].items()}
    n_words = sum(t.numel() for t in parent.values())
    snapshot_bytes = sum(t.numel() * t.element_size() for t in parent.values())
    zstd_snapshot = len(zstandard.ZstdCompressor(level=3).compress(raw_bytes(parent)))
    codec = Codec()
    rows: list[dict[str, Any]] = []
    children = {}
    for lr in LRS:
        for steps in STEPS:
            t0 = time.perf_counter()
            model, losses = update(master, seqs, lr, steps, args.batch, seed=1)
            child = shipped(model)
            children[(lr, steps)] = child
            same = sum(int((bits(parent[k]) == bits(child[k])).sum()) for k in parent)
            naive = {lvl: len(naive_xor_delta(parent, child, level=lvl)) for lvl in sorted({3, codec.level})}
            ours = measure(parent, child, parent_hashes, codec, args.reps, snapshot_bytes)
            best_naive = min(naive.values())
            row = {
                "lr": lr,
                "steps": steps,
                "losses": losses,
                "identical_pct": 100 * same / n_words,
                "naive_ratio": {str(k): snapshot_bytes / v for k, v in naive.items()},
                "naive_best_ratio": snapshot_bytes / best_naive,
                "ours": ours,
                "ours_over_naive": best_naive / ours["bytes"],
                "seconds": time.perf_counter() - t0,
            }
            rows.append(row)
            print(
                f"lr {lr:g} steps {steps}: identical {row['identical_pct']:.2f}% ours {ours['ratio']:.1f}x "
                f"naive {row['naive_best_ratio']:.1f}x  decode {ours['decode_MBps']:.0f} MB/s",
                flush=True,
            )
    ablation = []
    for lr in (1e-6, 1e-5):
        child = children[(lr, 1)]
        for variant in ({"max_classes": k} for k in (1, 2, 3, 4, 6)):
            ablation.append(_variant(parent, child, parent_hashes, codec, variant, lr, args.reps, snapshot_bytes))
        for variant in ({"level": k} for k in (3, 9, 19)):
            ablation.append(_variant(parent, child, parent_hashes, codec, variant, lr, args.reps, snapshot_bytes))
    result = {
        "threads": torch.get_num_threads(),
        "zstandard": zstandard.__version__,
        "objective": f"LM cross-entropy on fresh demo-corpus batches (seed {CORPUS_SEED}, {args.batch} seqs/step)",
        "optimizer": "AdamW betas (0.9, 0.95), wd 0.01 on matrices, clip 1.0, fresh state per update",
        "model": common.shown(args.model),
        "dtype": str(SHIPPING_DTYPE).removeprefix("torch."),
        "parameters": n_words,
        "snapshot_MB": snapshot_bytes / 1e6,
        "zstd_snapshot_ratio": snapshot_bytes / zstd_snapshot,
        "our_snapshot_ratio": snapshot_bytes / len(snapshot),
        "codec": codec.__dict__,
        "reps": args.reps,
        "rows": rows,
        "ablation": ablation,
    }
    common.save(NAME, result, st, args.out)


def _variant(parent, child, hashes, codec: Codec, variant: dict, lr: float, reps: int, snapshot_bytes: int) -> dict:
    c = Codec(**{**codec.__dict__, **variant})
    m = measure(parent, child, hashes, c, reps, snapshot_bytes)
    return {"lr": lr, "steps": 1, "codec": c.__dict__, "variant": variant, **m}


if __name__ == "__main__":
    main()
