"""How the checker starts the roles as processes: the one place that names their commands.

Each role runs as ``python -m <module>`` with the run's settings in ``SANDSTREAM_*``
variables, in its own session (so a signal reaches it and nothing else), its output appended
to a log file per instance.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from services.common.settings import PROJECT_ROOT, Settings

# The role commands, ``sandstream processor``, ``executor``, ``watcher`` and ``up`` (the executors
# and the watcher with SANDSTREAM_DRIVER=fake and SANDSTREAM_FAKE_STATE_FILE: one fake backend
# they all share, and SANDSTREAM_DRIVER_ROUTE_PREFIX: the run's few names on real Podman).
COMMANDS = {
    "processor": ["-m", "services.cli", "processor"],
    "executor": ["-m", "services.cli", "executor"],
    "watcher": ["-m", "services.cli", "watcher"],
    # The whole control plane in one process, as `sandstream up` runs it (the processor handing
    # its decided events to the executor beside it), on the run's stack instead of the local one.
    "up": ["-m", "services.cli", "up", "--no-stack"],
}


@dataclass
class RoleProcess:
    """One instance of a role, which can be killed and started again."""

    role: str
    index: int
    settings: Settings
    log_dir: Path
    proc: subprocess.Popen[bytes] | None = None

    @property
    def name(self) -> str:
        return f"{self.role}-{self.index}"

    @property
    def log(self) -> Path:
        return self.log_dir / f"{self.name}.log"

    def start(self) -> None:
        env = {**os.environ, **self.settings.as_env(), "PYTHONUNBUFFERED": "1"}
        self.log_dir.mkdir(parents=True, exist_ok=True)
        with self.log.open("ab") as out:
            out.write(f"\n--- {time.strftime('%F %T')} starting {self.name}\n".encode())
            out.flush()
            self.proc = subprocess.Popen(
                [sys.executable, *COMMANDS[self.role]],
                cwd=PROJECT_ROOT,
                env=env,
                stdin=subprocess.DEVNULL,
                stdout=out,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )

    def running(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def exit_code(self) -> int | None:
        """How the last process started ended; None while it runs (or before it started)."""
        return None if self.proc is None else self.proc.poll()

    def kill(self) -> None:
        """SIGKILL: no clean-up, no leaving the consumer group."""
        if self.running():
            assert self.proc is not None
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait()

    def stop(self, timeout: float = 30) -> None:
        """SIGTERM, SIGKILL after ``timeout``."""
        if self.proc is None:
            return
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.kill()
