"""Our Mixtral against transformers' MixtralForCausalLM, router replay, checkpoint round trip."""

import json

import pytest
import torch
from transformers import MixtralForCausalLM

from serving.checkpoint import CheckpointError, load_checkpoint, save_checkpoint
from serving.model import ModelArgs, Transformer


def random_args(seed: int) -> ModelArgs:
    g = torch.Generator().manual_seed(seed)
    pick = lambda xs: xs[int(torch.randint(len(xs), (1,), generator=g))]  # noqa: E731
    heads = pick([2, 4])
    return ModelArgs(vocab_size=pick([40, 57, 64]), dim=heads * pick([8, 16]), n_layers=pick([1, 2, 3]),
                     n_heads=heads, n_kv_heads=pick([1, 2]) if heads == 2 else pick([1, 2, 4]),
                     hidden_dim=pick([24, 40]), n_experts=pick([3, 4, 6]), top_k=2, max_seq_len=64,
                     rope_theta=pick([10000.0, 500.0]))


@pytest.fixture(params=[0, 1, 2])
def pair(request, tmp_path):
    args = random_args(request.param)
    ours = Transformer(args).init_weights(seed=request.param, std=0.2)
    save_checkpoint(ours, tmp_path)
    hf = MixtralForCausalLM.from_pretrained(tmp_path, dtype=torch.float32, attn_implementation="eager").eval()
    return args, ours.eval(), hf


def hf_routing(router_logits, B, T, k):
    # [L] x [B*T, E] -> [B, T, L, K], HF's own rule: top-k of softmax(float logits)
    per_layer = [torch.topk(torch.softmax(rl.float(), -1), k, dim=-1).indices.view(B, T, k) for rl in router_logits]
    return torch.stack(per_layer, dim=2)


def test_logits_and_routing_match_transformers(pair):
    args, ours, hf = pair
    tokens = torch.randint(args.vocab_size, (2, 11), generator=torch.Generator().manual_seed(7))
    out = ours(tokens, return_experts=True)
    ref = hf(tokens, output_router_logits=True)
    assert torch.allclose(out.logits, ref.logits, atol=1e-5, rtol=0), (out.logits - ref.logits).abs().max()
    assert torch.equal(out.experts, hf_routing(ref.router_logits, 2, 11, args.top_k))


def test_gradients_match_transformers(pair):
    args, ours, hf = pair
    tokens = torch.randint(args.vocab_size, (2, 9), generator=torch.Generator().manual_seed(3))
    ours.train(), hf.train()
    loss_ours = torch.nn.functional.cross_entropy(ours(tokens).logits[:, :-1].reshape(-1, args.vocab_size),
                                                  tokens[:, 1:].reshape(-1))
    loss_hf = hf(tokens, labels=tokens).loss
    assert abs(loss_ours.item() - loss_hf.item()) < 1e-5
    loss_ours.backward(), loss_hf.backward()
    hf_grads = dict(hf.named_parameters())
    n = args.n_layers
    for i in range(n):
        ol, hl = ours.layers[i], hf.model.layers[i]
        pairs = [(ol.self_attn.q_proj.weight, hl.self_attn.q_proj.weight),
                 (ol.self_attn.k_proj.weight, hl.self_attn.k_proj.weight),
                 (ol.block_sparse_moe.gate.weight, hl.mlp.gate.weight),
                 (ol.input_layernorm.weight, hl.input_layernorm.weight)]
        for e in range(args.n_experts):
            F_ = args.hidden_dim
            gu = hl.mlp.experts.gate_up_proj.grad[e]
            pairs.append((ol.block_sparse_moe.experts[e].w1.weight, gu[:F_]))
            pairs.append((ol.block_sparse_moe.experts[e].w3.weight, gu[F_:]))
            pairs.append((ol.block_sparse_moe.experts[e].w2.weight, hl.mlp.experts.down_proj.grad[e]))
        for a, b in pairs:
            ga = a.grad
            gb = b.grad if isinstance(b, torch.nn.Parameter) else b
            assert torch.allclose(ga, gb, atol=1e-5, rtol=1e-4), (ga - gb).abs().max()
    assert torch.allclose(ours.embed_tokens.weight.grad, hf_grads["model.embed_tokens.weight"].grad, atol=1e-5)
    assert torch.allclose(ours.lm_head.weight.grad, hf_grads["lm_head.weight"].grad, atol=1e-5)


def test_replay_own_routing_is_bit_exact_and_other_routing_changes_logits():
    args = ModelArgs.from_name("tiny")
    model = Transformer(args).init_weights(seed=1, std=0.2).eval()
    tokens = torch.randint(args.vocab_size, (3, 10), generator=torch.Generator().manual_seed(0))
    out = model(tokens, return_experts=True)
    again = model(tokens, replay_experts=out.experts, return_experts=True)
    assert torch.equal(again.logits, out.logits)
    assert torch.equal(again.experts, out.experts)
    other = (out.experts + 1) % args.n_experts
    changed = model(tokens, replay_experts=other, return_experts=True)
    assert torch.equal(changed.experts, other)
    assert (changed.logits - out.logits).abs().max() > 1e-3


def test_replay_keeps_router_gradient():
    args = ModelArgs.from_name("tiny")
    model = Transformer(args).init_weights(seed=2, std=0.2)
    tokens = torch.randint(args.vocab_size, (2, 8), generator=torch.Generator().manual_seed(1))
    experts = model(tokens, return_experts=True).experts
    model(tokens, replay_experts=experts).logits.sum().backward()
    for layer in model.layers:
        assert layer.block_sparse_moe.gate.weight.grad.abs().sum() > 0


def test_replay_shape_and_range_are_checked():
    args = ModelArgs.from_name("tiny")
    model = Transformer(args).init_weights(seed=0)
    tokens = torch.zeros(1, 4, dtype=torch.long)
    with pytest.raises(ValueError, match="shape"):
        model(tokens, replay_experts=torch.zeros(1, 4, args.n_layers, 1, dtype=torch.long))
    with pytest.raises(ValueError, match="expert id"):
        model(tokens, replay_experts=torch.full((1, 4, args.n_layers, args.top_k), args.n_experts))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_save_load_round_trip_is_bit_identical(tmp_path, dtype):
    model = Transformer(ModelArgs.from_name("tiny")).init_weights(seed=5).to(dtype)
    save_checkpoint(model, tmp_path)
    loaded = load_checkpoint(tmp_path)
    assert loaded.args == model.args
    for (n1, a), (n2, b) in zip(model.state_dict().items(), loaded.state_dict().items()):
        assert n1 == n2 and a.dtype == b.dtype == dtype and torch.equal(a, b), n1


def test_kv_cache_prefill_and_decode_match_full_forward():
    from serving.model import KVCache
    args = ModelArgs.from_name("tiny")
    model = Transformer(args).init_weights(seed=3, std=0.2).eval()
    tokens = torch.randint(args.vocab_size, (2, 12), generator=torch.Generator().manual_seed(4))
    full = model(tokens, return_experts=True)
    cache = KVCache.empty(args, n_slots=4, max_len=32)
    slots = torch.tensor([3, 1])
    with torch.no_grad():
        pre = model(tokens[:, :7], positions_BT=torch.arange(7).expand(2, 7), cache=cache, slots_B=slots,
                    return_experts=True)
        steps = [model(tokens[:, t:t + 1], positions_BT=torch.full((2, 1), t), cache=cache, slots_B=slots,
                       return_experts=True) for t in range(7, 12)]
    logits = torch.cat([pre.logits] + [s.logits for s in steps], dim=1)
    experts = torch.cat([pre.experts] + [s.experts for s in steps], dim=1)
    assert torch.allclose(logits, full.logits, atol=1e-5)
    assert torch.equal(experts, full.experts)


def _corrupt(folder, field, value):
    cfg = json.loads((folder / "config.json").read_text())
    cfg[field] = value
    (folder / "config.json").write_text(json.dumps(cfg))


@pytest.mark.parametrize("field,value,match", [
    ("architectures", ["LlamaForCausalLM"], "architectures"),
    ("hidden_size", 48, "hidden_size|shape"),
    ("num_local_experts", 5, "tensor"),
    ("num_attention_heads", 3, "num_attention_heads|divisible"),
    ("rms_norm_eps", "small", "rms_norm_eps"),
    ("torch_dtype", "int8", "torch_dtype"),
])
def test_mismatched_config_is_refused_naming_file_and_field(tmp_path, field, value, match):
    save_checkpoint(Transformer(ModelArgs.from_name("tiny")).init_weights(seed=0), tmp_path)
    _corrupt(tmp_path, field, value)
    with pytest.raises(CheckpointError, match=match) as err:
        load_checkpoint(tmp_path)
    assert "config.json" in str(err.value) or "model.safetensors" in str(err.value)


def test_missing_and_broken_files_are_refused(tmp_path):
    with pytest.raises(CheckpointError, match="config.json: missing"):
        tmp_path.joinpath("empty").mkdir()
        load_checkpoint(tmp_path / "empty")
    save_checkpoint(Transformer(ModelArgs.from_name("tiny")).init_weights(seed=0), tmp_path / "a")
    (tmp_path / "a" / "config.json").write_text("{not json")
    with pytest.raises(CheckpointError, match="config.json: not valid JSON"):
        load_checkpoint(tmp_path / "a")
    save_checkpoint(Transformer(ModelArgs.from_name("tiny")).init_weights(seed=0), tmp_path / "b")
    data = (tmp_path / "b" / "model.safetensors").read_bytes()
    (tmp_path / "b" / "model.safetensors").write_bytes(data[: len(data) // 2])
    with pytest.raises(CheckpointError, match="model.safetensors: unreadable"):
        load_checkpoint(tmp_path / "b")
    save_checkpoint(Transformer(ModelArgs.from_name("tiny")).init_weights(seed=0), tmp_path / "c")
    from safetensors.torch import load_file, save_file
    state = load_file(str(tmp_path / "c" / "model.safetensors"))
    del state["model.layers.1.block_sparse_moe.experts.2.w3.weight"]
    save_file(state, str(tmp_path / "c" / "model.safetensors"))
    with pytest.raises(CheckpointError, match="missing tensor 'model.layers.1.block_sparse_moe.experts.2.w3.weight'"):
        load_checkpoint(tmp_path / "c")
