"""A small S3-compatible object store in one process, for the durable tansu broker of the fault
harness (`core.harness.Tansu(durable=True)`): a broker SIGKILLed and started again finds its records,
offsets and groups here, as Kafka's log on disk would be found.

Why not moto's S3 server, which this replaced: tansu stores each produced batch as an object and
lists a partition's objects on every fetch. moto renders a listing through its generic serialiser at
about 0.2 ms per object (a 667-object listing took 146 ms here), so on 2 cores the broker's reads
slowed as its partitions grew and the joiner fell minutes behind (docs/trust.md). Here a listing is a
bisect into the bucket's sorted keys and a string join.

The subset of the S3 REST API that the Rust `object_store` crate (tansu's storage client) uses:
bucket create; object PUT (with `If-None-Match: *` and `If-Match: <etag>`, 412 when the condition
fails), GET (with `Range`, `If-Match`, `If-None-Match`), HEAD, DELETE, server-side copy
(`x-amz-copy-source`); ListObjectsV2 (prefix, delimiter, start-after, continuation token, max-keys);
multi-object delete. Requests are not authenticated (loopback only). Anything else is answered 501
`NotImplemented` and logged, never guessed at. Objects live in memory: the store lives as long as its
process, which outlives the broker it serves.

    python -m core.objstore --port 9000 --bucket tansu
"""

from __future__ import annotations

import argparse
import base64
import bisect
import hashlib
import logging
import re
import sys
import threading
import time
import urllib.parse
from dataclasses import dataclass, field
from email.utils import formatdate
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from xml.etree import ElementTree
from xml.sax.saxutils import escape

log = logging.getLogger("flywheel.objstore")

_RANGE = re.compile(r"bytes=(\d*)-(\d*)$")


@dataclass
class Object:
    data: bytes
    etag: str  # quoted, as S3 sends it
    mtime: float


@dataclass
class Bucket:
    objects: dict[str, Object] = field(default_factory=dict)
    keys: list[str] = field(default_factory=list)  # sorted, for listings

    def put(self, key: str, obj: Object) -> None:
        if key not in self.objects:
            bisect.insort(self.keys, key)
        self.objects[key] = obj

    def delete(self, key: str) -> None:
        if self.objects.pop(key, None) is not None:
            del self.keys[bisect.bisect_left(self.keys, key)]


class Store:
    """The buckets, behind one lock (requests are short; the lock keeps a conditional put atomic)."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.buckets: dict[str, Bucket] = {}
        self.requests: dict[str, int] = {}

    def count(self, op: str) -> None:
        self.requests[op] = self.requests.get(op, 0) + 1


def _etag(data: bytes) -> str:
    return '"' + hashlib.md5(data, usedforsecurity=False).hexdigest() + '"'


def _iso(t: float) -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(t)) + f".{int(t % 1 * 1000):03d}Z"


def _etag_matches(header: str, etag: str) -> bool:
    return any(tag.strip() in ("*", etag) for tag in header.split(","))


class Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    server: StoreServer
    # An answer leaves in one write, flushed when the request is done, on a socket without Nagle's
    # delay: headers and body written apart would wait out the client's delayed ACK (~40 ms) each time.
    wbufsize = 1 << 16
    disable_nagle_algorithm = True

    # -- plumbing ----------------------------------------------------------------------------------
    def handle_expect_100(self) -> bool:
        answered = super().handle_expect_100()
        self.wfile.flush()  # "100 Continue" must leave now: the client holds the body back until it does
        return answered

    def log_message(self, format: str, *args: object) -> None:  # noqa: A002 (the base class's name)
        log.debug(format, *args)

    def _target(self) -> tuple[str, str, dict[str, str]]:
        parts = urllib.parse.urlsplit(self.path)
        path = urllib.parse.unquote(parts.path)
        bucket, _, key = path.lstrip("/").partition("/")
        query = dict(urllib.parse.parse_qsl(parts.query, keep_blank_values=True))
        return bucket, key, query

    def _body(self) -> bytes:
        length = int(self.headers.get("Content-Length") or 0)
        data = self.rfile.read(length) if length else b""
        if "aws-chunked" in (self.headers.get("Content-Encoding") or ""):
            raise _Unsupported("aws-chunked request bodies")
        return data

    def _send(
        self, status: int, body: bytes = b"", headers: dict[str, str] | None = None, *, head: bool = False
    ) -> None:
        self.send_response(status)
        for name, value in (headers or {}).items():
            self.send_header(name, value)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        if body and not head:
            self.wfile.write(body)

    def _error(self, status: int, code: str, message: str, *, head: bool = False) -> None:
        body = (f'<?xml version="1.0" encoding="UTF-8"?><Error><Code>{code}</Code>'
                f"<Message>{escape(message)}</Message></Error>")  # fmt: skip
        self._send(status, body.encode(), {"Content-Type": "application/xml"}, head=head)

    def _dispatch(self, method: str) -> None:
        store = self.server.store
        try:
            bucket, key, query = self._target()
            handler = getattr(self, f"_{method.lower()}")
            handler(store, bucket, key, query)
        except _Unsupported as e:
            log.warning("unsupported S3 request %s %s: %s", method, self.path, e)
            with store.lock:
                store.count("unsupported")
            self._error(501, "NotImplemented", f"this object store does not implement {e}")
        except (ValueError, ElementTree.ParseError) as e:  # a malformed number, token or XML body
            log.warning("bad S3 request %s %s: %r", method, self.path, e)
            with store.lock:
                store.count("invalid")
            self._error(400, "InvalidArgument", f"{type(e).__name__}: {e}")

    def do_PUT(self) -> None:
        self._dispatch("PUT")

    def do_GET(self) -> None:
        self._dispatch("GET")

    def do_HEAD(self) -> None:
        self._dispatch("HEAD")

    def do_DELETE(self) -> None:
        self._dispatch("DELETE")

    def do_POST(self) -> None:
        self._dispatch("POST")

    # -- operations --------------------------------------------------------------------------------
    def _put(self, store: Store, bucket: str, key: str, query: dict[str, str]) -> None:
        body = self._body()
        if not key:
            if query:
                raise _Unsupported(f"bucket sub-resource {sorted(query)}")
            with store.lock:
                store.buckets.setdefault(bucket, Bucket())
                store.count("create_bucket")
            self._send(200, headers={"Location": f"/{bucket}"})
            return
        if query:
            raise _Unsupported(f"object sub-resource {sorted(query)} (multipart uploads, tagging, acl)")
        source = self.headers.get("x-amz-copy-source")
        with store.lock:
            b = store.buckets.get(bucket)
            if b is None:
                return self._error(404, "NoSuchBucket", bucket)
            if source is not None:
                src_bucket, _, src_key = urllib.parse.unquote(source).lstrip("/").partition("/")
                src = store.buckets.get(src_bucket, Bucket()).objects.get(src_key)
                if src is None:
                    return self._error(404, "NoSuchKey", src_key)
                body = src.data
            current = b.objects.get(key)
            if_none = self.headers.get("If-None-Match")
            if_match = self.headers.get("If-Match")
            if if_none is not None and current is not None and _etag_matches(if_none, current.etag):
                store.count("put_precondition_failed")
                return self._error(412, "PreconditionFailed", f"{key} exists")
            if if_match is not None and (current is None or not _etag_matches(if_match, current.etag)):
                store.count("put_precondition_failed")
                if current is None:
                    return self._error(404, "NoSuchKey", key)
                return self._error(412, "PreconditionFailed", f"{key} has changed")
            obj = Object(body, _etag(body), time.time())
            b.put(key, obj)
            store.count("copy" if source is not None else "put")
            if if_none is not None or if_match is not None:
                store.count("put_conditional")
        if source is not None:
            xml = (f'<?xml version="1.0" encoding="UTF-8"?><CopyObjectResult><LastModified>{_iso(obj.mtime)}'
                   f"</LastModified><ETag>{escape(obj.etag)}</ETag></CopyObjectResult>")  # fmt: skip
            self._send(200, xml.encode(), {"Content-Type": "application/xml", "ETag": obj.etag})
        else:
            self._send(200, headers={"ETag": obj.etag})

    def _head(self, store: Store, bucket: str, key: str, query: dict[str, str]) -> None:
        self._get(store, bucket, key, query, head=True)

    def _get(self, store: Store, bucket: str, key: str, query: dict[str, str], *, head: bool = False) -> None:
        if not key:
            if head:
                with store.lock:
                    found = bucket in store.buckets
                return self._send(200 if found else 404, head=True)
            return self._list(store, bucket, query)
        if query:
            raise _Unsupported(f"object sub-resource {sorted(query)}")
        with store.lock:
            b = store.buckets.get(bucket)
            obj = None if b is None else b.objects.get(key)
            store.count("head" if head else "get")
        if b is None:
            return self._error(404, "NoSuchBucket", bucket, head=head)
        if obj is None:
            return self._error(404, "NoSuchKey", key, head=head)
        headers = {"ETag": obj.etag, "Last-Modified": formatdate(obj.mtime, usegmt=True),
                   "Content-Type": "application/octet-stream", "Accept-Ranges": "bytes"}  # fmt: skip
        if_match, if_none = self.headers.get("If-Match"), self.headers.get("If-None-Match")
        if if_match is not None and not _etag_matches(if_match, obj.etag):
            return self._error(412, "PreconditionFailed", f"{key} has changed", head=head)
        if if_none is not None and _etag_matches(if_none, obj.etag):
            return self._send(304, headers={"ETag": obj.etag}, head=True)
        data, status = obj.data, 200
        wanted = self.headers.get("Range")
        if wanted is not None:
            m = _RANGE.match(wanted.strip())
            if m is None or m.group(1) == m.group(2) == "":
                raise _Unsupported(f"Range {wanted!r}")
            size = len(data)
            if m.group(1) == "":  # the last n bytes
                start, end = max(0, size - int(m.group(2))), size - 1
            else:
                start = int(m.group(1))
                end = min(size - 1, int(m.group(2))) if m.group(2) else size - 1
            if start >= size or start > end:
                return self._error(416, "InvalidRange", wanted, head=head)
            data, status = data[start : end + 1], 206
            headers["Content-Range"] = f"bytes {start}-{end}/{size}"
        self._send(status, data, headers, head=head)

    def _list(self, store: Store, bucket: str, query: dict[str, str]) -> None:
        if query.get("list-type") != "2":
            raise _Unsupported(f"bucket GET {sorted(query)} (only ListObjectsV2 is served)")
        prefix = query.get("prefix", "")
        delimiter = query.get("delimiter", "")
        max_keys = max(0, min(int(query.get("max-keys", "1000")), 1000))
        after = query.get("start-after", "")
        token = query.get("continuation-token")
        if token:
            after = max(after, base64.b64decode(token.encode(), altchars=b"-_", validate=True).decode())
        contents: list[tuple[str, Object]] = []
        prefixes: list[str] = []
        truncated, last = False, ""
        with store.lock:
            b = store.buckets.get(bucket)
            if b is None:
                return self._error(404, "NoSuchBucket", bucket)
            store.count("list")
            keys = b.keys
            i = bisect.bisect_left(keys, prefix)
            if after:
                i = max(i, bisect.bisect_right(keys, after))
            while i < len(keys) and keys[i].startswith(prefix):
                key = keys[i]
                if len(contents) + len(prefixes) == max_keys:
                    truncated = True
                    break
                cut = key.find(delimiter, len(prefix)) if delimiter else -1
                if cut >= 0:
                    common = key[: cut + len(delimiter)]
                    prefixes.append(common)
                    last = common
                    # skip every key under this common prefix
                    i = bisect.bisect_left(keys, common[:-1] + chr(ord(common[-1]) + 1), i)
                    continue
                contents.append((key, b.objects[key]))
                last = key
                i += 1
        out = ['<?xml version="1.0" encoding="UTF-8"?>',
               '<ListBucketResult xmlns="http://s3.amazonaws.com/doc/2006-03-01/">',
               f"<Name>{escape(bucket)}</Name><Prefix>{escape(prefix)}</Prefix>",
               f"<KeyCount>{len(contents) + len(prefixes)}</KeyCount><MaxKeys>{max_keys}</MaxKeys>",
               f"<IsTruncated>{'true' if truncated else 'false'}</IsTruncated>"]  # fmt: skip
        if delimiter:
            out.append(f"<Delimiter>{escape(delimiter)}</Delimiter>")
        if token:
            out.append(f"<ContinuationToken>{escape(token)}</ContinuationToken>")
        if query.get("start-after"):
            out.append(f"<StartAfter>{escape(query['start-after'])}</StartAfter>")
        if truncated:
            out.append(
                f"<NextContinuationToken>{base64.urlsafe_b64encode(last.encode()).decode()}</NextContinuationToken>"
            )
        for key, obj in contents:
            out.append(f"<Contents><Key>{escape(key)}</Key><LastModified>{_iso(obj.mtime)}</LastModified>"
                       f"<ETag>{escape(obj.etag)}</ETag><Size>{len(obj.data)}</Size>"
                       "<StorageClass>STANDARD</StorageClass></Contents>")  # fmt: skip
        for common in prefixes:
            out.append(f"<CommonPrefixes><Prefix>{escape(common)}</Prefix></CommonPrefixes>")
        out.append("</ListBucketResult>")
        self._send(200, "".join(out).encode(), {"Content-Type": "application/xml"})

    def _delete(self, store: Store, bucket: str, key: str, query: dict[str, str]) -> None:
        if not key or query:
            raise _Unsupported("bucket deletion and object sub-resources")
        with store.lock:
            b = store.buckets.get(bucket)
            if b is None:
                return self._error(404, "NoSuchBucket", bucket)
            b.delete(key)
            store.count("delete")
        self._send(204)

    def _post(self, store: Store, bucket: str, key: str, query: dict[str, str]) -> None:
        if key or "delete" not in query:
            raise _Unsupported(f"POST {sorted(query)} (only the multi-object delete is served)")
        root = ElementTree.fromstring(self._body())
        names = [el.text or "" for el in root.iter() if el.tag.rsplit("}", 1)[-1] == "Key"]
        quiet = any(el.tag.rsplit("}", 1)[-1] == "Quiet" and (el.text or "").lower() == "true" for el in root.iter())
        with store.lock:
            b = store.buckets.get(bucket)
            if b is None:
                return self._error(404, "NoSuchBucket", bucket)
            for name in names:
                b.delete(name)
            store.count("delete")
        deleted = "" if quiet else "".join(f"<Deleted><Key>{escape(n)}</Key></Deleted>" for n in names)
        xml = f'<?xml version="1.0" encoding="UTF-8"?><DeleteResult xmlns="http://s3.amazonaws.com/doc/2006-03-01/">{deleted}</DeleteResult>'
        self._send(200, xml.encode(), {"Content-Type": "application/xml"})


class _Unsupported(Exception):
    pass


class StoreServer(ThreadingHTTPServer):
    daemon_threads = True

    def __init__(self, address: tuple[str, int], buckets: tuple[str, ...] = ()):
        self.store = Store()
        for name in buckets:
            self.store.buckets[name] = Bucket()
        super().__init__(address, Handler)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m core.objstore", description=__doc__.splitlines()[0])
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--bucket", action="append", default=[], help="a bucket to create at start (repeatable)")
    parser.add_argument("--report-s", type=float, default=60.0, help="log the request counts this often")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s %(message)s", stream=sys.stderr)
    server = StoreServer((args.host, args.port), tuple(args.bucket))
    log.info("serving S3 on http://%s:%d, buckets %s", args.host, args.port, args.bucket)

    def report() -> None:
        while True:
            time.sleep(args.report_s)
            with server.store.lock:
                counts = dict(server.store.requests)
                objects = sum(len(b.objects) for b in server.store.buckets.values())
            log.info("requests so far %s; %d objects", counts, objects)

    threading.Thread(target=report, name="objstore-report", daemon=True).start()
    try:
        server.serve_forever(poll_interval=0.5)
    finally:
        log.info("requests served: %s", server.store.requests)


if __name__ == "__main__":
    main()
