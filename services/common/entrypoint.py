"""Run one long-lived service in the foreground until SIGINT or SIGTERM."""

from __future__ import annotations

import asyncio
import logging
import signal
from collections.abc import Awaitable, Callable

from services.common.log_filter import rate_limit_kafka_logs
from services.common.settings import Settings

LOG_FORMAT = "%(asctime)s %(levelname)s %(name)s %(message)s"


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
