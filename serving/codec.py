"""Weight codec: self-verifying, bit-exact snapshots of a state dict and lossless deltas between two.

Owns the bytes of one version: `encode_snapshot` / `decode_snapshot`, `encode_delta` / `apply_delta`
(pure functions over state dicts keyed by HF Mixtral names), their `Codec` parameters and the
container (`read_manifest`). Called by `serving/weight_store.py` (files and chains, what replicas
load through), `bench/deltas.py` (which measures it) and the weight-store tests.

Choices (measured in `bench/deltas.py` on real updates of the demo model):
- Bit-exact for any dtype: tensors are raw words (2 bytes for bf16, 4 for fp32, 1 or 8 for the
  rest), never numbers, so NaN payloads and -0.0 survive. Tensors of one word width form one
  stream (sorted by name): one zstd frame per stream and plane, not per tensor.
- Transform: the wrapping difference child - parent of the words, zig-zag folded, not XOR: both
  are zero exactly where bits are identical, but a one-ulp move is +-1 here and a carry mask
  (1, 3, 7, ...) under XOR. Byte planes are compressed apart (the high one is ~all zeros).
- Sparse positions by exponent class when at most `Codec.dense_above` of a stream changed: per
  class, gaps between changed ranks (uint32 byte planes) and the changed values. Classes are
  ranges of the parent's top 8 magnitude bits (the exponent, known to the decoder): Adam moves
  every weight by about the same amount, so small weights (small ulp) flip far more often. The
  encoder picks up to `max_classes` ranges minimising sum n_c H(p_c); each class costs the decoder
  a pass over the stream, so the default (2) balances size and decode speed as measured. Dense
  otherwise: zig-zag differences as byte planes, no positions.
- zstd 19 for sparse streams (a small part of the model), 3 for dense streams and snapshots
  (where 19 costs far more time than it saves bytes). Decode speed hardly depends on the level.
- Container: magic, manifest length and SHA-256, the manifest (zstd JSON: format version, kind,
  version, parent id and per-tensor SHA-256; per tensor dtype, shape, size, SHA-256 of its raw
  bytes; codec parameters per stream; per blob offset, size, decoded size, SHA-256), the blobs.
- Verified before anything is returned: manifest checksum, format, parent hashes (of the base, or
  hashes the caller already verified), blob bounds and hashes, decoded sizes, the SHA-256 of
  every rebuilt tensor. Output goes to new buffers (tensors are views of one buffer per stream);
  a mismatch raises `DeltaError` naming version, tensor or blob and what differed, base untouched.
  Hashing and decompression run on a small thread pool (both release the GIL). Assumes a
  little-endian host.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import struct
import sys
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np
import torch
import zstandard

FORMAT = "flywheel-weights"
FORMAT_VERSION = 1
MAGIC = b"FWWS\x01\r\n\x1a"
HEADER = struct.Struct("<8sQ32s")  # magic, manifest length, SHA-256 of the manifest
_VERSION_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")

DTYPES = {
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
    "float32": torch.float32,
    "float64": torch.float64,
    "int8": torch.int8,
    "uint8": torch.uint8,
    "int16": torch.int16,
    "int32": torch.int32,
    "int64": torch.int64,
    "bool": torch.bool,
}
_NAMES = {v: k for k, v in DTYPES.items()}
_UINT = {1: np.uint8, 2: np.uint16, 4: np.uint32, 8: np.uint64}
_SINT = {1: np.int8, 2: np.int16, 4: np.int32, 8: np.int64}
_TORCH_INT = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}

assert sys.byteorder == "little", "raw tensor bytes are read as little-endian words"


class DeltaError(ValueError):
    """A snapshot or delta failed verification (message: version, tensor or blob); nothing applied."""


@dataclass(frozen=True)
class Codec:
    level: int = 19
    """zstd level of sparse streams (small inputs: a high level is cheap)."""
    dense_level: int = 3
    """zstd level of dense streams and snapshots."""
    max_classes: int = 2
    """Exponent classes of the sparse position code (1: plain gaps in stream order)."""
    dense_above: float = 0.5
    """A stream with more than this fraction of changed words is coded dense (no positions)."""

    def __post_init__(self) -> None:
        for name, lo, hi in (("level", 1, 22), ("dense_level", 1, 22), ("max_classes", 1, 16)):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or not lo <= value <= hi:
                raise ValueError(f"Codec.{name} must be an integer in [{lo}, {hi}], got {value!r}")
        if not 0.0 <= self.dense_above <= 1.0:
            raise ValueError(f"Codec.dense_above must be in [0, 1], got {self.dense_above!r}")


def _words(name: str, t: torch.Tensor) -> np.ndarray:
    if not isinstance(t, torch.Tensor):
        raise ValueError(f"tensor {name!r} must be a torch.Tensor, got {type(t).__name__}")
    if t.dtype not in _NAMES:
        raise ValueError(f"tensor {name!r} has dtype {t.dtype}, supported: {sorted(DTYPES)}")
    t = t.detach().cpu().contiguous()
    return t.view(_TORCH_INT[t.element_size()]).numpy().view(_UINT[t.element_size()]).reshape(-1)


def _sha(buf) -> str:
    return hashlib.sha256(memoryview(buf).cast("B")).hexdigest()


def layout(state: dict[str, torch.Tensor]):
    """Group tensors by word width into streams: (entries {name: meta}, streams {key: words})."""
    if not isinstance(state, dict) or not state:
        raise ValueError(f"a state dict must be a non-empty dict of tensors, got {type(state).__name__}")
    parts: dict[str, list[np.ndarray]] = {}
    ends: dict[str, int] = {}
    entries: dict[str, dict] = {}
    for name in sorted(state):
        if not isinstance(name, str) or not name:
            raise ValueError(f"tensor names must be non-empty strings, got {name!r}")
        words = _words(name, state[name])
        key = f"w{8 * words.itemsize}"
        offset = ends.get(key, 0)
        ends[key] = offset + len(words)
        parts.setdefault(key, []).append(words)
        entries[name] = {
            "dtype": _NAMES[state[name].dtype],
            "shape": list(state[name].shape),
            "nbytes": words.nbytes,
            "stream": key,
            "offset": offset,
            "words": len(words),
        }
    streams = {k: np.concatenate(v) if len(v) > 1 else v[0].copy() for k, v in parts.items()}
    return entries, streams


_POOL: ThreadPoolExecutor | None = None


def _map(fn, items: list) -> list:
    """`fn` over `items` on a small thread pool: SHA-256 and zstd release the GIL on large buffers."""
    global _POOL
    if len(items) < 2:
        return [fn(x) for x in items]
    if _POOL is None:
        _POOL = ThreadPoolExecutor(max_workers=min(4, os.cpu_count() or 1), thread_name_prefix="weight-store")
    return list(_POOL.map(fn, items))


def _slice(streams: dict, e: dict) -> np.ndarray:
    return streams[e["stream"]][e["offset"] : e["offset"] + e["words"]]


def _hashes(entries: dict, streams: dict) -> dict[str, str]:
    return dict(zip(entries, _map(_sha, [_slice(streams, e) for e in entries.values()])))


def _tensors(entries: dict, streams: dict) -> dict[str, torch.Tensor]:
    return {
        n: torch.from_numpy((w := _slice(streams, e)).view(_SINT[w.itemsize]))
        .view(DTYPES[e["dtype"]])
        .reshape(e["shape"])
        for n, e in entries.items()
    }


def layout_diff(a: dict, b: dict) -> str | None:
    """The first tensor that differs in presence, dtype or shape between two layouts (None: same)."""
    return next(
        iter(
            sorted(set(a) ^ set(b))
            or [n for n in a if (a[n]["dtype"], a[n]["shape"]) != (b[n]["dtype"], b[n]["shape"])]
        ),
        None,
    )


def _zigzag(d: np.ndarray) -> np.ndarray:
    s = d.view(_SINT[d.itemsize])
    return ((s << 1) ^ (s >> (8 * d.itemsize - 1))).view(d.dtype)


def _unzigzag(z: np.ndarray) -> np.ndarray:
    """Inverse of `_zigzag`, in place (z is a fresh buffer)."""
    sign = z & z.dtype.type(1)
    np.negative(sign, out=sign)  # 0 or all ones (unsigned wrap-around)
    z >>= z.dtype.type(1)
    z ^= sign
    return z


def _planes(words: np.ndarray) -> list[bytes]:
    b = words.view(np.uint8).reshape(-1, words.itemsize)
    return [np.ascontiguousarray(b[:, i]).tobytes() for i in range(words.itemsize)]


def _unplanes(planes: list[bytes], dtype) -> np.ndarray:
    width = len(planes)
    out = np.empty((len(planes[0]), width), np.uint8)
    for i, p in enumerate(planes):
        out[:, i] = np.frombuffer(p, np.uint8)
    return out.reshape(-1).view(dtype)


def _class_key(words: np.ndarray) -> tuple[np.ndarray, int]:
    """Magnitudes (sign bit cleared) and the shift to their top 8 bits (the exponent of bf16/fp32)."""
    bits = 8 * words.itemsize
    return words & words.dtype.type((1 << (bits - 1)) - 1), max(bits - 9, 0)


def _entropy_bits(n: np.ndarray, k: np.ndarray) -> np.ndarray:
    p = np.clip(k / np.maximum(n, 1), 1e-300, 1 - 1e-16)  # n * H(k/n), 0 where nothing or all changed
    return np.where((k > 0) & (k < n), -n * (p * np.log2(p) + (1 - p) * np.log2(1 - p)), 0.0)


def _choose_classes(parent: np.ndarray, changed: np.ndarray, max_classes: int) -> list[int]:
    """Magnitude thresholds of up to `max_classes` exponent ranges minimising sum n_c H(p_c)."""
    if max_classes <= 1:
        return []
    mag, shift = _class_key(parent)
    key = (mag >> shift).astype(np.intp)
    cnt = np.bincount(key, minlength=256).astype(np.float64)
    chg = np.bincount(key[changed], minlength=256).astype(np.float64)
    keys = np.flatnonzero(cnt)
    if len(keys) <= 1:
        return []
    cn = np.concatenate([[0.0], np.cumsum(cnt[keys])])
    ck = np.concatenate([[0.0], np.cumsum(chg[keys])])
    m = len(keys)
    a, b = np.meshgrid(np.arange(m + 1), np.arange(m + 1), indexing="ij")
    cost = np.where(b > a, _entropy_bits(cn[b] - cn[a], ck[b] - ck[a]), np.inf)  # group keys[a:b]
    levels = [cost[0]]  # levels[j][b]: best cost of keys[:b] in exactly j+1 classes
    backs: list[np.ndarray | None] = [None]
    for _ in range(min(max_classes, m) - 1):
        total = levels[-1][:, None] + cost
        backs.append(np.argmin(total, axis=0))
        levels.append(total.min(axis=0))
    j = int(np.argmin([lv[m] for lv in levels]))  # ties: the fewest classes (each costs a decode pass)
    cuts, end = [], m
    for level in range(j, 0, -1):
        back = backs[level]
        assert back is not None  # backs[0] alone is None, and level >= 1
        end = int(back[end])
        cuts.append(end)
    return sorted(int(keys[c]) << shift for c in cuts)


def _class_mask(mag: np.ndarray | None, thresholds: list[int], c: int) -> np.ndarray | None:
    """Class c's members: thresholds[c-1] <= magnitude < thresholds[c] (None: the whole stream)."""
    if not thresholds:
        return None
    if mag is None:
        raise ValueError("class thresholds without magnitudes")
    if c == 0:
        return mag < thresholds[0]
    lo = thresholds[c - 1]
    if c == len(thresholds):
        return mag >= lo
    hi = thresholds[c]
    return (mag - mag.dtype.type(lo)) < mag.dtype.type(hi - lo)  # lo <= mag < hi, by unsigned wrap-around


class _Writer:
    def __init__(self):
        self.blobs, self.data, self.size = {}, [], 0

    def add(self, name: str, raw: bytes, level: int) -> str:
        comp = zstandard.ZstdCompressor(level=level).compress(raw)
        self.blobs[name] = dict(offset=self.size, size=len(comp), raw_size=len(raw), sha256=_sha(comp))
        self.data.append(comp)
        self.size += len(comp)
        return name

    def finish(self, manifest: dict) -> bytes:
        manifest["blobs"] = self.blobs
        text = json.dumps(manifest, sort_keys=True, separators=(",", ":")).encode()
        text = zstandard.ZstdCompressor(level=19).compress(text)
        return HEADER.pack(MAGIC, len(text), hashlib.sha256(text).digest()) + text + b"".join(self.data)


def read_manifest(data: bytes, where: str = "data") -> dict:
    """The manifest of a snapshot or delta, after checking the header and the manifest's checksum."""
    if len(data) < HEADER.size:
        raise DeltaError(f"{where}: truncated ({len(data)} bytes, the header alone is {HEADER.size})")
    magic, length, digest = HEADER.unpack_from(data)
    if magic != MAGIC:
        raise DeltaError(f"{where}: not a weight store file (magic {magic!r})")
    text = bytes(data[HEADER.size : HEADER.size + length])
    if len(text) != length:
        raise DeltaError(f"{where}: truncated manifest ({len(text)} of {length} bytes)")
    if hashlib.sha256(text).digest() != digest:
        raise DeltaError(f"{where}: manifest checksum mismatch (the manifest was altered or damaged)")
    try:
        manifest = json.loads(zstandard.ZstdDecompressor().decompress(text, max_output_size=64 << 20))
    except (zstandard.ZstdError, json.JSONDecodeError, UnicodeDecodeError) as e:
        raise DeltaError(f"{where}: manifest is not zstd-compressed JSON ({e})") from None
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
        raise DeltaError(f"{where}: manifest format is not {FORMAT!r}")
    if manifest.get("format_version") != FORMAT_VERSION:
        raise DeltaError(f"{where}: format_version {manifest.get('format_version')!r}, not {FORMAT_VERSION}")
    entries = manifest.get("tensors")
    if not isinstance(entries, dict) or not entries or any(e.get("dtype") not in DTYPES for e in entries.values()):
        raise DeltaError(f"{where}: manifest lists no tensors, or a tensor of an unsupported dtype")
    manifest["_data_start"] = HEADER.size + length
    return manifest


def _blob(data: bytes, manifest: dict, name: str) -> bytes:
    """A blob, checked for bounds and hash, decompressed and checked for size."""
    version = manifest.get("version")
    meta = manifest["blobs"].get(name)
    if meta is None:
        raise DeltaError(f"version {version!r}: blob {name!r} is not listed in the manifest")
    start = manifest["_data_start"] + meta["offset"]
    comp = data[start : start + meta["size"]]
    if len(comp) != meta["size"]:
        raise DeltaError(f"version {version!r}: blob {name!r} is truncated ({len(comp)} of {meta['size']} B)")
    if _sha(comp) != meta["sha256"]:
        raise DeltaError(f"version {version!r}: blob {name!r} hash mismatch (damaged or altered)")
    try:
        raw = zstandard.ZstdDecompressor().decompress(comp, max_output_size=meta["raw_size"])
    except zstandard.ZstdError as e:
        raise DeltaError(f"version {version!r}: blob {name!r} does not decompress ({e})") from None
    if len(raw) != meta["raw_size"]:
        raise DeltaError(
            f"version {version!r}: blob {name!r} decodes to {len(raw)} bytes, manifest says {meta['raw_size']}"
        )
    return raw


def _check_rebuilt(manifest: dict, entries: dict, streams: dict) -> None:
    got = _hashes(entries, streams)
    for name, e in entries.items():
        if got[name] != e["sha256"]:
            raise DeltaError(
                f"version {manifest['version']!r}: tensor {name!r} rebuilt with SHA-256 "
                f"{got[name][:16]}..., manifest says {e['sha256'][:16]}..."
            )


def check_version_id(version_id) -> str:
    if not isinstance(version_id, str) or not _VERSION_RE.match(version_id):
        raise ValueError(f"version id must match {_VERSION_RE.pattern} (a file name), got {version_id!r}")
    return version_id


def encode_snapshot(version_id: str, state: dict[str, torch.Tensor], codec: Codec = Codec()) -> bytes:
    """A full, self-verifying copy of `state`: byte planes of every stream, zstd at `codec.dense_level`."""
    check_version_id(version_id)
    entries, streams = layout(state)
    for name, digest in _hashes(entries, streams).items():
        entries[name]["sha256"] = digest
    w = _Writer()
    desc = {
        k: {
            "word_bytes": ws.itemsize,
            "words": len(ws),
            "mode": "planes",
            "blobs": [w.add(f"{k}.plane{i}", p, codec.dense_level) for i, p in enumerate(_planes(ws))],
        }
        for k, ws in streams.items()
    }
    return w.finish(
        {
            "format": FORMAT,
            "format_version": FORMAT_VERSION,
            "kind": "snapshot",
            "version": version_id,
            "parent": None,
            "tensors": entries,
            "streams": desc,
            "codec": asdict(codec),
        }
    )


def decode_snapshot(data: bytes, where: str = "snapshot") -> tuple[dict[str, torch.Tensor], dict]:
    """(state, manifest) of a snapshot, every blob and tensor hash verified."""
    manifest = read_manifest(data, where)
    if manifest.get("kind") != "snapshot":
        raise DeltaError(f"{where}: version {manifest.get('version')!r} is a {manifest.get('kind')!r}, not a snapshot")
    entries = manifest["tensors"]
    streams = {}
    for key, desc in manifest["streams"].items():
        planes = _map(lambda b: _blob(data, manifest, b), desc["blobs"])
        if len(planes) != desc["word_bytes"] or any(len(p) != desc["words"] for p in planes):
            raise DeltaError(f"version {manifest['version']!r}: stream {key!r} planes do not match its size")
        streams[key] = _unplanes(planes, _UINT[desc["word_bytes"]])
    _check_rebuilt(manifest, entries, streams)
    return _tensors(entries, streams), manifest


def _encode_stream(w: _Writer, key: str, parent: np.ndarray, child: np.ndarray, codec: Codec) -> dict:
    z = _zigzag(child - parent)  # wrapping difference: lossless for any bits
    changed = z != 0
    n_changed = int(np.count_nonzero(changed))
    desc: dict[str, Any] = {"word_bytes": z.itemsize, "words": len(z), "changed": n_changed}
    if n_changed > codec.dense_above * len(z):
        desc.update(
            mode="dense", blobs=[w.add(f"{key}.values.{i}", p, codec.dense_level) for i, p in enumerate(_planes(z))]
        )
        return desc
    thresholds = _choose_classes(parent, changed, codec.max_classes) if n_changed else []
    gap_dtype = np.uint32 if len(z) < 2**32 else np.uint64
    gaps, values, counts = [], [], []
    mag = _class_key(parent)[0] if thresholds else None
    for c in range(len(thresholds) + 1):
        mask = _class_mask(mag, thresholds, c)
        zc = z if mask is None else z[mask]
        ranks = np.flatnonzero(zc)
        gaps.append((np.diff(ranks, prepend=-1) - 1).astype(gap_dtype))
        values.append(zc[ranks])
        counts.append(len(ranks))
    gaps_all, values_all = np.concatenate(gaps), np.concatenate(values)
    desc.update(
        mode="sparse",
        classes=thresholds,
        counts=counts,
        gap_bytes=np.dtype(gap_dtype).itemsize,
        blobs=[w.add(f"{key}.gaps.{i}", p, codec.level) for i, p in enumerate(_planes(gaps_all))]
        + [w.add(f"{key}.values.{i}", p, codec.level) for i, p in enumerate(_planes(values_all))],
    )
    return desc


def encode_delta(
    version_id: str,
    parent_id: str,
    parent: dict[str, torch.Tensor],
    state: dict[str, torch.Tensor],
    codec: Codec = Codec(),
) -> bytes:
    """A lossless delta that rebuilds `state` from `parent` (same names, shapes and dtypes)."""
    check_version_id(version_id)
    check_version_id(parent_id)
    p_entries, p_streams = layout(parent)
    entries, streams = layout(state)
    if (diff := layout_diff(p_entries, entries)) is not None:
        raise ValueError(
            f"version {version_id!r}: cannot delta against {parent_id!r}: tensor {diff!r} "
            "differs in presence, dtype or shape (write a snapshot)"
        )
    for name, digest in _hashes(entries, streams).items():
        entries[name]["sha256"] = digest
    w = _Writer()
    desc = {key: _encode_stream(w, key, p_streams[key], streams[key], codec) for key in streams}
    return w.finish(
        {
            "format": FORMAT,
            "format_version": FORMAT_VERSION,
            "kind": "delta",
            "parent": {"version": parent_id, "tensors": _hashes(p_entries, p_streams)},
            "version": version_id,
            "tensors": entries,
            "streams": desc,
            "codec": asdict(codec),
        }
    )


def _decode_stream(data: bytes, manifest: dict, key: str, desc: dict, base: np.ndarray) -> np.ndarray:
    version = manifest["version"]
    out = base  # a fresh array from _layout: rebuilding in place never touches the caller's tensors
    udt = _UINT[desc["word_bytes"]]
    if desc["mode"] == "dense":
        z = _unplanes(_map(lambda b: _blob(data, manifest, b), desc["blobs"]), udt)
        if len(z) != len(out):
            raise DeltaError(f"version {version!r}: stream {key!r} has {len(z)} words, parent has {len(out)}")
        out += _unzigzag(z)
        return out
    if desc["mode"] != "sparse":
        raise DeltaError(f"version {version!r}: stream {key!r} has unknown mode {desc['mode']!r}")
    gb = desc["gap_bytes"]
    raw = _map(lambda b: _blob(data, manifest, b), desc["blobs"])
    total = sum(desc["counts"])
    if len(raw) != gb + desc["word_bytes"] or any(len(r) != total for r in raw):
        raise DeltaError(f"version {version!r}: stream {key!r} blobs do not match its {total} changed words")
    if total == 0:
        return out
    gaps = _unplanes(raw[:gb], _UINT[gb]).astype(np.int64)
    values = _unzigzag(_unplanes(raw[gb:], udt))
    classes = desc["classes"]
    if len(desc["counts"]) != len(classes) + 1:
        raise DeltaError(
            f"version {version!r}: stream {key!r} lists {len(desc['counts'])} class counts "
            f"for {len(classes) + 1} classes"
        )
    mag = _class_key(base)[0] if classes else None  # classes come from the parent's words, before any change
    ends = np.cumsum(desc["counts"])

    def positions(c: int) -> np.ndarray:  # stream positions of class c's changed words
        ranks = np.cumsum(gaps[ends[c] - desc["counts"][c] : ends[c]] + 1) - 1
        mask = _class_mask(mag, classes, c)
        members = np.flatnonzero(mask) if mask is not None else None
        if ranks[-1] >= (len(members) if members is not None else len(base)):
            raise DeltaError(f"version {version!r}: stream {key!r} positions run past the end of class {c}")
        return members[ranks] if members is not None else ranks

    active = [c for c, n in enumerate(desc["counts"]) if n]
    for c, pos in zip(active, _map(positions, active)):  # one pass over the stream per class, in parallel
        out[pos] += values[ends[c] - desc["counts"][c] : ends[c]]
    return out


def apply_delta(
    base: dict[str, torch.Tensor], data: bytes, base_hashes: dict[str, str] | None = None, where: str = "delta"
) -> tuple[dict[str, torch.Tensor], dict]:
    """(state, manifest): `base` + the delta in `data`, verified; `base` itself is never modified.

    `base_hashes` are the base's per-tensor SHA-256 when the caller has already verified them (a
    replica keeps those of the version it serves); otherwise the base is hashed here.
    """
    manifest = read_manifest(data, where)
    version = manifest.get("version")
    if manifest.get("kind") != "delta":
        raise DeltaError(f"{where}: version {version!r} is a {manifest.get('kind')!r}, not a delta")
    entries = manifest["tensors"]
    parent = manifest["parent"]
    b_entries, b_streams = layout(base)
    if (diff := layout_diff(b_entries, entries)) is not None:
        raise DeltaError(
            f"version {version!r}: base does not match parent {parent['version']!r}: tensor "
            f"{diff!r} differs in presence, dtype or shape"
        )
    got = base_hashes if base_hashes is not None else _hashes(b_entries, b_streams)
    for name, want in parent["tensors"].items():
        if got.get(name) != want:
            raise DeltaError(
                f"version {version!r}: tensor {name!r} of the base does not match parent "
                f"{parent['version']!r} (SHA-256 {str(got.get(name))[:12]}, not {want[:12]})"
            )
    streams = {}
    for key, desc in manifest["streams"].items():
        if key not in b_streams:
            raise DeltaError(f"version {version!r}: stream {key!r} is not in the base")
        streams[key] = _decode_stream(data, manifest, key, desc, b_streams[key])
    _check_rebuilt(manifest, entries, streams)
    return _tensors(entries, streams), manifest
