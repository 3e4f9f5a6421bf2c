"""Run one long-lived service in the foreground until SIGINT or SIGTERM.

``run_role`` runs a role as its own process (``sandstream processor``, ``executor``,
``watcher``, ``scheduler``, ``api``): its health endpoint (services/common/health.py) first,
then the role; SIGTERM or SIGINT stops it gracefully (the role drains, commits and leaves its
consumer group), a second one forces the exit. The exit code says how it ended (``EXIT_*``).
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

from services.common.health import Readiness, start_health
from services.common.log_filter import rate_limit_kafka_logs
from services.common.settings import Settings

LOG_FORMAT = "%(asctime)s %(levelname)s %(name)s %(message)s"

# Exit codes of a role process.
EXIT_STOPPED = 0  # stopped by SIGTERM/SIGINT after a clean drain
EXIT_FAILED = 1  # failed while running, or its drain failed (the log says why)
EXIT_USAGE = 2  # bad options or settings (nothing was started)
EXIT_START_FAILED = 3  # could not start: a backend unreachable or refusing (the log says why)
EXIT_FORCED = 130  # a second signal cut the drain short

# How long the drain after a signal may take before the process gives up on it.
DRAIN_TIMEOUT = 60.0

log = logging.getLogger("sandstream.role")


def run_until_signalled(serve: Callable[[Settings, asyncio.Event], Awaitable[None]]) -> None:
    """Load settings from the environment and run ``serve`` until a signal sets its stop event."""
    logging.basicConfig(level=logging.INFO, format=LOG_FORMAT)
    rate_limit_kafka_logs()
    settings = Settings()

    async def _run() -> None:
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, stop.set)
        await serve(settings, stop)

    asyncio.run(_run())


class Role(Protocol):
    """A role run as its own process.

    ``run`` starts the role, sets ``started`` once it works, runs until ``stop`` is set, then
    drains and releases everything it opened (also when it fails). ``readiness`` is what the
    health endpoint's /readyz reports."""

    name: str
    started: bool

    async def run(self, stop: asyncio.Event) -> None: ...

    async def readiness(self) -> Readiness: ...


@dataclass(frozen=True)
class Endpoint:
    """Where the role's health endpoint listens; port 0 picks a free one (logged, and written
    to ``port_file`` when given)."""

    host: str
    port: int
    port_file: Path | None = None
    tokens_file: Path | None = None  # the tokens that may see readiness detail and metrics


def configure_role_logging() -> None:
    logging.basicConfig(level=logging.INFO, format=LOG_FORMAT, force=True)
    for noisy in ("aiokafka", "kafka"):
        logging.getLogger(noisy).setLevel(logging.WARNING)
    rate_limit_kafka_logs()


def run_role(role: Role, endpoint: Endpoint) -> int:
    """Run ``role`` in the foreground until a signal; the process's exit code."""
    configure_role_logging()
    return asyncio.run(serve_role(role, endpoint))


async def serve_role(role: Role, endpoint: Endpoint) -> int:
    stop = asyncio.Event()
    _handle_signals(role.name, stop)
    try:
        health = await start_health(
            role.name,
            role.readiness,
            endpoint.host,
            endpoint.port,
            endpoint.port_file,
            endpoint.tokens_file,
        )
    except OSError as exc:
        log.error("%s: cannot serve the health endpoint on %s:%d: %s",
                  role.name, endpoint.host, endpoint.port, exc)  # fmt: skip
        return EXIT_START_FAILED
    log.info("%s (pid %d): health endpoint %s (/healthz, /readyz, /metrics)",
             role.name, os.getpid(), health.url)  # fmt: skip
    task = asyncio.create_task(role.run(stop), name=role.name)
    try:
        return await _until_ended(role, stop, task)
    finally:
        await health.stop()


async def _until_ended(role: Role, stop: asyncio.Event, task: asyncio.Task[None]) -> int:
    waiter = asyncio.ensure_future(stop.wait())
    await asyncio.wait([task, waiter], return_when=asyncio.FIRST_COMPLETED)
    waiter.cancel()
    if not task.done():  # a signal: drain
        log.info("%s: stopping (draining)", role.name)
        done, _ = await asyncio.wait([task], timeout=DRAIN_TIMEOUT)
        if not done:
            task.cancel()
            log.error("%s: the drain took longer than %.0fs; stopped without it",
                      role.name, DRAIN_TIMEOUT)  # fmt: skip
            return EXIT_FAILED
    error = None if task.cancelled() else task.exception()
    if error is not None:
        when = "while running" if role.started else "at start"
        log.error("%s failed %s: %r", role.name, when, error, exc_info=error)
        return EXIT_FAILED if role.started else EXIT_START_FAILED
    if not stop.is_set():
        log.error("%s ended by itself", role.name)
        return EXIT_FAILED
    log.info("%s stopped", role.name)
    return EXIT_STOPPED


def _handle_signals(name: str, stop: asyncio.Event) -> None:
    loop = asyncio.get_running_loop()

    def received(signum: int) -> None:
        if not stop.is_set():
            log.info("%s: %s received: stopping (again to force)",
                     name, signal.Signals(signum).name)  # fmt: skip
            stop.set()
            return
        log.warning("%s: forced exit", name)
        os._exit(EXIT_FORCED)

    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, received, sig)
