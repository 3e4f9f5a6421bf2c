"""A sandbox's output (its main process's stdout and stderr, ``GET .../logs``) as a call."""

from __future__ import annotations

import json
from datetime import datetime
from typing import Any

from sandstream_sdk._transport import Call
from sandstream_sdk.models import LogLine


def logs_call(name: str, tail: int | None, since: datetime | None) -> Call:
    params: dict[str, Any] = {}
    if tail is not None:
        params["tail"] = tail
    if since is not None:
        params["since"] = since.isoformat()
    return Call("GET", f"/v1/sandboxes/{name}/logs", params)


def lines_of(text: str) -> list[LogLine]:
    return [LogLine.model_validate(json.loads(line)) for line in text.splitlines() if line]
