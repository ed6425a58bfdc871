"""`flywheel bootstrap`: pre-train the demo product's base model from scratch, deterministically.

Owns the base model's recipe: a synthetic corpus of the product's train split (demo.corpus,
mixing correct and incorrect, house-style and other completions on purpose), a byte-level BPE
tokenizer trained on it (digits and quoted letters kept as single tokens, so held-out values are
new sequences of seen tokens), a next-token pre-training run of the `demo` preset, and a measured
evaluation of the result on the report split (verifiable pass rate and simulated users'
satisfaction, sampled at temperature 1 as the product serves). The checkpoint is written in the HF
Mixtral format and cached: a folder that already holds a finished bootstrap (`bootstrap.json`) is
reused.

The result of the default recipe is shipped in the repository (`models/demo-base`, `SHIPPED_BASE`),
so a first start copies it instead of training for 10-40 minutes; `bootstrap.json` records what
makes it checkable: the corpus's and the tokenizer's hashes and the loss of the first steps
(`tests/demo/test_shipped_base.py` replays them).

Why a mixed corpus: online RL can only sharpen what the base already does sometimes. A base that
is right about half the time and in the house style only now and then is useful but clearly
improvable, which is the situation Flywheel is for.
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import os
import shutil
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import torch
from pydantic import BaseModel, ConfigDict, Field
from tqdm import tqdm

from demo.corpus import CorpusMix, format_example, make_corpus
from demo.evaluation import evaluate
from demo.split import split_tasks
from demo.tasks import Task
from serving.checkpoint import save_checkpoint
from serving.engine import EmbeddedEngine
from serving.interface import Engine
from serving.model import ModelArgs, Transformer, lm_step
from serving.tokenizer import Tokenizer, train_tokenizer

log = logging.getLogger(__name__)

REPORT = "bootstrap.json"
SHIPPED_BASE = Path(__file__).resolve().parents[1] / "models" / "demo-base"
"""The default recipe's checkpoint, committed (about 8 MB): what a first start serves."""
LOSS_TRACE_STEPS = 20


class BootstrapConfig(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    seed: int = Field(0, description="Seeds the corpus, tokenizer data order, weights and batches.")
    preset: str = Field("demo", description="ModelArgs preset (vocabulary size comes from the tokenizer).")
    max_seq_len: int | None = Field(None, ge=64, description="Override the preset's context length.")
    corpus_size: int = Field(96000, ge=100, description="Examples in the synthetic pre-training corpus.")
    p_correct: float = Field(0.5, ge=0, le=1, description="Share of corpus completions that are correct.")
    p_preferred: float = Field(0.3, ge=0, le=1, description="Share of corpus completions in the house style.")
    vocab_size: int = Field(512, ge=259, description="Tokenizer vocabulary size (bytes + merges + specials).")
    steps: int = Field(1500, ge=1, description="Optimizer steps (10-40 minutes on 2 CPU cores).")
    batch_size: int = Field(64, ge=1, description="Sequences per step.")
    lr: float = Field(3e-3, gt=0, description="Peak AdamW learning rate (cosine decay to 10%).")
    warmup: int = Field(50, ge=0, description="Linear warm-up steps.")
    weight_decay: float = Field(0.01, ge=0, description="AdamW weight decay on matrices.")
    time_budget_s: float = Field(
        3600.0,
        gt=0,
        description="Safety guard: training stops early past this wall time (reported as stopped_early; the "
        "result then depends on machine speed).",
    )
    eval_tasks: int = Field(1000, ge=1, description="Report-split prompts of the evaluation (demo.split).")
    eval_temperature: float = Field(1.0, ge=0, le=2, description="Sampling temperature of the evaluation.")
    threads: int | None = Field(None, ge=1, description="torch threads (None: torch's default).")


def encode_example(tok: Tokenizer, prompt: str, completion: str) -> list[int]:
    """Prompt and completion are tokenized apart, as in serving: the prompt is encoded alone and the
    completion is generated token by token, so no BPE merge may straddle the boundary."""
    return tok.encode_prompt(prompt) + tok.encode(completion) + [tok.eos_id]


def train(
    model: Transformer, seqs: list[list[int]], cfg: BootstrapConfig, pad_id: int, stop_after: int | None = None
) -> dict:
    """`cfg.steps` optimizer steps (the schedule's length); `stop_after` ends the run sooner, on the
    same schedule (the shipped base's test replays its first steps). `pad_id` pads `seqs` and must be
    the model's."""
    if pad_id != model.args.pad_id:
        raise ValueError(f"pad_id {pad_id} is not the model's pad id {model.args.pad_id}")
    gen = torch.Generator().manual_seed(cfg.seed + 1)
    decay = [p for n, p in model.named_parameters() if p.dim() >= 2]
    no_decay = [p for n, p in model.named_parameters() if p.dim() < 2]
    opt = torch.optim.AdamW(
        [{"params": decay, "weight_decay": cfg.weight_decay}, {"params": no_decay, "weight_decay": 0.0}],
        lr=cfg.lr,
        betas=(0.9, 0.95),
    )
    model.train()
    t0, losses, step = time.perf_counter(), [], 0
    last = min(cfg.steps, stop_after or cfg.steps)
    bar = tqdm(total=last, desc="bootstrap", unit="step", dynamic_ncols=True, leave=False, disable=last < 50)
    for step in range(1, last + 1):
        lr = cfg.lr * (
            step / cfg.warmup
            if step <= cfg.warmup
            else 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * (step - cfg.warmup) / max(1, cfg.steps - cfg.warmup)))
        )
        for g in opt.param_groups:
            g["lr"] = lr
        idx = torch.randint(len(seqs), (cfg.batch_size,), generator=gen).tolist()
        losses.append(lm_step(model, opt, [seqs[i] for i in idx]))
        bar.update(1)
        bar.set_postfix(loss=f"{losses[-1]:.3f}", refresh=False)
        if step % 100 == 0 or step == 1:
            log.info(
                "bootstrap step %d/%d loss %.4f lr %.2e (%.0fs)",
                step,
                cfg.steps,
                losses[-1],
                lr,
                time.perf_counter() - t0,
            )
        if time.perf_counter() - t0 > cfg.time_budget_s:
            log.warning("bootstrap: time budget of %.0fs reached at step %d", cfg.time_budget_s, step)
            break
    bar.close()
    model.eval()
    tail = losses[-50:]
    return {
        "steps": step,
        "stopped_early": step < cfg.steps,
        "final_loss": sum(tail) / len(tail),
        "train_seconds": time.perf_counter() - t0,
        "loss_trace": losses[:LOSS_TRACE_STEPS],
    }


def corpus_of(cfg: BootstrapConfig) -> list[tuple[Task, str]]:
    """The pre-training examples of `cfg`, in order: (train task, known completion)."""
    return make_corpus(
        cfg.corpus_size, seed=cfg.seed, mix=CorpusMix(p_correct=cfg.p_correct, p_preferred=cfg.p_preferred)
    )


def texts_sha256(texts: Sequence[str]) -> str:
    h = hashlib.sha256()
    for text in texts:
        h.update(text.encode())
        h.update(b"\0")
    return h.hexdigest()


def make_tokenizer(texts: Sequence[str], cfg: BootstrapConfig) -> Tokenizer:
    return train_tokenizer(list(texts), vocab_size=cfg.vocab_size, spell_quoted_strings=True)


def make_model(tok: Tokenizer, cfg: BootstrapConfig) -> Transformer:
    """The untrained model of `cfg`, weights seeded."""
    assert tok.pad_id is not None  # train_tokenizer always adds PAD
    overrides = {"max_seq_len": cfg.max_seq_len} if cfg.max_seq_len else {}
    args = ModelArgs.from_name(
        cfg.preset, vocab_size=tok.vocab_size, bos_id=tok.bos_id, eos_id=tok.eos_id, pad_id=tok.pad_id, **overrides
    )
    return Transformer(args).init_weights(seed=cfg.seed)


def bootstrap(
    out_dir: str | Path,
    cfg: BootstrapConfig | None = None,
    force: bool = False,
    *,
    evaluation: Callable[[Engine, str], dict] | None = None,
) -> dict:
    """Pre-train (or reuse) the base in `out_dir`. `evaluation(engine, "base")` replaces the default
    evaluation (`demo.evaluation.evaluate` on `cfg.eval_tasks` report prompts) for the report's "eval"
    (`bench/demo_calibration.py` measures more sets)."""
    cfg = cfg or BootstrapConfig()
    out_dir = Path(out_dir)
    report_path = out_dir / REPORT
    if report_path.is_file() and not force:
        log.info("bootstrap: reusing %s", out_dir)
        return json.loads(report_path.read_text())
    if cfg.threads:
        torch.set_num_threads(cfg.threads)
    torch.manual_seed(cfg.seed)
    t0 = time.perf_counter()
    corpus = corpus_of(cfg)
    texts = [format_example(t, c) for t, c in corpus]
    tok = make_tokenizer(texts, cfg)
    assert tok.pad_id is not None
    model = make_model(tok, cfg)
    args = model.args
    seqs = [encode_example(tok, t.prompt, c) for t, c in corpus]
    stats = train(model, seqs, cfg, tok.pad_id)
    engine = EmbeddedEngine(max_batch=64, max_model_len=args.max_seq_len, seed=cfg.seed)
    try:
        engine.add_version("base", model, tok)
        torch.manual_seed(cfg.seed)
        if evaluation is None:
            tasks = split_tasks("report", cfg.eval_tasks)
            ev = evaluate(engine, "base", tasks, seed=cfg.seed + 10_000, temperature=cfg.eval_temperature)
            ev["split"] = "report"
        else:
            ev = evaluation(engine, "base")
    finally:
        engine.shutdown()
    report = {
        "config": cfg.model_dump(),
        "model": args.to_dict(),
        "parameters": sum(p.numel() for p in model.parameters()),
        "corpus_examples": len(texts),
        "corpus_tokens": sum(len(s) for s in seqs),
        "corpus_sha256": texts_sha256(texts),
        **stats,
        "eval": ev,
        "total_seconds": time.perf_counter() - t0,
        "torch_threads": torch.get_num_threads(),
    }
    # Write into a sibling temp folder, then rename: a crash never leaves a half-written model behind.
    tmp = out_dir.with_name(out_dir.name + f".tmp-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    save_checkpoint(model, tmp, tokenizer=tok, extra_files={REPORT: json.dumps(report, indent=2)})
    if out_dir.exists():
        shutil.rmtree(out_dir)
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    os.replace(tmp, out_dir)
    return report
