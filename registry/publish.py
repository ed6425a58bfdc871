"""Cold start: put the base model where replicas fetch versions, and promote it, in one audited step.

`publish_base(registry, models_dir, base_dir)` copies the base checkpoint to `<models_dir>/<name>/`,
puts its weights in the weight store `<models_dir>/store/` (float32, the trainer's dtype) and calls
`Registry.bootstrap` (actor `bootstrap`): after it there is always a promoted version, so the gate
never evaluates a candidate without an incumbent. Idempotent. Called by the gateway (before its
replicas first sync) and by the learner (its lineage starts at the base).
"""

from __future__ import annotations

import hashlib
import shutil
from pathlib import Path

import torch

from registry.models import ModelVersionPublic
from registry.registry import Registry
from serving.checkpoint import WEIGHTS, load_checkpoint
from serving.weight_store import WeightStore, shipping_state

SHIPPING_DTYPE = torch.float32  # replicas then serve exactly the weights the trainer has
STORE = "store"


def sha256_of(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 20):
            h.update(chunk)
    return h.hexdigest()


def file_entry(models_dir: Path, path: Path, kind: str) -> dict:
    """A registry file entry: the path relative to the models folder (the root replicas fetch from)."""
    return {"path": str(path.relative_to(models_dir)), "sha256": sha256_of(path), "bytes": path.stat().st_size,
            "kind": kind}  # fmt: skip


def publish_base(
    registry: Registry, models_dir: str | Path, base_dir: str | Path, snapshot_every: int = 8
) -> ModelVersionPublic:
    """The base model (named after its folder) in the store and promoted; the promoted version if
    one is already (a restart, or a fleet that moved on)."""
    promoted = registry.promoted()
    if promoted is not None:
        return promoted
    models_dir, base_dir = Path(models_dir), Path(base_dir)
    vid = base_dir.name
    shutil.copytree(base_dir, models_dir / vid, dirs_exist_ok=True)
    store = WeightStore(models_dir / STORE, snapshot_every=snapshot_every)
    if vid not in store.versions():
        store.put(vid, shipping_state(load_checkpoint(base_dir), SHIPPING_DTYPE))
    artifact = store.path(vid)
    assert artifact is not None, "just put"
    files = [
        file_entry(models_dir, models_dir / vid / WEIGHTS, "snapshot"),
        file_entry(models_dir, artifact, "snapshot"),
    ]
    return registry.bootstrap(vid, files=files, notes=f"copied from {base_dir}")
