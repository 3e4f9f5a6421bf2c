"""The bounds of the log sources' reads, on the real Podman service: a tail above MAX_TAIL and a
start before the epoch, whatever a caller asks, reach the backend as the bound and the epoch.

A tail far above the bound is never sent here: before the bound, Podman allocated a channel of
``tail`` entries and a tail of 2**32-1 ran the shared Podman service out of memory. A tail just
above the bound shows the bound as well (the lines answered).
"""

from __future__ import annotations

import struct
import uuid
from collections.abc import AsyncIterator
from datetime import UTC, datetime, timedelta, timezone

import pytest
from harness import eventually
from podman import PodmanClient

from drivers.logs import EPOCH, MAX_TAIL, LogLine, backend_since, backend_tail
from drivers.podman import PodmanDriver
from drivers.podman_logs import Frames, PodmanLogs
from drivers.protocol import LaunchSpec
from events.common import SandboxSpec
from services.common.settings import Settings

LINES = MAX_TAIL + 2  # the main process writes 1 … LINES, one a line
LONG = 100_000  # and before them one line this long


def test_a_tail_is_held_to_the_bound_and_a_start_to_the_epoch() -> None:
    """What every source (Podman's, Kubernetes') asks its backend for."""
    assert [backend_tail(t) for t in (None, 0, 5, MAX_TAIL, MAX_TAIL + 1, 2**32 - 1, -1)] == [
        None, 0, 5, MAX_TAIL, MAX_TAIL, MAX_TAIL, 0,
    ]  # fmt: skip
    before = datetime(1, 1, 1, tzinfo=UTC)
    after = datetime(2026, 1, 1, tzinfo=UTC)
    assert [backend_since(s) for s in (None, before, EPOCH, after)] == [None, EPOCH, EPOCH, after]


@pytest.fixture(scope="module")
async def printed(settings: Settings, podman: PodmanClient) -> AsyncIterator[str]:
    """A running sandbox whose main process has written LINES lines (its key)."""
    driver = PodmanDriver(settings.podman_url, stop_timeout=1)
    key = f"logs-{uuid.uuid4().hex[:10]}"
    # One write a line (the shell's echo): Podman's log splits a write that ends mid-line (as
    # seq's buffered blocks do) into partial lines, each read as a line of its own.
    # First, one line of LONG characters, which Podman keeps in parts.
    script = (
        f"head -c {LONG} /dev/zero | tr '\\0' x; echo; "
        f"for i in $(seq 1 {LINES}); do echo $i; done; exec sleep 3600"
    )
    spec = SandboxSpec(image=settings.sandbox_image, command=["sh", "-c", script])
    try:
        await driver.launch(LaunchSpec(key, uuid.uuid4(), 1, f"rid-{key}", spec))
        yield key
    finally:
        await driver.delete(key)
        await driver.close()


@pytest.fixture
async def logs(settings: Settings) -> AsyncIterator[PodmanLogs]:
    source = PodmanLogs(settings.podman_url)
    yield source
    await source.close()


async def read(source: PodmanLogs, key: str, **how: object) -> list[LogLine]:
    return [line async for line in source.read(key, 1, **how)]  # type: ignore[arg-type]


async def written(source: PodmanLogs, key: str) -> None:
    async def last() -> list[str]:
        return [line.text for line in await read(source, key, tail=1)]

    def all_written(texts: list[str]) -> bool:
        return texts == [str(LINES)]

    await eventually(last, all_written, what="the last line written")


async def test_a_tail_above_the_bound_answers_the_bound(printed: str, logs: PodmanLogs) -> None:
    """Before, the tail went to Podman as asked (MAX_TAIL + 1 lines came back here)."""
    await written(logs, printed)
    # Podman counts its entries, a line's parts each (rare here, one write a line): the same
    # answer as the bound's, rather than a count of lines.
    lines = await read(logs, printed, tail=MAX_TAIL + 1)
    assert lines == await read(logs, printed, tail=MAX_TAIL)
    assert MAX_TAIL - 50 < len(lines) <= MAX_TAIL
    assert lines[-1].text == str(LINES)


@pytest.mark.parametrize(
    "since",
    [
        EPOCH - timedelta(seconds=1),
        datetime(1, 1, 1, 10, tzinfo=UTC),  # year 1, not Go's zero time
        datetime(1, 1, 1, tzinfo=timezone(timedelta(hours=14))),  # year 0 in UTC
    ],
    ids=["a-second-before-the-epoch", "year-1", "year-0"],
)
async def test_a_start_before_the_epoch_answers_every_line(
    printed: str, logs: PodmanLogs, since: datetime
) -> None:
    """Before, Podman got the negative time as asked: it answered every line for these but
    none for a time in year 0 (0001-01-01T00:00:00+14:00, which the doors now refuse as out
    of range, but a source takes). Now the backend is asked from the epoch."""
    await written(logs, printed)
    everything = await read(logs, printed)
    assert len(everything) == 1 + LINES
    assert await read(logs, printed, since=since) == everything


async def test_a_line_podman_keeps_in_parts_is_read_as_one(printed: str, logs: PodmanLogs) -> None:
    """Before, each part was a line of its own (the long line came as several, and lines of the
    count split where the monitor's reads ended mid-line)."""
    await written(logs, printed)
    texts = [line.text for line in await read(logs, printed)]
    assert len(texts) == 1 + LINES
    assert texts[0] == "x" * LONG
    assert texts[1:] == [str(i) for i in range(1, LINES + 1)]


def frame(stream: int, text: bytes) -> bytes:
    return struct.pack(">BxxxL", stream, len(text)) + text


def test_frames_join_a_lines_parts_per_stream_and_end_with_the_unfinished() -> None:
    stamp = b"2026-12-04T12:00:00Z "
    later = b"2026-12-04T12:00:01Z "
    lines = Frames()
    whole = frame(1, stamp + b"ab") + frame(2, later + b"err\n") + frame(1, later + b"cd\n")
    assert [(line.stream, line.text) for line in lines.feed(whole[:5])] == []
    got = lines.feed(whole[5:] + frame(1, later + b"tail"))
    assert [(line.stream, line.text) for line in got] == [("stderr", "err"), ("stdout", "abcd")]
    assert got[1].at == datetime(2026, 12, 4, 12, tzinfo=UTC)  # the time of its first part
    assert [(line.stream, line.text) for line in lines.rest()] == [("stdout", "tail")]
