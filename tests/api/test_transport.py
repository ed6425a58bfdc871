"""The gateway's HTTP transport (`api.transport`): a response's writes within one event-loop turn leave as
one write of the real transport; writes in separate turns (a stream's chunks) leave one by one; closing
sends what is held first. On a real asyncio socket transport, its writes counted; the bytes are read back
from the other end of the socket pair. (Every in-process live gateway of the suite runs this protocol:
`tests/conftest.py`'s `LiveServer`.)"""

import asyncio
import socket

from api.transport import _CoalescingTransport


def test_one_turns_writes_leave_as_one_write_and_close_sends_what_is_held():
    async def main() -> tuple[list[bytes], bytes]:
        loop = asyncio.get_running_loop()
        ours, theirs = socket.socketpair()
        transport, _ = await loop.connect_accepted_socket(asyncio.Protocol, ours)
        sent: list[bytes] = []
        real_write = transport.write

        def counted(data: bytes) -> None:
            sent.append(bytes(data))
            real_write(data)

        transport.write = counted  # type: ignore[method-assign,assignment]
        t = _CoalescingTransport(transport, loop)
        t.write(b"HTTP/1.1 200 OK\r\ncontent-length: 4\r\n\r\n")
        t.write(b"body")
        assert sent == [] and t.get_write_buffer_size() == 42  # held until the turn ends
        await asyncio.sleep(0)
        assert sent == [b"HTTP/1.1 200 OK\r\ncontent-length: 4\r\n\r\nbody"]
        for chunk in (b"data: 1\n\n", b"data: 2\n\n"):  # a stream: one write per turn
            t.write(chunk)
            await asyncio.sleep(0)
        assert sent[1:] == [b"data: 1\n\n", b"data: 2\n\n"]
        t.write(b"last")
        t.close()
        assert sent[-1] == b"last"
        await asyncio.sleep(0.05)
        theirs.settimeout(5)
        got = b""
        while chunk := theirs.recv(4096):
            got += chunk
        theirs.close()
        return sent, got

    sent, got = asyncio.run(main())
    assert got == b"".join(sent)
    assert len(sent) == 4
