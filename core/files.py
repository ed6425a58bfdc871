"""Small file helpers shared by every package: the one `atomic_write` (and `atomic_path` under it).

Readers never see a half-written file: the bytes go to a temporary file in the same folder, are
synced, and the file is renamed over the target.
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path


def fsync_dir(folder: str | Path) -> None:
    """Make a rename or a new file in `folder` durable (the directory entry itself)."""
    fd = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


@contextmanager
def atomic_path(path: str | Path, fsync: bool = True) -> Iterator[Path]:
    """A temporary file next to `path`, renamed over it when the block exits cleanly (removed if it
    raises): for writers that need a file name, such as a library's save function."""
    path = Path(path)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix="." + path.name + ".", suffix=".tmp")
    os.close(fd)
    try:
        yield Path(tmp)
        if fsync:
            with open(tmp, "rb+") as f:
                os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    if fsync:
        fsync_dir(path.parent)


def atomic_write(path: str | Path, data: bytes | str, fsync: bool = True) -> None:
    """Replace `path` with `data` (str is written as UTF-8) in one rename; `fsync`: durable on return."""
    with atomic_path(path, fsync) as tmp:
        tmp.write_bytes(data.encode() if isinstance(data, str) else data)
