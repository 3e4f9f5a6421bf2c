"""Podman's event stream (``GET /events``, container events) read by a daemon thread into an
``asyncio.Queue``, with a socket shutdown that ends it from the event loop at once.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import socket
import threading
from typing import Any

from podman import PodmanClient
from podman.api import prepare_filters

log = logging.getLogger("sandstream.drivers.podman")


class _Connected:
    """Queue marker: the event stream is open."""


class _Ended:
    """Queue marker: the event stream ended (``error`` says why, None for a clean end)."""

    def __init__(self, error: BaseException | None) -> None:
        self.error = error


class EventStream:
    """Podman's ``GET /events`` (container events) read by a daemon thread into a queue.

    This is the request ``PodmanClient.events(decode=True, filters={"type": "container"})``
    sends; it is made directly so the stream's socket can be shut down from the event loop,
    which wakes the reading thread at once (closing a pooled session does not).
    """

    def __init__(self, base_url: str, loop: asyncio.AbstractEventLoop) -> None:
        self._base_url = base_url
        self._loop = loop
        self._queue: asyncio.Queue[dict[str, Any] | _Connected | _Ended] = asyncio.Queue()
        self._stopping = threading.Event()
        self._lock = threading.Lock()
        self._response: Any = None
        self._thread = threading.Thread(target=self._run, name="podman-events", daemon=True)
        self.error: BaseException | None = None
        self.is_connected = False

    def start(self) -> None:
        self._thread.start()

    async def connected(self) -> None:
        """Wait until the stream is open; ConnectionError if it could not be opened."""
        item = await self._queue.get()
        if isinstance(item, _Ended):
            self.error = item.error
            raise ConnectionError(f"podman event stream: {item.error or 'closed'}")
        if not isinstance(item, _Connected):  # pragma: no cover - the thread sends it first
            raise ConnectionError(f"podman event stream: unexpected first item {item!r}")
        self.is_connected = True

    async def next_event(self) -> dict[str, Any] | None:
        """The next event, or None once the stream has ended (``error`` says why)."""
        while True:
            item = await self._queue.get()
            if isinstance(item, _Ended):
                self.error = item.error
                self.is_connected = False
                return None
            if isinstance(item, dict):
                return item

    def interrupt(self) -> None:
        """Break the connection; the reader reports the stream as ended."""
        with self._lock:
            response = self._response
        if response is not None:
            _shutdown(response)

    def close(self) -> None:
        """Stop for good: the reader thread ends without reporting, any reader wakes up."""
        self._stopping.set()
        self.interrupt()
        if not self._loop.is_closed():
            self._queue.put_nowait(_Ended(None))

    def _put(self, item: dict[str, Any] | _Connected | _Ended) -> None:
        try:
            self._loop.call_soon_threadsafe(self._queue.put_nowait, item)
        except RuntimeError:  # the loop is closed: nobody is listening any more
            self._stopping.set()

    def _run(self) -> None:
        client = PodmanClient(base_url=self._base_url)  # no timeout: the stream idles
        response: Any = None
        try:
            response = client.api.get(
                "/events",
                params={"filters": prepare_filters({"type": "container"}), "stream": True},
                stream=True,
            )
            response.raise_for_status()
            with self._lock:
                self._response = response
            if self._stopping.is_set():
                return
            self._put(_Connected())
            for line in response.iter_lines():
                if self._stopping.is_set():
                    return
                if not line:
                    continue
                try:
                    event = json.loads(line)
                except ValueError:
                    log.warning("podman watch: undecodable event %r", line[:200])
                    continue
                if isinstance(event, dict):
                    self._put(event)
            self._put(_Ended(None))
        except Exception as exc:  # the thread reports every failure to the watcher
            if not self._stopping.is_set():
                self._put(_Ended(exc))
        finally:
            if response is not None:
                # Closing a broken stream may fail; there is nothing left to do then.
                with contextlib.suppress(Exception):
                    response.close()
            client.close()  # type: ignore[no-untyped-call]


def _shutdown(response: Any) -> None:
    """Shut the stream's socket down, which wakes a thread blocked reading it."""
    raw = getattr(response, "raw", None)
    connection = getattr(raw, "connection", None) or getattr(raw, "_connection", None)
    sock = getattr(connection, "sock", None)
    if isinstance(sock, socket.socket):
        with contextlib.suppress(OSError):
            sock.shutdown(socket.SHUT_RDWR)
    else:
        with contextlib.suppress(Exception):
            response.close()
