"""The API over TLS: with a certificate (made here, signed by a CA of the test's own) it answers
https only; a client that trusts that CA gets through, the CLI with ``--ca-file`` too; plain
http and a client without the CA do not. By default the API listens on loopback."""

from __future__ import annotations

import asyncio
import ipaddress
import ssl
import sys
from pathlib import Path
from types import SimpleNamespace

import apikit
import grpc
import httpx
import pytest
import tlskit

from services.api.server import Tls, bind
from services.common.settings import PROJECT_ROOT, Settings
from services.common.tokens import TokenStore
from services.openshell.proto import openshell_pb2 as pb
from services.openshell.proto.openshell_pb2_grpc import OpenShellStub
from services.openshell.server import start_openshell


async def _cli(api: apikit.Api, *args: str) -> tuple[int, str, str]:
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "services.cli", "--url", api.url, "--token", apikit.ADMIN, *args,
        cwd=PROJECT_ROOT, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
    )  # fmt: skip
    out, err = await asyncio.wait_for(proc.communicate(), 120)
    assert proc.returncode is not None
    return proc.returncode, out.decode(), err.decode()


async def test_the_api_over_tls_answers_clients_that_trust_its_ca_and_nothing_else(
    tmp_path: Path,
) -> None:
    issued = tlskit.issue_for_localhost(tmp_path)
    tls = Tls(issued.cert, issued.key)
    async with apikit.running_api(None, partitions=1, tls=tls) as api:
        assert api.url.startswith("https://127.0.0.1:")
        trusting = ssl.create_default_context(cafile=str(issued.ca))
        headers = {"Authorization": f"Bearer {apikit.ADMIN}"}
        async with httpx.AsyncClient(base_url=api.url, verify=trusting, headers=headers) as c:
            assert (await c.get("/healthz")).json() == {"status": "ok"}
            assert (await c.get("/v1/sandboxes")).status_code == 200

        plain = api.url.replace("https://", "http://")
        async with httpx.AsyncClient(base_url=plain) as c:
            with pytest.raises(httpx.TransportError):
                await c.get("/healthz")
        async with httpx.AsyncClient(base_url=api.url) as c:  # the system's CAs only
            with pytest.raises(httpx.ConnectError, match="CERTIFICATE_VERIFY_FAILED"):
                await c.get("/healthz")

        code, out, err = await _cli(api, "--ca-file", str(issued.ca), "sandbox", "list")
        assert code == 0, err
        assert "no sandboxes" in out + err
        code, _, err = await _cli(api, "sandbox", "list")
        assert code == 1 and "certificate verify failed" in err


def test_tls_needs_a_certificate_and_a_private_key(tmp_path: Path) -> None:
    issued = tlskit.issue_for_localhost(tmp_path)
    assert Tls.of(Settings()) is None
    with pytest.raises(ValueError, match="needs both api_tls_certfile and api_tls_keyfile"):
        Tls.of(Settings(api_tls_certfile=issued.cert))
    issued.key.chmod(0o644)
    with pytest.raises(ValueError, match="chmod 600"):
        Tls.of(Settings(api_tls_certfile=issued.cert, api_tls_keyfile=issued.key))
    issued.key.chmod(0o600)
    tls = Tls.of(Settings(api_tls_certfile=issued.cert, api_tls_keyfile=issued.key))
    assert tls == Tls(issued.cert, issued.key)
    with_tls = Settings(api_tls_certfile=issued.cert, api_port=9443)
    assert with_tls.api_base_url == "https://127.0.0.1:9443"


def test_the_api_and_the_openshell_api_listen_on_loopback_by_default(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    for name in ("SANDSTREAM_API_HOST", "SANDSTREAM_OPENSHELL_HOST"):
        monkeypatch.delenv(name, raising=False)
    settings = Settings()
    sock = bind(settings.api_host, 0)
    try:
        assert ipaddress.ip_address(sock.getsockname()[0]).is_loopback
    finally:
        sock.close()
    assert ipaddress.ip_address(settings.openshell_host).is_loopback


async def test_the_openshell_api_uses_the_same_certificate(tmp_path: Path) -> None:
    issued = tlskit.issue_for_localhost(tmp_path)
    settings = Settings(openshell_port=0, api_tls_certfile=issued.cert, api_tls_keyfile=issued.key)
    idle = SimpleNamespace(feed=None)  # Health reaches no service
    server = await start_openshell(
        settings,
        pool=None,
        gateway=idle,
        tokens=TokenStore([]),
        driver=None,  # type: ignore[arg-type]
    )
    try:
        assert server.tls
        trusting = grpc.ssl_channel_credentials(root_certificates=issued.ca.read_bytes())
        async with grpc.aio.secure_channel(server.address, trusting) as channel:
            answer = await OpenShellStub(channel).Health(pb.HealthRequest(), timeout=30)
            assert answer.status == pb.SERVICE_STATUS_HEALTHY
        async with grpc.aio.insecure_channel(server.address) as channel:
            with pytest.raises(grpc.aio.AioRpcError) as refused:
                await OpenShellStub(channel).Health(pb.HealthRequest(), timeout=30)
            assert refused.value.code() == grpc.StatusCode.UNAVAILABLE
    finally:
        await server.stop(0)


async def test_the_openshell_api_stays_plaintext_when_told_to_beside_a_tls_api(
    tmp_path: Path,
) -> None:
    """OpenShell's CLI and conformance runner speak https only with mutual TLS: with
    openshell_tls=false the gRPC API keeps plaintext while the HTTP API has its certificate."""
    issued = tlskit.issue_for_localhost(tmp_path)
    settings = Settings(
        openshell_port=0,
        openshell_tls=False,
        api_tls_certfile=issued.cert,
        api_tls_keyfile=issued.key,
    )
    idle = SimpleNamespace(feed=None)  # Health reaches no service
    server = await start_openshell(
        settings,
        pool=None,
        gateway=idle,
        tokens=TokenStore([]),
        driver=None,  # type: ignore[arg-type]
    )
    try:
        assert not server.tls
        async with grpc.aio.insecure_channel(server.address) as channel:
            answer = await OpenShellStub(channel).Health(pb.HealthRequest(), timeout=30)
            assert answer.status == pb.SERVICE_STATUS_HEALTHY
    finally:
        await server.stop(0)
