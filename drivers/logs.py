"""Reading a sandbox's runtime logs: what the main process wrote to stdout and stderr, as the
backend keeps it (Podman's container log, the Pod's log on Kubernetes).

Logs are data, not state: they are read from the runtime when asked for and never go on the
log (Kafka) nor into PostgreSQL. A source reads one generation's runtime (the current one: an
older generation's runtime is removed when the next one launches). Implementations:
:class:`drivers.podman_logs.PodmanLogs`, :class:`drivers.kube_logs.KubeLogs`, and
:class:`RoutedLogs` for a routing driver's two backends.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Final, Literal, Protocol, runtime_checkable

MAX_TAIL: Final = 10_000  # the most lines a read's tail may ask a backend for
EPOCH: Final = datetime(1970, 1, 1, tzinfo=UTC)


@dataclass(frozen=True, slots=True)
class LogLine:
    """One line of output (without its newline; a last line may lack one)."""

    at: datetime  # when the backend recorded it (UTC)
    stream: Literal["stdout", "stderr"]
    text: str  # decoded as UTF-8, undecodable bytes replaced


class LogsUnavailable(Exception):
    """The backend cannot serve this runtime's logs (unreachable, or it keeps none)."""


def backend_tail(tail: int | None) -> int | None:
    """The tail a source asks its backend for: ``tail`` held to 0…MAX_TAIL (None: all lines).
    The doors refuse or clamp a larger tail already; this holds whatever a caller asks, since a
    backend may size its buffers by the tail (Podman allocates a channel of ``tail`` entries:
    a tail of 2**32-1 ran the Podman service out of memory)."""
    return None if tail is None else min(max(tail, 0), MAX_TAIL)


def backend_since(since: datetime | None) -> datetime | None:
    """The start a source asks its backend for: a time before the epoch is the epoch (every
    line), never a negative time (Podman read one as no line at all)."""
    return None if since is None else max(since, EPOCH)


@runtime_checkable
class LogSource(Protocol):
    def read(
        self,
        key: str,
        generation: int,
        *,
        tail: int | None = None,
        since: datetime | None = None,
        follow: bool = False,
    ) -> AsyncIterator[LogLine]:
        """The lines of the generation's runtime, oldest first: the last ``tail`` of them
        (all when None; at most MAX_TAIL), only those recorded at or after ``since`` (every
        line for a time before the epoch); with ``follow``, then the
        new ones as they are written, until the runtime stops or the caller leaves. A runtime
        that does not exist (not launched yet, or removed) has no lines. Raises
        LogsUnavailable."""
        ...

    async def close(self) -> None: ...


@dataclass(frozen=True, slots=True)
class RoutedLogs:
    """The logs of a routing driver's sandboxes: names starting with ``prefix`` from
    ``routed``, the others from ``default`` (the same rule as drivers.routing)."""

    default: LogSource
    routed: LogSource
    prefix: str

    def read(
        self,
        key: str,
        generation: int,
        *,
        tail: int | None = None,
        since: datetime | None = None,
        follow: bool = False,
    ) -> AsyncIterator[LogLine]:
        source = self.routed if key.startswith(self.prefix) else self.default
        return source.read(key, generation, tail=tail, since=since, follow=follow)

    async def close(self) -> None:
        await self.default.close()
        await self.routed.close()


@dataclass(frozen=True, slots=True)
class NoLogs:
    """A backend that keeps no logs (the fake driver): every read says why."""

    reason: str

    def read(
        self,
        key: str,
        generation: int,
        *,
        tail: int | None = None,
        since: datetime | None = None,
        follow: bool = False,
    ) -> AsyncIterator[LogLine]:
        raise LogsUnavailable(self.reason)

    async def close(self) -> None:
        return None
