"""What the API answers, as pydantic models (unknown fields are kept, so a newer server's
answers still parse)."""

from __future__ import annotations

from datetime import datetime
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict


class _Answer(BaseModel):
    model_config = ConfigDict(extra="allow")


class SandboxInfo(_Answer):
    """One sandbox, as ``GET /v1/sandboxes/{name}`` shows it."""

    id: str
    name: str
    phase: str
    generation: int
    version: int
    spec: dict[str, Any]
    labels: dict[str, str] = {}
    reason: str | None = None
    exit_code: int | None = None
    created_at: datetime | None = None
    updated_at: datetime | None = None
    expires_at: datetime | None = None
    template: dict[str, Any] | None = None  # {name, revision} it was made from, if any


class CommandResult(_Answer):
    """A command's end: its exit code (None when its timeout ended it) and its output (each
    cut at the server's limit when not streamed; ``*_truncated`` says so)."""

    exit_code: int | None
    stdout: str
    stderr: str
    stdout_truncated: bool = False
    stderr_truncated: bool = False
    timed_out: bool = False

    @property
    def error(self) -> str | None:
        """E2B's name: the stderr of a failed command, None for a success."""
        return self.stderr if self.exit_code != 0 else None


class EntryInfo(_Answer):
    """A file, directory or link inside the sandbox."""

    name: str
    path: str
    type: Literal["file", "dir", "symlink", "other"]
    size: int
    mode: int
    mtime: float


class LogLine(_Answer):
    """One line the sandbox's main process wrote."""

    at: datetime
    stream: Literal["stdout", "stderr"]
    text: str
