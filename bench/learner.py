"""Learner benchmark: serving-vs-trainer mismatch at the behaviour version, and update throughput.

Completions come from the embedded engine serving the demo checkpoint (by default the shipped demo base,
`models/demo-base`): train-split demo tasks (`demo.split.sample_tasks`), temperature 1, top_p 1,
max_tokens 48, one seed per request; rewards are the checker's pass/fail (they only matter for the
throughput part, which needs a real loss).

1. Mismatch. For each (serving dtype, trainer dtype) pair the trainer re-scores every completion
   at the behaviour version (`learner.replay.trainer_logprobs`, micro-batches of 64), once routing
   every token to its recorded experts (replay) and once letting its own router choose (no replay):
     |Δlogprob| = |recorded - recomputed| per output token, mean / p99 / max over all tokens;
     routing disagreement = share of fed (token, layer) decisions whose expert set differs from the
     recorded one without replay (as `mismatch_stats`), and the share of fed tokens with any layer
     differing. Trainer bf16 = a copy of the model cast with `.to(torch.bfloat16)`; serving bf16 =
     an engine version holding that copy (its KV cache is bf16 too). The first micro-batch of every
     pair is cross-checked against `mismatch_stats`, which the learner logs every update.
   Target: |Δlogprob| with replay <= 1e-6, serving and trainer both float32. Replay cannot
   close the float32 gap by itself: the engine computes decode steps against a KV cache, the trainer
   one full forward. Both use the model's batch-invariant kernels by default (`serving/model.py`),
   which make the two bit-identical; one more pair, "float32 (default kernels)", serves and re-scores
   with torch's default kernels (`batch_invariant=False` on both sides).
   The floor under any gap: the float32 trainer against itself, micro-batch 64 vs 1, in both modes.
2. Throughput. `Trainer.update` (float32, micro_batch 64, the default `steps_per_update`: two Adam
   steps, each a pass over the batch; no mismatch measurement) on 64 / 256 / 512 of those
   completions, replay on and off (batch-invariant kernels), plus 512 with replay on and the default
   kernels (the cost of invariance): samples/s and completion tokens/s from the update's own stats
   (each pass counts, so a sample counts twice), median over `--repeats` timed updates after one
   warm-up. The grid runs with `--threads` intra-op threads (default 1); one extra row repeats 64
   samples / replay on with 2 threads: on the shared 2-core dev machine 2 OpenMP threads have been
   measured both faster than 1 and, at load ~3-4 from other work, 2-10x slower (every parallel
   region waits for a descheduled thread).

The engine runs on its own thread with 1 intra-op thread and is shut down before anything is timed;
the serving wall time of each engine (512 requests, 64 at a time) is recorded as a rough measure of
what the batch-invariant decode costs (bench/serving.py is the serving benchmark).
The peers, in the same run: the trainer against itself (micro-batch 64 vs 1), and the default kernels.
"""

from __future__ import annotations

import copy
import statistics
import time
from pathlib import Path

import torch

from bench import common
from demo.bootstrap import SHIPPED_BASE
from demo.checker import check_batch
from demo.split import sample_tasks
from learner.replay import Sequence, make_batch, mismatch_stats, trainer_logprobs
from learner.trainer import Trainer, TrainerConfig
from serving.checkpoint import load_checkpoint
from serving.engine import EmbeddedEngine
from serving.model import Transformer
from serving.sampling import SamplingParams
from serving.tokenizer import Tokenizer

NAME = "learner"
MAX_TOKENS = 48
MICRO_BATCH = 64
UPDATE_SIZES = (64, 256, 512)
THREADS_CHECK = (2, 64, True)  # (threads, samples, replay): the contention row
DEFAULT_FP32 = "float32 (default kernels)"  # batch_invariant=False in the engine and the trainer
DEFAULT_KERNELS_CHECK = (512, True)  # (samples, replay) with batch_invariant=False: the cost of invariance
TARGET = 1e-6


def serve(engine: EmbeddedEngine, version: str, tok: Tokenizer, tasks, seed: int) -> list[Sequence]:
    prompts = [tok.encode_prompt(t.prompt) for t in tasks]
    params = [
        SamplingParams(temperature=1.0, top_p=1.0, max_tokens=MAX_TOKENS, seed=seed + i) for i in range(len(tasks))
    ]
    outs = engine.generate(prompts, params, version)
    checks = check_batch(tasks, [o.text for o in outs])
    return [
        Sequence(
            o.prompt_ids,
            o.output_ids,
            o.logprobs,
            o.routed_experts,
            o.params.temperature,
            o.params.top_p,
            reward=float(c.passed),
            version=version,
            key=t.family,
        )
        for t, o, c in zip(tasks, outs, checks)
    ]


@torch.no_grad()
def mismatch(model: Transformer, seqs: list[Sequence], pad_id: int, n_vocab: int, invariant: bool = True) -> dict:
    """|Δlogprob| with and without replay and routing disagreement over all `seqs` (`invariant`: the
    trainer's batch-invariant kernels)."""
    args = model.args
    model.eval()
    d_rep, d_free = [], []
    dis, decisions, tok_dis, fed_tokens = 0, 0, 0, 0
    check = None
    for i in range(0, len(seqs), MICRO_BATCH):
        batch = make_batch(seqs[i : i + MICRO_BATCH], pad_id, args.n_layers, args.top_k, replay=True)
        assert batch.replay_BSLK is not None, "every served completion records its routing"
        m = batch.mask_BT.bool()
        lp_rep, _ = trainer_logprobs(model, batch, n_vocab, replay=True, batch_invariant=invariant)
        lp_free, experts = trainer_logprobs(model, batch, n_vocab, replay=False, batch_invariant=invariant)
        d_rep.append((lp_rep - batch.behaviour_BT).abs()[m])
        d_free.append((lp_free - batch.behaviour_BT).abs()[m])
        # Fed tokens: prompt + output - 1 per sequence (the last output token is never fed).
        n_fed = batch.mask_BT.sum(1).long() + batch.out_pos_BT[:, 0]  # [B]
        fed_BS = torch.arange(batch.tokens_BS.shape[1])[None, :] < n_fed[:, None]
        differ_BSL = ~(experts.sort(-1).values == batch.replay_BSLK.sort(-1).values).all(-1)
        dis += int((differ_BSL & fed_BS[..., None]).sum())
        decisions += int(fed_BS.sum()) * args.n_layers
        tok_dis += int((differ_BSL.any(-1) & fed_BS).sum())
        fed_tokens += int(fed_BS.sum())
        if check is None:  # the learner's own per-update numbers, on the first micro-batch
            ms, n = mismatch_stats(model, batch, n_vocab, batch_invariant=invariant), m.sum()
            mine = {
                "abs_dlogp_mean": float(d_rep[0].sum() / n),
                "abs_dlogp_max": float(d_rep[0].max()),
                "abs_dlogp_mean_no_replay": float(d_free[0].sum() / n),
                "abs_dlogp_max_no_replay": float(d_free[0].max()),
                "routing_disagreement": dis / max(decisions, 1),
            }
            for k, v in mine.items():
                assert abs(ms[k] - v) <= 1e-6 * max(1.0, abs(v)), f"{k}: mismatch_stats {ms[k]} vs {v}"
            check = ms
    rep, free = torch.cat(d_rep).double(), torch.cat(d_free).double()

    behaviour = torch.cat([torch.tensor(s.logprobs) for s in seqs]).double()

    def summary(d: torch.Tensor) -> dict:
        return {
            "mean": float(d.mean()),
            "p99": float(torch.quantile(d, 0.99)),
            "max": float(d.max()),
            "share_over_target": float((d > TARGET).double().mean()),
            # float32 spacing grows with |logprob|: the worst token's own value says how many ulps it is
            "max_at_logprob": float(behaviour[int(d.argmax())]),
        }

    return {
        "tokens": int(rep.numel()),
        "replay": summary(rep),
        "no_replay": summary(free),
        "routing_disagreement": dis / max(decisions, 1),
        "tokens_with_any_layer_rerouted": tok_dis / max(fed_tokens, 1),
        "mismatch_stats_first_batch": check,
    }


@torch.no_grad()
def batch_noise(model: Transformer, seqs: list[Sequence], pad_id: int, n_vocab: int, invariant: bool) -> dict:
    """The trainer against itself: the same sequences scored in one micro-batch of 64 and one by one.
    torch's default float32 CPU kernels are not batch-invariant, so with them this is the floor under
    any serving-vs-trainer gap; with the batch-invariant kernels it is 0."""
    args = model.args
    seqs = seqs[:MICRO_BATCH]
    full, _ = trainer_logprobs(
        model, make_batch(seqs, pad_id, args.n_layers, args.top_k), n_vocab, batch_invariant=invariant
    )
    d = []
    for i, s in enumerate(seqs):
        one, _ = trainer_logprobs(
            model, make_batch([s], pad_id, args.n_layers, args.top_k), n_vocab, batch_invariant=invariant
        )
        d.append((one[0] - full[i, : len(s.output_ids)]).abs())
    d_all = torch.cat(d)
    return {
        "sequences": len(seqs),
        "batch_invariant": invariant,
        "mean": float(d_all.mean()),
        "max": float(d_all.max()),
    }


def throughput(
    base: Transformer, seqs: list[Sequence], pad_id: int, n_vocab: int, repeats: int, threads: int
) -> list[dict]:
    rows = []
    # replay on/off interleaved per size: the load of the shared machine drifts during the run
    grid = [(threads, size, replay, True) for size in UPDATE_SIZES for replay in (True, False)]
    grid.append((threads, *DEFAULT_KERNELS_CHECK, False))
    if THREADS_CHECK[0] != threads:
        grid.append((*THREADS_CHECK, True))
    for n_threads, size, replay, invariant in grid:
        torch.set_num_threads(n_threads)
        if size > len(seqs):
            raise ValueError(f"update size {size} needs at least {size} completions (--n)")
        model = copy.deepcopy(base)
        cfg = TrainerConfig(micro_batch=MICRO_BATCH, replay=replay, lr=1e-5, batch_invariant=invariant)
        trainer = Trainer(model, cfg, n_vocab, pad_id)
        batch = seqs[:size]
        trainer.update(batch)  # warm-up: allocator, Adam state
        runs = [trainer.update(batch).stats for _ in range(repeats)]

        def pick(k: str, runs=runs) -> float:
            return statistics.median(r[k] for r in runs)

        row = {
            "threads": n_threads,
            "replay": replay,
            "batch_invariant": invariant,
            "samples": size,
            "micro_batch": MICRO_BATCH,
            "tokens": int(sum(len(s.output_ids) for s in batch)),
            "repeats": repeats,
            "update_s": pick("update_seconds"),
            "samples_per_s": pick("samples_per_s"),
            "tokens_per_s": pick("tokens_per_s"),
            "samples_per_s_range": [min(r["samples_per_s"] for r in runs), max(r["samples_per_s"] for r in runs)],
        }
        rows.append(row)
        print(
            f"  update threads={n_threads} replay={replay} invariant={invariant} samples={size}: "
            f"{row['samples_per_s']:.0f} samples/s, "
            f"{row['tokens_per_s']:.0f} tokens/s ({row['update_s']:.2f} s)",
            flush=True,
        )
    torch.set_num_threads(threads)
    return rows


def main() -> None:
    ap = common.parser(__doc__)
    ap.add_argument("--model", type=Path, default=SHIPPED_BASE, help="the checkpoint (default: models/demo-base)")
    ap.add_argument("--n", type=int, default=512, help="completions served per serving dtype")
    ap.add_argument("--repeats", type=int, default=5, help="timed updates per throughput row")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=1, help="torch intra-op threads of the trainer")
    a = ap.parse_args()
    st = common.stamp()
    t_start = time.perf_counter()
    torch.set_num_threads(a.threads)
    torch.manual_seed(a.seed)
    model_dir = Path(a.model)
    tok = Tokenizer.from_file(model_dir)
    pad_id = tok.pad_id
    assert pad_id is not None, "the demo tokenizer has a pad token"
    fp32 = load_checkpoint(model_dir).eval()
    if next(fp32.parameters()).dtype != torch.float32:
        raise ValueError(f"{model_dir} is not a float32 checkpoint")
    bf16 = copy.deepcopy(fp32).to(torch.bfloat16).eval()
    n_vocab = min(fp32.args.vocab_size, tok.vocab_size)
    tasks = sample_tasks(a.n, seed=a.seed + 4242)

    t0 = time.perf_counter()
    served, serve_wall = {}, {}
    for invariant, versions in (
        (True, (("float32", "fp32", fp32), ("bfloat16", "bf16", bf16))),
        (False, ((DEFAULT_FP32, "fp32", fp32),)),
    ):
        engine = EmbeddedEngine(
            max_batch=64, max_model_len=fp32.args.max_seq_len, seed=a.seed, batch_invariant=invariant
        )
        try:
            for _, name, model in versions:
                engine.add_version(name, model, tok)
            for label, name, _ in versions:
                t1 = time.perf_counter()
                served[label] = serve(engine, name, tok, tasks, a.seed)
                serve_wall[label] = time.perf_counter() - t1
                print(f"served {a.n} completions ({label}) in {serve_wall[label]:.1f} s", flush=True)
        finally:
            engine.shutdown()
    serve_s = time.perf_counter() - t0

    t0 = time.perf_counter()
    rows = []
    for serving, trainer_dtype, model in (
        ("float32", "float32", fp32),
        ("float32", "bfloat16", bf16),
        ("bfloat16", "float32", fp32),
        ("bfloat16", "bfloat16", bf16),
        (DEFAULT_FP32, DEFAULT_FP32, fp32),
    ):
        r = {
            "serving": serving,
            "trainer": trainer_dtype,
            **mismatch(model, served[serving], pad_id, n_vocab, invariant=serving != DEFAULT_FP32),
        }
        rows.append(r)
        print(
            f"  serving {serving} / trainer {trainer_dtype}: replay mean {r['replay']['mean']:.3e} max "
            f"{r['replay']['max']:.3e}; no replay mean {r['no_replay']['mean']:.3e} "
            f"max {r['no_replay']['max']:.3e}, "
            f"routing differs {r['routing_disagreement'] * 100:.2f}%",
            flush=True,
        )
    noise = batch_noise(fp32, served["float32"], pad_id, n_vocab, invariant=True)
    noise_default = batch_noise(fp32, served[DEFAULT_FP32], pad_id, n_vocab, invariant=False)
    mismatch_s = time.perf_counter() - t0
    base = rows[0]["replay"]
    target = {
        "mean": base["mean"],
        "max": base["max"],
        "max_at_logprob": base["max_at_logprob"],
        "mean_ok": base["mean"] <= TARGET,
        "max_ok": base["max"] <= TARGET,
    }

    t0 = time.perf_counter()
    tput = throughput(fp32, served["float32"], pad_id, n_vocab, a.repeats, a.threads)
    tput_s = time.perf_counter() - t0

    res = {
        "trainer_threads": a.threads,
        "model": common.shown(model_dir),
        "completions": a.n,
        "max_tokens": MAX_TOKENS,
        "temperature": 1.0,
        "mean_output_tokens": {k: sum(len(s.output_ids) for s in v) / len(v) for k, v in served.items()},
        "target": target,
        "mismatch": rows,
        "trainer_batch_noise_fp32": noise,
        "trainer_batch_noise_fp32_default_kernels": noise_default,
        "throughput": tput,
        "serve_wall_s": serve_wall,
        "default_fp32": DEFAULT_FP32,
        "seconds": {
            "serve": serve_s,
            "mismatch": mismatch_s,
            "throughput": tput_s,
            "total": time.perf_counter() - t_start,
        },
    }
    common.save(NAME, res, st, a.out)


if __name__ == "__main__":
    main()
