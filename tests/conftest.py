"""Shared fixtures: a small real checkpoint (trained tokenizer, random tiny MoE) and a live gateway."""

from __future__ import annotations

import threading

import pytest
import torch

from core.harness import free_port, wait_until
from demo.corpus import format_example, make_corpus
from serving.checkpoint import save_checkpoint
from serving.model import ModelArgs, Transformer
from serving.tokenizer import train_tokenizer

# One intra-op thread: the models are tiny, and on a 2-core machine shared with other processes two
# threads spin-wait on each other (the same tests ran 5 times slower with 2 under load; tests that
# compare thread counts set them themselves).
torch.set_num_threads(1)

F32_EPS = torch.finfo(torch.float32).eps  # one float32 ulp at 1.0: the unit of every float32 tolerance
F64_EPS = torch.finfo(torch.float64).eps  # and of every float64 (Python float) one


def approx_ulps(expected, ulps: int = 16, eps: float = F64_EPS):
    """`pytest.approx` within `ulps` ulps (float64 unless `eps` says otherwise) of the expected value, or of
    1 near 0: for a result of a few float operations checked against the same arithmetic written out."""
    return pytest.approx(expected, rel=ulps * eps, abs=ulps * eps)


def assert_close_ulps(actual: torch.Tensor, expected: torch.Tensor, ulps: float, what: object = "") -> None:
    """`actual` within `ulps` float32 ulps of the largest |expected| entry. Two float32 computations of
    one function that differ only in order (fused or split matmuls, another reduction order) round
    differently by a few ulps of the magnitudes they sum, so the scale is the tensor's, not 1."""
    actual, expected = actual.detach(), expected.detach()
    scale = float(expected.abs().max())
    diff = float((actual - expected).abs().max())
    assert diff <= ulps * F32_EPS * scale, (
        f"{what}: max |diff| {diff:.3g} is {diff / (F32_EPS * scale):.1f} ulps of {scale:.3g}, over {ulps}"
    )


@pytest.fixture(scope="session")
def demo_corpus():
    """The shipped base's pre-training corpus (`demo.bootstrap.corpus_of` of the default recipe): made
    once per session, for the split and shipped-base tests."""
    from demo.bootstrap import BootstrapConfig, corpus_of

    return tuple(corpus_of(BootstrapConfig()))


@pytest.fixture(scope="session")
def tiny_checkpoint(tmp_path_factory):
    """A checkpoint folder in the demo's format: demo-corpus tokenizer, random tiny weights."""
    folder = tmp_path_factory.mktemp("ckpt") / "tiny-v1"
    tok = train_tokenizer([format_example(t, c) for t, c in make_corpus(2000, seed=1)], vocab_size=320)
    # head_dim 32: the smallest head size vLLM's CPU attention kernels accept.
    # (and an expert width of 64, which its fused-MoE reload keeps unpadded).
    args = ModelArgs.from_name(
        "tiny",
        dim=64,
        n_heads=2,
        n_kv_heads=1,
        hidden_dim=64,
        vocab_size=tok.vocab_size,
        bos_id=tok.bos_id,
        eos_id=tok.eos_id,
        pad_id=tok.pad_id,
        max_seq_len=128,
    )
    model = Transformer(args).init_weights(seed=0, std=0.05)
    save_checkpoint(model, folder, tokenizer=tok)
    return folder


@pytest.fixture(scope="session")
def small_trained_checkpoint(tmp_path_factory):
    """A copy of the shipped demo base (`models/demo-base`, what `flywheel bootstrap` makes): useful
    but clearly improvable. For the tests of learning; a copy, so no test can change the shipped one."""
    import shutil

    from demo.bootstrap import SHIPPED_BASE

    folder = tmp_path_factory.mktemp("base") / "demo-base"
    shutil.copytree(SHIPPED_BASE, folder)
    return folder


def served_samples(checkpoint, rewards: list[float], max_tokens: int = 10) -> list:
    """`SampleEvent`s of real completions of `checkpoint` (its folder name is the served version),
    one per reward, as the joiner would emit them."""
    from feedback.events import CompletionEvent, SampleEvent
    from serving.engine import EmbeddedEngine
    from serving.sampling import SamplingParams

    n = len(rewards)
    eng = EmbeddedEngine(max_batch=16, max_model_len=128)
    try:
        eng.add_version(checkpoint.name, checkpoint)
        tok = eng.tokenizer()
        outs = eng.generate(
            [tok.encode_prompt(f"# add {i % 9} to x\ndef f(x):\n") for i in range(n)],
            [SamplingParams(max_tokens=max_tokens, seed=i) for i in range(n)],
        )
    finally:
        eng.shutdown()
    return [
        SampleEvent(
            tenant="t",
            completion=CompletionEvent.from_completion(c, "t", "u", "completions"),
            reward=r,
            signals=[],
            reward_spec="default-v1",
        )
        for c, r in zip(outs, rewards)
    ]


class LiveServer:
    """uvicorn on a free loopback port, in a thread of this process, with the HTTP protocol `flywheel serve`
    runs (`api.transport`): the live gateway of the in-process tests (a `flywheel serve` process is
    `core.harness.LiveGateway`)."""

    def __init__(self, app):
        import uvicorn

        from api.transport import CoalescedHttpTools

        self.app, self.port = app, free_port()
        config = uvicorn.Config(app, host="127.0.0.1", port=self.port, log_level="warning", http=CoalescedHttpTools)
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=self.server.run, daemon=True)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def __enter__(self):
        self.thread.start()

        def thread_alive() -> None:
            if not self.thread.is_alive():
                raise RuntimeError(f"the in-process gateway on port {self.port} stopped before serving")

        what = f"the in-process gateway on port {self.port}"
        wait_until(lambda: self.server.started, 30, what=what, interval_s=0.02, check=thread_alive)
        return self

    def __exit__(self, *exc):
        self.server.should_exit = True
        self.thread.join(timeout=30)
