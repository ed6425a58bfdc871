"""The gateway's HTTP protocol under uvicorn: httptools, with each response's writes sent together.

Owns `CoalescedHttpTools`, the protocol class `api.main.serve` gives uvicorn. uvicorn's httptools
protocol writes a response's status line and headers when the app starts the response, and its body
in a second write: two sends, two loopback packets, per answer. Here the connection's transport
gathers what is written during one turn of the event loop and sends it as one write at the end of
that turn (`_CoalescingTransport`), so a whole (non-streamed) response leaves in one send; a streamed
response's chunks, written in separate turns, still leave one by one, as soon as they are written.
Nothing is held past the turn it was written in, and closing the transport sends what is held first.
"""

from __future__ import annotations

import asyncio
from typing import Any

from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol


class _CoalescingTransport:
    """A transport whose writes within one event-loop turn go out as one write of the real transport."""

    def __init__(self, transport: asyncio.Transport, loop: asyncio.AbstractEventLoop):
        self._transport, self._loop = transport, loop
        self._held: list[bytes] = []

    def write(self, data: bytes) -> None:
        if not self._held:
            self._loop.call_soon(self._flush)
        self._held.append(bytes(data))

    def writelines(self, chunks: Any) -> None:
        for chunk in chunks:
            self.write(chunk)

    def _flush(self) -> None:
        if not self._held:
            return
        data = self._held[0] if len(self._held) == 1 else b"".join(self._held)
        self._held.clear()
        if not self._transport.is_closing():
            self._transport.write(data)

    def close(self) -> None:
        self._flush()
        self._transport.close()

    def get_write_buffer_size(self) -> int:
        return self._transport.get_write_buffer_size() + sum(len(d) for d in self._held)

    def __getattr__(self, name: str) -> Any:  # everything else is the real transport's
        return getattr(self._transport, name)


class CoalescedHttpTools(HttpToolsProtocol):
    """uvicorn's httptools protocol on a `_CoalescingTransport`."""

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(_CoalescingTransport(transport, self.loop))  # type: ignore[arg-type]
