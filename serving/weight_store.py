"""Weight store: the versions of a model in one folder, as snapshots and verified deltas between them.

Owns the on-disk chain the learner publishes and replicas load: `WeightStore(folder,
snapshot_every=N)` keeps a snapshot every N versions of a chain and deltas between, rebuilds and
verifies any version (`get`), and `shipping_state` gives a model's weights as shipped (HF Mixtral
names, in the dtype asked for: the learner and `registry.publish` ship float32,
`registry.publish.SHIPPING_DTYPE`). The bytes of each file are `serving/codec.py`'s. Called by the
learner, replicas and the tests.

Files: `<id>.snapshot.fws` / `<id>.delta.fws`, written to a temporary name, fsynced, renamed;
ids are immutable; a parent with other tensor names, shapes or dtypes gets a snapshot instead of
a delta; the last version written or read stays in memory.
"""

from __future__ import annotations

from pathlib import Path
from typing import NamedTuple

import torch

from core.files import atomic_write
from serving.checkpoint import hf_name
from serving.codec import (
    HEADER,
    Codec,
    DeltaError,
    apply_delta,
    check_version_id,
    decode_snapshot,
    encode_delta,
    encode_snapshot,
    layout,
    layout_diff,
    read_manifest,
)

SNAPSHOT_SUFFIX = ".snapshot.fws"
DELTA_SUFFIX = ".delta.fws"


_DEFAULT_CODEC = Codec()


class MissingVersionError(ValueError):
    """A version, or a piece of the chain it needs, is not in the store."""


def shipping_state(model: torch.nn.Module, dtype: torch.dtype | None = torch.bfloat16) -> dict:
    """A model's weights as shipped: HF names (tied lm_head left out, as in a checkpoint), in `dtype`
    (None: as stored). Callers pass the dtype: the learner, `registry.publish` and the benchmarks pass
    `registry.publish.SHIPPING_DTYPE` (float32); only tests use the bf16 default."""
    tied = getattr(getattr(model, "args", None), "tie_embeddings", False)
    out = {}
    for name, t in model.state_dict().items():
        if tied and name == "lm_head.weight":
            continue
        t = t.detach()
        out[hf_name(name)] = (t.to(dtype) if dtype is not None else t).contiguous().clone()
    return out


class PutResult(NamedTuple):
    version: str
    kind: str
    path: Path
    nbytes: int


class WeightStore:
    """Versions in one folder. `put(v, state, parent=p)`: a delta on p unless p's chain already holds
    `snapshot_every - 1` deltas after its snapshot (or p is None, or the layouts differ); `get(v)`:
    v rebuilt from the nearest snapshot through the deltas, every step verified."""

    def __init__(self, folder: str | Path, snapshot_every: int = 8, codec: Codec = _DEFAULT_CODEC):
        if not isinstance(snapshot_every, int) or isinstance(snapshot_every, bool) or snapshot_every < 1:
            raise ValueError(f"snapshot_every must be an integer >= 1, got {snapshot_every!r}")
        self.folder = Path(folder)
        self.folder.mkdir(parents=True, exist_ok=True)
        self.snapshot_every = snapshot_every
        self.codec = codec
        self._last: tuple[str, dict[str, torch.Tensor], dict[str, str]] | None = None  # (id, state, hashes)

    def path(self, version_id: str) -> Path | None:
        """The file holding `version_id` (its snapshot if both exist), or None."""
        check_version_id(version_id)
        return next(
            (p for suffix in (SNAPSHOT_SUFFIX, DELTA_SUFFIX) if (p := self.folder / (version_id + suffix)).is_file()),
            None,
        )

    def versions(self) -> list[str]:
        return sorted(
            p.name[: -len(x)]
            for p in self.folder.iterdir()
            for x in (SNAPSHOT_SUFFIX, DELTA_SUFFIX)
            if p.name.endswith(x) and p.name[0] != "."
        )

    def _file(self, version_id: str, needed_by: str | None = None) -> Path:
        p = self.path(version_id)
        if p is None:
            why = f" (needed to rebuild {needed_by!r})" if needed_by and needed_by != version_id else ""
            raise MissingVersionError(
                f"version {version_id!r}: no {version_id}{SNAPSHOT_SUFFIX} or "
                f"{version_id}{DELTA_SUFFIX} in {self.folder}{why}"
            )
        return p

    def manifest(self, version_id: str, needed_by: str | None = None) -> dict:
        """The manifest of `version_id`, read without its blobs."""
        p = self._file(version_id, needed_by)
        with open(p, "rb") as f:
            head = f.read(HEADER.size)
            length = HEADER.unpack(head)[1] if len(head) == HEADER.size else 0
            m = read_manifest(head + f.read(length), str(p))
        if m.get("version") != version_id:
            raise DeltaError(f"{p}: holds version {m.get('version')!r}, not {version_id!r}")
        return m

    def chain(self, version_id: str) -> list[str]:
        """Versions from the nearest snapshot to `version_id`, in the order they are applied."""
        chain, v = [], version_id
        while v not in chain:
            m = self.manifest(v, needed_by=version_id)
            chain.append(v)
            if m["kind"] == "snapshot":
                return chain[::-1]
            v = m["parent"]["version"]
        raise DeltaError(f"version {version_id!r}: delta chain loops at {v!r}")

    def get(self, version_id: str) -> dict[str, torch.Tensor]:
        """The state of `version_id`, rebuilt and verified tensor by tensor (raises, never half-applies)."""
        check_version_id(version_id)
        if self._last is None or self._last[0] != version_id:
            state: dict[str, torch.Tensor] | None = None
            hashes: dict[str, str] | None = None
            for v in self.chain(version_id):
                data = (p := self._file(v, version_id)).read_bytes()
                state, m = (
                    decode_snapshot(data, str(p))
                    if state is None
                    else apply_delta(state, data, base_hashes=hashes, where=str(p))
                )
                if m["version"] != v:
                    raise DeltaError(f"{p}: holds version {m['version']!r}, not {v!r}")
                hashes = {n: e["sha256"] for n, e in m["tensors"].items()}
            if state is None or hashes is None:  # chain() always holds at least the snapshot
                raise DeltaError(f"version {version_id!r}: empty delta chain")
            self._last = (version_id, state, hashes)
        return {n: t.clone() for n, t in self._last[1].items()}  # the cache stays ours

    def put(self, version_id: str, state: dict[str, torch.Tensor], parent: str | None = None) -> PutResult:
        """Store `state` as `version_id` (immutable); a delta on `parent` unless a snapshot is due."""
        check_version_id(version_id)
        if self.path(version_id) is not None:
            raise ValueError(f"version {version_id!r} is already in {self.folder} (versions are immutable)")
        if parent is not None and check_version_id(parent) == version_id:
            raise ValueError(f"version {version_id!r} cannot be its own parent")
        # A delta while the parent's chain (its snapshot and deltas) is shorter than snapshot_every.
        data = None
        if parent is not None and len(self.chain(parent)) < self.snapshot_every:
            base = self.get(parent)
            if layout_diff(layout(state)[0], layout(base)[0]) is None:  # else: a snapshot
                data = encode_delta(version_id, parent, base, state, self.codec)
        kind = "delta" if data is not None else "snapshot"
        data = data if data is not None else encode_snapshot(version_id, state, self.codec)
        path = self.folder / (version_id + (DELTA_SUFFIX if kind == "delta" else SNAPSHOT_SUFFIX))
        atomic_write(path, data)
        hashes = {n: e["sha256"] for n, e in read_manifest(data, str(path))["tensors"].items()}
        self._last = (version_id, {n: t.detach().cpu().clone() for n, t in state.items()}, hashes)
        return PutResult(version_id, kind, path, len(data))
