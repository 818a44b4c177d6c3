#!/usr/bin/env python3
"""A TCP proxy that delivers every chunk it reads a fixed delay later, in order, in both
directions: a stand-in for shards on other hosts when the kernel offers no netem.

Usage: bench/delay-proxy.py [HOST:]LISTEN_PORT [HOST:]TARGET_PORT DELAY_MS
(a bare port means 127.0.0.1)
"""
import asyncio
import socket
import sys
import time


async def pipe(reader, writer, delay):
    queue = asyncio.Queue()

    async def read():
        while True:
            chunk = await reader.read(65536)
            await queue.put((time.monotonic() + delay, chunk))
            if not chunk:
                return

    async def write():
        while True:
            due, chunk = await queue.get()
            wait = due - time.monotonic()
            if wait > 0:
                await asyncio.sleep(wait)
            if not chunk:
                writer.close()
                return
            writer.write(chunk)
            await writer.drain()

    await asyncio.gather(read(), write())


def host_port(arg):
    host, _, port = arg.rpartition(":")
    return host or "127.0.0.1", int(port)


async def main(listen, target, delay):
    async def handle(client_r, client_w):
        server_r, server_w = await asyncio.open_connection(*target)
        for w in (client_w, server_w):
            w.get_extra_info("socket").setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        await asyncio.gather(
            pipe(client_r, server_w, delay), pipe(server_r, client_w, delay), return_exceptions=True
        )

    server = await asyncio.start_server(handle, *listen)
    async with server:
        await server.serve_forever()


if __name__ == "__main__":
    listen, target, delay_ms = host_port(sys.argv[1]), host_port(sys.argv[2]), float(sys.argv[3])
    asyncio.run(main(listen, target, delay_ms / 1000))
