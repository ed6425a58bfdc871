"""Small file helpers shared by every package: the one `atomic_write`.

Readers never see a half-written file: the bytes go to a temporary file in the same folder, are
synced, and the file is renamed over the target.
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path


def fsync_dir(folder: str | Path) -> None:
    """Make a rename or a new file in `folder` durable (the directory entry itself)."""
    fd = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def atomic_write(path: str | Path, data: bytes | str, fsync: bool = True) -> None:
    """Replace `path` with `data` (str is written as UTF-8) in one rename; `fsync`: durable on return."""
    path = Path(path)
    raw = data.encode() if isinstance(data, str) else data
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix="." + path.name + ".", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(raw)
            if fsync:
                f.flush()
                os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    if fsync:
        fsync_dir(path.parent)
