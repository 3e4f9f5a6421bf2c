"""The operator-lifecycle parts of `sandstream sandbox create` and `get`: --ttl durations, the
expiry and exit policies, the restart policy's options (shared with `restart-policy`), and the
rows `get` shows for deadlines, expiry, holds and restarts."""

from __future__ import annotations

import re
from enum import StrEnum
from typing import Annotated, Any

import typer

from events.common import RestartBackoff

_DURATION = re.compile(r"^(\d+)([smhd]?)$")
_UNIT = {"": 1, "s": 1, "m": 60, "h": 3600, "d": 86400}
# A back-off delay may be a fraction of a second: 0.5, 500ms, 1.5s, 2m, 1h.
_DELAY = re.compile(r"^(\d+(?:\.\d+)?)(ms|s|m|h)?$")
_DELAY_UNIT = {"ms": 0.001, "s": 1.0, "m": 60.0, "h": 3600.0}
_BACKOFF_BOUNDS = (0.01, 24 * 3600.0)  # events.common.BackoffSeconds
DEFAULT_BACKOFF = RestartBackoff()


class RestartChoice(StrEnum):
    Never = "Never"
    OnFailure = "OnFailure"
    Always = "Always"


RestartBackoffOpt = Annotated[
    str | None,
    typer.Option(
        "--restart-backoff",
        "--backoff",
        help="delay before the first restart in a row, doubling up to a cap: INITIAL[:MAX], "
        "e.g. 1s:5m or 500ms (the cap defaults to 5m)",
    ),
]
MaxRestartsOpt = Annotated[
    int | None,
    typer.Option("--max-restarts", min=0, help="restarts in a row, then it stays in Error"),
]


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


def _delay_seconds(text: str, option: str) -> float:
    match = _DELAY.match(text.strip())
    if match is None:
        raise typer.BadParameter(
            f"expected a delay like 500ms, 2s, 1.5s, 5m or 1h, got {text!r}", param_hint=option
        )
    seconds = float(match.group(1)) * _DELAY_UNIT[match.group(2) or "s"]
    low, high = _BACKOFF_BOUNDS
    if not low <= seconds <= high:
        raise typer.BadParameter(f"{text!r}: a delay must be from 10ms to 24h", param_hint=option)
    return seconds


def backoff_body(text: str | None, option: str = "--restart-backoff") -> dict[str, float] | None:
    """``INITIAL[:MAX]`` as the API's restart_backoff; a clear error for anything else."""
    if text is None:
        return None
    first, _, cap = text.partition(":")
    initial = _delay_seconds(first, option)
    maximum = _delay_seconds(cap, option) if cap else max(initial, DEFAULT_BACKOFF.max_seconds)
    if maximum < initial:
        raise typer.BadParameter(
            f"{text!r}: the cap must not be below the first delay", param_hint=option
        )
    return {"initial_seconds": initial, "max_seconds": maximum}


def restart_body(
    policy: RestartChoice | None, backoff: str | None, max_restarts: int | None
) -> dict[str, Any]:
    """The restart fields of a spec (create) or of a restart-policy request, those given."""
    body: dict[str, Any] = {
        "restart_policy": policy.value if policy else None,
        "restart_backoff": backoff_body(backoff),
        "max_restarts": max_restarts,
    }
    return {k: v for k, v in body.items() if v is not None}


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
    fields.append(idle_field(row))
    return fields + restart_fields(row)


def idle_field(row: dict[str, Any]) -> tuple[str, str]:
    """The `get` row of the idle timeout, the same for a sandbox and a template."""
    idle = (row.get("spec") or {}).get("idle_suspend_seconds")
    return ("Idle", f"suspended after {idle}s unused" if idle else "never suspended")


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
