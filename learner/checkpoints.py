"""The learner's files: its durable state (`learner.json`), version ids, and the file entries a
registered version carries.

Owns the shape of `learner.json` (`new_state`: the lineage starts at the promoted base) and how a
version's files are described to the registry: paths relative to the models folder (the weight
store root, which can move), with their hashes and sizes. Called by `learner.service`.
"""

from __future__ import annotations

from pathlib import Path

from registry.publish import sha256_of
from registry.registry import Registry, UnknownVersion
from serving.checkpoint import WEIGHTS
from serving.weight_store import DELTA_SUFFIX, WeightStore

STATE = "learner.json"
OPT_STATE = "learner_state.pt"


def new_state(base_id: str, base_dir: str) -> dict:
    """A lineage that starts at the promoted base (`base_dir`: its folder, relative to the models folder)."""
    return {
        "current": base_id,
        "versions": [base_id],
        "dirs": {base_id: base_dir},
        "published": [base_id],
        "parents": {},
        "held": {},
        "positions": {},
        "trained_ids": [],
    }


def free_id(n: int, used: set[str], registry: Registry, store: WeightStore) -> str:
    """`vNNNN` (from `n` up) not yet used: not in the lineage (`used`; held-back tips are in no registry),
    the registry (a crash between registering and `learner.json` leaves one used) or the weight store."""
    while True:
        vid = f"v{n:04d}"
        if vid not in used:
            try:
                registry.get(vid)
            except UnknownVersion:
                if vid not in store.versions():
                    return vid
        n += 1


def store_entry(store: WeightStore, models_dir: Path, version_id: str) -> dict:
    """The weight store's file for `version_id` (a snapshot or a delta) as a registry file entry."""
    path = store.path(version_id)
    if path is None:
        raise ValueError(f"version {version_id!r} is not in the weight store")
    kind = "delta" if path.name.endswith(DELTA_SUFFIX) else "snapshot"
    return {
        "path": str(path.relative_to(models_dir)),
        "sha256": sha256_of(path),
        "bytes": path.stat().st_size,
        "kind": kind,
    }


def file_entry(folder: Path, kind: str, version_id: str) -> dict:
    """A checkpoint's weights as a registry file entry: `<version>/model.safetensors`, relative to the
    models folder (the weight store root)."""
    w = folder / WEIGHTS
    return {"path": f"{version_id}/{WEIGHTS}", "sha256": sha256_of(w), "bytes": w.stat().st_size, "kind": kind}
