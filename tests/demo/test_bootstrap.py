"""Bootstrap: deterministic from its seed, cached, and its checkpoint loads in transformers too."""

import json

import pytest
import torch
from transformers import MixtralForCausalLM

from demo.bootstrap import REPORT, BootstrapConfig, bootstrap
from serving.checkpoint import load_checkpoint
from tests.conftest import assert_close_ulps

SMALL = BootstrapConfig(
    seed=3,
    preset="tiny",
    max_seq_len=128,
    corpus_size=300,
    vocab_size=300,
    steps=6,
    batch_size=8,
    eval_tasks=8,
    warmup=2,
)


@pytest.mark.slow  # three small bootstraps
def test_bootstrap_is_deterministic_and_cached(tmp_path):
    a = bootstrap(tmp_path / "a", SMALL)
    b = bootstrap(tmp_path / "b", SMALL)
    assert (tmp_path / "a" / "model.safetensors").read_bytes() == (tmp_path / "b" / "model.safetensors").read_bytes()
    assert (tmp_path / "a" / "tokenizer.json").read_bytes() == (tmp_path / "b" / "tokenizer.json").read_bytes()
    assert a["eval"] == b["eval"] and a["steps"] == 6 and not a["stopped_early"]
    assert 0.0 <= a["eval"]["pass_rate"] <= 1.0 and 0.0 <= a["eval"]["satisfaction"] <= 1.0
    mtime = (tmp_path / "a" / "model.safetensors").stat().st_mtime_ns
    again = bootstrap(tmp_path / "a", SMALL)  # cached: not retrained
    assert again == json.loads((tmp_path / "a" / REPORT).read_text())
    assert (tmp_path / "a" / "model.safetensors").stat().st_mtime_ns == mtime
    other = bootstrap(tmp_path / "c", SMALL.model_copy(update={"seed": 4}))
    assert (tmp_path / "c" / "model.safetensors").read_bytes() != (tmp_path / "a" / "model.safetensors").read_bytes()
    assert other["config"]["seed"] == 4


def test_bootstrap_checkpoint_loads_in_transformers(tmp_path):
    bootstrap(tmp_path / "m", SMALL)
    ours = load_checkpoint(tmp_path / "m")
    hf = MixtralForCausalLM.from_pretrained(tmp_path / "m", dtype=torch.float32).eval()
    tokens = torch.tensor([[ours.args.bos_id, 5, 6, 7, 8]])
    with torch.no_grad():
        # The same function computed in another order (test_model has the details): 1 ulp seen.
        assert_close_ulps(ours(tokens).logits, hf(tokens).logits, 32, "logits")
    assert not any(p.name.startswith("m.tmp") for p in tmp_path.iterdir())  # no half-written folder left
