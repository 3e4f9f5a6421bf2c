"""Typed errors: one class per condition a caller handles differently. Every error from the
API carries its HTTP status, the API's error code and its message."""

from __future__ import annotations

from typing import Any


class SandstreamError(Exception):
    """Any failure of a call to sandstream (the base of every error here)."""

    def __init__(self, message: str, *, status: int | None = None, code: str | None = None,
                 body: Any = None) -> None:  # fmt: skip
        super().__init__(message)
        self.message = message
        self.status = status
        self.code = code
        self.body = body


class AuthenticationError(SandstreamError):
    """401: no token, or one the API does not know (or revoked, or expired)."""


class ForbiddenError(SandstreamError):
    """403: the token lacks the scope the call needs (the message names it)."""


class NotFoundError(SandstreamError):
    """404: no such sandbox, or no such path in it."""


class ConflictError(SandstreamError):
    """409: the call conflicts with the sandbox's state."""


class AlreadyExistsError(ConflictError):
    """409 ALREADY_EXISTS: a live sandbox has the name (or mkdir of an existing path)."""


class VersionConflictError(ConflictError):
    """409 ABORTED: ``expected_version`` is not the sandbox's version."""


class NotReadyError(ConflictError):
    """FAILED_PRECONDITION (409 from commands and files, 412 from lifecycle calls): the sandbox
    is not in a phase that admits the call (commands and files need it Ready; start needs it
    Stopped, ...), or its runtime is not running. The message names the phase."""


class PathConflictError(ConflictError):
    """409 PATH_CONFLICT: the path itself refuses the file operation (a directory not empty, a
    read-only file system, the sandbox's own permissions). The sandbox is Ready: waiting or
    retrying the same call does not help; the message names the path and the reason."""


class TooLargeError(SandstreamError):
    """413: the request (a body, an upload) is above the API's limit."""


class InvalidArgumentError(SandstreamError):
    """422 (or 400, or 411 LENGTH_REQUIRED): the request is malformed; the message names the
    field. The SDK sends every upload with its length, so a 411 is a bug (of a proxy between
    or of the SDK), never worth a retry."""


class TooManySessionsError(SandstreamError):
    """429: too many commands run at once (per token, per sandbox or in all)."""


class UnavailableError(SandstreamError):
    """503: the API cannot reach Kafka, PostgreSQL or the runtime now; worth a retry."""


class NotSupportedError(SandstreamError):
    """501: a feature the server lacks."""


class SandboxError(SandstreamError):
    """The sandbox ended in Error (or Completed) while the SDK waited for it to be Ready."""


class TimeoutError(SandstreamError):
    """A wait ran out (for a phase), or a command ran past its timeout (it was ended;
    ``result`` then holds the output it wrote until then)."""

    result: Any = None


class CommandExitError(SandstreamError):
    """The command exited with a non-zero code (``commands.run`` raises it, as E2B's does);
    ``result`` holds its output and exit code."""

    def __init__(self, result: Any) -> None:
        super().__init__(f"the command exited with code {result.exit_code}: "
                         f"{result.stderr[-500:]}")  # fmt: skip
        self.result = result
        self.exit_code: int = result.exit_code
        self.stdout: str = result.stdout
        self.stderr: str = result.stderr


_BY_CODE: dict[str, type[SandstreamError]] = {
    "ALREADY_EXISTS": AlreadyExistsError,
    "ABORTED": VersionConflictError,
    "FAILED_PRECONDITION": NotReadyError,
    "PATH_CONFLICT": PathConflictError,
    "LENGTH_REQUIRED": InvalidArgumentError,
    "NOT_FOUND": NotFoundError,
    "PAYLOAD_TOO_LARGE": TooLargeError,
    "INVALID_ARGUMENT": InvalidArgumentError,
    "RESOURCE_EXHAUSTED": TooManySessionsError,
    "UNAVAILABLE": UnavailableError,
    "UNAUTHENTICATED": AuthenticationError,
    "PERMISSION_DENIED": ForbiddenError,
    "NOT_IMPLEMENTED": NotSupportedError,
    "DEADLINE_EXCEEDED": TimeoutError,  # the server's wait ran out (a wake on access)
}
_BY_STATUS: dict[int, type[SandstreamError]] = {
    400: InvalidArgumentError,
    401: AuthenticationError,
    403: ForbiddenError,
    404: NotFoundError,
    409: ConflictError,
    411: InvalidArgumentError,
    412: NotReadyError,
    413: TooLargeError,
    422: InvalidArgumentError,
    429: TooManySessionsError,
    501: NotSupportedError,
    503: UnavailableError,
    504: TimeoutError,
}


def error_of(status: int, body: Any, text: str) -> SandstreamError:
    """The typed error of an API answer: by its error code, else by its status."""
    code = message = None
    if isinstance(body, dict):
        code, message = body.get("code"), body.get("message")
    kind = _BY_CODE.get(str(code)) or _BY_STATUS.get(status, SandstreamError)
    shown = str(message) if message else (text[:500] or f"HTTP {status}")
    return kind(shown, status=status, code=str(code) if code else None, body=body)
