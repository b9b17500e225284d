"""The yardstick for the RPC front: a bare asyncio msgpack echo server, and a round-trip timer.

Run as a script it serves `[0, msgid, method, params]` -> `[1, msgid, nil, params]`
on a Unix socket with nothing but an asyncio Protocol, msgpack's Unpacker and
one write per reply: what any asyncio msgpack server pays at least. It prints
"ready" once it listens.

    python bench/rpc_echo.py SOCKET [--uvloop]

`round_trips` times requests one at a time over one connection with a
blocking client, the same client for kvwake and the echo server.
"""

from __future__ import annotations

import asyncio
import socket
import sys
import time

import msgpack


class Echo(asyncio.Protocol):
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport
        self.unpacker = msgpack.Unpacker(raw=False)

    def data_received(self, data: bytes) -> None:
        self.unpacker.feed(data)
        for _, msgid, _, params in self.unpacker:
            self.transport.write(msgpack.packb([1, msgid, None, params]))


async def serve(path: str) -> None:
    server = await asyncio.get_running_loop().create_unix_server(Echo, path)
    print("ready", flush=True)
    async with server:
        await server.serve_forever()


def round_trips(path: str, n: int, method: str = "hello", warmup: int = 200) -> list[float]:
    """Seconds per request/response, `n` of them after `warmup` untimed ones."""
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.connect(path)
    unpacker = msgpack.Unpacker(raw=False)
    times = []
    try:
        for i in range(warmup + n):
            t0 = time.perf_counter()
            sock.sendall(msgpack.packb([0, i, method, {}]))
            while True:
                reply = next(unpacker, None)
                if reply is not None:
                    break
                unpacker.feed(sock.recv(1 << 16))
            assert reply[0] == 1 and reply[1] == i and reply[2] is None, reply
            if i >= warmup:
                times.append(time.perf_counter() - t0)
    finally:
        sock.close()
    return times


if __name__ == "__main__":
    if "--uvloop" in sys.argv:
        import uvloop

        uvloop.run(serve(sys.argv[1]))
    else:
        asyncio.run(serve(sys.argv[1]))
