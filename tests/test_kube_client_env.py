"""The Kubernetes driver's client and the process environment, against a real kube-apiserver:
no proxy or netrc lookup per request when the environment has neither (kubernetes-asyncio
opens its session with ``trust_env=True``, and aiohttp then looks both up in a thread-pool
thread at every request), and a proxy that is configured is still used.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import aiohttp.client
import pytest
from kube_support import (
    Admin,
    admin_fixture,  # noqa: F401  (the module's admin client)
    new_driver,
    ns_fixture,  # noqa: F401  (the module's namespace)
)

from drivers.kube_config import environment_proxies_or_netrc
from drivers.protocol import DriverError
from services.localstack.cluster import free_port_run


def without_proxies_or_netrc(monkeypatch: pytest.MonkeyPatch, home: Path) -> None:
    for name in list(os.environ):
        if name.lower().endswith("_proxy"):
            monkeypatch.delenv(name)
    monkeypatch.setenv("NETRC", str(home / "no-netrc-here"))


def counted_lookups(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """Every proxy and netrc lookup aiohttp makes from now on (by kind)."""
    seen: list[str] = []
    proxy_lookup = aiohttp.client.get_env_proxy_for_url
    netrc_lookup = aiohttp.ClientSession._get_netrc_auth

    def proxy(url: Any) -> Any:
        seen.append("proxy")
        return proxy_lookup(url)

    def netrc(self: aiohttp.ClientSession, host: str) -> Any:
        seen.append("netrc")
        return netrc_lookup(self, host)

    monkeypatch.setattr(aiohttp.client, "get_env_proxy_for_url", proxy)
    monkeypatch.setattr(aiohttp.ClientSession, "_get_netrc_auth", netrc)
    return seen


@pytest.mark.asyncio(loop_scope="session")
async def test_driver_requests_look_up_no_proxy_or_netrc_when_the_environment_has_neither(
    admin: Admin, ns: str, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    without_proxies_or_netrc(monkeypatch, tmp_path)
    lookups = counted_lookups(monkeypatch)
    driver = new_driver(admin, ns)
    try:
        for _ in range(3):
            assert await driver.list() == []
    finally:
        await driver.close()
    assert lookups == []


@pytest.mark.asyncio(loop_scope="session")
async def test_a_proxy_in_the_environment_is_still_used(
    admin: Admin, ns: str, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    without_proxies_or_netrc(monkeypatch, tmp_path)
    closed = free_port_run(1)  # nothing listens there: a request through it is refused
    monkeypatch.setenv("HTTPS_PROXY", f"http://127.0.0.1:{closed}")
    lookups = counted_lookups(monkeypatch)
    driver = new_driver(admin, ns, request_timeout=5.0)
    try:
        with pytest.raises(DriverError, match="Cannot connect to host 127.0.0.1:" + str(closed)):
            await driver.list()
    finally:
        await driver.close()
    assert "proxy" in lookups


def test_proxy_variables_and_a_netrc_file_count_as_environment_to_trust(tmp_path: Path) -> None:
    nowhere = {"NETRC": str(tmp_path / "absent")}
    assert not environment_proxies_or_netrc(nowhere)
    assert not environment_proxies_or_netrc({**nowhere, "no_proxy": "*", "HTTPS_PROXY": ""})
    assert environment_proxies_or_netrc({**nowhere, "https_proxy": "http://proxy:3128"})
    assert environment_proxies_or_netrc({**nowhere, "ALL_PROXY": "socks5://proxy:1080"})
    netrc = tmp_path / "netrc"
    netrc.write_text("machine apiserver login a password b\n")
    assert environment_proxies_or_netrc({"NETRC": str(netrc)})
