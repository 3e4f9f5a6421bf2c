"""The tokens file on a running API (real Kafka and PostgreSQL): it fails closed. A file that
becomes missing, unreadable, readable by others or not a valid document refuses every token
(401 without internals, /readyz not ready), says why in the log once, and is taken up again as
soon as it is valid; `sandstream token` writes it atomically, so a running API never reads a
half-written one. And the scopes a file gives never grow: an older token has no sandbox:exec."""

from __future__ import annotations

import asyncio
import json
import logging
import os
import shutil
import stat
import threading
from collections.abc import Callable
from pathlib import Path

import apikit
import grpc
import pytest

from services.common import secret_files
from services.common import tokens as auth
from services.openshell.service import Authenticator

Breakage = Callable[[Path], None]


def _group_readable(path: Path) -> None:
    path.chmod(0o640)


def _world_readable(path: Path) -> None:
    path.chmod(0o644)


def _half_written(path: Path) -> None:
    text = path.read_bytes()
    with path.open("r+b") as f:  # in place, as a writer that is not atomic leaves it
        f.truncate(len(text) // 2)


def _invalid_document(path: Path) -> None:
    with path.open("w") as f:
        f.write(json.dumps({"tokens": [{"name": "x"}]}))


def _missing(path: Path) -> None:
    path.unlink()


def _unreadable(path: Path) -> None:
    # The tests run as root, which reads a file of any mode: a directory in its place is
    # what cannot be read as the file (open fails with an OSError, as EACCES would).
    path.unlink()
    path.mkdir()


BREAKAGES: dict[str, Breakage] = {
    "group-readable": _group_readable,
    "world-readable": _world_readable,
    "half-written": _half_written,
    "invalid-document": _invalid_document,
    "missing": _missing,
    "unreadable": _unreadable,
}


def _restore(path: Path, good: str) -> None:
    if path.is_dir():
        shutil.rmtree(path)
    secret_files.replace_secret_file(path, good)


async def _status(api: apikit.Api, token: str) -> tuple[int, dict[str, object]]:
    async with api.client(token) as c:
        answer = await c.get("/v1/sandboxes")
    return answer.status_code, answer.json()


@pytest.mark.parametrize("breakage", sorted(BREAKAGES))
async def test_a_broken_tokens_file_refuses_every_token_until_it_is_valid_again(
    breakage: str, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """It once kept serving the tokens it had read before, revoked ones included, silently."""
    path = tmp_path / "tokens.json"
    admin = auth.add_token(path, "admin", (auth.READ, auth.OPS))
    ci = auth.add_token(path, "ci", (auth.READ,))
    good = path.read_text()
    store = auth.TokenStore.from_file(path)
    caplog.set_level(logging.INFO, logger="sandstream.tokens")
    async with apikit.running_api(None, token_store=store) as api:
        assert (await _status(api, ci))[0] == 200

        BREAKAGES[breakage](path)
        for token in (admin, ci, admin):
            status, body = await _status(api, token)
            assert status == 401
            assert body == {"code": "UNAUTHENTICATED", "message": auth.TOKENS_UNAVAILABLE}
        async with api.client(None) as probe, api.client(admin) as ops:
            bare = await probe.get("/readyz")
            assert bare.status_code == 503 and bare.json()["status"] == "not ready"
            told = await ops.get("/readyz")
        assert told.status_code == 503
        assert told.json()["message"] == f"not ready: tokens: {auth.TOKENS_UNAVAILABLE}"
        assert str(tmp_path) not in bare.text + told.text  # the details are the log's
        refusals = [r for r in caplog.records if "refusing every token" in r.getMessage()]
        assert len(refusals) == 1 and str(path) in refusals[0].getMessage()  # once, not per call

        _restore(path, good)
        assert (await _status(api, ci))[0] == 200
        async with api.client(admin) as ops:
            ready = await ops.get("/readyz")
        assert "checks" in ready.json()  # the ops token is accepted again: the details
        recovered = [r for r in caplog.records if "valid again" in r.getMessage()]
        assert len(recovered) == 1


async def test_a_token_revoked_by_a_write_that_breaks_the_file_is_not_accepted(
    tmp_path: Path,
) -> None:
    """The failure the fail-open reading allowed: a revocation whose file the API cannot read
    left the revoked token working."""
    path = tmp_path / "tokens.json"
    ci = auth.add_token(path, "ci", (auth.READ,))
    store = auth.TokenStore.from_file(path)
    async with apikit.running_api(None, token_store=store) as api:
        assert (await _status(api, ci))[0] == 200
        auth.revoke_token(path, "ci")
        revoked = path.read_text()
        path.write_text(revoked[: len(revoked) - 3])  # the revocation, cut short
        assert (await _status(api, ci))[0] == 401
        secret_files.replace_secret_file(path, revoked)
        status, body = await _status(api, ci)
        assert status == 401 and str(body["message"]).startswith("token 'ci' was revoked at ")


async def test_token_create_and_revoke_never_show_a_running_api_a_half_written_file(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Every request made while tokens are added and revoked over and over succeeds: each
    write is complete before it replaces the file (a reader sees the old file or the new)."""
    path = tmp_path / "tokens.json"
    admin = auth.add_token(path, "admin", (auth.READ,))
    store = auth.TokenStore.from_file(path)
    caplog.set_level(logging.INFO, logger="sandstream.tokens")
    done = threading.Event()

    def edit() -> None:
        try:
            for i in range(40):
                auth.add_token(path, f"ci-{i}", (auth.READ,))
                auth.revoke_token(path, f"ci-{i}")
        finally:
            done.set()

    async with apikit.running_api(None, token_store=store) as api, api.client(admin) as c:
        writer = asyncio.create_task(asyncio.to_thread(edit))
        answers: list[int] = []
        while not done.is_set():
            answers.append((await c.get("/v1/sandboxes")).status_code)
        await writer
    assert answers and set(answers) == {200}, answers
    assert not [r for r in caplog.records if "refusing every token" in r.getMessage()]
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert [n for n in os.listdir(tmp_path) if "partial" in n] == []


def test_the_replaced_tokens_file_is_private_and_whole_before_it_is_renamed_in(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """At the moment a token write renames its new file over the tokens file, that file has
    mode 0600 and is a complete, valid tokens document (and the old one is still in place)."""
    path = tmp_path / "tokens.json"
    auth.add_token(path, "admin", (auth.READ,))
    seen: list[tuple[int, int, int]] = []
    rename = os.replace

    def checked(src: str, dst: str) -> None:
        new = Path(src)
        seen.append(
            (
                stat.S_IMODE(new.stat().st_mode),
                len(auth.read_tokens(new)),
                len(auth.read_tokens(Path(dst))),
            )
        )
        rename(src, dst)

    monkeypatch.setattr(secret_files.os, "replace", checked)
    auth.add_token(path, "ci", (auth.READ,))
    auth.revoke_token(path, "ci")
    assert seen == [(0o600, 2, 1), (0o600, 2, 2)]


def test_a_token_made_before_sandbox_exec_existed_cannot_exec(tmp_path: Path) -> None:
    """The admin token of an older tokens file held every scope of its time: it is not given
    sandbox:exec (reading the values of attached providers) by an upgrade; a new file's is."""
    path = tmp_path / "tokens.json"
    value = auth.new_token_value()
    older = [s for s in auth.SCOPES if s != auth.EXEC]
    document = {"tokens": [{"name": "admin", "sha256": auth.hash_token(value), "scopes": older}]}
    assert secret_files.create_secret_file(path, json.dumps(document))
    store = auth.TokenStore.from_file(path)
    assert store.authorize(value, auth.EXEC) == auth.Denied(
        403, "token 'admin' lacks the scope sandbox:exec"
    )
    exec_token = auth.add_token(path, "shell", (auth.READ, auth.EXEC))
    shell = store.authorize(exec_token, auth.EXEC)
    assert isinstance(shell, auth.Principal) and shell.scopes == {auth.READ, auth.EXEC}
    assert "sandbox:exec" in auth.SCOPES


def test_the_grpc_door_refuses_every_token_of_a_broken_file_too(tmp_path: Path) -> None:
    """OpenShell's gRPC API checks tokens with the same store: UNAUTHENTICATED, same message."""
    path = tmp_path / "tokens.json"
    admin = auth.add_token(path, "admin", (auth.READ,))
    door = Authenticator(auth.TokenStore.from_file(path))
    metadata = [f"Bearer {admin}"]
    assert isinstance(door.check(metadata, auth.READ), auth.Principal)
    path.chmod(0o644)
    assert door.check(metadata, auth.READ) == (
        grpc.StatusCode.UNAUTHENTICATED,
        auth.TOKENS_UNAVAILABLE,
    )
    path.chmod(0o600)
    assert isinstance(door.check(metadata, auth.READ), auth.Principal)
