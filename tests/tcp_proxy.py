"""A TCP proxy the test controls: ``cut()`` drops every connection and refuses new ones until
``restore()``, as a broker restart or a network failure does to its clients.

With ``hold_closes``, a connection the server closes stays open towards the client (until the
client closes it, or ``cut()``): what the server said last has arrived, its close has not. That
is the window in which a PostgreSQL restart's goodbye reaches a client before the close does.
"""

from __future__ import annotations

import asyncio
import contextlib


class TcpProxy:
    def __init__(
        self, port: int, target_port: int, host: str = "127.0.0.1", *, hold_closes: bool = False
    ) -> None:
        self.host, self.port, self.target_port = host, port, target_port
        self.hold_closes = hold_closes
        # Closes the server made while its client was still connected, held so far
        # (everything the server sent before them forwarded).
        self.closes_held = 0
        self._server: asyncio.Server | None = None
        self._writers: set[asyncio.StreamWriter] = set()

    @property
    def is_cut(self) -> bool:
        return self._server is None

    async def restore(self) -> None:
        if self._server is None:
            self._server = await asyncio.start_server(self._serve, self.host, self.port)

    async def cut(self) -> None:
        if self._server is not None:
            self._server.close()
            await self._server.wait_closed()
            self._server = None
        for writer in list(self._writers):
            writer.transport.abort()  # a reset, not a polite close
        self._writers.clear()

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            up_reader, up_writer = await asyncio.open_connection(self.host, self.target_port)
        except OSError:
            writer.transport.abort()
            return
        self._writers.update((writer, up_writer))
        from_client = asyncio.ensure_future(self._pipe(reader, up_writer))
        await self._copy(up_reader, writer)
        if self.hold_closes and not from_client.done():
            self.closes_held += 1  # the client's side stays open (``cut()`` still closes it)
        else:
            self._close(writer)
        await from_client

    async def _pipe(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await self._copy(reader, writer)
        self._close(writer)

    @staticmethod
    async def _copy(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        with contextlib.suppress(ConnectionError, OSError):
            while data := await reader.read(65536):
                writer.write(data)
                await writer.drain()

    def _close(self, writer: asyncio.StreamWriter) -> None:
        self._writers.discard(writer)
        writer.transport.abort()
