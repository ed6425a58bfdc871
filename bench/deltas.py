"""Weight-delta benchmark: how small and how fast lossless deltas are on real updates of the demo model.

What is measured (one run, one machine, numbers as they come):
- Parent: the shipped demo base, `models/demo-base` (`demo.bootstrap.SHIPPED_BASE`; float32 master
  weights), shipped as bf16 (`shipping_state`). bench/results/deltas.* were measured on the old
  8-family product's base.
- Update: a trainer copy keeps the float32 masters and a fresh AdamW with the demo's recipe
  (betas (0.9, 0.95), weight decay 0.01 on matrices, gradient clipping at 1.0) and takes k
  optimizer steps at learning rate lr on the demo's LM objective: next-token cross-entropy on
  fresh demo-corpus batches (`demo.corpus.make_corpus` with a seed the bootstrap never used,
  `--batch` sequences a step; the same batches for every lr). Child: the masters shipped as bf16.
- Sweep: lr in {1e-6, 1e-5, 1e-4, 3e-3 (the demo's own)} x steps in {1, 4}. Nothing is tuned per
  cell; the demo's ratio is reported as measured.
- Sizes are ratios to the bf16 snapshot (raw bytes of every tensor): zstd(snapshot) at level 3;
  the naive baseline, zstd of the XOR of the raw bytes, at level 3 and at our sparse level (the
  better of the two is the baseline in "ours/naive"); ours: the whole `encode_delta` file,
  manifest (names, shapes, per-tensor SHA-256 of parent and child) included.
- Throughput in MB of bf16 snapshot per second, median of `--reps` runs: encode = `encode_delta`
  (hashing both versions included); decode = `apply_delta` with the base's hashes known (as a
  replica holds them), every blob and rebuilt tensor verified by SHA-256; "+base hash" also
  hashes the base. Bit-exact: every rebuilt tensor equals the child's bits.
- Ablation on the lr 1e-6 / 1e-5 one-step deltas: exponent classes and zstd level, the two
  codec knobs whose defaults these numbers choose.

Writes bench/results/deltas.json and bench/results/deltas.md and prints the table.
Usage: python bench/deltas.py [--model DIR] [--reps 7] [--batch 64]
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F
import zstandard

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def _shown(path: Path) -> str:
    """A path as committed results name it: relative to the repository (or just its name)."""
    path = Path(path).resolve()
    return str(path.relative_to(ROOT)) if path.is_relative_to(ROOT) else path.name


from demo.bootstrap import SHIPPED_BASE, encode_example  # noqa: E402
from demo.corpus import make_corpus  # noqa: E402
from serving.checkpoint import load_checkpoint  # noqa: E402
from serving.codec import Codec, apply_delta, encode_delta, encode_snapshot, read_manifest  # noqa: E402
from serving.tokenizer import Tokenizer  # noqa: E402
from serving.weight_store import shipping_state  # noqa: E402

LRS = (1e-6, 1e-5, 1e-4, 3e-3)
STEPS = (1, 4)
CORPUS_SEED = 4242  # the bootstrap trained on seed 0 (train-split prompts, as these)


def update(master, seqs, lr: float, steps: int, batch: int, seed: int):
    """k AdamW steps on the demo LM loss from the given float32 masters (the demo's optimizer recipe)."""
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
    return shipping_state(model, torch.bfloat16)


def bits(t):
    return t.view(torch.int16)


def raw_bytes(state) -> bytes:
    return b"".join(bits(state[k]).numpy().tobytes() for k in sorted(state))


def naive_xor_delta(parent, child, level: int) -> bytes:
    """The baseline: zstd of the XOR of the raw bf16 bytes (no planes, no positions)."""
    p = bits(torch.cat([parent[k].reshape(-1) for k in sorted(parent)]))
    c = bits(torch.cat([child[k].reshape(-1) for k in sorted(child)]))
    return zstandard.ZstdCompressor(level=level).compress((p ^ c).numpy().tobytes())


def timed(fn, reps: int) -> tuple[float, object]:
    times, out = [], None
    for _ in range(reps):
        t0 = time.perf_counter()
        out = fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times), out


def measure(parent, child, parent_hashes, codec: Codec, reps: int, snapshot_bytes: int) -> dict:
    enc_s, data = timed(lambda: encode_delta("child", "parent", parent, child, codec), max(1, reps // 2))
    dec_s, (rebuilt, manifest) = timed(lambda: apply_delta(parent, data, base_hashes=parent_hashes), reps)
    dec_full_s, _ = timed(lambda: apply_delta(parent, data), reps)
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
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=str(SHIPPED_BASE), help="Default: the shipped demo base (models/demo-base).")
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--out", default=str(ROOT / "bench" / "results"))
    args = ap.parse_args()
    torch.manual_seed(0)
    master = load_checkpoint(args.model)
    tok = Tokenizer.from_file(args.model)
    seqs = [encode_example(tok, t.prompt, c) for t, c in make_corpus(4096, seed=CORPUS_SEED)]
    parent = shipped(master)
    snapshot = encode_snapshot("parent", parent)
    parent_hashes = {k: e["sha256"] for k, e in read_manifest(snapshot)["tensors"].items()}
    n_words = sum(t.numel() for t in parent.values())
    snapshot_bytes = 2 * n_words
    zstd_snapshot = len(zstandard.ZstdCompressor(level=3).compress(raw_bytes(parent)))
    ours_snapshot = len(snapshot)
    codec = Codec()
    rows, children = [], {}
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
                "snapshot_MB": snapshot_bytes / 1e6,
                "zstd_snapshot_ratio": snapshot_bytes / zstd_snapshot,
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
        for variant in (
            {"max_classes": 1},
            {"max_classes": 2},
            {"max_classes": 3},
            {"max_classes": 4},
            {"max_classes": 6},
            {"level": 3},
            {"level": 9},
            {"level": 19},
        ):
            c = Codec(**{**codec.__dict__, **variant})
            m = measure(parent, child, parent_hashes, c, args.reps, snapshot_bytes)
            ablation.append({"lr": lr, "steps": 1, "codec": c.__dict__, "variant": variant, **m})
    machine = {
        "platform": platform.platform(),
        "processor": platform.processor() or platform.machine(),
        "cpus": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "torch": torch.__version__,
        "zstandard": zstandard.__version__,
        "load_average": os.getloadavg(),
    }
    result = {
        "machine": machine,
        "objective": (f"LM cross-entropy on fresh demo-corpus batches (seed {CORPUS_SEED}, {args.batch} seqs/step)"),
        "optimizer": "AdamW betas (0.9, 0.95), wd 0.01 on matrices, clip 1.0, fresh state per update",
        "model": _shown(Path(args.model)),
        "parameters": n_words,
        "snapshot_MB": snapshot_bytes / 1e6,
        "zstd_snapshot_ratio": snapshot_bytes / zstd_snapshot,
        "our_snapshot_ratio": snapshot_bytes / ours_snapshot,
        "codec": codec.__dict__,
        "reps": args.reps,
        "rows": rows,
        "ablation": ablation,
    }
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "deltas.json").write_text(json.dumps(result, indent=2))
    md = render(result)
    (out / "deltas.md").write_text(md)
    print(md)


def render(r: dict) -> str:
    lines = [
        f"# Weight deltas on real updates of the demo model ({r['parameters'] / 1e6:.2f} M params, "
        f"bf16 snapshot {r['snapshot_MB']:.2f} MB)",
        "",
        f"Update: {r['optimizer']}; objective: {r['objective']}. Codec: {r['codec']}. "
        f"Machine: {r['machine']['platform']}, {r['machine']['cpus']} CPUs, torch threads "
        f"{r['machine']['torch_threads']}, load {r['machine']['load_average'][0]:.1f} at the end "
        f"(CPUs shared with other jobs); medians of {r['reps']} runs. Our snapshot file: "
        f"{r['our_snapshot_ratio']:.2f}x.",
        "",
        "| lr | steps | % bf16 identical | snapshot MB | zstd(snapshot) | naive XOR+zstd | ours "
        "| ours/naive | encode MB/s | decode MB/s | decode +base hash MB/s | bit-exact |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for row in r["rows"]:
        o = row["ours"]
        lines.append(
            f"| {row['lr']:g} | {row['steps']} | {row['identical_pct']:.2f} | "
            f"{row['snapshot_MB']:.2f} | {row['zstd_snapshot_ratio']:.2f}x | "
            f"{row['naive_best_ratio']:.1f}x | {o['ratio']:.1f}x | "
            f"{row['ours_over_naive']:.2f} | {o['encode_MBps']:.0f} | {o['decode_MBps']:.0f} | "
            f"{o['decode_with_base_hash_MBps']:.0f} | {'yes' if o['bit_exact'] else 'NO'} |"
        )
    lines += [
        "",
        "Naive = the better of zstd levels " + ", ".join(r["rows"][0]["naive_ratio"]) + ".",
        "",
        "## Codec ablation (one step)",
        "",
        "| lr | variant | ratio | encode MB/s | decode MB/s | bit-exact |",
        "|---|---|---|---|---|---|",
    ]
    for a in r["ablation"]:
        lines.append(
            f"| {a['lr']:g} | {a['variant']} | {a['ratio']:.1f}x | {a['encode_MBps']:.0f} | "
            f"{a['decode_MBps']:.0f} | {'yes' if a['bit_exact'] else 'NO'} |"
        )
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
