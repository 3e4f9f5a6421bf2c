"""The API behind a TLS-terminating proxy: the real `sandstream api` process (plain http on
loopback) and, in the test, a proxy that speaks https to the client (its certificate signed by
a CA of the test's own) and forwards to the API from 127.0.0.2 with X-Forwarded-Proto and
X-Forwarded-For, as an ingress does. With that address in SANDSTREAM_API_FORWARDED_ALLOW_IPS
the console's cookie is Secure and the access log names the client; the same headers from any
other peer change neither the cookie nor the logged address."""

from __future__ import annotations

import contextlib
import re
import ssl
from collections.abc import AsyncIterator
from http.cookies import SimpleCookie
from pathlib import Path
from typing import Any

import httpx
import pytest
import tlskit
import uvicorn
from harness import eventually
from pydantic import ValidationError
from role_processes import RoleProcess, Roles, roles_env

from services.api.console.session import COOKIE, csrf_token
from services.common.serving import EmbeddedServer, bind, serve_started, url_of
from services.common.settings import Settings

PROXY_SOURCE = "127.0.0.2"  # the proxy's address as the API sees it (all of 127/8 is loopback)
FORGED = "203.0.113.66"  # an address a client claims (TEST-NET-3: no one's)
HOP_BY_HOP = {b"connection", b"keep-alive", b"transfer-encoding", b"content-length", b"upgrade"}


def _proxy_app(upstream: str) -> Any:
    """An ASGI app forwarding every request to ``upstream`` from PROXY_SOURCE, appending the
    peer to X-Forwarded-For and setting X-Forwarded-Proto to the client's scheme (nginx's
    $proxy_add_x_forwarded_for and $scheme)."""
    transport = httpx.AsyncHTTPTransport(local_address=PROXY_SOURCE)
    client = httpx.AsyncClient(base_url=upstream, transport=transport, timeout=30)

    async def app(scope: dict[str, Any], receive: Any, send: Any) -> None:
        assert scope["type"] == "http"
        body = b""
        while True:
            message = await receive()
            body += message.get("body", b"")
            if not message.get("more_body"):
                break
        peer = scope["client"][0]
        headers = [(k, v) for k, v in scope["headers"]
                   if k not in (b"x-forwarded-proto", b"accept-encoding", *HOP_BY_HOP)]  # fmt: skip
        forwarded = [v for k, v in headers if k == b"x-forwarded-for"]
        headers = [(k, v) for k, v in headers if k != b"x-forwarded-for"]
        chain = b", ".join([*forwarded, peer.encode()])
        headers += [(b"x-forwarded-for", chain), (b"x-forwarded-proto", scope["scheme"].encode())]
        query = scope["query_string"].decode()
        target = scope["path"] + (f"?{query}" if query else "")
        answer = await client.request(scope["method"], target, headers=headers, content=body)
        kept = [(k, v) for k, v in answer.headers.raw if k.lower() not in HOP_BY_HOP]
        await send({"type": "http.response.start", "status": answer.status_code, "headers": kept})
        await send({"type": "http.response.body", "body": answer.content})

    return app


@contextlib.asynccontextmanager
async def tls_terminating_proxy(upstream: str, issued: tlskit.Issued) -> AsyncIterator[str]:
    """The proxy on an ephemeral loopback port over https: its URL."""
    sock = bind("127.0.0.1", 0)
    config = uvicorn.Config(
        _proxy_app(upstream), log_config=None, lifespan="off",
        proxy_headers=False, ssl_certfile=issued.cert, ssl_keyfile=issued.key,
    )  # fmt: skip
    server = EmbeddedServer(config)
    task = await serve_started(server, sock, name="proxy")
    try:
        yield url_of("127.0.0.1", sock.getsockname()[1], "https")
    finally:
        server.should_exit = True
        await task


@contextlib.asynccontextmanager
async def api_process(
    tmp_path: Path, trusted: str, host: str = "127.0.0.1"
) -> AsyncIterator[tuple[Roles, RoleProcess, str]]:
    """The `sandstream api` process listening on ``host``; its URL over IPv4 loopback."""
    async with roles_env(tmp_path, partitions=1) as roles:
        api = roles.start("api", "--host", host, "--port", "0",
                          env={"SANDSTREAM_API_FORWARDED_ALLOW_IPS": trusted})  # fmt: skip
        await api.ready()
        port = (await api.readiness())["url"].rsplit(":", 1)[1]
        yield roles, api, f"http://127.0.0.1:{port}"


def _cookie(response: httpx.Response) -> Any:
    """The console cookie's Set-Cookie, parsed (its attributes by lower-case name)."""
    (header,) = [v for v in response.headers.get_list("set-cookie") if v.startswith(COOKIE)]
    parsed: SimpleCookie = SimpleCookie()
    parsed.load(header)
    return parsed[COOKIE]


async def _logged(api: RoleProcess, request_line: str, count: int) -> list[str]:
    """The clients the access log names for ``request_line`` once it holds ``count`` of them."""
    pattern = re.compile(rf'(\S+) - "{re.escape(request_line)} HTTP/1\.1"')

    def clients() -> list[str]:
        return pattern.findall(api.log.read_text(errors="replace"))

    return await eventually(clients, lambda found: len(found) >= count,
                            what=f"{count} access log lines of {request_line}")  # fmt: skip


# On "::" (dual stack) the API sees the proxy as ::ffff:127.0.0.2: the IPv4 entry covers it.
@pytest.mark.parametrize("host", ["127.0.0.1", "::"], ids=["ipv4", "dual-stack"])
async def test_behind_a_trusted_tls_proxy_the_cookie_is_secure_and_the_log_names_the_client(
    tmp_path: Path, host: str
) -> None:
    issued = tlskit.issue_for_localhost(tmp_path)
    async with api_process(tmp_path, PROXY_SOURCE, host) as (roles, api, upstream):
        token = roles.admin_token()
        trusting = ssl.create_default_context(cafile=str(issued.ca))
        async with (
            tls_terminating_proxy(upstream, issued) as url,
            httpx.AsyncClient(base_url=url, verify=trusting) as browser,
        ):
            # a client's own X-Forwarded-For is kept by the proxy, the peer appended after it
            signed = await browser.post("/ui/login", data={"token": token, "next": "/ui/"},
                                        headers={"X-Forwarded-For": FORGED})  # fmt: skip
            assert signed.status_code == 303, signed.text
            cookie = _cookie(signed)
            assert cookie.value == token
            assert cookie["secure"] is True and cookie["httponly"] is True
            assert (cookie["samesite"].lower(), cookie["path"]) == ("strict", "/ui")

            page = await browser.get("/ui/")  # the cookie from the client's jar
            assert page.status_code == 200, page.text

            out = await browser.post("/ui/logout", data={"csrf": csrf_token(token)})
            assert out.status_code == 303, out.text
            ended = _cookie(out)
            assert ended.value == "" and ended["secure"] is True

        # the rightmost address not of a trusted proxy: the proxy's peer, never the claim
        assert await _logged(api, "POST /ui/login", 1) == ["127.0.0.1:0"]
        log = api.log.read_text(errors="replace")
        assert FORGED not in log
        assert '"GET /readyz' not in log  # the health probes stay out of the access log


async def test_forwarded_headers_from_an_untrusted_peer_change_nothing(tmp_path: Path) -> None:
    """The API trusts only 127.0.0.2; a client on 127.0.0.1 (uvicorn's default trusted proxy)
    claiming https and another address gets a cookie without Secure and is logged as itself."""
    async with api_process(tmp_path, PROXY_SOURCE) as (roles, api, url):
        token = roles.admin_token()
        claims = {"X-Forwarded-Proto": "https", "X-Forwarded-For": FORGED}
        async with httpx.AsyncClient(base_url=url, headers=claims) as client:
            signed = await client.post("/ui/login", data={"token": token, "next": "/ui/"})
            assert signed.status_code == 303, signed.text
            assert _cookie(signed)["secure"] == ""  # SimpleCookie: an absent flag is ""
            out = await client.post("/ui/logout", data={"csrf": csrf_token(token)})
            assert _cookie(out)["secure"] == ""

        (client_address,) = await _logged(api, "POST /ui/login", 1)
        assert client_address.startswith("127.0.0.1:") and client_address != "127.0.0.1:0"
        assert FORGED not in api.log.read_text(errors="replace")


def test_only_addresses_and_networks_may_be_trusted() -> None:
    settings = Settings(api_forwarded_allow_ips="10.0.0.0/8, 127.0.0.2,,fd00::1")
    assert settings.trusted_proxies == (
        "10.0.0.0/8", "127.0.0.2", "fd00::1", "::ffff:10.0.0.0/104", "::ffff:127.0.0.2/128",
    )  # fmt: skip
    assert Settings().trusted_proxies == ()
    # "*" would make uvicorn take the leftmost X-Forwarded-For entry: the client's own claim
    for bad in ("*", "ingress.local", "10.0.0.1/8"):
        with pytest.raises(ValidationError, match="api_forwarded_allow_ips"):
            Settings(api_forwarded_allow_ips=bad)
