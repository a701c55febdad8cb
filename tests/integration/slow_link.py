"""A TCP relay with a slow uplink, for a department whose network to the SuperLink is slow.

The SuperNode connects to the relay instead of the SuperLink; bytes from the node to the SuperLink
(its trained model each round) pass at most ``bytes_per_second``, what it pulls passes at full
speed (the app bundle, the round's model). Everything else about the node is real: its SuperNode,
ClientApp and data.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
from collections.abc import Iterator
from contextlib import contextmanager

from quorumfl.deploy.processes import free_port


async def _pipe(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, rate: float | None) -> None:
    try:
        while chunk := await reader.read(1024 if rate else 65536):
            writer.write(chunk)
            await writer.drain()
            if rate:
                await asyncio.sleep(len(chunk) / rate)
    except ConnectionError:
        pass
    finally:
        writer.close()


@contextmanager
def slow_link(target: str, *, bytes_per_second: float) -> Iterator[str]:
    """Relay 127.0.0.1:<free port> → ``target`` (HOST:PORT) for the ``with`` block; yields the relay's address."""
    host, port = target.rsplit(":", 1)
    listen = free_port()
    loop = asyncio.new_event_loop()
    ready = threading.Event()
    stopping: asyncio.Event | None = None
    pipes: set[asyncio.Task[None]] = set()

    async def handle(node_reader: asyncio.StreamReader, node_writer: asyncio.StreamWriter) -> None:
        link_reader, link_writer = await asyncio.open_connection(host, int(port))
        for task in (loop.create_task(_pipe(node_reader, link_writer, bytes_per_second)),
                     loop.create_task(_pipe(link_reader, node_writer, None))):
            pipes.add(task)
            task.add_done_callback(pipes.discard)

    async def serve() -> None:
        nonlocal stopping
        stopping = asyncio.Event()
        server = await asyncio.start_server(handle, "127.0.0.1", listen)
        ready.set()
        await stopping.wait()
        server.close()
        for task in list(pipes):
            task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await asyncio.gather(*pipes, return_exceptions=True)
        await server.wait_closed()

    thread = threading.Thread(target=lambda: loop.run_until_complete(serve()), daemon=True)
    thread.start()
    if not ready.wait(10):
        raise RuntimeError("the slow-link relay did not start")
    try:
        yield f"127.0.0.1:{listen}"
    finally:
        assert stopping is not None
        loop.call_soon_threadsafe(stopping.set)
        thread.join(10)
        loop.close()
