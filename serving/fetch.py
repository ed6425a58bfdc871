"""Fetching a version's artifact into the local weight store: from a folder or over HTTP.

`Fetcher(source, token=...)`: `source` is a folder (or `file://` URL) or an `http(s)://` URL; the
registry's artifact paths (`ModelVersionPublic.artifact.path`, e.g. `store/v0007.delta.fws`, relative
to the learner's models folder) are taken relative to it. `fetch(path, sha256, dest, size)`:

- over HTTP, ONE GET per call, with `Authorization: Bearer <token>` and connect / read timeouts. The
  bytes go to `<dest>.part`; a `.part` left by an interrupted download is continued with
  `Range: bytes=<have>-` (a server answering 200 instead of 206 sends the whole file again: the part
  is restarted). An interrupted transfer raises `FetchError` and keeps the part for the next call;
- from a folder, a copy through the same `.part` (a source that is `dest` itself is only checked);
- the bytes are checked against `sha256` and `size` as the *registry* recorded them (passed in by
  the caller), never anything the server says. A mismatch deletes the part and raises
  `HashMismatch`; a file already at `dest` is replaced only by a download that verified;
- a verified file is fsynced and renamed onto `dest`. A `dest` already holding the right bytes is
  not fetched again (verified hashes are remembered by size and mtime). Fetches into one folder
  take turns (`flock` on its `.fetch.lock`), so replicas sharing a store never write one part together.

Called by `serving.replica.Replica`.
"""

from __future__ import annotations

import fcntl
import hashlib
import os
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path, PurePosixPath
from urllib.parse import quote, urlparse

import httpx

from core.files import fsync_dir

CHUNK = 1 << 20
LOCK = ".fetch.lock"  # one per destination folder (hidden: the weight store lists no dot files)


class FetchError(RuntimeError):
    """An artifact could not be fetched (unreachable, refused, interrupted); the message says where."""


class HashMismatch(FetchError):
    """The fetched bytes are not the ones the registry recorded; nothing was kept."""


def _sha_file(path: Path, upto: int | None = None) -> hashlib._Hash:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        left = upto
        while left is None or left > 0:
            chunk = f.read(CHUNK if left is None else min(CHUNK, left))
            if not chunk:
                break
            h.update(chunk)
            if left is not None:
                left -= len(chunk)
    return h


@contextmanager
def _locked(path: Path) -> Iterator[None]:
    with open(path, "a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


class Fetcher:
    """Fetches artifacts from one source (a folder or an HTTP base URL) with one token."""

    def __init__(
        self,
        source: str | Path,
        token: str | None = None,
        timeout_s: float = 30.0,
        connect_timeout_s: float = 5.0,
        client: httpx.Client | None = None,
    ):
        text = str(source)
        parsed = urlparse(text)
        self.http = parsed.scheme in ("http", "https")
        if parsed.scheme == "file":
            source = Path(parsed.path)
        elif not self.http and parsed.scheme and len(parsed.scheme) > 1:  # (not a Windows drive letter)
            raise ValueError(f"artifact source {text!r}: use a folder, file://, http:// or https://")
        self.source = text.rstrip("/") if self.http else Path(source)
        self.token = token
        self.timeout = httpx.Timeout(timeout_s, connect=connect_timeout_s)
        self._client = client
        self._verified: dict[Path, tuple[int, int, str]] = {}  # dest -> (size, mtime_ns, sha256)
        self._mutex = threading.Lock()

    def __repr__(self) -> str:  # never the token
        return f"Fetcher({str(self.source)!r}, token={'***' if self.token else None})"

    def where(self, path: str) -> str:
        """The URL or file an artifact path is fetched from."""
        rel = PurePosixPath(path)
        if rel.is_absolute() or ".." in rel.parts or not rel.parts or "\\" in path:
            raise FetchError(f"artifact path {path!r} must be relative to the source, without '..'")
        if self.http:
            return f"{self.source}/{quote(rel.as_posix())}"
        return str(Path(self.source) / rel)

    def fetch(self, path: str, sha256: str, dest: str | Path, size: int | None = None) -> Path:
        """`path` (relative to the source) at `dest`, its bytes verified against `sha256` (and `size`)."""
        sha256 = sha256.lower()
        dest = Path(dest)
        dest.parent.mkdir(parents=True, exist_ok=True)
        where = self.where(path)
        with _locked(dest.parent / LOCK):
            if dest.is_file() and self._holds(dest, sha256, size):
                return dest
            if not self.http and Path(where).resolve() == dest.resolve():
                raise HashMismatch(  # the source itself: checked, never deleted
                    f"{dest}: its SHA-256 is not {sha256} (the registry's); the file was left as it is"
                )
            part = dest.with_name(dest.name + ".part")
            digest, total = self._download(where, part, size) if self.http else self._copy(where, part, size)
            if digest != sha256 or (size is not None and total != size):
                part.unlink(missing_ok=True)
                got = f"{total} bytes with SHA-256 {digest}"
                want = f"{size} bytes with SHA-256 {sha256}" if size is not None else f"SHA-256 {sha256}"
                raise HashMismatch(f"{where}: got {got}, the registry records {want}; the download was deleted")
            with open(part, "rb+") as f:
                os.fsync(f.fileno())
            os.replace(part, dest)
            fsync_dir(dest.parent)
            st = dest.stat()
            with self._mutex:
                self._verified[dest] = (st.st_size, st.st_mtime_ns, sha256)
            return dest

    def _holds(self, dest: Path, sha256: str, size: int | None) -> bool:
        st = dest.stat()
        if size is not None and st.st_size != size:
            return False
        with self._mutex:
            known = self._verified.get(dest)
        if known is None or known[:2] != (st.st_size, st.st_mtime_ns):
            known = (st.st_size, st.st_mtime_ns, _sha_file(dest).hexdigest())
            with self._mutex:
                self._verified[dest] = known
        return known[2] == sha256

    def _start(self, part: Path, size: int | None) -> tuple[int, hashlib._Hash]:
        """How much of the part is kept (and its hash so far)."""
        have = part.stat().st_size if part.is_file() else 0
        if size is not None and have > size:
            part.unlink()
            have = 0
        return have, (_sha_file(part, have) if have else hashlib.sha256())

    def _copy(self, src: str, part: Path, size: int | None) -> tuple[str, int]:
        have, h = self._start(part, size)
        try:
            with open(src, "rb") as fin, open(part, "ab") as fout:
                fin.seek(have)
                while chunk := fin.read(CHUNK):
                    fout.write(chunk)
                    h.update(chunk)
                    have += len(chunk)
        except OSError as e:
            raise FetchError(f"{src}: cannot copy the artifact ({e})") from None
        return h.hexdigest(), have

    def _download(self, url: str, part: Path, size: int | None) -> tuple[str, int]:
        have, h = self._start(part, size)
        if size is not None and have == size:  # a part completed by an earlier call: just verify it
            return h.hexdigest(), have
        headers = {"Accept-Encoding": "identity"}  # Range counts the bytes as stored
        if self.token:
            headers["Authorization"] = f"Bearer {self.token}"
        if have:
            headers["Range"] = f"bytes={have}-"
        client = self._client or httpx.Client(timeout=self.timeout, follow_redirects=False)
        try:
            with client.stream("GET", url, headers=headers, timeout=self.timeout) as r:
                if r.status_code == 416 and have:  # nothing past what we have: verify it as it is
                    return h.hexdigest(), have
                if r.status_code in (401, 403):
                    raise FetchError(f"{url}: HTTP {r.status_code}: the server refused the token")
                if r.status_code == 206 and have:
                    if not r.headers.get("content-range", "").startswith(f"bytes {have}-"):
                        part.unlink(missing_ok=True)
                        raise FetchError(
                            f"{url}: asked for bytes {have}- and got Content-Range "
                            f"{r.headers.get('content-range')!r}; the partial download was deleted"
                        )
                elif r.status_code == 200:
                    have, h = 0, hashlib.sha256()  # the whole file (a server ignoring Range): start over
                    part.unlink(missing_ok=True)
                else:
                    raise FetchError(f"{url}: HTTP {r.status_code}")
                with open(part, "ab") as f:
                    try:
                        for chunk in r.iter_raw():  # as it arrives: an interruption keeps all of it
                            f.write(chunk)
                            h.update(chunk)
                            have += len(chunk)
                    except httpx.HTTPError as e:
                        raise FetchError(
                            f"{url}: interrupted after {have} bytes ({type(e).__name__}: {e}); "
                            f"{part.name} is kept and the next fetch continues it"
                        ) from None
        except httpx.HTTPError as e:
            raise FetchError(f"{url}: {type(e).__name__}: {e}") from None
        finally:
            if self._client is None:
                client.close()
        return h.hexdigest(), have
