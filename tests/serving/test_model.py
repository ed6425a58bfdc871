"""Our Mixtral against transformers' MixtralForCausalLM, router replay, checkpoint round trip."""

import json

import pytest
import torch
from transformers import MixtralForCausalLM

from serving.checkpoint import CheckpointError, load_checkpoint, save_checkpoint
from serving.model import Attention, ModelArgs, Transformer
from tests.conftest import F32_EPS, assert_close_ulps


def random_args(seed: int) -> ModelArgs:
    g = torch.Generator().manual_seed(seed)
    pick = lambda xs: xs[int(torch.randint(len(xs), (1,), generator=g))]  # noqa: E731
    heads = pick([2, 4])
    return ModelArgs(
        vocab_size=pick([40, 57, 64]),
        dim=heads * pick([8, 16]),
        n_layers=pick([1, 2, 3]),
        n_heads=heads,
        n_kv_heads=pick([1, 2]) if heads == 2 else pick([1, 2, 4]),
        hidden_dim=pick([24, 40]),
        n_experts=pick([3, 4, 6]),
        top_k=2,
        max_seq_len=64,
        rope_theta=pick([10000.0, 500.0]),
    )


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


@pytest.mark.parametrize("invariant", [False, True], ids=["default", "batch_invariant"])
def test_logits_and_routing_match_transformers(pair, invariant):
    args, ours, hf = pair
    tokens = torch.randint(args.vocab_size, (2, 11), generator=torch.Generator().manual_seed(7))
    out = ours(tokens, return_experts=True, batch_invariant=invariant)
    ref = hf(tokens, output_router_logits=True)
    # The same function computed in another order (HF fuses gate_up, attends eagerly): 6 ulps seen.
    assert_close_ulps(out.logits, ref.logits, 32, "logits")
    assert torch.equal(out.experts, hf_routing(ref.router_logits, 2, 11, args.top_k))


@pytest.mark.parametrize("invariant", [False, True], ids=["default", "batch_invariant"])
def test_gradients_match_transformers(pair, invariant):
    args, ours, hf = pair
    tokens = torch.randint(args.vocab_size, (2, 9), generator=torch.Generator().manual_seed(3))
    ours.train(), hf.train()
    logits = ours(tokens, batch_invariant=invariant).logits
    loss_ours = torch.nn.functional.cross_entropy(
        logits[:, :-1].reshape(-1, args.vocab_size), tokens[:, 1:].reshape(-1)
    )
    loss_hf = hf(tokens, labels=tokens).loss
    assert abs(loss_ours.item() - loss_hf.item()) <= 8 * F32_EPS * abs(loss_hf.item())  # a mean of logits: 1 ulp seen
    loss_ours.backward(), loss_hf.backward()
    hf_grads = dict(hf.named_parameters())
    n = args.n_layers
    for i in range(n):
        ol, hl = ours.layers[i], hf.model.layers[i]
        pairs = [
            (ol.self_attn.q_proj.weight, hl.self_attn.q_proj.weight),
            (ol.self_attn.k_proj.weight, hl.self_attn.k_proj.weight),
            (ol.block_sparse_moe.gate.weight, hl.mlp.gate.weight),
            (ol.input_layernorm.weight, hl.input_layernorm.weight),
        ]
        for e in range(args.n_experts):
            F_ = args.hidden_dim
            gu = hl.mlp.experts.gate_up_proj.grad[e]
            pairs.append((ol.block_sparse_moe.experts[e].w1.weight, gu[:F_]))
            pairs.append((ol.block_sparse_moe.experts[e].w3.weight, gu[F_:]))
            pairs.append((ol.block_sparse_moe.experts[e].w2.weight, hl.mlp.experts.down_proj.grad[e]))
        for a, b in pairs:
            ga = a.grad
            gb = b.grad if isinstance(b, torch.nn.Parameter) else b
            assert_close_ulps(ga, gb, 64, a.shape)  # backward sums in another order too: 22 ulps seen
    assert_close_ulps(ours.embed_tokens.weight.grad, hf_grads["model.embed_tokens.weight"].grad, 64, "embed_tokens")
    assert_close_ulps(ours.lm_head.weight.grad, hf_grads["lm_head.weight"].grad, 64, "lm_head")


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
    assert (changed.logits - out.logits).abs().max() > 0.1 * out.logits.abs().max()  # not rounding: other experts


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
    from serving.kv_cache import KVCache

    args = ModelArgs.from_name("tiny")
    model = Transformer(args).init_weights(seed=3, std=0.2).eval()
    tokens = torch.randint(args.vocab_size, (2, 12), generator=torch.Generator().manual_seed(4))
    full = model(tokens, return_experts=True)
    cache = KVCache.empty(args, n_slots=4, max_len=32)
    slots = torch.tensor([3, 1])
    with torch.no_grad():
        pre = model(
            tokens[:, :7], positions_BT=torch.arange(7).expand(2, 7), cache=cache, slots_B=slots, return_experts=True
        )
        steps = [
            model(
                tokens[:, t : t + 1],
                positions_BT=torch.full((2, 1), t),
                cache=cache,
                slots_B=slots,
                return_experts=True,
            )
            for t in range(7, 12)
        ]
    logits = torch.cat([pre.logits] + [s.logits for s in steps], dim=1)
    experts = torch.cat([pre.experts] + [s.experts for s in steps], dim=1)
    assert_close_ulps(logits, full.logits, 32, "cached logits")  # default kernels: order depends on the shapes; 8 seen
    assert torch.equal(experts, full.experts)


def _corrupt(folder, field, value):
    cfg = json.loads((folder / "config.json").read_text())
    cfg[field] = value
    (folder / "config.json").write_text(json.dumps(cfg))


@pytest.mark.parametrize(
    "field,value,match",
    [
        ("architectures", ["LlamaForCausalLM"], "architectures"),
        ("hidden_size", 48, "hidden_size|shape"),
        ("num_local_experts", 5, "tensor"),
        ("num_attention_heads", 3, "num_attention_heads|divisible"),
        ("rms_norm_eps", "small", "rms_norm_eps"),
        ("torch_dtype", "int8", "torch_dtype"),
    ],
)
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


# ---- batch-invariant mode: the same token gets bit-identical logits whatever it is computed with ----


def test_invariant_linear_rows_do_not_depend_on_the_other_rows():
    """The property the mode stands on, checked on this machine's kernels for the layer shapes used here:
    from MIN_GEMM_ROWS rows on (small inputs are padded up to it), a row's result is the same whatever
    M is and wherever the row sits."""
    from serving.batch_invariant import invariant_linear

    g = torch.Generator().manual_seed(0)
    for K, N in [
        (32, 48),
        (48, 32),
        (64, 64),
        (64, 320),
        (128, 128),
        (128, 64),
        (128, 4),
        (128, 256),
        (256, 128),
        (128, 512),
        (512, 1024),
    ]:
        w = torch.randn(N, K, generator=g)
        pool = torch.randn(2000, K, generator=g)
        ref = invariant_linear(pool, w)
        for m in [*range(1, 40), 64, 100, 255, 1000, 2000]:
            idx = torch.randperm(2000, generator=g)[:m]
            assert torch.equal(invariant_linear(pool[idx], w), ref[idx]), (K, N, m)


def test_expert_matmuls_rows_are_independent_and_their_kept_transposes_follow_the_weights():
    """`matmul_t` (the experts' matmuls): a row's result does not depend on the other rows (from
    MIN_GEMM_ROWS rows on, as the experts pad); the weight's transpose it keeps between serving passes
    is made again when the weight changes in place (an optimizer step, `load_state_dict`) or gets new
    storage; under autograd it is a fresh copy that passes the gradient."""
    from serving.batch_invariant import matmul_t, pad_rows

    g = torch.Generator().manual_seed(0)
    with torch.inference_mode():
        for K, N in [(32, 48), (48, 32), (64, 64), (128, 256), (256, 128)]:
            w = torch.randn(N, K, generator=g)
            pool = torch.randn(500, K, generator=g)
            ref = matmul_t(pool, w)
            for m in [*range(1, 40), 64, 255, 500]:
                idx = torch.randperm(500, generator=g)[:m]
                assert torch.equal(matmul_t(pad_rows(pool[idx]), w)[:m], ref[idx]), (K, N, m)

    w = torch.randn(64, 32, generator=g, requires_grad=True)
    x = torch.randn(16, 32, generator=g)
    fresh = lambda: torch.mm(x, w.detach().t().contiguous())  # noqa: E731
    with torch.inference_mode():
        before = matmul_t(x, w)
    assert torch.equal(before, fresh())
    with torch.no_grad():
        w.mul_(2.0)  # in place: the version counter moves
    with torch.inference_mode():
        after = matmul_t(x, w)
    assert torch.equal(after, fresh()) and not torch.equal(after, before)
    w.data = torch.randn(64, 32, generator=g)  # new storage, the same tensor object
    with torch.inference_mode():
        assert torch.equal(matmul_t(x, w), fresh())
    y = matmul_t(x, w)  # under autograd
    y.sum().backward()
    assert w.grad is not None
    torch.testing.assert_close(w.grad, x.sum(0).expand(64, 32))  # d sum(x W^T) / dW: x's column sums


def test_every_expert_on_few_rows_is_the_dispatch_bit_for_bit(monkeypatch):
    """The batch-invariant MoE runs every expert on every row for a few rows (`DENSE_MOE_ROWS`) and
    dispatches each row to its own experts for more, or under autograd: the same bits either way, for
    the model's own routing and for replayed experts."""
    import serving.moe as sm

    for args in [ModelArgs.from_name("demo"), random_args(3)]:
        moe = sm.SparseMoE(args)
        for p in moe.parameters():
            torch.nn.init.normal_(p, std=0.2)
        g = torch.Generator().manual_seed(args.dim)
        for n in [1, 2, 7, 15, 16, 17, 31, 32, 33, 48, 63, 64]:
            x = torch.randn(n, args.dim, generator=g)
            replay = torch.stack([torch.randperm(args.n_experts, generator=g)[: args.top_k] for _ in range(n)])
            for r in (None, replay):
                with torch.no_grad():
                    monkeypatch.setattr(sm, "DENSE_MOE_ROWS", 64)
                    dense, idx_dense = moe(x, r, invariant=True)
                    monkeypatch.setattr(sm, "DENSE_MOE_ROWS", 0)
                    sparse, idx_sparse = moe(x, r, invariant=True)
                assert torch.equal(idx_dense, idx_sparse)
                assert torch.equal(dense, sparse), (args, n, r is None)
        monkeypatch.setattr(sm, "DENSE_MOE_ROWS", 128)
        x = torch.randn(8, args.dim, generator=g, requires_grad=True)
        out, _ = moe(x, None, invariant=True)  # under autograd: dispatched, the gradient flows
        out.sum().backward()
        assert x.grad is not None and moe.gate.weight.grad is not None


def _random_tokens(args, lengths, seed):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, args.vocab_size, (n,), generator=g) for n in lengths]


def _padded(seqs, pad):
    out = torch.full((len(seqs), max(len(s) for s in seqs)), pad, dtype=torch.long)
    for i, s in enumerate(seqs):
        out[i, : len(s)] = s
    return out


INVARIANT_CASES = [random_args(i) for i in range(6)] + [
    ModelArgs.from_name("demo", max_seq_len=128),
    # A long context: MKL splits a reduction over more than ~400 keys into pieces that depend on its length.
    ModelArgs.from_name("tiny", dim=64, n_heads=2, n_kv_heads=1, hidden_dim=64, max_seq_len=640),
]


@pytest.mark.parametrize(
    "args", INVARIANT_CASES, ids=lambda a: f"d{a.dim}h{a.n_heads}g{a.n_kv_heads}f{a.hidden_dim}s{a.max_seq_len}"
)
def test_batch_invariant_logits_are_bit_identical_across_batches_decode_and_threads(args, monkeypatch):
    """Full forwards in different batches (micro-batch sizes, padding), a prefill plus decode steps over a
    changing batch in a slot cache, with 1 and 2 threads: every token's logits are bit-identical. The decode
    steps over most of the slots attend to the cache in place (`Attention._decode_in_place`), those over few
    to a gathered copy; both are asserted below."""
    from serving.kv_cache import KVCache

    model = Transformer(args).init_weights(seed=11, std=0.1).eval()
    long = args.max_seq_len > 256
    lengths = [args.max_seq_len - 20, 37, 450, 9] if long else [args.max_seq_len - 5, 13, 2, 41, 30, 64, 1]
    seqs = _random_tokens(args, lengths, seed=args.dim)
    threads = torch.get_num_threads()
    with torch.inference_mode():
        alone = [model(s[None], batch_invariant=True).logits[0] for s in seqs]
        try:
            torch.set_num_threads(1 if threads > 1 else 2)
            together = model(_padded(seqs, args.pad_id), batch_invariant=True).logits
        finally:
            torch.set_num_threads(threads)
        for i, s in enumerate(seqs):
            assert torch.equal(together[i, : len(s)], alone[i]), i
        pair = model(_padded(seqs[1:3], args.pad_id), batch_invariant=True).logits
        assert torch.equal(pair[0, : len(seqs[1])], alone[1]) and torch.equal(pair[1, : len(seqs[2])], alone[2])

        # Serving: prompts prefilled together, then one decode step at a time for whoever is still running;
        # sequences finish at different times and one joins late, into permuted slots.
        cache = KVCache.empty(args, n_slots=len(seqs) + 2, max_len=args.max_seq_len)
        slot = {i: len(seqs) + 1 - i for i in range(len(seqs))}
        prompt = {i: max(1, len(s) // 3) for i, s in enumerate(seqs)}
        got = {i: [] for i in range(len(seqs))}

        def prefill(ids):
            ps = [seqs[i][: prompt[i]] for i in ids]
            T = max(len(p) for p in ps)
            out = model(
                _padded(ps, args.pad_id),
                positions_BT=torch.arange(T).expand(len(ids), T),
                cache=cache,
                slots_B=torch.tensor([slot[i] for i in ids]),
                batch_invariant=True,
            ).logits
            for j, i in enumerate(ids):
                got[i].append(out[j, : prompt[i]])

        late = len(seqs) - 1
        paths, in_place = set(), []
        decode_in_place = Attention._decode_in_place
        monkeypatch.setattr(
            Attention, "_decode_in_place", staticmethod(lambda *a: in_place.append(1) or decode_in_place(*a))
        )
        prefill([i for i in range(len(seqs)) if i != late])
        pos = {i: prompt[i] for i in range(len(seqs)) if i != late}
        step = 0
        while pos:
            if step == 3:
                prefill([late])
                pos[late] = prompt[late]
            ids = [i for i in pos if pos[i] < len(seqs[i])]
            for i in [i for i in pos if pos[i] >= len(seqs[i])]:
                del pos[i]
            if not ids:
                continue
            before = len(in_place)
            out = model(
                torch.stack([seqs[i][pos[i] : pos[i] + 1] for i in ids]),
                positions_BT=torch.tensor([[pos[i]] for i in ids]),
                cache=cache,
                slots_B=torch.tensor([slot[i] for i in ids]),
                batch_invariant=True,
            ).logits
            paths.add("in place" if len(in_place) > before else "gathered")
            for j, i in enumerate(ids):
                got[i].append(out[j])
                pos[i] += 1
            step += 1
    assert paths == {"in place", "gathered"}, paths
    for i in range(len(seqs)):
        served = torch.cat(got[i])
        assert served.shape == alone[i].shape
        assert torch.equal(served, alone[i]), (i, (served - alone[i]).abs().max())


@pytest.mark.parametrize("compact", [False, True], ids=["padded", "compact"])
@pytest.mark.parametrize("args", INVARIANT_CASES[:3] + INVARIANT_CASES[6:7], ids=lambda a: f"d{a.dim}v{a.vocab_size}")
def test_a_prefill_and_a_decode_step_in_one_pass_are_bit_identical_to_each_token_alone(args, compact):
    """`forward_steps`: new prompts prefilled in the same pass as other sequences' decode step (the
    engine's step) give every token the logits and experts of a full forward of its sequence alone,
    whether the prefill's pads run through the row-wise layers or only through attention's grid
    (`compact`: the step's `valid_BT`)."""
    from serving.kv_cache import CacheStep, KVCache

    model = Transformer(args).init_weights(seed=5, std=0.1).eval()
    seqs = _random_tokens(args, [23, 9, 31, 14, 40], seed=args.dim + 1)
    with torch.inference_mode():
        alone = [model(s[None], batch_invariant=True, return_experts=True) for s in seqs]
        cache = KVCache.empty(args, n_slots=8, max_len=args.max_seq_len)
        slot = {0: 6, 1: 2, 2: 0, 3: 7, 4: 3}
        prompt = {0: 5, 1: 9, 2: 11, 3: 3, 4: 17}
        pos: dict[int, int] = {}
        joins = {0: [0, 1], 2: [2], 3: [3, 4]}  # step -> sequences whose prompts are prefilled then
        step = 0
        while step in joins or any(pos[i] < len(seqs[i]) for i in pos):
            new = joins.get(step, [])
            decoding = [i for i in pos if pos[i] < len(seqs[i])]
            steps = []
            if new:
                T = max(prompt[i] for i in new)
                lengths = torch.tensor([prompt[i] for i in new])
                steps.append(
                    CacheStep(
                        _padded([seqs[i][: prompt[i]] for i in new], args.pad_id),
                        torch.arange(T).expand(len(new), T),
                        torch.tensor([slot[i] for i in new]),
                        lengths - 1,
                        torch.arange(T)[None, :] < lengths[:, None] if compact else None,
                    )
                )
            if decoding:
                steps.append(
                    CacheStep(
                        torch.stack([seqs[i][pos[i] : pos[i] + 1] for i in decoding]),
                        torch.tensor([[pos[i]] for i in decoding]),
                        torch.tensor([slot[i] for i in decoding]),
                        torch.zeros(len(decoding), dtype=torch.int64),
                    )
                )
            outs = model.forward_steps(steps, cache, batch_invariant=True)
            if new:
                for j, i in enumerate(new):
                    full = alone[i]
                    assert torch.equal(outs[0].logits[j], full.logits[0, prompt[i] - 1]), (i, "prefill")
                    assert torch.equal(outs[0].experts[j, : prompt[i]], full.experts[0, : prompt[i]])
                    if compact:  # the pads never reached the router
                        assert not outs[0].experts[j, prompt[i] :].any()
                    pos[i] = prompt[i]
            if decoding:
                out = outs[-1]
                for j, i in enumerate(decoding):
                    full = alone[i]
                    assert torch.equal(out.logits[j], full.logits[0, pos[i]]), (i, pos[i])
                    assert torch.equal(out.experts[j, 0], full.experts[0, pos[i]])
                    pos[i] += 1
            step += 1
        assert all(pos[i] == len(seqs[i]) for i in pos) and len(pos) == len(seqs)
        with pytest.raises(ValueError, match="at least one step"):
            model.forward_steps([], cache)
        with pytest.raises(ValueError, match="do not match"):
            model.forward_steps(
                [CacheStep(seqs[0][None, :4], torch.arange(3)[None], torch.tensor([0]), torch.tensor([2]))], cache
            )
        tokens, positions, slots = seqs[0][None, :4], torch.arange(4)[None], torch.tensor([0])
        with pytest.raises(ValueError, match="valid_BT must be a bool tensor"):
            model.forward_steps([CacheStep(tokens, positions, slots, torch.tensor([3]), torch.ones(1, 4))], cache)
        with pytest.raises(ValueError, match="marks as padding"):
            valid = torch.tensor([[True, True, False, False]])
            model.forward_steps([CacheStep(tokens, positions, slots, torch.tensor([3]), valid)], cache)


def test_batch_invariant_backward_is_sdpa_gradient():
    """The invariant attention and SiLU take their gradients from torch's own kernels: the same gradients
    (to float32 rounding) as the default path."""
    args = ModelArgs.from_name("tiny")
    tokens = torch.randint(args.vocab_size, (3, 21), generator=torch.Generator().manual_seed(2))
    grads = []
    for invariant in (False, True):
        model = Transformer(args).init_weights(seed=4, std=0.2)
        torch.log_softmax(model(tokens, batch_invariant=invariant).logits, -1)[..., 5].sum().backward()
        grads.append({n: p.grad for n, p in model.named_parameters()})
    for name, g in grads[0].items():
        assert_close_ulps(g, grads[1][name], 32, name)  # the same gradients, summed in another order: 9 ulps seen


def test_batch_invariant_is_float32_only():
    args = ModelArgs.from_name("tiny")
    model = Transformer(args).init_weights(seed=4).to(torch.bfloat16).eval()
    tokens = torch.randint(args.vocab_size, (2, 9), generator=torch.Generator().manual_seed(2))
    assert torch.equal(model(tokens, batch_invariant=True).logits, model(tokens, batch_invariant=False).logits)
