"""The sandbox page (``/ui/sandboxes/{name}``): the row and its conditions, its timeline (every
input recorded about it, each with its disposition and reason, ignored late observations
included), the audit chain's state for a token with ``audit:read``, the actions for a token
with ``sandbox:write``; and a command's outcome (``/ui/commands/{id}``)."""

from __future__ import annotations

import re
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Annotated, Final, Literal

from fastapi import APIRouter, Depends, Request
from starlette.responses import HTMLResponse

from events.common import COMMAND_ID_PATTERN, SANDBOX_NAME_PATTERN
from events.outcomes import Code, CommandOutcome
from events.publisher import new_command_id
from services.api import readmodel
from services.api.console.render import html
from services.api.console.session import ROOT, Refused, Viewer, reader
from services.api.deps import ApiState, api_state
from services.api.errors import ApiError
from services.api.routes import commands
from services.audit.chains import check_chains
from services.common.names import resolve

TIMELINE: Final = 200  # inputs on one page of the timeline
VERBS: Final = ("stop", "start", "restart", "suspend", "resume", "hold", "release", "delete")
SANDBOX_PARTS: Final = "_sandbox.html"

router = APIRouter(include_in_schema=False)


@dataclass(frozen=True, slots=True)
class Notice:
    """What became of an action, in words, above the page."""

    kind: Literal["ok", "pending", "refused"]
    text: str
    command_id: str | None = None


@dataclass(frozen=True, slots=True)
class ChainState:
    intact: bool
    checked: int
    unchained: int
    broken: list[str]


def checked_name(name: str) -> str:
    if not re.fullmatch(SANDBOX_NAME_PATTERN, name):
        raise Refused(404, f"{name!r} is not a sandbox name (a DNS label)")
    return name


def checked_position(value: str | None, field: str) -> int | None:
    if value is None or value == "":
        return None
    if not value.isdigit() or len(value) > 18:
        raise Refused(422, f"query parameter {field!r}: expected a history position (a number)")
    return int(value)


def refusal(command_type: str, code: str | None, message: str) -> str:
    """Why a command was refused, in words; a stale page's version conflict most of all."""
    verb = command_type.removesuffix("Sandbox")
    if code == Code.ABORTED.value:
        return (
            f"{verb} refused: this page was out of date. The sandbox changed after the page "
            f"showed it ({message}). The page now shows it as it is: check what changed, then "
            "act again if you still mean to."
        )
    return f"{verb} refused: {message}"


def outcome_notice(outcome: CommandOutcome | None, command_id: str) -> Notice:
    if outcome is None:
        return Notice("pending", f"Command {command_id} was sent; its outcome is pending.",
                      command_id)  # fmt: skip
    verb = outcome.command_type.removesuffix("Sandbox")
    if outcome.accepted:
        return Notice("ok", f"{verb} accepted: {outcome.message}", command_id)
    return Notice("refused", refusal(outcome.command_type, outcome.code.value, outcome.message),
                  command_id)  # fmt: skip


async def chain_state(state: ApiState, name: str) -> ChainState:
    async with state.pool.acquire() as conn:
        report = await check_chains(conn, await resolve(conn, name))
    return ChainState(report.intact, report.checked, report.unchained,
                      [b.describe() for b in report.broken])  # fmt: skip


async def sandbox_page(
    viewer: Viewer,
    state: ApiState,
    name: str,
    *,
    before: int | None = None,
    notice: Notice | None = None,
    status: int = 200,
) -> HTMLResponse:
    """The page, also as the answer to a refused action (with the refusal above it)."""
    row = await readmodel.get_sandbox(state.pool, name, include_deleted=True)
    entries, earlier = await readmodel.recent_history(state.pool, name, TIMELINE, before)
    if row is None and not entries:
        raise Refused(404, f"sandbox {name!r} not found: no row and no recorded input")
    chain = await chain_state(state, name) if viewer.can_audit else None
    live = None
    if before is None:  # the latest inputs: the page follows what comes next
        after = entries[-1].seq if entries else 0
        live = f"{ROOT}/live/sandboxes/{name}?cursor={row.change_seq if row else 0}&after={after}"
    return html(
        "sandbox.html",
        status,
        viewer=viewer,
        name=name,
        row=row,
        entries=entries,
        earlier=earlier,
        chain=chain,
        notice=notice,
        live=live,
        commands={verb: new_command_id() for verb in VERBS},
        now=datetime.now(UTC),
    )


@router.get("/ui/sandboxes/{name}")
async def get_sandbox_page(
    name: str,
    viewer: Annotated[Viewer, Depends(reader)],
    state: Annotated[ApiState, Depends(api_state)],
    before: str | None = None,
    command: str | None = None,
) -> HTMLResponse:
    checked_name(name)
    notice = None
    if command and re.fullmatch(COMMAND_ID_PATTERN, command):
        notice = outcome_notice(await readmodel.get_outcome(state.pool, command, name), command)
    return await sandbox_page(
        viewer, state, name, before=checked_position(before, "before"), notice=notice
    )


@router.get("/ui/commands/{command_id}")
async def get_command_page(
    request: Request,
    command_id: str,
    viewer: Annotated[Viewer, Depends(reader)],
    state: Annotated[ApiState, Depends(api_state)],
    sandbox: str | None = None,
) -> HTMLResponse:
    if not re.fullmatch(COMMAND_ID_PATTERN, command_id):
        raise Refused(404, f"{command_id!r} is not a command id")
    if sandbox is not None:
        checked_name(sandbox)
    try:  # the API's own route: the same answer as GET /v1/commands/{id}
        found = await commands.get_command(command_id, viewer.principal, state, sandbox, None)
    except ApiError as exc:
        raise Refused(exc.status, exc.message) from None
    return html("command.html", viewer=viewer, command=found)
