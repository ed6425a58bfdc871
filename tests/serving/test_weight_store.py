"""Weight store: bit-exact snapshots and deltas (random bits, real AdamW updates), chains, and every
corruption refused with nothing applied."""

import hashlib
import json

import pytest
import torch
import torch.nn.functional as F
import zstandard

from demo.bootstrap import SHIPPED_BASE, encode_example
from demo.corpus import make_corpus
from serving.checkpoint import load_checkpoint
from serving.codec import (
    HEADER,
    MAGIC,
    Codec,
    DeltaError,
    apply_delta,
    decode_snapshot,
    encode_delta,
    encode_snapshot,
    read_manifest,
)
from serving.tokenizer import Tokenizer
from serving.weight_store import MissingVersionError, WeightStore, shipping_state

DEMO = SHIPPED_BASE
_INT = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(_INT[t.element_size()])


def same_bits(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(
        a[k].dtype == b[k].dtype and a[k].shape == b[k].shape and torch.equal(bits(a[k]), bits(b[k])) for k in a
    )


def clone(state: dict) -> dict:
    return {k: v.clone() for k, v in state.items()}


def random_state(seed: int) -> dict:
    """Random raw bits (NaN payloads, infinities, -0.0 included), odd sizes, 0-d, 1-d and empty tensors."""
    g = torch.Generator().manual_seed(seed)

    def rbits(shape, dtype):
        n = torch.Size(shape).numel()
        width = torch.empty((), dtype=dtype).element_size()
        lo, hi = -(2 ** (8 * width - 1)), 2 ** (8 * width - 1) - 1
        words = torch.randint(lo, hi, (n,), generator=g, dtype=torch.int64).to(_INT[width])
        return words.view(dtype).reshape(shape)

    return {
        "model.layers.0.a.weight": rbits((3, 5, 7), torch.bfloat16),
        "model.layers.0.b.weight": rbits((17,), torch.float32),
        "model.norm.weight": rbits((), torch.bfloat16),
        "model.scale": rbits((), torch.float16),
        "model.count": rbits((4,), torch.int64),
        "model.mask": torch.randint(0, 2, (9,), generator=g).bool(),
        "model.empty": torch.empty(0, 3, dtype=torch.bfloat16),
        "lm_head.weight": rbits((11, 13), torch.bfloat16),
    }


def perturb(state: dict, frac: float, seed: int) -> dict:
    """Change the bits of about `frac` of every tensor's words (1.0: every word random)."""
    g = torch.Generator().manual_seed(seed)
    out = {}
    for k, t in state.items():
        b = bits(t).clone().reshape(-1)
        if t.dtype == torch.bool:
            flip = torch.rand(b.shape, generator=g) < frac
            out[k] = (b ^ flip.to(torch.uint8)).view(torch.bool).reshape(t.shape)
            continue
        noise = torch.randint(1, 255, b.shape, generator=g).to(b.dtype)
        flip = torch.rand(b.shape, generator=g) < frac
        out[k] = torch.where(flip, b ^ noise, b).view(t.dtype).reshape(t.shape)
    return out


def lm_update(model, seqs, lr: float, steps: int = 1, seed: int = 0):
    """`steps` AdamW steps (the demo's betas, clipping) on the LM cross-entropy of demo-corpus sequences."""
    opt = torch.optim.AdamW(model.parameters(), lr=lr, betas=(0.9, 0.95), weight_decay=0.01)
    g = torch.Generator().manual_seed(seed)
    model.train()
    for _ in range(steps):
        idx = torch.randint(len(seqs), (8,), generator=g).tolist()
        T = max(len(seqs[i]) for i in idx)
        batch = torch.tensor([seqs[i] + [0] * (T - len(seqs[i])) for i in idx])
        logits = model(batch[:, :-1]).logits
        targets = batch[:, 1:].masked_fill(batch[:, 1:] == 0, -100)
        loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1), ignore_index=-100)
        opt.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
    return model.eval()


def corpus_seqs(folder, n=64, seed=777):
    tok = Tokenizer.from_file(folder)
    return [encode_example(tok, t.prompt, c) for t, c in make_corpus(n, seed=seed)]


def naive_xor(parent: dict, child: dict, level: int) -> bytes:
    """The baseline the issue names: zstd of the XOR of the raw bytes, tensors in name order."""
    x = torch.cat([(bits(parent[k]) ^ bits(child[k])).reshape(-1) for k in sorted(child)])
    return zstandard.ZstdCompressor(level=level).compress(x.numpy().tobytes())


def naive_unxor(parent: dict, blob: bytes) -> dict:
    x = torch.frombuffer(bytearray(zstandard.ZstdDecompressor().decompress(blob)), dtype=torch.int16)
    out, at = {}, 0
    for k in sorted(parent):
        n = parent[k].numel()
        out[k] = (bits(parent[k]).reshape(-1) ^ x[at : at + n]).view(parent[k].dtype).reshape(parent[k].shape)
        at += n
    return out


def reseal(data: bytes, edit) -> bytes:
    """Rewrite a file's manifest with `edit` applied and a matching header checksum (a deliberate tamper)."""
    m = read_manifest(data)
    start = m.pop("_data_start")
    edit(m)
    text = zstandard.ZstdCompressor().compress(json.dumps(m).encode())
    return HEADER.pack(MAGIC, len(text), hashlib.sha256(text).digest()) + text + data[start:]


# ---------------------------------------------------------------------------- round trips


@pytest.mark.parametrize("frac,mode", [(0.03, "sparse"), (1.0, "dense")])
def test_random_bits_round_trip_bit_exact(frac, mode):
    parent = random_state(0)
    child = perturb(parent, frac, seed=1)
    state, m = decode_snapshot(encode_snapshot("v0", parent))
    assert same_bits(state, parent) and m["kind"] == "snapshot"
    keep = clone(parent)
    rebuilt, m = apply_delta(parent, encode_delta("v1", "v0", parent, child))
    assert same_bits(rebuilt, child) and not same_bits(rebuilt, parent)
    assert same_bits(parent, keep)  # the base is never modified
    assert m["streams"]["w16"]["mode"] == mode and m["parent"]["version"] == "v0"
    assert {e["dtype"] for e in m["tensors"].values()} == {"bfloat16", "float32", "float16", "int64", "bool"}


def test_identical_versions_give_a_tiny_delta_and_rebuild():
    parent = random_state(2)
    data = encode_delta("v1", "v0", parent, clone(parent))
    assert same_bits(apply_delta(parent, data)[0], parent)
    assert all(s["changed"] == 0 for s in read_manifest(data)["streams"].values())


def test_exponent_classes_shrink_an_adam_like_step():
    """Same move for every weight: small weights (small ulp) flip more often; classes must exploit it."""
    g = torch.Generator().manual_seed(0)
    master = torch.randn(200_000, generator=g) * 0.05
    parent = {"model.w": master.to(torch.bfloat16)}
    child = {"model.w": (master + 2e-5 * torch.randn(master.shape, generator=g).sign()).to(torch.bfloat16)}
    plain = encode_delta("v1", "v0", parent, child, Codec(max_classes=1))
    split = encode_delta("v1", "v0", parent, child, Codec(max_classes=4))
    assert read_manifest(split)["streams"]["w16"]["classes"]
    assert not read_manifest(plain)["streams"]["w16"]["classes"]
    assert len(split) < 0.9 * len(plain)
    assert same_bits(apply_delta(parent, split)[0], child) and same_bits(apply_delta(parent, plain)[0], child)


def test_fp32_weights_round_trip_losslessly(tiny_checkpoint):
    model = load_checkpoint(tiny_checkpoint)
    parent = shipping_state(model, dtype=None)
    child = shipping_state(lm_update(model, corpus_seqs(tiny_checkpoint), lr=1e-4), dtype=None)
    assert {t.dtype for t in child.values()} == {torch.float32}
    assert same_bits(apply_delta(parent, encode_delta("v1", "v0", parent, child))[0], child)


def _real_update(folder, lr):
    model = load_checkpoint(folder)
    parent = shipping_state(model)  # the shipped bf16 weights, from float32 masters
    child = shipping_state(lm_update(model, corpus_seqs(folder), lr=lr))
    return parent, child


@pytest.mark.parametrize("which", ["tiny", "demo"])
def test_real_adamw_update_round_trips_and_beats_naive_xor(which, tiny_checkpoint):
    folder = tiny_checkpoint if which == "tiny" else DEMO
    parent, child = _real_update(folder, lr=1e-6 if which == "demo" else 1e-5)
    snapshot = sum(t.numel() * 2 for t in parent.values())
    data = encode_delta("v1", "v0", parent, child)
    rebuilt, m = apply_delta(parent, data)
    assert same_bits(rebuilt, child)
    changed = sum(s["changed"] for s in m["streams"].values())
    assert 0 < changed < 0.5 * snapshot / 2  # a real, small step: most bf16 words bit-identical
    naive = naive_xor(parent, child, level=Codec().level)
    assert same_bits(naive_unxor(parent, naive), child)
    assert len(data) < len(naive)  # byte planes + positions beat XOR + zstd at the same level
    if which == "demo":  # the targets for one Adam step at lr 1e-6
        assert snapshot / len(data) >= 20 and len(naive) / len(data) >= 1.5


# ---------------------------------------------------------------------------- the store


@pytest.fixture(scope="module")
def chain_states(tiny_checkpoint):
    """Seven versions of one training run (two AdamW steps between versions)."""
    model, seqs = load_checkpoint(tiny_checkpoint), corpus_seqs(tiny_checkpoint)
    states = []
    for i in range(7):
        if i:
            lm_update(model, seqs, lr=1e-5, steps=2, seed=i)
        states.append(shipping_state(model))
    return states


@pytest.fixture
def chain_store(tmp_path, chain_states):
    """The seven versions put in order into a store that snapshots every 3."""
    store = WeightStore(tmp_path / "store", snapshot_every=3)
    for i, state in enumerate(chain_states):
        store.put(f"v{i}", state, parent=f"v{i - 1}" if i else None)
    return store, chain_states


def test_store_writes_snapshots_every_n_and_rebuilds_every_version(chain_store):
    store, states = chain_store
    kinds = [store.manifest(f"v{i}")["kind"] for i in range(7)]
    assert kinds == ["snapshot", "delta", "delta", "snapshot", "delta", "delta", "snapshot"]
    assert store.chain("v5") == ["v3", "v4", "v5"] and store.versions() == [f"v{i}" for i in range(7)]
    fresh = WeightStore(store.folder, snapshot_every=3)  # nothing cached: every chain read from disk
    for i in (5, 2, 0, 6, 4):
        assert same_bits(fresh.get(f"v{i}"), states[i])
    assert not [p for p in store.folder.iterdir() if p.name.startswith(".")]  # no temp files left
    assert store.manifest("v4")["parent"]["version"] == "v3"


def test_store_refuses_rewrites_and_unknown_parents(chain_store):
    store, states = chain_store
    with pytest.raises(ValueError, match="'v3' is already"):
        store.put("v3", states[3], parent="v2")
    with pytest.raises(MissingVersionError, match="'nope'"):
        store.put("v9", states[3], parent="nope")
    with pytest.raises(MissingVersionError, match="'v42'"):
        store.get("v42")


def test_store_writes_a_snapshot_when_the_layout_changes(chain_store):
    store, states = chain_store
    smaller = dict(list(states[4].items())[1:])
    assert store.put("v7", smaller, parent="v4").kind == "snapshot"
    assert same_bits(WeightStore(store.folder).get("v7"), smaller)


def _flip_blob_byte(data: bytes, blob_prefix: str) -> tuple[bytes, str]:
    m = read_manifest(data)
    name = next(n for n, b in m["blobs"].items() if n.startswith(blob_prefix) and b["size"] > 8)
    at = m["_data_start"] + m["blobs"][name]["offset"] + m["blobs"][name]["size"] // 2
    return data[:at] + bytes([data[at] ^ 0x40]) + data[at + 1 :], name


@pytest.mark.parametrize(
    "case",
    [
        "blob byte",
        "snapshot byte",
        "truncated",
        "missing",
        "manifest checksum",
        "tensor hash",
        "blob hash",
        "parent hash",
    ],
)
def test_store_refuses_every_corruption(chain_store, case):
    store, states = chain_store
    target = store.path("v0" if case == "snapshot byte" else "v1")
    good = target.read_bytes()
    if case == "blob byte":
        bad, name = _flip_blob_byte(good, "w16.")
        expect = f"'v1': blob '{name}' hash mismatch"
    elif case == "snapshot byte":
        bad, name = _flip_blob_byte(good, "w16.plane")
        expect = f"'v0': blob '{name}' hash mismatch"
    elif case == "truncated":
        bad, expect = good[: len(good) - 10], "'v1': blob .* is truncated"
    elif case == "missing":
        bad, expect = None, "version 'v1': no v1.snapshot.fws or v1.delta.fws .*needed to rebuild 'v2'"
    elif case == "manifest checksum":
        m = read_manifest(good)
        text = good[HEADER.size : m["_data_start"]]
        bad = good[: HEADER.size] + bytes([text[0] ^ 1]) + text[1:] + good[m["_data_start"] :]
        expect = "manifest checksum mismatch"
    elif case == "tensor hash":
        name = "model.layers.0.self_attn.q_proj.weight"
        bad = reseal(good, lambda m: m["tensors"][name].update(sha256="0" * 64))
        expect = f"'v1': tensor '{name}' rebuilt with SHA-256"
    elif case == "blob hash":
        bad = reseal(good, lambda m: next(iter(m["blobs"].values())).update(sha256="f" * 64))
        expect = "'v1': blob .* hash mismatch"
    else:
        name = "model.norm.weight"
        bad = reseal(good, lambda m: m["parent"]["tensors"].update({name: "a" * 64}))
        expect = f"'v1': tensor '{name}' of the base does not match parent 'v0'"
    if bad is None:
        target.unlink()
    else:
        target.write_bytes(bad)
    with pytest.raises((DeltaError, MissingVersionError), match=expect):
        WeightStore(store.folder).get("v2")
    # Repair the piece: the same store now rebuilds v2 exactly (nothing half-applied was kept).
    target.write_bytes(good)
    assert same_bits(WeightStore(store.folder).get("v2"), states[2])


def test_apply_delta_refuses_the_wrong_parent_and_leaves_it_untouched(chain_store):
    store, states = chain_store
    data = store.path("v2").read_bytes()  # a delta on v1
    base = clone(states[0])
    with pytest.raises(DeltaError, match="'v2': tensor '.*' of the base does not match parent 'v1'"):
        apply_delta(base, data)
    assert same_bits(base, states[0])
    with pytest.raises(DeltaError, match="does not match parent 'v1'"):  # hashes a caller gives are checked
        apply_delta(states[1], data, base_hashes={k: "0" * 64 for k in states[1]})
    assert same_bits(apply_delta(states[1], data)[0], states[2])


def test_snapshot_and_delta_files_are_not_interchangeable(chain_store):
    store, _ = chain_store
    with pytest.raises(DeltaError, match="is a 'delta', not a snapshot"):
        decode_snapshot(store.path("v1").read_bytes())
    with pytest.raises(DeltaError, match="is a 'snapshot', not a delta"):
        apply_delta(random_state(0), store.path("v0").read_bytes())
    with pytest.raises(DeltaError, match="not a weight store file"):
        read_manifest(b"x" * 100)


# ---------------------------------------------------------------------------- validation


@pytest.mark.parametrize("bad", ["", "../v1", "a b", "v/1", None, "x" * 200])
def test_version_ids_must_be_safe_file_names(tmp_path, bad):
    with pytest.raises(ValueError, match="version id must match"):
        WeightStore(tmp_path).put(bad, random_state(0))


def test_invalid_settings_and_tensors_are_named():
    with pytest.raises(ValueError, match="snapshot_every must be an integer >= 1, got 0"):
        WeightStore("/tmp/unused-weight-store", snapshot_every=0)
    with pytest.raises(ValueError, match="Codec.level must be .* got 0"):
        Codec(level=0)
    with pytest.raises(ValueError, match="Codec.max_classes"):
        Codec(max_classes=0)
    with pytest.raises(ValueError, match="tensor 'model.z' has dtype torch.complex64"):
        encode_snapshot("v0", {"model.z": torch.zeros(3, dtype=torch.complex64)})
    a = {"model.w": torch.zeros(4, dtype=torch.bfloat16)}
    with pytest.raises(ValueError, match="tensor 'model.w' differs in presence, dtype or shape"):
        encode_delta("v1", "v0", a, {"model.w": torch.zeros(5, dtype=torch.bfloat16)})
