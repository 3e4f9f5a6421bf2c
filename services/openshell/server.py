"""The OpenShell-compatible gRPC server (grpcio's asyncio server), in `up` or as its own role.

``start_openshell`` serves an :class:`OpenShellService` on ``host:port``, over TLS with the
HTTP API's certificate when the settings name one (unless ``openshell_tls`` is false: OpenShell's
CLI connects to an https gateway only with mutual-TLS files of its own). ``sandstream up``
runs it beside the HTTP API and shares its command gateway (the publisher), pool and change
feed; ``python -m services.openshell`` runs it alone (with its own, and a Podman driver).

Keep-alive: OpenShell's clients ping every 10 s, also on idle connections; grpc-core's default
policy answers such pings with GOAWAY ("too many pings") after about 40 s, so the server
accepts pings every 5 s with or without calls and never counts strikes.
"""

from __future__ import annotations

import asyncio
import functools
import ipaddress
import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING, Final

import grpc

from drivers.logs import LogSource
from events.publisher import CommandPublisher
from services.api import idempotency
from services.api.gateway import CommandGateway
from services.api.providers import ProviderService
from services.api.readmodel import ChangeFeed
from services.api.server import Tls
from services.common.entrypoint import run_until_signalled
from services.common.exec_sessions import ExecLimits
from services.common.kafka_clients import kafka_client_args
from services.common.settings import Settings
from services.common.suspend import suspend_refusal
from services.common.tokens import SCOPES, TokenStore
from services.common.usage import UseRecorder
from services.openshell.handlers import OpenShellService
from services.openshell.service import Authenticator, Door, Pool

if TYPE_CHECKING:
    from drivers.kube_exec import KubeExec
    from drivers.podman import PodmanDriver

log = logging.getLogger("sandstream.openshell")

# A connection must finish its handshake (TLS, then HTTP/2's preface and SETTINGS) within this,
# as an HTTP request head must arrive within 30 s (services/common/serving.py): grpc-core's own
# default is 120 s.
HANDSHAKE_SECONDS: Final = 30.0
# A connection with no call open this long is closed (GOAWAY; a client reconnects at its next
# call). Pings do not count as use, so without it a client that stopped calling (or never
# authenticated a call) held its connection for ever; an open watch or exec stream is a call.
IDLE_SECONDS: Final = 300.0


def server_options(
    handshake_seconds: float = HANDSHAKE_SECONDS, idle_seconds: float = IDLE_SECONDS
) -> tuple[tuple[str, int], ...]:
    return (
        ("grpc.http2.min_recv_ping_interval_without_data_ms", 5000),
        ("grpc.http2.max_ping_strikes", 0),
        ("grpc.keepalive_permit_without_calls", 1),
        # grpc-core binds with SO_REUSEPORT by default: a second `up` would share the port and
        # get half of the first one's calls instead of failing to start.
        ("grpc.so_reuseport", 0),
        ("grpc.server_handshake_timeout_ms", int(handshake_seconds * 1000)),
        ("grpc.max_connection_idle_ms", int(idle_seconds * 1000)),
    )


SERVER_OPTIONS: Final = server_options()
STOP_GRACE: Final = 5.0  # seconds running calls get to finish when the server stops


class OpenShellConfigError(ValueError):
    """Settings the server refuses to run with."""


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def check_settings(settings: Settings) -> None:
    if settings.openshell_allow_unauthenticated and not is_loopback(settings.openshell_host):
        raise OpenShellConfigError(
            "unauthenticated OpenShell calls are for local use only: openshell_host "
            f"{settings.openshell_host!r} is not a loopback address"
        )
    unknown = sorted(settings.openshell_local_scopes - set(SCOPES))
    if unknown:
        raise OpenShellConfigError(
            f"openshell_unauthenticated_scopes: unknown scopes {', '.join(unknown)} "
            f"(known: {', '.join(SCOPES)})"
        )


@dataclass
class RunningOpenShell:
    server: grpc.aio.Server
    address: str  # host:port actually bound
    tls: bool = False

    async def stop(self, grace: float = STOP_GRACE) -> None:
        await self.server.stop(grace)


async def start_openshell(
    settings: Settings,
    *,
    pool: Pool,
    gateway: CommandGateway,
    tokens: TokenStore,
    driver: object | None,
    driver_name: str | None = None,
    logs: LogSource | None = None,
    limits: ExecLimits | None = None,
    use: UseRecorder | None = None,
) -> RunningOpenShell:
    """Start serving; raises OpenShellConfigError or OSError (the port is taken).
    ``driver_name`` (what GetGatewayInfo reports) defaults to ``settings.driver``; ``limits``
    (the exec sessions' bounds and counts) to new ones of ``settings``; ``use`` (where the
    door records use, for idle suspend) to one that records nothing."""
    from drivers.protocol import ExecDriver

    check_settings(settings)
    door = Door(
        pool=pool,
        gateway=gateway,
        auth=Authenticator(
            tokens, settings.openshell_allow_unauthenticated, settings.openshell_local_scopes
        ),
        driver=driver if isinstance(driver, ExecDriver) else None,
        logs=logs,
        providers=ProviderService(settings, pool, gateway),
        driver_name=driver_name or settings.driver,
        default_image=settings.sandbox_image,
        events_topic=settings.topic_events,
        wake_timeout=settings.wake_timeout_seconds,
        use=UseRecorder(None, settings.use_flush_seconds) if use is None else use,
        max_stop_timeout=settings.api_max_stop_timeout_seconds,
        default_ttl=settings.default_ttl_seconds,
        unsuspendable=functools.partial(suspend_refusal, settings),
    )
    limits = ExecLimits.of(settings) if limits is None else limits
    server = grpc.aio.server(options=SERVER_OPTIONS)
    server.add_generic_rpc_handlers((OpenShellService(door, limits).generic_handler(),))
    host = settings.openshell_host
    target = (
        f"[{host}]:{settings.openshell_port}"
        if ":" in host
        else f"{host}:{settings.openshell_port}"
    )
    hint = "set SANDSTREAM_OPENSHELL_PORT (--openshell-port) or turn it off (--no-openshell)"
    # the HTTP API's certificate, when it has one and openshell_tls leaves it on
    tls = Tls.of(settings) if settings.openshell_tls else None
    if tls is None and not is_loopback(host):
        log.warning(
            "the OpenShell API listens on %s without TLS: tokens cross the network in clear",
            host,
        )
    try:
        if tls is None:
            port = server.add_insecure_port(target)
        else:
            pair = (tls.keyfile.read_bytes(), tls.certfile.read_bytes())
            port = server.add_secure_port(target, grpc.ssl_server_credentials([pair]))
    except RuntimeError as exc:
        raise OSError(f"OpenShell API: cannot listen on {target} ({exc}); {hint}") from exc
    if port == 0:
        raise OSError(f"OpenShell API: cannot listen on {target}; {hint}")
    await server.start()
    shown = "127.0.0.1" if host in ("0.0.0.0", "") else host
    return RunningOpenShell(server, f"{shown}:{port}", tls is not None)


async def serve(settings: Settings, stop: asyncio.Event) -> None:
    """The OpenShell API as its own role: until ``stop`` is set."""
    from services.common.database import connect_pool
    from services.executor.log_sources import log_source

    tokens = TokenStore.from_file(settings.tokens_file)
    driver = exec_driver(settings)
    logs = log_source(settings)
    pool = await connect_pool(settings)
    feed = ChangeFeed(pool)
    try:
        async with CommandPublisher(
            kafka_client_args(settings, "api"), topic=settings.topic_commands
        ) as publisher:
            await feed.start()
            gateway = CommandGateway.of_role(settings, pool, publisher, feed)
            use = UseRecorder(pool, settings.use_flush_seconds)
            running = await start_openshell(
                settings, pool=pool, gateway=gateway, tokens=tokens, driver=driver, logs=logs,
                use=use,
            )  # fmt: skip
            log.info("OpenShell API on %s", running.address)
            # Run alone, it records the use it sees (idle suspend) and forgets the expired
            # command ids it records, as the API does.
            flusher = asyncio.create_task(use.run(stop), name="sandbox use")
            retention = settings.api_command_retention_hours
            try:
                await idempotency.keep_forgetting(pool, retention, stop)
                await stop.wait()
            finally:
                await feed.close()
                await running.stop()
                await flusher
    finally:
        await pool.close()
        if driver is not None:
            await driver.close()
        await logs.close()


def exec_driver(settings: Settings) -> PodmanDriver | KubeExec | None:
    """The driver ExecSandbox runs commands through when this role runs alone
    (services/executor/exec_sources.py)."""
    from services.executor.exec_sources import exec_source

    return exec_source(settings)


def main() -> None:
    run_until_signalled(serve)
