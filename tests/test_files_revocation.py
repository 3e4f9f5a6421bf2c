"""A file transfer under way ends when its token lapses (real Kafka, PostgreSQL and Podman):
revoked or stripped of its scope, a download is broken off (the client sees an incomplete
body, never a short one that looks whole) and an upload is refused with 401/403 naming why,
leaving no file and no part. Before, a revoked token's transfer ran to its end (a gigabyte
upload, a download of any size), while watches and followed logs already ended."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from pathlib import Path

import httpx
import pytest
import pytest_asyncio
from files_support import Sandbox, files_api
from harness import eventually
from podman import PodmanClient
from test_api_files_hostile import run_in
from test_watch_revocation import drop_scope

from services.common import tokens as auth
from services.common.settings import load_settings

SIZE = 64 * 1024 * 1024  # bytes of the downloaded file: far more than the sockets buffer
LIMIT = 256 * 1024  # files_max_upload_bytes here


class Tokens:
    def __init__(self, path: Path) -> None:
        self.path = path
        self.admin = auth.add_token(path, "admin", auth.SCOPES)

    def new(self, name: str) -> str:
        return auth.add_token(self.path, name, (auth.FILES_READ, auth.FILES_WRITE))


@pytest.fixture(scope="module")
def tokens(tmp_path_factory: pytest.TempPathFactory) -> Tokens:
    return Tokens(tmp_path_factory.mktemp("tokens") / "tokens.json")


@pytest_asyncio.fixture(scope="module", loop_scope="session")
async def box(tokens: Tokens) -> AsyncIterator[Sandbox]:
    store = auth.TokenStore.from_file(tokens.path)
    async with files_api(store, tokens.admin, files_max_upload_bytes=LIMIT) as sandbox:
        yield sandbox


@pytest.fixture(scope="module")
def podman() -> PodmanClient:
    return PodmanClient(base_url=load_settings().podman_url)


LAPSES = {
    "revoked": lambda path, name: auth.revoke_token(path, name),
    "read dropped": lambda path, name: drop_scope(path, name, auth.FILES_READ),
}


@pytest.mark.parametrize("form", ["raw", "tar"])
async def test_a_download_breaks_off_once_its_token_is_revoked(
    box: Sandbox, tokens: Tokens, podman: PodmanClient, form: str
) -> None:
    await run_in(podman, box, "dd", "if=/dev/zero", "of=/workspace/big", "bs=1048576",
                 f"count={SIZE // 1048576}")  # fmt: skip
    for lapse, change in sorted(LAPSES.items()):
        name = f"dl-{form}-{lapse.replace(' ', '-')}"
        received = 0
        async with box.api.client(tokens.new(name)) as c:
            params = {"path": "big", "format": form}
            async with c.stream("GET", box.url("/content"), params=params) as r:
                assert r.status_code == 200
                chunks = r.aiter_raw()
                received += len(await anext(chunks))
                change(tokens.path, name)
                with pytest.raises(httpx.RemoteProtocolError):  # incomplete: broken off
                    async with asyncio.timeout(30):
                        async for chunk in chunks:
                            received += len(chunk)
        assert received < SIZE, (lapse, received)


async def test_an_upload_is_refused_once_its_token_is_revoked_and_leaves_nothing(
    box: Sandbox, tokens: Tokens
) -> None:
    host, port = box.api.url.removeprefix("http://").split(":")
    for lapse, (change, status, code) in {
        "revoked": (LAPSES["revoked"], 401, "token 'up-revoked' was revoked at "),
        "write dropped": (
            lambda path, name: drop_scope(path, name, auth.FILES_WRITE),
            403,
            "token 'up-write-dropped' lacks the scope files:write",
        ),
    }.items():
        name = f"up-{lapse.replace(' ', '-')}"
        value = tokens.new(name)
        folder = f"/workspace/{name}"
        reader, writer = await asyncio.open_connection(host, int(port))
        head = (
            f"PUT {box.url('/content')}?path={folder}/file.bin HTTP/1.1\r\nHost: x\r\n"
            f"Authorization: Bearer {value}\r\nContent-Length: {LIMIT}\r\n\r\n"
        )
        writer.write(head.encode() + b"z" * (LIMIT // 2))  # half the body: then it waits
        await writer.drain()
        async with box.api.client(tokens.admin) as c:

            async def parts(folder: str = folder) -> set[str]:  # the part beside the target
                r = await c.get(box.url(), params={"path": folder})
                return {e["name"] for e in r.json().get("entries", [])}

            await eventually(parts, bool, what="the upload to begin")
            change(tokens.path, name)
            async with asyncio.timeout(30):
                answer = await reader.read(65536)
            writer.close()
            assert answer.startswith(f"HTTP/1.1 {status} ".encode()), answer
            assert f"upload ended: {code}".encode() in answer, answer
            await eventually(parts, lambda left: left == set(), what="the part to be removed")
            r = await c.get(box.url("/stat"), params={"path": f"{folder}/file.bin"})
            assert r.status_code == 404
