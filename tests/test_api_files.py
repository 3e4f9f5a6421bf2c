"""A sandbox's files through the HTTP API, on the real Podman service: upload, download (a
file, a tar), list, stat, mkdir, remove, move, and the answers for what cannot be done.

Fails (never skips) when the Podman service or the sandbox image is missing (conftest.py).
"""

from __future__ import annotations

import asyncio
import os
from collections.abc import AsyncIterator

import pytest
from files_support import FILES, Sandbox, files_api, members_of, tar_of


@pytest.fixture(scope="module")
async def box() -> AsyncIterator[Sandbox]:
    async with files_api() as sandbox:
        yield sandbox


async def test_a_file_uploaded_is_downloaded_byte_for_byte_with_its_entry(box: Sandbox) -> None:
    data = bytes(range(256)) * 4096 + b"tail"  # 1 MiB and a bit, every byte value
    async with box.api.client(FILES) as c:
        r = await c.put(box.url("/content"), params={"path": "up/deep/blob.bin"}, content=data)
        assert r.status_code == 201, r.text
        entry = r.json()
        assert entry["path"] == "/workspace/up/deep/blob.bin"
        assert (entry["name"], entry["type"], entry["size"]) == ("blob.bin", "file", len(data))
        r = await c.get(box.url("/content"), params={"path": "/workspace/up/deep/blob.bin"})
        assert r.status_code == 200, r.text
        assert r.headers["content-type"] == "application/octet-stream"
        assert r.headers["content-length"] == str(len(data))
        assert r.content == data
        r = await c.put(box.url("/content"), params={"path": "up/deep/blob.bin"}, content=b"new")
        assert r.status_code == 200, r.text  # replaced
        r = await c.get(box.url("/content"), params={"path": "up/deep/blob.bin"})
        assert r.content == b"new"
        r = await c.get(box.url(), params={"path": "up/deep"})
        assert r.status_code == 200, r.text
        names = [e["name"] for e in r.json()["entries"]]
        assert names == ["blob.bin"]  # no temporary file left beside it


async def test_a_directory_goes_both_ways_as_a_tar(box: Sandbox) -> None:
    archive = tar_of(
        [
            ("tree", "dir", ""),
            ("tree/a.txt", "file", "alpha"),
            ("tree/sub", "dir", ""),
            ("tree/sub/b.txt", "file", "beta"),
            ("tree/link", "symlink", "a.txt"),
        ]
    )
    async with box.api.client(FILES) as c:
        r = await c.put(
            box.url("/content"), params={"path": "/workspace/t1", "format": "tar"}, content=archive
        )
        assert r.status_code == 201, r.text
        assert r.json()["type"] == "dir"
        r = await c.get(box.url("/content"), params={"path": "t1/tree", "format": "tar"})
        assert r.status_code == 200, r.text
        assert r.headers["content-type"] == "application/x-tar"
        got = members_of(r.content)
        assert got["tree/a.txt"] == b"alpha"
        assert got["tree/sub/b.txt"] == b"beta"
        assert got["tree/link"] == "a.txt"
        r = await c.get(box.url("/content"), params={"path": "t1/tree"})
        assert r.status_code == 400, r.text
        assert "format=tar" in r.json()["message"]


async def test_list_stat_mkdir_move_and_remove(box: Sandbox) -> None:
    async with box.api.client(FILES) as c:
        r = await c.post(box.url("/mkdir"), json={"path": "ops/x/y", "parents": True})
        assert r.status_code == 201, r.text
        assert (r.json()["path"], r.json()["type"]) == ("/workspace/ops/x/y", "dir")
        r = await c.post(box.url("/mkdir"), json={"path": "ops/x", "parents": False})
        assert (r.status_code, r.json()["code"]) == (409, "ALREADY_EXISTS"), r.text
        await c.put(box.url("/content"), params={"path": "ops/f.txt"}, content=b"12345")
        r = await c.get(box.url(), params={"path": "ops"})
        entries = {e["name"]: e for e in r.json()["entries"]}
        assert set(entries) == {"f.txt", "x"}
        assert (entries["f.txt"]["type"], entries["f.txt"]["size"]) == ("file", 5)
        assert entries["x"]["type"] == "dir"
        assert r.json()["truncated"] is False
        r = await c.post(box.url("/move"), json={"source": "ops/f.txt", "destination": "ops/g"})
        assert r.status_code == 200, r.text
        assert r.json()["name"] == "g"
        r = await c.get(box.url("/stat"), params={"path": "ops/f.txt"})
        assert (r.status_code, r.json()["code"]) == (404, "NOT_FOUND"), r.text
        assert "/workspace/ops/f.txt" in r.json()["message"]
        r = await c.delete(box.url(), params={"path": "ops/x"})
        # The path refuses it, not the sandbox's phase: a code no wait cures, never the
        # FAILED_PRECONDITION of a sandbox not Ready.
        assert (r.status_code, r.json()["code"]) == (409, "PATH_CONFLICT"), r.text
        assert "not empty" in r.json()["message"].lower()
        r = await c.delete(box.url(), params={"path": "ops/x", "recursive": True})
        assert r.status_code == 204, r.text
        r = await c.delete(box.url(), params={"path": "ops/g"})
        assert r.status_code == 204, r.text
        r = await c.get(box.url(), params={"path": "ops"})
        assert r.json()["entries"] == []


def resident_bytes() -> int:
    with open("/proc/self/statm") as statm:
        return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


async def test_a_large_upload_is_streamed_not_held(box: Sandbox) -> None:
    """128 MiB go through the API (in this process) while its resident memory grows by far
    less than that: the body is streamed on to Podman, never held."""
    size, piece = 128 * 1024 * 1024, bytes(64 * 1024)
    start = resident_bytes()
    peak = start
    sending = True

    async def body() -> AsyncIterator[bytes]:
        for _ in range(size // len(piece)):
            yield piece

    async def sample() -> None:
        nonlocal peak
        while sending:
            peak = max(peak, resident_bytes())
            await asyncio.sleep(0.05)  # a sampling interval, not a synchronisation

    sampler = asyncio.create_task(sample())
    try:
        async with box.api.client(FILES) as c:
            r = await c.put(box.url("/content"), params={"path": "large.bin"}, content=body(),
                            headers={"Content-Length": str(size)})  # fmt: skip
            assert r.status_code == 201, r.text
            assert r.json()["size"] == size
            await c.delete(box.url(), params={"path": "large.bin"})
    finally:
        sending = False
        await sampler
    assert peak - start < 48 * 1024 * 1024, (start, peak)
