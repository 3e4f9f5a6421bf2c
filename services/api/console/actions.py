"""The console's actions: stop, start, restart, hold, release and delete, each a form posted
with the page's version as ``expected_version``. They run the API's own route handlers (the same
command, the same gateway, the same answers); the console only turns the answer into a page: a
redirect to the sandbox (accepted, or pending) or the page again with the refusal in words, under
the refusal's status (409 for a stale page). Delete asks first, on a page of its own."""

from __future__ import annotations

import json
import re
from typing import Annotated, Any, Final

from fastapi import APIRouter, Depends
from pydantic import ValidationError
from starlette.requests import Request
from starlette.responses import HTMLResponse, RedirectResponse, Response

from events.commands import (
    DeleteSandbox,
    RestartSandbox,
    ResumeSandbox,
    StartSandbox,
    StopSandbox,
    SuspendSandbox,
)
from events.common import COMMAND_ID_PATTERN
from events.publisher import new_command_id
from services.api.console.render import html
from services.api.console.sandbox import Notice, checked_name, refusal, sandbox_page
from services.api.console.session import ROOT, Refused, Viewer, acting_form, reader
from services.api.deps import ApiState, api_state
from services.api.errors import describe_validation
from services.api.models import HoldRequest, LifecycleRequest
from services.api.routes import commands
from services.api.routes import lifecycle as operator
from services.common.tokens import WRITE

WAIT: Final = 10.0  # seconds an action waits for its outcome before the page says "pending"
Kind = type[
    StopSandbox | StartSandbox | RestartSandbox | SuspendSandbox | ResumeSandbox | DeleteSandbox
]
KINDS: Final[dict[str, Kind]] = {"stop": StopSandbox, "start": StartSandbox,
                                 "restart": RestartSandbox, "suspend": SuspendSandbox,
                                 "resume": ResumeSandbox, "delete": DeleteSandbox}  # fmt: skip
COMMAND_TYPES: Final = {"hold": "HoldSandbox", "release": "ReleaseSandbox",
                        **{verb: kind.__name__ for verb, kind in KINDS.items()}}  # fmt: skip

router = APIRouter(include_in_schema=False)


def request_of(verb: str, form: dict[str, str]) -> LifecycleRequest:
    """The API request body the form stands for (validated by the API's own model)."""
    version = form.get("expected_version", "")
    if not version.isdigit() or len(version) > 18:
        raise Refused(422, "field 'expected_version': the page's version is missing (reload)")
    command_id = form.get("command_id") or new_command_id()
    if not re.fullmatch(COMMAND_ID_PATTERN, command_id):
        command_id = new_command_id()
    fields: dict[str, Any] = {"command_id": command_id, "expected_version": int(version)}
    try:
        if verb == "hold":
            return HoldRequest.model_validate({**fields, "reason": form.get("reason", "")})
        return LifecycleRequest.model_validate(fields)
    except ValidationError as exc:
        raise Refused(422, describe_validation(list(exc.errors()))) from None


async def run(
    verb: str, name: str, viewer: Viewer, state: ApiState, body: LifecycleRequest
) -> Response:
    """The API's handler of this verb, called as its route would call it."""
    if verb == "hold":
        assert isinstance(body, HoldRequest)
        return await operator.hold_sandbox(name, body, viewer.principal, state, WAIT)
    if verb == "release":
        return await operator.release_sandbox(name, viewer.principal, state, body, WAIT)
    handler = commands.lifecycle(KINDS[verb])
    answer: Response = await handler(name, viewer.principal, state, body, WAIT)
    return answer


@router.post("/ui/sandboxes/{name}/{verb}")
async def act(
    request: Request, name: str, verb: str, state: Annotated[ApiState, Depends(api_state)]
) -> Response:
    checked_name(name)
    if verb not in COMMAND_TYPES:
        raise Refused(404, f"no such action: {verb!r}")
    viewer, form = await acting_form(request, WRITE)
    if verb == "delete" and form.get("confirm") != name:
        raise Refused(422, f"delete: not confirmed (the confirmation must name {name!r})")
    body = request_of(verb, form)
    answer = await run(verb, name, viewer, state, body)
    result = json.loads(bytes(answer.body))
    if answer.status_code in (200, 201, 202) and result.get("status") != "rejected":
        return RedirectResponse(f"{ROOT}/sandboxes/{name}?command={result['command_id']}", 303)
    message = result.get("message", "refused")
    words = refusal(COMMAND_TYPES[verb], result.get("code"), message)
    notice = Notice("refused", words, result.get("command_id"))
    return await sandbox_page(viewer, state, name, notice=notice, status=answer.status_code)


@router.get("/ui/sandboxes/{name}/delete")
async def confirm_delete(
    name: str, viewer: Annotated[Viewer, Depends(reader)], version: str = ""
) -> HTMLResponse:
    checked_name(name)
    if not version.isdigit() or len(version) > 18:
        raise Refused(422, "query parameter 'version': the version to delete at (a number)")
    return html("confirm_delete.html", viewer=viewer, name=name, version=int(version),
                command_id=new_command_id())  # fmt: skip
