"""One bad file or one failing reconcile never stops the control plane.

A value file that is not UTF-8 is reported with a log line naming it and its stored value
kept (the directory source, as the Kubernetes Secrets source does with such a key). Inside a
real `sandstream up`, the provider-sync controller is a supervised part: a reconcile that
raises (here: its table is away) is reported in /readyz and the controller starts again,
while the API keeps serving.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Hashable
from pathlib import Path
from typing import Any

import httpx
import pytest
from harness import eventually, isolated_env
from upkit import running_up

from services.provider_sync.controller import ProviderSync
from services.provider_sync.sources import Desired, read_directory

NOT_UTF8 = b"\xff\xfe not text"
BROKEN_LOGGED = "keeping the stored value of gh/BROKEN: its value cannot be read (not UTF-8 text)"


def provider_dir(root: Path) -> Path:
    (root / "gh").mkdir(parents=True)
    (root / "gh" / "TOKEN").write_text("one")
    (root / "gh" / "BROKEN").write_bytes(NOT_UTF8)
    return root


def test_a_value_that_is_not_utf8_is_read_as_unreadable_and_its_file_named(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING, logger="sandstream.provider-sync")
    assert read_directory(provider_dir(tmp_path)) == {"gh": {"BROKEN": None, "TOKEN": "one"}}
    assert BROKEN_LOGGED in caplog.text
    assert "not text" not in caplog.text  # the bytes are never logged


async def test_up_supervises_provider_sync_a_crash_is_reported_and_started_again(
    tmp_path: Path,
) -> None:
    source = provider_dir(tmp_path / "providers")
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    async with isolated_env() as env:
        # Every reconcile raises while the providers table is away.
        await env.fetchval("ALTER TABLE providers RENAME TO providers_away")
        variables = {"SANDSTREAM_PROVIDER_SYNC_DIR": str(source)}
        async with running_up(run_dir, variables, env) as up:
            admin = {"Authorization": f"Bearer {up.admin_token()}"}
            async with httpx.AsyncClient(base_url=up.url, headers=admin, timeout=30) as client:

                async def readiness() -> Any:
                    try:
                        return await client.get("/readyz")
                    except httpx.TransportError:
                        assert up.proc.returncode is None, up.log.read_text()[-3000:]
                        return None

                down = await eventually(
                    readiness,
                    lambda r: r is not None and r.status_code == 503
                    and "provider sync restarting after" in r.json()["checks"]["control_plane"]
                    ["detail"],
                    timeout=60,
                    what="/readyz to report the crashed provider sync",
                )  # fmt: skip
                assert "UndefinedTable" in down.json()["checks"]["control_plane"]["detail"]
                assert (await client.get("/healthz")).status_code == 200

                await env.fetchval("ALTER TABLE providers_away RENAME TO providers")
                gh = await eventually(
                    lambda: client.get("/v1/providers/gh"),
                    lambda r: r.status_code == 200,
                    timeout=60,
                    what="the provider-sync controller, started again, to create gh",
                )
                assert [k["name"] for k in gh.json()["keys"]] == ["TOKEN"]
                await eventually(
                    readiness,
                    lambda r: r is not None and r.status_code == 200,
                    timeout=30,
                    what="/readyz ready again",
                )
            assert up.proc.returncode is None
        log = up.log.read_text()
        assert BROKEN_LOGGED in log
        assert "provider sync crashed" in log


def test_a_value_file_whose_link_dangles_is_unreadable_not_removed(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A key whose symbolic link points at nothing for now (its target being replaced by a
    tool that does not swap atomically) keeps its stored value, like an unreadable file; a
    folder under a provider is still no key."""
    caplog.set_level(logging.WARNING, logger="sandstream.provider-sync")
    (tmp_path / "gh").mkdir()
    (tmp_path / "gh" / "TOKEN").symlink_to(tmp_path / "gh" / ".TOKEN.new")
    (tmp_path / "gh" / "NESTED").mkdir()
    assert read_directory(tmp_path) == {"gh": {"TOKEN": None}}
    assert "keeping the stored value of gh/TOKEN" in caplog.text


class Writing:
    """A source whose signature moves for a few checks (a value file being written), then
    stays; it holds nothing, so each reconcile is only counted."""

    def __init__(self, signatures: list[int]) -> None:
        self.signatures = signatures
        self.checks = 0

    async def signature(self) -> Hashable:
        self.checks += 1
        return self.signatures[min(self.checks, len(self.signatures)) - 1]

    async def read(self) -> Desired:
        return {}

    async def close(self) -> None:
        pass


async def test_the_loop_reads_a_source_only_once_it_stopped_changing() -> None:
    """A file written over several checks (an ASCII value cut short is still valid text, so it
    cannot be told from a whole one): the loop reconciles once the source kept the same
    signature for one interval, not at each step of the write."""
    source = Writing([1, 2, 3, 3])
    passes: list[int] = []

    class Counted(ProviderSync):
        async def reconcile(self) -> None:
            passes.append(source.checks)

    stop = asyncio.Event()
    loop = Counted(service=None, source=source, interval=0.01)  # type: ignore[arg-type]
    task = asyncio.create_task(loop.run(stop))
    await eventually(lambda: asyncio.sleep(0, source.checks), lambda n: n >= 8,
                     what="the loop to check the source eight times")  # fmt: skip
    stop.set()
    await asyncio.wait_for(task, 10)
    assert passes == [4]  # the first check that found the signature of the one before
