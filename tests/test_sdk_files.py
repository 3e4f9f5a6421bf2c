"""The SDK's streamed reads (``files.read_stream``, ``files.download``) against a real
`sandstream up` (a subprocess: the memory measured here is the client's alone; sandboxes in
real Podman containers). A file far larger than a bound is handed on in chunks while the
client's traced memory stays under the bound; a stream left after its first chunk has taken
no more than a chunk; a refused read raises its typed error before any byte; a suspended
sandbox is woken; a body broken off (the token revoked) raises, never ends short. And the
CLI's ``sandbox cp`` out of a sandbox, which streamed already: its peak resident memory for
the large file is that for a small one.

Before, ``files.read`` was the SDK's only way to read a file, and it holds the whole file in
memory (``read_stream`` and ``download`` are new API: these tests fail on the old code with
AttributeError). An implementation that read the whole body before handing on its first chunk
fails the bounds here: its traced peak is at least the file's size."""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
import tracemalloc
from collections.abc import AsyncIterator, Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
import pytest_asyncio
from upkit import SANDSTREAM, Up, running_up, sdk_environment

from services.common.settings import PROJECT_ROOT, load_settings

sys.path.insert(0, str(PROJECT_ROOT / "sdk" / "python"))  # the SDK as a user has it

import sandstream_sdk as ss
from sandstream_sdk import AsyncSandbox, Sandbox
from sandstream_sdk.files import CHUNK_SIZE

IMAGE = load_settings().sandbox_image
SIZE = 64 * 1024 * 1024  # the file: far more than the bound, and than the sockets buffer
BOUND = 8 * 1024 * 1024  # the client's traced peak while it streams the file
MAKE_BIG = f"head -c {SIZE} /dev/urandom > big.bin && sha256sum big.bin"


@pytest_asyncio.fixture(scope="module", loop_scope="session")
async def up(tmp_path_factory: pytest.TempPathFactory) -> AsyncIterator[Up]:
    async with running_up(tmp_path_factory.mktemp("run")) as running:
        yield running


@pytest.fixture
def connection(up: Up) -> Iterator[dict[str, str]]:
    """Where the SDK finds the API: the variables it reads, as a user sets them."""
    yield from sdk_environment(up)


@contextmanager
def traced() -> Iterator[Callable[[], int]]:
    """The peak of this process's Python allocations since the block began (what a body
    held whole would show: its bytes are allocated here, in the client)."""
    tracemalloc.start()
    try:
        yield lambda: tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()


def sha256_of(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as handle:
        while block := handle.read(1024 * 1024):
            digest.update(block)
    return digest.hexdigest()


def test_read_stream_and_download_hold_a_chunk_not_the_file(
    up: Up, connection: dict[str, str], tmp_path: Path
) -> None:
    with Sandbox.create(image=IMAGE, name=up.name("sdk-stream")) as sb:
        made = sb.commands.run(MAKE_BIG, cwd="/workspace", timeout=120)
        digest = made.stdout.split()[0]
        sizes: list[int] = []
        hashed = hashlib.sha256()
        with traced() as peak:
            with sb.files.read_stream("big.bin") as chunks:
                assert chunks.size == SIZE
                for chunk in chunks:
                    sizes.append(len(chunk))
                    hashed.update(chunk)
            streamed = peak()
        assert hashed.hexdigest() == digest and chunks.received == sum(sizes) == SIZE
        assert sizes == [CHUNK_SIZE] * (SIZE // CHUNK_SIZE)
        assert streamed < BOUND, f"the client held {streamed} bytes at once"

        with traced() as peak:
            landed = sb.files.download("/workspace/big.bin", tmp_path)
            downloaded = peak()
        assert landed == tmp_path / "big.bin" and sha256_of(landed) == digest
        assert downloaded < BOUND, f"the client held {downloaded} bytes at once"
        assert sb.files.download("big.bin", tmp_path / "again.bin") == tmp_path / "again.bin"
        assert sorted(p.name for p in tmp_path.iterdir()) == ["again.bin", "big.bin"]  # no part


def test_a_refused_stream_raises_its_typed_error_before_any_byte(
    up: Up, connection: dict[str, str], tmp_path: Path
) -> None:
    with Sandbox.create(image=IMAGE, name=up.name("sdk-refused")) as sb:
        sb.files.write("dir/kept.txt", "kept")
        refusals: list[tuple[str, type[ss.SandstreamError]]] = [
            ("nothing-here", ss.NotFoundError),
            ("dir", ss.InvalidArgumentError),  # a directory: no file's bytes to stream
        ]
        for path, kind in refusals:
            with pytest.raises(kind), sb.files.read_stream(path):
                pytest.fail("the block runs only once the API answered 200")
            with pytest.raises(kind):
                sb.files.download(path, tmp_path / "out")
        with pytest.raises(ValueError, match="chunk_size"), sb.files.read_stream("x", chunk_size=0):
            pytest.fail("refused before any request")
        sb.stop()
        with pytest.raises(ss.NotReadyError, match="Stopped"), sb.files.read_stream("dir/kept.txt"):
            pytest.fail("the block runs only once the API answered 200")
        with pytest.raises(ss.NotReadyError, match="Stopped"):
            sb.files.download("dir/kept.txt", tmp_path)
    assert list(tmp_path.iterdir()) == []  # neither a file nor a part


async def test_a_stream_wakes_a_suspended_sandbox_and_leaving_early_reads_no_more(
    up: Up, connection: dict[str, str], tmp_path: Path
) -> None:
    async with await AsyncSandbox.create(image=IMAGE, name=up.name("sdk-astream")) as sb:
        made = await sb.commands.run(MAKE_BIG, cwd="/workspace", timeout=120)
        digest = made.stdout.split()[0]
        await sb.pause()
        left = await AsyncSandbox.connect(sb.name, auto_resume=False)
        assert left.info.phase == "Suspended"
        with traced() as peak:
            async with left.files.read_stream("big.bin") as chunks:  # wakes it first
                first = await anext(chunks)
            held = peak()
        assert (len(first), chunks.received, chunks.size) == (CHUNK_SIZE, CHUNK_SIZE, SIZE)
        assert held < BOUND, f"the client held {held} bytes for its first chunk"
        assert (await left.get_info()).phase == "Ready"
        # The connection left mid-body was closed, not reused: the next calls are whole.
        with traced() as peak:
            landed = await left.files.download("big.bin", tmp_path / "big.copy")
            downloaded = peak()
        assert sha256_of(landed) == digest and downloaded < BOUND, downloaded
        assert await left.files.read("big.bin", format="bytes") == landed.read_bytes()
        await left.close()


def test_a_stream_broken_off_raises_instead_of_ending_short(
    up: Up, connection: dict[str, str]
) -> None:
    """The API breaks a download off once its token lapses (it cannot send a status once the
    body began): the SDK raises UnavailableError naming what arrived, never a short file."""
    with Sandbox.create(image=IMAGE, name=up.name("sdk-lapse")) as sb:
        sb.commands.run(MAKE_BIG, cwd="/workspace", timeout=120)
        reader = up.name("sdk-reader")
        made = subprocess.run(
            [SANDSTREAM, "token", "create", reader, "--scope", "sandbox:read",
             "--scope", "files:read"],
            env=up.env, capture_output=True, text=True, timeout=60,
        )  # fmt: skip
        assert made.returncode == 0, made.stderr
        limited = Sandbox.connect(sb.name, token=made.stdout.strip())
        with limited.files.read_stream("big.bin") as chunks:
            next(chunks)
            revoked = subprocess.run([SANDSTREAM, "token", "revoke", reader], env=up.env,
                                     capture_output=True, text=True, timeout=60)  # fmt: skip
            assert revoked.returncode == 0, revoked.stderr
            with pytest.raises(ss.UnavailableError, match="broke off after") as broken:
                for _ in chunks:
                    pass
        assert chunks.received < SIZE and f"of {SIZE} bytes" in broken.value.message
        limited.close()


def peak_rss_of(argv: list[str], env: dict[str, str]) -> int:
    """The peak resident memory (bytes) of one process run to its end: its own, from wait4."""
    process = subprocess.Popen(argv, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    _, status, usage = os.wait4(process.pid, 0)
    process.returncode = os.waitstatus_to_exitcode(status)
    out, err = process.communicate()
    assert process.returncode == 0, (argv, out, err)
    return usage.ru_maxrss * 1024  # Linux: KiB


def test_the_cli_copies_a_large_file_out_in_the_memory_of_a_small_one(
    up: Up, connection: dict[str, str], tmp_path: Path
) -> None:
    with Sandbox.create(image=IMAGE, name=up.name("sdk-cp")) as sb:
        digest = sb.commands.run(MAKE_BIG, cwd="/workspace", timeout=120).stdout.split()[0]
        sb.files.write("small.txt", "small")
        env = {**up.env, **connection}
        small = peak_rss_of([SANDSTREAM, "sandbox", "cp", f"{sb.name}:small.txt",
                             str(tmp_path)], env)  # fmt: skip
        large = peak_rss_of([SANDSTREAM, "sandbox", "cp", f"{sb.name}:big.bin",
                             str(tmp_path)], env)  # fmt: skip
    assert sha256_of(tmp_path / "big.bin") == digest
    assert large - small < BOUND, f"{large - small} bytes more for the large file"
