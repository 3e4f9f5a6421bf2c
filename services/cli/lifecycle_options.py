"""The operator-lifecycle parts of `sandstream sandbox create` and `get`: --ttl durations, the
expiry and exit policies, and the rows `get` shows for deadlines, expiry and holds."""

from __future__ import annotations

import re
from enum import StrEnum
from typing import Any

import typer

_DURATION = re.compile(r"^(\d+)([smhd]?)$")
_UNIT = {"": 1, "s": 1, "m": 60, "h": 3600, "d": 86400}


class ExpiryChoice(StrEnum):
    stop = "stop"
    delete = "delete"


class ExitChoice(StrEnum):
    keep = "keep"
    delete = "delete"


def duration_seconds(text: str, option: str) -> int:
    """``90``, ``90s``, ``30m``, ``2h``, ``7d`` as seconds; a clear error otherwise."""
    match = _DURATION.match(text.strip())
    if match is None or int(match.group(1)) == 0:
        raise typer.BadParameter(
            f"expected a positive duration like 90s, 30m, 2h or 7d, got {text!r}",
            param_hint=option,
        )
    return int(match.group(1)) * _UNIT[match.group(2)]


def lifecycle_fields(row: dict[str, Any]) -> list[tuple[str, Any]]:
    """`get` rows: the phase deadline, the expiry and policies, the hold."""
    deadline = row.get("deadline")
    hold = row.get("hold")
    expires = row.get("expires_at")
    fields: list[tuple[str, Any]] = [
        ("Expires", f"{expires} (then {row['on_expiry']})" if expires else "never"),
        ("On exit", row.get("on_exit", "keep")),
    ]
    if deadline:
        retry = f", retry {deadline['attempt']}" if deadline.get("attempt") else ""
        fields.append(("Deadline", f"{deadline['kind']} by {deadline['due_at']}{retry}"))
    fields.append(
        ("Held", f"by {hold['by']} since {hold['since']}: {hold['reason']}" if hold else "no")
    )
    return fields + restart_fields(row)


def restart_fields(row: dict[str, Any]) -> list[tuple[str, Any]]:
    """`get` rows of the restart policy: the policy, restarts made, the last exit, the next."""
    policy = (row.get("spec") or {}).get("restart_policy") or "Never"
    fields: list[tuple[str, Any]] = [("Restarts", f"{row.get('restart_count', 0)} ({policy})")]
    last = row.get("last_exit")
    if last:
        fields.append(("Last exit", f"generation {last['generation']}: {last['reason']}"))
    if row.get("next_restart_at"):
        fields.append(("Next restart", row["next_restart_at"]))
    return fields
