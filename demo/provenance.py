"""Where a demo run came from: the commit, and a hash of every source that affects it.

`flywheel demo --report --resume` reuses a saved run only when its config and its `source_sha256`
match this checkout's: a change to any package the run executes, to the shipped base model or to the
pinned requirements makes a fresh run, even if uncommitted. The commit (`git rev-parse HEAD`, with
`dirty` when the tree has changes) is recorded for the reader; it is None outside a git checkout.
"""

from __future__ import annotations

import hashlib
import subprocess
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("api", "cli", "core", "demo", "feedback", "gating", "learner", "product", "registry", "serving")
"""The packages a demo run executes (every process of `flywheel demo`), hashed with the base and the pins."""
FILES = ("requirements.txt",)
FOLDERS = ("models/demo-base",)


def _sources(root: Path) -> list[Path]:
    out = [p for pkg in PACKAGES for p in (root / pkg).rglob("*.py")]
    out += [root / f for f in FILES if (root / f).is_file()]
    out += [p for d in FOLDERS for p in (root / d).rglob("*") if p.is_file()]
    return sorted(out)


def source_sha256(root: Path = ROOT) -> str:
    """SHA-256 over the relative path and the bytes of every source file (`PACKAGES`, `FILES`, `FOLDERS`)."""
    h = hashlib.sha256()
    for p in _sources(root):
        h.update(str(p.relative_to(root)).encode() + b"\0")
        h.update(hashlib.sha256(p.read_bytes()).digest())
    return h.hexdigest()


def _git(root: Path, *args: str) -> str | None:
    try:
        r = subprocess.run(["git", *args], cwd=root, capture_output=True, text=True, timeout=10, check=True)
    except (OSError, subprocess.SubprocessError):
        return None
    return r.stdout.strip()


def provenance(root: Path = ROOT) -> dict[str, Any]:
    """{"commit", "dirty", "source_sha256"} of the checkout at `root`."""
    commit = _git(root, "rev-parse", "HEAD")
    status = _git(root, "status", "--porcelain", "--untracked-files=no")
    return {
        "commit": commit,
        "dirty": None if status is None else bool(status),
        "source_sha256": source_sha256(root),
    }
