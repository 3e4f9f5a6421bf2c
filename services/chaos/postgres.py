"""A PostgreSQL server of the checker's own (initdb + pg_ctl on its own port and data dir), so
that restarting it breaks nobody else's tests; the machine's cluster is never touched.

Run as root, the server runs as the ``postgres`` user (``initdb`` refuses root).
"""

from __future__ import annotations

import os
import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path

from services.common.settings import Settings
from services.localstack import config as cfg

START_TIMEOUT = 60


class PostgresError(RuntimeError):
    pass


@dataclass
class PrivatePostgres:
    home: Path
    port: int
    version: str = "15"

    @property
    def data(self) -> Path:
        return self.home / "data"

    @property
    def sockets(self) -> Path:
        return self.home / "run"

    @property
    def log(self) -> Path:
        return self.home / "server.log"

    def _bin(self, name: str) -> str:
        return str(Path(f"/usr/lib/postgresql/{self.version}/bin") / name)

    def _run(self, *cmd: str, stdin: str | None = None) -> str:
        prefix = ["runuser", "-u", "postgres", "--"] if os.geteuid() == 0 else []
        result = subprocess.run(
            [*prefix, *cmd], input=stdin, capture_output=True, text=True, cwd="/", check=False
        )
        if result.returncode != 0:
            raise PostgresError(f"{' '.join(cmd)} failed:\n{result.stdout}{result.stderr}")
        return result.stdout

    def init(self, settings: Settings) -> None:
        """A fresh cluster with the settings' role, password and database; TCP clients log in
        with the password (SCRAM), as against the machine's server."""
        shutil.rmtree(self.home, ignore_errors=True)
        self.sockets.mkdir(parents=True)
        if os.geteuid() == 0:
            shutil.chown(self.home, "postgres", "postgres")
            shutil.chown(self.sockets, "postgres", "postgres")
        self._run(self._bin("initdb"), "-D", str(self.data), "-U", "postgres", "--no-sync",
                  "--auth-local=trust", "--auth-host=scram-sha-256", "-E", "UTF8")  # fmt: skip
        self.start()
        args = cfg.psql_bootstrap_args(settings)
        args[args.index("-p") + 1] = str(self.port)
        assert settings.pg_password is not None
        script = cfg.psql_bootstrap_input(settings.pg_password.get_secret_value(), os.urandom(16))
        self._run(*args, "-h", str(self.sockets), "-U", "postgres", stdin=script)

    def start(self) -> None:
        options = (
            f"-p {self.port} -k {self.sockets} -c listen_addresses=127.0.0.1 "
            "-c fsync=off -c max_connections=200 -c shared_buffers=64MB"
        )
        self._run(self._bin("pg_ctl"), "-D", str(self.data), "-l", str(self.log), "-o", options,
                  "-w", "-t", str(START_TIMEOUT), "start")  # fmt: skip

    def restart(self, mode: str = "fast") -> None:
        """Stop (``fast``: sessions ended, a checkpoint; ``immediate``: as a crash, recovery at
        start) and start again."""
        self.stop(mode)
        self.start()

    def stop(self, mode: str = "fast") -> None:
        if (self.data / "postmaster.pid").exists():
            self._run(self._bin("pg_ctl"), "-D", str(self.data), "-m", mode, "-w", "stop")

    def remove(self) -> None:
        self.stop("immediate")
        shutil.rmtree(self.home, ignore_errors=True)
