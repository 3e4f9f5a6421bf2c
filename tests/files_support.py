"""One API over the Podman driver with a Ready sandbox, for the files tests (a module's tests
share it: launching a sandbox is the slow part)."""

from __future__ import annotations

import io
import tarfile
from collections.abc import AsyncIterator, Iterable
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Any

import apikit
from apikit import Api, create_body, unique

from drivers.podman import PodmanDriver
from services.common.settings import load_settings

FILES = "sst_test-files"  # files:read and files:write only
FILES_READER = "sst_test-files-reader"


def tokens() -> Any:
    from services.common.tokens import FILES_READ, FILES_WRITE, SCOPES, TokenStore

    return TokenStore.of(
        admin=(apikit.ADMIN, *SCOPES),
        reader=(apikit.READER, "sandbox:read"),
        writer=(apikit.WRITER, "sandbox:write"),
        files=(FILES, FILES_READ, FILES_WRITE),
        files_reader=(FILES_READER, FILES_READ),
    )


@dataclass
class Sandbox:
    api: Api
    name: str

    def url(self, tail: str = "") -> str:
        return f"/v1/sandboxes/{self.name}/files{tail}"


@asynccontextmanager
async def files_api(
    token_store: Any = None, admin: str = apikit.ADMIN, **settings_update: Any
) -> AsyncIterator[Sandbox]:
    """An API (Podman driver) with one Ready sandbox (a sleeping busybox, read-only root);
    ``token_store``: its tokens instead of this module's, ``admin`` the value of its admin's."""
    settings = load_settings()
    driver = PodmanDriver(settings.podman_url, stop_timeout=1)
    try:
        async with apikit.running_api(
            driver, settings_update=settings_update or None, token_store=token_store or tokens()
        ) as api:
            name = unique("files")
            body = create_body(name, command=["sleep", "3600"])
            body["spec"]["image"] = api.env.settings.sandbox_image
            async with api.client(admin) as c:
                r = await c.post("/v1/sandboxes", params={"wait": 30}, json=body)
                assert r.status_code == 201, r.text
            await api.wait_phase(name, "Ready")
            try:
                yield Sandbox(api, name)
            finally:
                async with api.client(admin) as c:
                    await c.delete(f"/v1/sandboxes/{name}", params={"wait": 30})
    finally:
        await driver.close()


def tar_of(members: Iterable[tuple[str, str, str]]) -> bytes:
    """A tar of (name, kind, content-or-link-target) members: kind file, dir, symlink,
    hardlink, fifo."""
    out = io.BytesIO()
    with tarfile.open(fileobj=out, mode="w", format=tarfile.PAX_FORMAT) as archive:
        for name, kind, value in members:
            info = tarfile.TarInfo(name)
            info.mode = 0o755 if kind == "dir" else 0o644
            if kind == "file":
                data = value.encode()
                info.size = len(data)
                archive.addfile(info, io.BytesIO(data))
                continue
            info.type = {
                "dir": tarfile.DIRTYPE,
                "symlink": tarfile.SYMTYPE,
                "hardlink": tarfile.LNKTYPE,
                "fifo": tarfile.FIFOTYPE,
                "chr": tarfile.CHRTYPE,
            }[kind]
            info.linkname = value
            archive.addfile(info)
    return out.getvalue()


def members_of(data: bytes) -> dict[str, bytes | str | None]:
    """A tar's members: a file's bytes, a symlink's target, None for a directory."""
    found: dict[str, bytes | str | None] = {}
    with tarfile.open(fileobj=io.BytesIO(data), mode="r") as archive:
        for info in archive:
            if info.isreg():
                extracted = archive.extractfile(info)
                assert extracted is not None
                found[info.name] = extracted.read()
            elif info.issym():
                found[info.name] = info.linkname
            else:
                found[info.name] = None
    return found
