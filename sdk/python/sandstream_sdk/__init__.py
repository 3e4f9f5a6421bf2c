"""sandstream's Python SDK: sandboxes, the commands and files inside them, their logs; a
synchronous face (:class:`Sandbox`) and an asynchronous one (:class:`AsyncSandbox`) over one
transport. Depends on httpx and pydantic only, never on the server's packages.

Modules: ``sandbox`` and ``async_sandbox`` (the two faces), ``lifecycle`` (create, stop,
start, delete, waiting for a phase), ``commands`` (exec), ``files``, ``logs``, ``models``
(the answers), ``errors`` (typed errors), ``_transport`` (configuration, the calls, the
sync and async HTTP clients)."""

from sandstream_sdk.async_sandbox import AsyncCommands, AsyncFiles, AsyncSandbox
from sandstream_sdk.errors import (
    AlreadyExistsError,
    AuthenticationError,
    CommandExitError,
    ConflictError,
    ForbiddenError,
    InvalidArgumentError,
    NotFoundError,
    NotReadyError,
    NotSupportedError,
    PathConflictError,
    SandboxError,
    SandstreamError,
    TimeoutError,
    TooLargeError,
    TooManySessionsError,
    UnavailableError,
    VersionConflictError,
)
from sandstream_sdk.files import AsyncFileChunks, FileChunks
from sandstream_sdk.models import CommandResult, EntryInfo, LogLine, SandboxInfo
from sandstream_sdk.sandbox import Commands, Files, Sandbox

__all__ = [
    "AlreadyExistsError",
    "AsyncCommands",
    "AsyncFileChunks",
    "AsyncFiles",
    "AsyncSandbox",
    "AuthenticationError",
    "CommandExitError",
    "CommandResult",
    "Commands",
    "ConflictError",
    "EntryInfo",
    "FileChunks",
    "Files",
    "ForbiddenError",
    "InvalidArgumentError",
    "LogLine",
    "NotFoundError",
    "NotReadyError",
    "NotSupportedError",
    "PathConflictError",
    "Sandbox",
    "SandboxError",
    "SandboxInfo",
    "SandstreamError",
    "TimeoutError",
    "TooLargeError",
    "TooManySessionsError",
    "UnavailableError",
    "VersionConflictError",
]  # fmt: skip
