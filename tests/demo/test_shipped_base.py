"""The shipped demo base (`models/demo-base`) is what `flywheel bootstrap` makes: same corpus, same
tokenizer, and the same first training steps (a replay against the loss trace it recorded). The whole
reproduction (10-40 minutes on 2 cores) runs with FLYWHEEL_FULL_BOOTSTRAP=1 and compares the result
on its evaluation."""

from __future__ import annotations

import json
import os

import pytest
import torch

from demo.bootstrap import (
    LOSS_TRACE_STEPS,
    REPORT,
    SHIPPED_BASE,
    BootstrapConfig,
    bootstrap,
    encode_example,
    make_model,
    make_tokenizer,
    texts_sha256,
    train,
)
from demo.corpus import format_example
from serving.checkpoint import load_checkpoint
from serving.tokenizer import Tokenizer

REPORTED = json.loads((SHIPPED_BASE / REPORT).read_text())
CFG = BootstrapConfig(**REPORTED["config"])


@pytest.fixture(scope="module")
def corpus(demo_corpus):
    assert CFG == BootstrapConfig(threads=CFG.threads), "models/demo-base was made with another recipe"
    return demo_corpus  # corpus_of(CFG): the default recipe's


def test_it_is_the_default_recipe_and_small_enough_to_ship():
    assert CFG == BootstrapConfig(threads=CFG.threads), "models/demo-base was made with another recipe"
    size = sum(p.stat().st_size for p in SHIPPED_BASE.iterdir())
    assert size <= 16 * 2**20, size
    assert not REPORTED["stopped_early"] and REPORTED["steps"] == CFG.steps
    model = load_checkpoint(SHIPPED_BASE)
    assert sum(p.numel() for p in model.parameters()) == REPORTED["parameters"]
    ev = REPORTED["eval"]
    assert ev["split"] == "report" and ev["n"] == CFG.eval_tasks
    assert 0.25 <= ev["pass_rate"] <= 0.60 and ev["satisfaction_ceiling"] - ev["satisfaction"] >= 0.50


@pytest.mark.slow  # the corpus made again, a tokenizer trained on it
def test_corpus_and_tokenizer_are_reproduced(corpus):
    texts = [format_example(t, c) for t, c in corpus]
    assert len(texts) == REPORTED["corpus_examples"] and texts_sha256(texts) == REPORTED["corpus_sha256"]
    shipped = Tokenizer.from_file(SHIPPED_BASE)
    made = make_tokenizer(texts, CFG)
    assert made.inner.get_vocab(with_added_tokens=True) == shipped.inner.get_vocab(with_added_tokens=True)
    sample = texts[:: len(texts) // 500]
    assert made.encode_batch(sample) == shipped.encode_batch(sample)


@pytest.mark.slow
def test_the_first_training_steps_replay_the_recorded_loss_trace(corpus):
    torch.manual_seed(CFG.seed)
    tok = Tokenizer.from_file(SHIPPED_BASE)
    assert tok.pad_id is not None
    model = make_model(tok, CFG)
    seqs = [encode_example(tok, t.prompt, c) for t, c in corpus]
    stats = train(model, seqs, CFG, tok.pad_id, stop_after=LOSS_TRACE_STEPS)
    recorded = REPORTED["loss_trace"]
    assert len(recorded) == LOSS_TRACE_STEPS and len(stats["loss_trace"]) == LOSS_TRACE_STEPS
    # Same data, weights and batches: it replays exactly on the machine that recorded it. Another thread
    # count or CPU sums in another order, and float32 rounding differences grow step after step of
    # training, far past a few ulps: 2e-3 of a loss of ~5, a small fraction of the 1.0 the trace falls.
    assert stats["loss_trace"] == pytest.approx(recorded, rel=2e-3, abs=2e-3)
    assert recorded[-1] < recorded[0] - 1.0  # it is a real training trace, not a flat line


@pytest.mark.slow
@pytest.mark.skipif(
    os.environ.get("FLYWHEEL_FULL_BOOTSTRAP") != "1",
    reason="the full bootstrap takes 10-40 minutes on 2 cores: FLYWHEEL_FULL_BOOTSTRAP=1 runs it",
)
def test_a_full_bootstrap_reproduces_the_shipped_base(tmp_path):
    report = bootstrap(tmp_path / "demo-base", CFG)
    assert report["corpus_sha256"] == REPORTED["corpus_sha256"]
    # A whole training run elsewhere: the drift above over every step, not rounding of one result.
    assert report["final_loss"] == pytest.approx(REPORTED["final_loss"], abs=0.02)
    shipped, made = REPORTED["eval"], report["eval"]
    assert abs(made["pass_rate"] - shipped["pass_rate"]) < 0.05, (made["pass_rate"], shipped["pass_rate"])
    assert abs(made["satisfaction"] - shipped["satisfaction"]) < 0.05
