"""A sandbox's lifecycle as calls (create, get, stop, start, suspend, resume, delete, extend,
idle-suspend) and the rule for
waiting on a phase: the faces poll ``GET /v1/sandboxes/{name}`` until :func:`settled` says
the goal is reached or cannot be."""

from __future__ import annotations

import secrets
from collections.abc import Mapping, Sequence
from typing import Any, Literal

from sandstream_sdk._transport import Call
from sandstream_sdk.errors import NotFoundError, SandboxError
from sandstream_sdk.models import SandboxInfo

# "suspend settled": no longer Suspending (Suspended, or Ready again after a failed suspend).
Goal = Literal["Ready", "Stopped", "Suspended", "gone", "suspend settled"]
Verb = Literal["stop", "start", "extend", "suspend", "resume", "idle-suspend"]
KEEP_ALIVE = ("sleep", "infinity")  # the main process when the caller names none
POLL_SECONDS = 0.25
DEFAULT_WAIT = 120.0
# The server decides a command within this (?wait=); reaching the phase is waited for after.
DECIDE_WAIT = 30


def new_name() -> str:
    return f"sb-{secrets.token_hex(5)}"


def create_call(
    name: str,
    image: str | None,
    template: str | None,
    *,
    command: Sequence[str] | None,
    env: Mapping[str, str] | None,
    labels: Mapping[str, str] | None,
    timeout: float | None,
    idle_suspend: int | None = None,
) -> Call:
    if template is not None:
        if idle_suspend is not None:
            raise ValueError(
                "idle_suspend: the template's spec sets it; create, then set_idle_suspend()"
            )
        return _from_template(name, image, template, command, env, labels, timeout)
    if not image:
        raise ValueError("image: required (the container image the sandbox runs)")
    spec: dict[str, Any] = {"image": image, "command": list(command or KEEP_ALIVE)}
    if env:
        spec["env"] = dict(env)
    if labels:
        spec["labels"] = dict(labels)
    if idle_suspend is not None:
        spec["idle_suspend_seconds"] = idle_suspend
    body: dict[str, Any] = {"name": name, "spec": spec}
    if timeout is not None:
        body["ttl_seconds"] = timeout
    return Call("POST", "/v1/sandboxes", {"wait": DECIDE_WAIT}, body, ok=(201, 202))


def _from_template(
    name: str,
    image: str | None,
    template: str,
    command: Sequence[str] | None,
    env: Mapping[str, str] | None,
    labels: Mapping[str, str] | None,
    timeout: float | None,
) -> Call:
    """A create from ``template`` (``NAME`` or ``NAME:REVISION``): env added or replaced,
    labels added, the time to live set; the image and the command are the template's."""
    if image is not None or command is not None:
        what = "image" if image is not None else "command"
        raise ValueError(f"{what}: set by the template; pass either template= or {what}=")
    ref, _, revision = template.partition(":")
    asked: dict[str, Any] = {"name": ref}
    if revision:
        if not revision.isdigit():
            raise ValueError(f"template: expected NAME or NAME:REVISION, got {template!r}")
        asked["revision"] = int(revision)
    overrides = {"env": dict(env or {}), "labels": dict(labels or {})}
    body: dict[str, Any] = {"name": name, "template": asked, "overrides": overrides}
    if timeout is not None:
        body["ttl_seconds"] = timeout
    return Call("POST", "/v1/sandboxes", {"wait": DECIDE_WAIT}, body, ok=(201, 202))


def get_call(name: str) -> Call:
    return Call("GET", f"/v1/sandboxes/{name}")


def command_call(name: str, verb: Verb, body: dict[str, Any] | None = None) -> Call:
    return Call("POST", f"/v1/sandboxes/{name}:{verb}", {"wait": DECIDE_WAIT}, body or {},
                ok=(200, 202))  # fmt: skip


def wake_body(info: SandboxInfo) -> dict[str, Any]:
    """A resume of ``info``'s suspended generation under a command id of this call alone
    (``resume:<id>:<generation>:v<version>:<random>``): the transport's retries of it are one
    command, and no other caller's is refused as a reuse of its id (a command id belongs to its
    first sender). A resume that finds the sandbox resuming already is decided as idempotent."""
    call = secrets.token_hex(6)
    return {"command_id": f"resume:{info.id}:{info.generation}:v{info.version}:{call}"}


def versioned(expected_version: int | None) -> dict[str, Any]:
    return {} if expected_version is None else {"expected_version": expected_version}


def delete_call(name: str) -> Call:
    return Call("DELETE", f"/v1/sandboxes/{name}", {"wait": DECIDE_WAIT}, ok=(200, 202))


def info_of(body: Any) -> SandboxInfo:
    return SandboxInfo.model_validate(body)


def settled(goal: Goal, info: SandboxInfo | None) -> bool:
    """True once ``goal`` holds; False while it may still come; SandboxError when the sandbox
    ended elsewhere (Error, Completed), NotFoundError when it is gone before Ready/Stopped."""
    if goal == "gone":
        return info is None
    if info is None:
        raise NotFoundError("the sandbox is gone", status=404, code="NOT_FOUND")
    if info.phase == goal:
        return True
    if goal == "suspend settled":
        return info.phase != "Suspending"
    if goal == "Stopped" and info.phase == "Suspended":
        return True  # nothing runs: the server answers a stop "nothing to do"
    if info.phase in ("Error", "Completed") and goal in ("Ready", "Suspended"):
        why = info.reason or (f"exit code {info.exit_code}" if info.exit_code is not None else "")
        raise SandboxError(f"sandbox {info.name!r} is {info.phase}: {why}".rstrip(": "))
    return False


def resumable(info: SandboxInfo) -> bool:
    """Whether a resume is what ``info`` needs to run again: Suspended. Ready, Provisioning or
    Starting (another caller's resume, a wake) need only a wait for Ready; any other phase is
    left to the server's answer to the resume."""
    return info.phase not in ("Ready", "Provisioning", "Starting")


def expired_while_suspended(info: SandboxInfo) -> str | None:
    """Why an implicit resume (``connect``) must not bring ``info`` back: its time to live
    ended (the server refuses a wake of it; an explicit :meth:`resume` may still)."""
    if (
        info.phase == "Suspended"
        and info.expires_at is None
        and (info.reason or "").startswith("Expired:")
    ):
        return (
            f"sandbox {info.name!r} is Suspended and its time to live ended: give it one "
            "(set_timeout) or resume() it explicitly"
        )
    return None
