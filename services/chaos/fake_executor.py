"""``python -m services.chaos.fake_executor STATE_FILE``: what ``python -m services.executor``
runs (executor, watcher, reconciler), with the fake driver whose runtimes live in
``STATE_FILE``, shared by every executor of a checker run (drivers/fake_shared.py)."""

from __future__ import annotations

import asyncio
import sys
from pathlib import Path

from drivers.fake_shared import SharedFakeDriver
from services.common.entrypoint import run_until_signalled
from services.common.settings import Settings
from services.executor.driver_side import serve_driver_side


def main(state_file: Path) -> None:
    async def serve(settings: Settings, stop: asyncio.Event) -> None:
        await serve_driver_side(settings, stop, driver=SharedFakeDriver(state_file))

    run_until_signalled(serve)


if __name__ == "__main__":
    main(Path(sys.argv[1]))
