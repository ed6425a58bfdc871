"""Fetching artifacts (`serving.fetch`) against a real HTTP server on loopback and from a folder."""

from __future__ import annotations

import hashlib
import os
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import unquote

import pytest

from serving.fetch import Fetcher, FetchError, HashMismatch

TOKEN = "s3cret-token"


class FileServer:
    """Serves `files` (path -> bytes) over HTTP/1.1 with Range support and a bearer token.

    `drop_after`: the next GET sends that many body bytes and then drops the connection; `ignore_range`:
    answers 200 with the whole file to a Range request; `corrupt`: flips a byte of what it sends;
    `requests`: the headers of every GET."""

    def __init__(self, files: dict[str, bytes], token: str = TOKEN):
        self.files, self.token = files, token
        self.requests: list[dict[str, str]] = []
        self.drop_after: int | None = None
        self.ignore_range = self.corrupt = False
        server = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args) -> None:
                pass

            def do_GET(self) -> None:
                server.requests.append(dict(self.headers))
                if self.headers.get("Authorization") != f"Bearer {server.token}":
                    return self._empty(401)
                data = server.files.get(unquote(self.path.lstrip("/")))
                if data is None:
                    return self._empty(404)
                if server.corrupt:
                    data = bytes([data[0] ^ 1]) + data[1:]
                start, rng = 0, self.headers.get("Range")
                if rng and not server.ignore_range:
                    start = int(rng.removeprefix("bytes=").rstrip("-"))
                    if start >= len(data):
                        return self._empty(416)
                    self.send_response(206)
                    self.send_header("Content-Range", f"bytes {start}-{len(data) - 1}/{len(data)}")
                else:
                    self.send_response(200)
                body = data[start:]
                self.send_header("Content-Length", str(len(body)))
                self.send_header("X-Checksum-Sha256", "0" * 64)  # never trusted
                self.end_headers()
                if server.drop_after is not None:
                    body, server.drop_after = body[: server.drop_after], None
                    self.wfile.write(body)
                    self.wfile.flush()
                    self.close_connection = True
                    return
                self.wfile.write(body)

            def _empty(self, code: int) -> None:
                self.send_response(code)
                self.send_header("Content-Length", "0")
                self.end_headers()

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.httpd.daemon_threads = True
        self.thread = threading.Thread(target=self.httpd.serve_forever, args=(0.05,), daemon=True)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.httpd.server_address[1]}/models"

    def __enter__(self) -> FileServer:
        self.thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()


def serve(files: dict[str, bytes]) -> FileServer:
    """A server whose URL prefix `/models` is the root the artifact paths are relative to."""
    return FileServer({f"models/{p}": b for p, b in files.items()})


def sha(b: bytes) -> str:
    return hashlib.sha256(b).hexdigest()


DATA = os.urandom(300_000)
PATH = "store/v0002.delta.fws"


def test_a_full_download_sends_the_token_and_lands_verified(tmp_path):
    dest = tmp_path / "store" / "v0002.delta.fws"
    with serve({PATH: DATA}) as srv:
        f = Fetcher(srv.url, token=TOKEN)
        assert f.fetch(PATH, sha(DATA), dest, size=len(DATA)) == dest
        assert dest.read_bytes() == DATA and not dest.with_name(dest.name + ".part").exists()
        assert srv.requests[0]["Authorization"] == f"Bearer {TOKEN}" and "Range" not in srv.requests[0]
        f.fetch(PATH, sha(DATA), dest, size=len(DATA))  # held already: no second GET
        assert len(srv.requests) == 1 and TOKEN not in repr(f)


def test_an_interrupted_download_resumes_with_a_range_request(tmp_path):
    dest = tmp_path / "v0002.delta.fws"
    part = dest.with_name(dest.name + ".part")
    with serve({PATH: DATA}) as srv:
        f = Fetcher(srv.url, token=TOKEN, timeout_s=5)
        srv.drop_after = 100_000
        with pytest.raises(FetchError, match="interrupted after 100000 bytes"):
            f.fetch(PATH, sha(DATA), dest, size=len(DATA))
        assert part.read_bytes() == DATA[:100_000] and not dest.exists()
        f.fetch(PATH, sha(DATA), dest, size=len(DATA))
        assert srv.requests[-1]["Range"] == "bytes=100000-"
        assert dest.read_bytes() == DATA and not part.exists()


def test_a_server_ignoring_range_restarts_the_part(tmp_path):
    dest = tmp_path / "v0002.delta.fws"
    dest.with_name(dest.name + ".part").write_bytes(b"stale bytes of something else")
    with serve({PATH: DATA}) as srv:
        srv.ignore_range = True
        Fetcher(srv.url, token=TOKEN).fetch(PATH, sha(DATA), dest, size=len(DATA))
        assert srv.requests[-1]["Range"].startswith("bytes=") and dest.read_bytes() == DATA


def test_a_wrong_token_is_an_error_and_keeps_nothing(tmp_path):
    dest = tmp_path / "v0002.delta.fws"
    with serve({PATH: DATA}) as srv:
        for token in ("wrong", None):
            with pytest.raises(FetchError, match="HTTP 401: the server refused the token"):
                Fetcher(srv.url, token=token).fetch(PATH, sha(DATA), dest)
        with pytest.raises(FetchError, match="HTTP 404"):
            Fetcher(srv.url, token=TOKEN).fetch("store/nope.fws", sha(DATA), dest)
    assert list(tmp_path.iterdir()) == [tmp_path / ".fetch.lock"]


def test_corrupted_bytes_fail_the_registry_hash_and_nothing_is_kept(tmp_path):
    dest = tmp_path / "v0002.delta.fws"
    with serve({PATH: DATA}) as srv:
        srv.corrupt = True
        with pytest.raises(HashMismatch, match="the registry records 300000 bytes with SHA-256 .*download was deleted"):
            Fetcher(srv.url, token=TOKEN).fetch(PATH, sha(DATA), dest, size=len(DATA))
        assert not dest.exists() and not dest.with_name(dest.name + ".part").exists()
        srv.corrupt = False  # a wrong hash in the registry: the true bytes are refused too
        with pytest.raises(HashMismatch):
            Fetcher(srv.url, token=TOKEN).fetch(PATH, sha(b"other"), dest)
        assert not dest.exists()


def test_a_wrong_file_at_dest_is_replaced_only_by_a_verified_download(tmp_path):
    dest = tmp_path / "v0002.delta.fws"
    dest.write_bytes(b"rotten")
    with serve({PATH: DATA}) as srv:
        f = Fetcher(srv.url, token=TOKEN)
        srv.corrupt = True
        with pytest.raises(HashMismatch):
            f.fetch(PATH, sha(DATA), dest)
        assert dest.read_bytes() == b"rotten"
        srv.corrupt = False
        f.fetch(PATH, sha(DATA), dest)
        assert dest.read_bytes() == DATA


def test_from_a_folder(tmp_path):
    src = tmp_path / "models"
    (src / "store").mkdir(parents=True)
    (src / PATH).write_bytes(DATA)
    dest = tmp_path / "replica" / "v0002.delta.fws"
    for source in (src, f"file://{src}"):
        dest.unlink(missing_ok=True)
        Fetcher(source).fetch(PATH, sha(DATA), dest, size=len(DATA))
        assert dest.read_bytes() == DATA
    with pytest.raises(HashMismatch):
        Fetcher(src).fetch(PATH, sha(b"x"), tmp_path / "other.fws")
    assert not (tmp_path / "other.fws").exists()
    # The source itself as the destination: checked in place, never deleted.
    Fetcher(src).fetch(PATH, sha(DATA), src / PATH)
    with pytest.raises(HashMismatch, match="left as it is"):
        Fetcher(src).fetch(PATH, sha(b"x"), src / PATH)
    assert (src / PATH).read_bytes() == DATA
    for bad in ("../etc/passwd", "/etc/passwd", ""):
        with pytest.raises(FetchError, match="relative"):
            Fetcher(src).fetch(bad, sha(DATA), tmp_path / "x")
    with pytest.raises(ValueError, match="use a folder"):
        Fetcher("ftp://host/models")
    assert Path(Fetcher(src).where(PATH)) == src / PATH
