"""`sandstream up`'s HTTP API in a child process of its own (``up_api_process``), so that its
answers do not wait behind the processor's and the executor's work in ``up``'s event loop.

``up`` binds the API's socket itself (a taken port fails before anything starts, the printed
URL is the one it bound) and hands it to the child, ``python -m services.up.api_process FD``,
which loads the same settings from ``SANDSTREAM_*`` variables (``Settings.as_env``; secrets it
inherits or reads from their files, as ``up`` does) and serves the same app on it with its own
pool and producer. The child says it serves by writing a line on its stdout; it stops on
SIGTERM/SIGINT, and when its stdin (a pipe from ``up``) ends, so it never outlives ``up``, even
one killed. ``up`` stops it on its own shutdown and, as with the in-process API, stops
everything when it ends by itself (the child's exit is logged).

What the child lacks beside the in-process API: the plane's crashed-parts report in /readyz,
the exec driver of the plane (its own, from the settings: on Podman it looks a container up on
its first exec instead of remembering what the plane launched), and OpenShell and the provider
sync (which share the in-process app's parts: ``up`` refuses the mode with either on).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
import socket
import subprocess
import sys
from dataclasses import dataclass
from typing import Literal

from services.common.settings import PROJECT_ROOT, Settings

log = logging.getLogger("sandstream.up")

READY_LINE = b"serving\n"
START_WAIT = 60.0  # how long `up` waits for the child to serve
STOP_WAIT = 30.0  # how long `up` waits for the child to stop after SIGTERM, then SIGKILL


@dataclass
class ApiChild:
    """The child serving the API on ``up``'s socket."""

    proc: asyncio.subprocess.Process

    @classmethod
    async def start(cls, settings: Settings, sock: socket.socket) -> ApiChild:
        """Start the child on ``sock`` and wait until it serves; RuntimeError if it ends or
        takes longer than START_WAIT."""
        env = {**os.environ, **settings.as_env(), "PYTHONUNBUFFERED": "1"}
        proc = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "services.up.api_process", str(sock.fileno()),
            cwd=PROJECT_ROOT, env=env, pass_fds=(sock.fileno(),),
            stdin=subprocess.PIPE, stdout=subprocess.PIPE,  # stderr: up's, the terminal
            # Its own session: a Ctrl-C at the terminal reaches up alone, which stops the
            # child after the rest (the child ending first would read as a crash).
            start_new_session=True,
        )  # fmt: skip
        child = cls(proc)
        assert proc.stdout is not None
        try:
            line = await asyncio.wait_for(proc.stdout.readline(), START_WAIT)
        except TimeoutError:
            line = b""
        if line != READY_LINE:
            await child.stop()
            raise RuntimeError(f"the API process did not start (exit {proc.returncode})")
        log.info("the API serves in a process of its own (pid %d)", proc.pid)
        return child

    async def ended(self) -> int:
        """Wait until the child ends; its exit code (logged)."""
        code = await self.proc.wait()
        log.error("the API process (pid %d) ended, exit code %d", self.proc.pid, code)
        return code

    async def stop(self) -> None:
        """SIGTERM, SIGKILL after STOP_WAIT; waits for it."""
        if self.proc.returncode is None:
            with contextlib.suppress(ProcessLookupError):
                self.proc.terminate()
            try:
                await asyncio.wait_for(self.proc.wait(), STOP_WAIT)
            except TimeoutError:
                log.warning("the API process did not stop within %.0fs: killed", STOP_WAIT)
                with contextlib.suppress(ProcessLookupError):
                    self.proc.kill()
                await self.proc.wait()
        if self.proc.stdin is not None:
            self.proc.stdin.close()


# ---------------------------------------------------------------------------------------------
# The child


async def _serve_child(settings: Settings, fd: int) -> int:
    from events.publisher import CommandPublisher
    from services.api.app import create_app
    from services.api.server import Tls, start_api
    from services.common.database import connect_pool
    from services.common.kafka_clients import kafka_client_args
    from services.common.tokens import TokenStore

    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    # up's end of the pipe closes when up ends, however it ends.
    loop.add_reader(sys.stdin.fileno(), _on_stdin, stop)
    sock = socket.socket(fileno=fd)  # family, type and protocol (TCP: no Nagle) as up bound it
    sock.setblocking(False)
    pool = await connect_pool(settings)
    publisher = CommandPublisher(kafka_client_args(settings, "api"),
                                 topic=settings.topic_commands)  # fmt: skip
    api = None
    try:
        await publisher.__aenter__()
        app = create_app(settings, pool, publisher, TokenStore.from_file(settings.tokens_file),
                         exec_driver=settings_exec_driver(settings))  # fmt: skip
        api = await start_api(
            app, settings.api_host, settings.api_port, sock=sock, tls=Tls.of(settings),
            trusted_proxies=settings.trusted_proxies,
        )  # fmt: skip
        os.write(sys.stdout.fileno(), READY_LINE)
        stopper = asyncio.ensure_future(stop.wait())
        await asyncio.wait([stopper, api.task], return_when=asyncio.FIRST_COMPLETED)
        stopper.cancel()
        return 0 if stop.is_set() else 1
    finally:
        loop.remove_reader(sys.stdin.fileno())
        if api is not None:
            await api.stop()
        else:
            sock.close()
        with contextlib.suppress(Exception):
            await publisher.__aexit__()
        await pool.close()


def _on_stdin(stop: asyncio.Event) -> None:
    if not os.read(sys.stdin.fileno(), 4096):
        log.warning("sandstream up is gone: the API process stops")
        stop.set()


def settings_exec_driver(settings: Settings) -> Literal["settings"] | None:
    """The exec driver an API without the plane's driver uses (this child, and `up` when its
    driver cannot exec): the settings' (none behind a routing prefix: the routing driver has
    no exec)."""
    return "settings" if settings.driver_route_prefix is None else None


def main() -> int:
    from services.common.entrypoint import configure_role_logging

    configure_role_logging()  # as the roles log (up's own module imports this one)
    return asyncio.run(_serve_child(Settings(), int(sys.argv[1])))


if __name__ == "__main__":
    sys.exit(main())
