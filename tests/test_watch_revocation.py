"""Open watches end when their token lapses (real Kafka, PostgreSQL and, for OpenShell's
WatchSandbox, Podman). A watch re-checks its token at every wake: once it is revoked or no
longer holds sandbox:read, ``/v1/watch`` and ``/v1/watch/events`` send ``event: denied`` and
end, and WatchSandbox ends with UNAUTHENTICATED (PERMISSION_DENIED for a lost scope). Before,
only the console's feed re-checked: a revoked token kept every open watch for as long as the
client kept it open (a day, with ``?timeout=86400``)."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import apikit
import grpc
import openshell_support as oss
import pytest
from podman import PodmanClient

from services.common import secret_files
from services.common import tokens as auth
from services.openshell.proto import openshell_pb2 as pb

ENDS_WITHIN = 10.0  # seconds: the streams wake at least once a second


def drop_scope(path: Path, name: str, scope: str) -> None:
    """Edit the tokens file as an operator would: ``name`` no longer holds ``scope``."""
    document = json.loads(path.read_text())
    for entry in document["tokens"]:
        if entry["name"] == name:
            entry["scopes"] = [s for s in entry["scopes"] if s != scope]
    secret_files.replace_secret_file(path, json.dumps(document))


def revoke(path: Path, name: str) -> None:
    assert auth.revoke_token(path, name) == 1


LAPSES: dict[str, tuple[Callable[[Path, str], None], int, str, str]] = {
    "revoked": (revoke, 401, "UNAUTHENTICATED", "token 'watcher' was revoked at "),
    "scope dropped": (
        lambda path, name: drop_scope(path, name, auth.READ),
        403,
        "PERMISSION_DENIED",
        "token 'watcher' lacks the scope sandbox:read",
    ),
}


async def follow_until_end(
    client: Any, path: str, on_open: Callable[[], None]
) -> tuple[list[tuple[str, dict[str, Any]]], float]:
    """The events of one stream until the server ends it, and the seconds from ``on_open``
    (called once the stream is open) to that end."""
    events: list[tuple[str, dict[str, Any]]] = []
    async with asyncio.timeout(ENDS_WITHIN + 20):
        async with client.stream("GET", path, params={"timeout": 600}) as response:
            assert response.status_code == 200, await response.aread()
            lines = response.aiter_lines()
            assert (await anext(lines)).startswith(": sandstream")  # open: the first comment
            on_open()
            opened = time.monotonic()
            kind = "message"
            async for line in lines:
                if line.startswith("event:"):
                    kind = line.partition(":")[2].strip()
                elif line.startswith("data:"):
                    events.append((kind, json.loads(line.partition(":")[2])))
            return events, time.monotonic() - opened


@pytest.mark.parametrize("lapse", sorted(LAPSES))
@pytest.mark.parametrize("path", ["/v1/watch", "/v1/watch/events"])
async def test_an_open_http_watch_ends_with_denied_once_its_token_lapses(
    tmp_path: Path, path: str, lapse: str
) -> None:
    tokens_file = tmp_path / "tokens.json"
    watcher = auth.add_token(tokens_file, "watcher", (auth.READ,))
    other = auth.add_token(tokens_file, "other", (auth.READ,))
    store = auth.TokenStore.from_file(tokens_file)
    change, status, code, message = LAPSES[lapse]
    async with apikit.running_api(None, token_store=store) as api, api.client(watcher) as c:
        events, took = await follow_until_end(c, path, lambda: change(tokens_file, "watcher"))
        assert took < ENDS_WITHIN
        assert [kind for kind, _ in events if kind != "bookmark"] == ["denied"], events
        body = events[-1][1]
        assert (body["status"], body["code"]) == (status, code)
        assert body["message"].startswith("watch ended: " + message), body
        async with api.client(other) as still:  # another token's watch is not ended
            kept = await still.get(path, params={"timeout": 1.5})
        assert kept.status_code == 200 and "event: denied" not in kept.text


async def test_an_open_openshell_watch_ends_once_its_token_lapses(
    tmp_path: Path, podman: PodmanClient
) -> None:
    tokens_file = tmp_path / "tokens.json"
    admin = auth.add_token(tokens_file, "admin", auth.SCOPES)
    watcher = auth.add_token(tokens_file, "watcher", (auth.READ,))
    keeper = auth.add_token(tokens_file, "keeper", (auth.READ,))
    store = auth.TokenStore.from_file(tokens_file)
    async with oss.running_gateway(podman, "osrevoke", token_store=store) as gw:
        name = gw.new_name()
        created = await gw.stub.CreateSandbox(
            pb.CreateSandboxRequest(name=name, spec=pb.SandboxSpec()), metadata=oss.auth(admin)
        )
        request = pb.WatchSandboxRequest(id=created.sandbox.metadata.id, follow_status=True)
        for lapse, (change, _, _, message) in sorted(LAPSES.items()):
            lapsing = gw.stub.WatchSandbox(request, metadata=oss.auth(watcher), timeout=60)
            kept = gw.stub.WatchSandbox(request, metadata=oss.auth(keeper), timeout=60)
            assert (await lapsing.read()).WhichOneof("payload") == "sandbox"  # open
            assert (await kept.read()).WhichOneof("payload") == "sandbox"
            change(tokens_file, "watcher")
            opened = time.monotonic()
            with pytest.raises(grpc.aio.AioRpcError) as ended:
                while (await lapsing.read()) is not grpc.aio.EOF:
                    pass
            assert time.monotonic() - opened < ENDS_WITHIN
            expected = {
                "revoked": grpc.StatusCode.UNAUTHENTICATED,
                "scope dropped": grpc.StatusCode.PERMISSION_DENIED,
            }[lapse]
            assert ended.value.code() == expected, ended.value
            assert (ended.value.details() or "").startswith("watch ended: " + message)
            assert not kept.done()  # the other token's watch goes on
            kept.cancel()
            if lapse == "revoked":  # the next case needs a live watcher again
                watcher = auth.add_token(tokens_file, "watcher", (auth.READ,))
