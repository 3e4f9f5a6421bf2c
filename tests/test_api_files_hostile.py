"""The files routes against hostile callers, on the real Podman service: scopes, path tricks
(``..``, symlinks out of the sandbox or at /proc), hostile tar members, the read-only root,
size limits, slow readers, clients that leave mid-upload, a sandbox deleted mid-download.

Fails (never skips) when the Podman service or the sandbox image is missing (conftest.py).
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import apikit
import httpx
import pytest
from files_support import FILES, FILES_READER, Sandbox, files_api, members_of, tar_of
from harness import eventually
from podman import PodmanClient

from drivers.files import FilesError
from drivers.podman_objects import container_name

LIMIT = 256 * 1024  # files_max_upload_bytes of this module's API
LIST_LIMIT = 3


@pytest.fixture(scope="module")
async def box() -> AsyncIterator[Sandbox]:
    limits = {"files_max_upload_bytes": LIMIT, "files_list_max_entries": LIST_LIMIT}
    async with files_api(**limits) as sandbox:
        yield sandbox


async def run_in(podman: PodmanClient, box: Sandbox, *command: str) -> str:
    """Run ``command`` in the sandbox behind the API's back; its output."""

    def run() -> str:
        container = podman.containers.get(container_name(box.name, 1))
        code, out = container.exec_run(list(command))
        assert code == 0, out
        return out.decode() if isinstance(out, bytes) else str(out)

    return await asyncio.to_thread(run)


async def names_in(c: httpx.AsyncClient, box: Sandbox, path: str) -> set[str]:
    r = await c.get(box.url(), params={"path": path})
    assert r.status_code == 200, r.text
    assert not r.json()["truncated"]
    return {e["name"] for e in r.json()["entries"]}


# --- scopes -------------------------------------------------------------------------------


async def test_sandbox_scopes_give_no_file_access_and_files_read_cannot_write(
    box: Sandbox,
) -> None:
    for token in (apikit.READER, apikit.WRITER):
        async with box.api.client(token) as c:
            r = await c.get(box.url("/content"), params={"path": "x"})
            assert (r.status_code, r.json()["code"]) == (403, "PERMISSION_DENIED")
            assert "files:read" in r.json()["message"]
            r = await c.put(box.url("/content"), params={"path": "x"}, content=b"x")
            assert r.status_code == 403 and "files:write" in r.json()["message"]
    async with box.api.client(FILES_READER) as c:
        assert (await c.get(box.url(), params={"path": "/"})).status_code == 200
        for r in (
            await c.put(box.url("/content"), params={"path": "x"}, content=b"x"),
            await c.post(box.url("/mkdir"), json={"path": "d"}),
            await c.delete(box.url(), params={"path": "x"}),
            await c.post(box.url("/move"), json={"source": "a", "destination": "b"}),
        ):
            assert r.status_code == 403 and "files:write" in r.json()["message"], r.text
    async with box.api.client(FILES) as c:  # files scopes read no sandbox
        assert (await c.get(f"/v1/sandboxes/{box.name}")).status_code == 403
    async with box.api.client(None) as c:
        assert (await c.get(box.url(), params={"path": "/"})).status_code == 401


# --- paths --------------------------------------------------------------------------------


async def test_dot_dot_resolves_by_name_inside_the_sandbox_and_a_nul_is_refused(
    box: Sandbox,
) -> None:
    async with box.api.client(FILES) as c:
        r = await c.get(box.url("/content"), params={"path": "../../../../etc/hostname"})
        assert r.status_code == 200, r.text
        assert r.content.strip() == box.name.encode()  # the sandbox's /etc, not the host's
        r = await c.get(box.url("/stat"), params={"path": "a\0b"})
        assert (r.status_code, r.json()["code"]) == (422, "INVALID_ARGUMENT")
        assert "'path'" in r.json()["message"]


async def test_symlinks_pointing_out_resolve_inside_the_sandbox_and_proc_gives_nothing(
    box: Sandbox, podman: PodmanClient
) -> None:
    links = (
        "mkdir -p /workspace/sl/d && cd /workspace/sl && touch d/one && ln -s d dl"
        " && ln -s / root && ln -s /proc/1 init && ln -s d/one fl"
    )
    await run_in(podman, box, "sh", "-c", links)
    identity = (await run_in(podman, box, "sh", "-c", "echo $SANDSTREAM_IDENTITY")).strip()
    assert identity
    async with box.api.client(FILES) as c:
        r = await c.get(box.url("/content"), params={"path": "sl/root/etc/hostname"})
        assert r.status_code == 200 and r.content.strip() == box.name.encode(), r.text
        for path in ("/proc/1/environ", "sl/init/environ"):
            r = await c.get(box.url("/content"), params={"path": path})
            # Podman's archive has no member for a file of /proc, or an empty one (size 0).
            assert r.status_code in (200, 400), r.text
            assert identity.encode() not in r.content
            assert r.status_code == 400 or r.content == b""
            r = await c.get(box.url("/content"), params={"path": path, "format": "tar"})
            assert identity.encode() not in r.content
        # Writing through a symlink to / stays in the sandbox: the read-only root refuses it.
        r = await c.put(box.url("/content"), params={"path": "sl/root/etc/evil"}, content=b"x")
        assert (r.status_code, r.json()["code"]) == (409, "PATH_CONFLICT"), r.text
        # A listing follows the symlink given as the directory; stat and remove take the link.
        assert await names_in(c, box, "sl/dl") == {"one"}
        r = await c.get(box.url("/stat"), params={"path": "sl/root"})
        assert (r.json()["type"], r.json()["name"]) == ("symlink", "root"), r.text
        r = await c.delete(box.url(), params={"path": "sl/root"})
        assert r.status_code == 204, r.text
        assert (await c.get(box.url("/stat"), params={"path": "sl/root"})).status_code == 404
        assert (await c.get(box.url("/stat"), params={"path": "/etc"})).json()["type"] == "dir"
        # A raw upload to a symlink replaces the link (renamed over it), never writing through
        # it; to a symlink to a directory it is refused as for a directory.
        r = await c.put(box.url("/content"), params={"path": "sl/fl"}, content=b"file now")
        assert r.status_code == 200 and r.json()["type"] == "file", r.text
        r = await c.get(box.url("/content"), params={"path": "sl/d/one"})
        assert (r.status_code, r.content) == (200, b""), r.text
        r = await c.put(box.url("/content"), params={"path": "sl/dl"}, content=b"x")
        assert (r.status_code, r.json()["code"]) == (400, "INVALID_ARGUMENT"), r.text
        assert await names_in(c, box, "sl/d") == {"one"}  # and no temporary file left
        assert (await c.get(box.url("/stat"), params={"path": "sl/dl"})).json()["type"] == "symlink"


async def test_the_read_only_root_answers_a_clear_409(box: Sandbox) -> None:
    async with box.api.client(FILES) as c:
        for r in (
            await c.put(box.url("/content"), params={"path": "/etc/motd"}, content=b"x"),
            await c.put(
                box.url("/content"),
                params={"path": "/opt/new", "format": "tar"},
                content=tar_of([("a", "file", "x")]),
            ),
            await c.post(box.url("/mkdir"), json={"path": "/srv/x"}),
            await c.delete(box.url(), params={"path": "/etc/passwd"}),
        ):
            assert (r.status_code, r.json()["code"]) == (409, "PATH_CONFLICT"), r.text
            assert "read-only file system" in r.json()["message"].lower()
            assert ".sandstream-upload" not in r.json()["message"]  # the path asked, not ours
        r = await c.put(box.url("/content"), params={"path": "/tmp/ok"}, content=b"tmpfs")
        assert r.status_code == 201, r.text


async def test_the_root_and_the_workspace_cannot_be_removed_or_moved(box: Sandbox) -> None:
    async with box.api.client(FILES) as c:
        for params in ({"path": "/", "recursive": True}, {"path": "/workspace/."}):
            r = await c.delete(box.url(), params=params)
            assert (r.status_code, r.json()["code"]) == (400, "INVALID_ARGUMENT"), r.text
        r = await c.post(box.url("/move"), json={"source": "/workspace", "destination": "/w"})
        assert r.status_code == 400 and "'source'" in r.json()["message"], r.text


# --- tar members --------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("member", "said"),
    [
        (("../escaped", "file", "x"), "'..'"),
        (("/tmp/escaped", "file", "x"), "absolute"),
        (("ok/../../escaped", "file", "x"), "'..'"),
        (("lnk", "symlink", "/tmp"), "absolute"),
        (("lnk", "symlink", "../../tmp"), "out of the directory"),
        (("hl", "hardlink", "/etc/passwd"), "absolute"),
        (("hl", "hardlink", "../x"), "out of the directory"),
        (("fifo", "fifo", ""), "not a file"),
        (("null", "chr", ""), "not a file"),
    ],
)
async def test_a_tar_member_out_of_the_directory_or_a_device_is_refused_naming_it(
    box: Sandbox, member: tuple[str, str, str], said: str
) -> None:
    """Podman itself would move '..' and absolute members inside, follow a symlink member out
    of the directory for the members after it, and answer 500 for a hard link out of it."""
    archive = tar_of([("first.txt", "file", "fine"), member, ("lnk/after", "file", "x")])
    target = f"tars/{member[1]}-{abs(hash(member)) % 10_000}"
    async with box.api.client(FILES) as c:
        r = await c.put(
            box.url("/content"), params={"path": target, "format": "tar"}, content=archive
        )
        assert (r.status_code, r.json()["code"]) == (400, "INVALID_ARGUMENT"), r.text
        assert repr(member[0]) in r.json()["message"] and said in r.json()["message"]
        for outside in ("/tmp/escaped", "/tmp/after", "/workspace/escaped"):
            r = await c.get(box.url("/stat"), params={"path": outside})
            assert r.status_code == 404, r.text


@pytest.mark.parametrize(
    "members",
    [
        [("a", "symlink", "."), ("a/b", "symlink", ".."), ("a/b/escaped", "file", "x")],
        [
            ("d/up", "symlink", ".."),
            ("d/up/up2", "symlink", ".."),
            ("d/up/up2/escaped", "file", "x"),
        ],
    ],
)
async def test_a_member_through_a_symlink_of_the_archive_is_refused_naming_it(
    box: Sandbox, members: list[tuple[str, str, str]]
) -> None:
    """Each member is inside by name, but Podman follows the links already extracted: the
    last would land beside the directory, not in it."""
    folder = f"chain-{abs(hash(tuple(members))) % 10_000}"
    async with box.api.client(FILES) as c:
        r = await c.post(box.url("/mkdir"), json={"path": f"{folder}/in", "parents": True})
        assert r.status_code == 201, r.text
        r = await c.put(box.url("/content"), params={"path": f"{folder}/in", "format": "tar"},
                        content=tar_of(members))  # fmt: skip
        assert r.status_code == 400 and r.json()["code"] == "INVALID_ARGUMENT", r.text
        assert f"{members[1][0]!r}: its path passes through" in r.json()["message"], r.text
        assert await names_in(c, box, folder) == {"in"}


async def test_a_body_that_is_no_tar_is_refused(box: Sandbox) -> None:
    async with box.api.client(FILES) as c:
        r = await c.put(
            box.url("/content"), params={"path": "notar", "format": "tar"}, content=b"x" * 2048
        )
        assert (r.status_code, r.json()["code"]) == (400, "INVALID_ARGUMENT"), r.text


# --- sizes --------------------------------------------------------------------------------


async def test_an_upload_above_the_limit_is_413_naming_the_setting_and_leaves_nothing(
    box: Sandbox,
) -> None:
    async with box.api.client(FILES) as c:
        r = await c.put(box.url("/content"), params={"path": "big/declared"},
                        content=b"x" * (LIMIT + 1))  # fmt: skip
        assert (r.status_code, r.json()["code"]) == (413, "PAYLOAD_TOO_LARGE"), r.text
        assert "files_max_upload_bytes" in r.json()["message"]

        async def chunked() -> AsyncIterator[bytes]:  # no Content-Length: counted as it comes
            archive = tar_of([("huge.bin", "file", "y" * (2 * LIMIT))])
            for at in range(0, len(archive), 16 * 1024):
                yield archive[at : at + 16 * 1024]

        r = await c.put(
            box.url("/content"), params={"path": "big", "format": "tar"}, content=chunked()
        )
        assert (r.status_code, r.json()["code"]) == (413, "PAYLOAD_TOO_LARGE"), r.text

        async def raw() -> AsyncIterator[bytes]:
            yield b"no length"

        r = await c.put(box.url("/content"), params={"path": "big/raw"}, content=raw())
        assert (r.status_code, r.json()["code"]) == (411, "LENGTH_REQUIRED"), r.text
        r = await c.get(box.url("/stat"), params={"path": "big/declared"})
        assert r.status_code == 404
        r = await c.get(box.url("/stat"), params={"path": "big/raw"})
        assert r.status_code == 404


async def test_a_listing_answers_at_most_the_limit_and_says_so(box: Sandbox) -> None:
    async with box.api.client(FILES) as c:
        for i in range(LIST_LIMIT + 2):
            await c.post(box.url("/mkdir"), json={"path": f"many/d{i}"})
        r = await c.get(box.url(), params={"path": "many"})
        assert r.status_code == 200, r.text
        assert len(r.json()["entries"]) == LIST_LIMIT and r.json()["truncated"] is True


async def test_names_with_spaces_newlines_and_non_ascii_are_listed_whole(
    box: Sandbox, podman: PodmanClient
) -> None:
    make = "mkdir -p /workspace/odd && cd /workspace/odd && touch 'a b' \"$(printf 'l1\\nl2')\" 'é'"
    await run_in(podman, box, "sh", "-c", make)
    async with box.api.client(FILES) as c:
        assert await names_in(c, box, "odd") == {"a b", "l1\nl2", "é"}


# --- streams ------------------------------------------------------------------------------


async def test_a_client_that_leaves_mid_upload_leaves_no_file_and_no_part(
    box: Sandbox,
) -> None:
    host, port = box.api.url.removeprefix("http://").split(":")
    reader, writer = await asyncio.open_connection(host, int(port))
    head = (
        f"PUT {box.url('/content')}?path=left/file.bin HTTP/1.1\r\nHost: x\r\n"
        f"Authorization: Bearer {FILES}\r\nContent-Length: {LIMIT}\r\n\r\n"
    )
    writer.write(head.encode() + b"z" * (LIMIT // 2))
    await writer.drain()
    async with box.api.client(FILES) as c:
        # The upload is under way once its temporary file exists beside the target.
        async def started() -> set[str]:
            r = await c.get(box.url(), params={"path": "left"})
            return {e["name"] for e in r.json().get("entries", [])}

        await eventually(started, lambda names: any(names), what="the upload to begin")
        writer.close()
        await writer.wait_closed()
        await eventually(started, lambda names: names == set(), what="the part to be removed")
        r = await c.get(box.url("/stat"), params={"path": "left/file.bin"})
        assert r.status_code == 404
    reader.feed_eof()


async def test_a_slow_reader_holds_the_download_back(box: Sandbox, podman: PodmanClient) -> None:
    """The API reads from Podman only as fast as its client reads: a 64 MiB download whose
    client stops reading leaves most of the file unread (never buffered in the API)."""
    await run_in(podman, box, "dd", "if=/dev/zero", "of=/workspace/huge", "bs=1048576",
                 "count=64")  # fmt: skip
    source = box.api.app.state.api.files
    read = 0
    original = source.read_tar

    async def counting(key: str, generation: int, path: str) -> AsyncIterator[bytes]:
        nonlocal read
        async for chunk in original(key, generation, path):
            read += len(chunk)
            yield chunk

    source.read_tar = counting
    try:
        async with (
            box.api.client(FILES) as c,
            c.stream("GET", box.url("/content"), params={"path": "huge"}) as r,
        ):
            assert r.status_code == 200
            chunks = r.aiter_raw()
            first = await anext(chunks)
            assert first
            # The server fills the socket buffers, then waits: its count stops growing.
            seen: list[int] = []

            def settled(now: int) -> bool:
                seen.append(now)
                return len(seen) > 5 and len(set(seen[-5:])) == 1

            await eventually(lambda: read, settled, interval=0.1, what="the read-ahead to stop")
            assert read < 24 * 1024 * 1024, read
            rest = sum([len(chunk) async for chunk in chunks])
            assert len(first) + rest == 64 * 1024 * 1024
    finally:
        del source.read_tar


async def test_a_sandbox_deleted_mid_download_gives_the_whole_file_or_breaks_off(
    podman: PodmanClient,
) -> None:
    """Podman keeps streaming what it had opened, or the answer breaks off: never a short body
    that looks whole."""
    async with files_api() as box:
        await run_in(podman, box, "dd", "if=/dev/zero", "of=/workspace/big", "bs=1048576",
                     "count=64")  # fmt: skip
        got = 0
        async with box.api.client(FILES) as c:
            try:
                async with c.stream("GET", box.url("/content"), params={"path": "big"}) as r:
                    assert r.status_code == 200
                    chunks = r.aiter_raw()
                    got += len(await anext(chunks))
                    container = podman.containers.get(container_name(box.name, 1))
                    await asyncio.to_thread(container.remove, force=True)
                    async for chunk in chunks:
                        got += len(chunk)
            except httpx.RemoteProtocolError:
                assert got < 64 * 1024 * 1024
            else:
                assert got == 64 * 1024 * 1024


@pytest.mark.parametrize("format", ["raw", "tar"])
async def test_a_runtime_stream_that_breaks_off_breaks_the_answer_off(
    box: Sandbox, format: str
) -> None:
    """The runtime's archive ends early (its sandbox went away): the client sees a broken
    answer (a raw download's Content-Length unmet; a tar's chunked body never ended)."""
    archive = tar_of([("whole.bin", "file", "w" * 100_000)])
    source = box.api.app.state.api.files

    async def cut(key: str, generation: int, path: str) -> AsyncIterator[bytes]:
        yield archive[:50_000]
        raise FilesError("unavailable", "Podman's API: RemoteProtocolError: peer closed")

    source.read_tar = cut
    try:
        async with box.api.client(FILES) as c:
            with pytest.raises(httpx.RemoteProtocolError):
                await c.get(box.url("/content"), params={"path": "x", "format": format})
    finally:
        del source.read_tar


@pytest.mark.parametrize(
    ("first", "failure"),
    [
        (b"\0" * 100, FilesError("unavailable", "Podman's API: RemoteProtocolError")),
        (b"not a tar header" * 40, None),
    ],
)
async def test_a_runtime_archive_broken_before_its_first_member_is_503(
    box: Sandbox, first: bytes, failure: FilesError | None
) -> None:
    source = box.api.app.state.api.files

    async def broken(key: str, generation: int, path: str) -> AsyncIterator[bytes]:
        yield first
        if failure is not None:
            raise failure

    source.read_tar = broken
    try:
        async with box.api.client(FILES) as c:
            r = await c.get(box.url("/content"), params={"path": "x"})
            assert (r.status_code, r.json()["code"]) == (503, "UNAVAILABLE"), r.text
    finally:
        del source.read_tar


async def test_an_empty_file_goes_both_ways(box: Sandbox) -> None:
    async with box.api.client(FILES) as c:
        r = await c.put(box.url("/content"), params={"path": "empty"}, content=b"")
        assert r.status_code == 201 and r.json()["size"] == 0, r.text
        r = await c.get(box.url("/content"), params={"path": "empty"})
        assert (r.status_code, r.content) == (200, b""), r.text


async def test_a_stopped_sandbox_answers_409_naming_its_phase() -> None:
    async with files_api() as box, box.api.client(apikit.ADMIN) as c:
        r = await c.post(f"/v1/sandboxes/{box.name}:stop", params={"wait": 30})
        assert r.status_code == 200, r.text
        await box.api.wait_phase(box.name, "Stopped")
        r = await c.get(box.url(), params={"path": "/workspace"})
        assert (r.status_code, r.json()["code"]) == (409, "FAILED_PRECONDITION"), r.text
        assert "Stopped" in r.json()["message"]
        r = await c.get("/v1/sandboxes/no-such-box/files", params={"path": "/"})
        assert r.status_code == 404


async def test_a_tar_download_of_a_tree_holds_every_member(box: Sandbox) -> None:
    archive = tar_of([(f"t/f{i}", "file", str(i) * 1000) for i in range(50)])
    async with box.api.client(FILES) as c:
        r = await c.put(box.url("/content"), params={"path": "tree", "format": "tar"},
                        content=archive)  # fmt: skip
        assert r.status_code == 201, r.text
        r = await c.get(box.url("/content"), params={"path": "tree", "format": "tar"})
        got = members_of(r.content)
        assert all(got[f"tree/t/f{i}"] == (str(i) * 1000).encode() for i in range(50))


async def test_a_slow_writer_holds_no_other_request_back(box: Sandbox) -> None:
    """An upload whose client pauses mid-body waits for it (no timeout cuts it), and the API
    answers other requests meanwhile."""
    archive = tar_of([("slow.txt", "file", "s" * 100_000)])
    paused, resume = asyncio.Event(), asyncio.Event()

    async with box.api.client(FILES) as c, box.api.client(FILES) as other:
        upload = asyncio.create_task(
            c.put(
                box.url("/content"),
                params={"path": "slow", "format": "tar"},
                content=held_body(paused, resume, archive, 30_000),
            )
        )
        await paused.wait()
        r = await other.get(box.url("/stat"), params={"path": "/workspace"})
        assert r.status_code == 200, r.text
        assert not upload.done()
        resume.set()
        r = await upload
        assert r.status_code == 201, r.text
        r = await other.get(box.url("/content"), params={"path": "slow/slow.txt"})
        assert r.content == b"s" * 100_000


async def held_body(
    paused: asyncio.Event,
    resume: asyncio.Event,
    body: bytes = b"a" * 100_000 + b"b" * 100_000,
    at: int = 100_000,
) -> AsyncIterator[bytes]:
    """``body`` held after its first ``at`` bytes: ``paused`` set, until ``resume``."""
    yield body[:at]
    paused.set()
    await resume.wait()
    yield body[at:]


async def test_a_sandbox_deleted_mid_upload_answers_a_4xx_or_503_not_a_500(
    podman: PodmanClient,
) -> None:
    async with files_api() as box:
        paused, resume = asyncio.Event(), asyncio.Event()

        async with box.api.client(FILES) as c:
            upload = asyncio.create_task(
                c.put(
                    box.url("/content"),
                    params={"path": "gone.bin"},
                    content=held_body(paused, resume),
                    headers={"Content-Length": "200000"},
                )
            )
            await paused.wait()
            container = podman.containers.get(container_name(box.name, 1))
            await asyncio.to_thread(container.remove, force=True)
            resume.set()
            r = await upload
            assert r.status_code in (409, 503), r.text
            assert r.json()["code"] in ("FAILED_PRECONDITION", "UNAVAILABLE")


async def test_the_part_an_upload_cut_off_by_a_restart_left_goes_with_the_next_upload(
    podman: PodmanClient,
) -> None:
    """A restart removes the runtime mid-upload, and with it the exec that would remove the
    part: the next upload into the folder (a later generation) removes it, and never the part
    of an upload of its own generation still under way, nor one of a newer generation (a
    runtime killed at once can run its last exec beside its successor's)."""
    async with files_api() as box:
        paused, resume = asyncio.Event(), asyncio.Event()

        async def listed() -> set[str]:
            r = await c.get(box.url(), params={"path": "cut"})
            return {e["name"] for e in r.json().get("entries", [])}

        async with box.api.client(FILES) as c, box.api.client(apikit.ADMIN) as admin:
            sized = {"Content-Length": "200000"}
            put = c.put(box.url("/content"), params={"path": "cut/f.bin"},
                        content=held_body(paused, resume), headers=sized)  # fmt: skip
            upload = asyncio.create_task(put)
            await paused.wait()
            await eventually(listed, lambda names: bool(names), what="the upload to begin")
            r = await admin.post(f"/v1/sandboxes/{box.name}:restart", params={"wait": 30}, json={})
            assert r.status_code == 200 and r.json()["generation"] == 2, r.text
            await box.api.wait_phase(box.name, "Ready")
            resume.set()
            assert (await upload).status_code in (409, 503)
            [part] = await listed()
            assert part.startswith(".sandstream-upload-"), part
            under_way = ".sandstream-upload-g2-0123456789abcdef"  # an upload into generation 2
            newer = ".sandstream-upload-g12-0123456789abcdef"  # g12 is not g1: kept too
            container = podman.containers.get(container_name(box.name, 2))
            for name in (under_way, newer):
                code, out = await asyncio.to_thread(
                    container.exec_run, ["touch", f"/workspace/cut/{name}"]
                )
                assert code == 0, out
            r = await c.put(box.url("/content"), params={"path": "cut/next.txt"}, content=b"next")
            assert r.status_code == 201, r.text
            assert await listed() == {"next.txt", under_way, newer}


async def test_a_declared_length_above_the_limit_is_refused_before_a_byte_is_sent(
    box: Sandbox,
) -> None:
    host, port = box.api.url.removeprefix("http://").split(":")
    reader, writer = await asyncio.open_connection(host, int(port))
    try:
        writer.write(
            f"PUT {box.url('/content')}?path=never HTTP/1.1\r\nHost: x\r\n"
            f"Authorization: Bearer {FILES}\r\nContent-Length: {LIMIT + 1}\r\n\r\n".encode()
        )
        await writer.drain()
        async with asyncio.timeout(30):
            status = await reader.readline()
        assert status.startswith(b"HTTP/1.1 413"), status
    finally:
        writer.close()
        await writer.wait_closed()
