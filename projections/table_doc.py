"""Render the transition tables of ``projections.lifecycle`` as Markdown.

docs/state-machine.md embeds this output between markers; a test keeps the two in step, and
``python -m projections.table_doc --write`` refreshes the document.
"""

from __future__ import annotations

import sys
from pathlib import Path

from projections.lifecycle import (
    CLAIM_DETACHED,
    CLAIM_ROTATED,
    COMMAND_TABLE,
    DEADLINE_TABLE,
    DETACH_HELD,
    DETACH_NO_RESTART,
    DETACH_TABLE,
    EXIT_KINDS,
    FOLLOW_OBSERVED,
    HELD,
    IDLE_TABLE,
    KEEP_DELETING,
    KEEP_STOPPING,
    NO_RESTART,
    OBSERVATION_TABLE,
    PENDING_RESTART_TABLE,
    PHASE_COLUMNS,
    PHASE_DEADLINES,
    REFUSED_WHILE_HELD,
    RESTART,
    RESTART_POLICY_TABLE,
    ROTATION_TABLE,
    Admission,
)

DOC = Path(__file__).resolve().parent.parent / "docs" / "state-machine.md"
BEGIN, END = "<!-- tables:begin -->", "<!-- tables:end -->"
KINDS = [
    "created", "running", "stopping", "exited_ok", "exited_error", "removed",
    "launch_succeeded", "launch_failed",
    "stop_succeeded", "stop_absent", "stop_failed",
    "suspend_succeeded", "suspend_absent", "suspend_failed",
    "delete_succeeded", "delete_absent", "delete_failed",
]  # fmt: skip
_CELL = {Admission.ADMIT: "**admit**", Admission.IDEMPOTENT: "idempotent", Admission.REJECT: "—"}


def render() -> str:
    head = "| command | " + " | ".join(p.value for p in PHASE_COLUMNS) + " |"
    rule = "|---" * (len(PHASE_COLUMNS) + 1) + "|"
    lines = ["### Commands by phase", "", head, rule]
    for command, row in COMMAND_TABLE.items():
        lines.append(f"| {command} | " + " | ".join(_CELL[a] for a in row) + " |")
    lines += [
        "",
        "— is a rejection with FAILED_PRECONDITION. CreateSandbox is admitted only when the name "
        "is free or tombstoned (ALREADY_EXISTS otherwise); every other command on a free or "
        "tombstoned name is NOT_FOUND; a client `expected_version` that differs from the row's "
        "version is ABORTED before any of this.",
        "",
        "### Observations of the current generation by phase",
        "",
        "| observation | " + " | ".join(p.value for p in PHASE_COLUMNS) + " |",
        rule,
    ]
    for kind in KINDS:
        cells = []
        for phase in PHASE_COLUMNS:
            target = OBSERVATION_TABLE[phase].get(kind)  # type: ignore[call-overload]
            if target is None:
                cells.append("·")
            elif target == FOLLOW_OBSERVED:
                cells.append("observed phase")
            elif target == KEEP_STOPPING:
                cells.append("stays unless seen not running")
            elif target == KEEP_DELETING:
                cells.append("stays, failure recorded")
            else:
                cells.append(f"→ {target.value}")
        lines.append(f"| {kind} | " + " | ".join(cells) + " |")
    lines += [
        "",
        "· changes nothing (recorded as ignored, no new version). Observations of an older "
        "generation (stale), of a generation newer than any issued (unknown), of an unknown "
        "sandbox or of a tombstone are ignored before this table is consulted. A decided "
        "delete is never undone: only the delete's own report that nothing of the incarnation "
        "is left (its runtimes, workspace volume or claim, and the secrets the driver made for "
        "it) tombstones the row; a runtime seen removed is not that report (another container "
        "may still hold the workspace), and a failed delete stays Deleting (SandboxOperationFailed "
        "with phase Deleting, `reason` naming the retries so far and the next retry), its delete "
        "deadline kept: the retries go on until the backend confirms. A decided stop is never "
        "undone either: a failed stop ends the stop (Stopped) only when the backend was seen "
        "with the runtime not running (exited, created, or absent: gone already); seen running, "
        "or not seen, it stays Stopping (SandboxOperationFailed with phase Stopping, `reason` "
        "`StopFailed: still Stopping (...)` naming the retries so far and the next retry), with "
        "a retry deadline on the delete's back-off: the retries go on until the runtime is "
        "stopped, or a restart or delete takes over. Running lifts Error only when it is "
        "news: the row keeps the time of the exit that ended its generation (`exited_at`, "
        "the backend's clock: an exit with its code, including the one a restart policy gave "
        "up after), and a running of that generation dated no later is late (e.g. a start "
        "Podman's event stream sends again when it rotates its log) and is ignored. Without a "
        "known exit (a failed launch, a vanished runtime) any running lifts it.",
        "",
        "### Holds",
        "",
        "A held sandbox refuses "
        + ", ".join(REFUSED_WHILE_HELD)
        + " in every phase (FAILED_PRECONDITION naming who holds it, since when and why); "
        "its time to live waits until it is released, and a restart the restart policy "
        "scheduled waits too (it happens after the release). The completion policy does not "
        "act on an exit while held, and the release does not act on it either: the sandbox "
        "stays Completed or Error until deleted.",
        "",
        "### Deadlines",
        "",
        "| phase | deadline |",
        "|---|---|",
        *(f"| {phase.value} | {kind} |" for phase, kind in PHASE_DEADLINES.items()),
        "",
        "| DeadlineDue | what it does |",
        "|---|---|",
        *(f"| {kind} | {effect} |" for kind, effect in DEADLINE_TABLE.items()),
        "",
        "A DeadlineDue acts only when it names exactly the deadline the row holds (kind and "
        "due time; for ttl the row's expires_at) at the row's generation; anything else, "
        "including a repeat, is ignored. An idle DeadlineDue names no deadline of the row: "
        "the rule below decides it, and a repeat finds the row Suspending (or used since).",
        "",
        "### Idle suspend (DeadlineDue idle)",
        "",
        "| condition | if not |",
        "|---|---|",
        *(f"| {condition} | {effect} |" for condition, effect in IDLE_TABLE.items()),
        "",
        "### Restart policy (spec.restart_policy) by how the current generation ended",
        "",
        "| policy | " + " | ".join(EXIT_KINDS) + " |",
        "|---" * (len(EXIT_KINDS) + 1) + "|",
        *(
            f"| {policy} | " + " | ".join("**restart**" if y else "·" for y in row) + " |"
            for policy, row in RESTART_POLICY_TABLE.items()
        ),
        "",
        "An exit of the current generation (the runtime exited, vanished: removed outside "
        "sandstream, the launch failed, or the launch deadline fell due) under a policy marked "
        "**restart** keeps the phase it led to (Error or Completed) and schedules the restart: "
        "SandboxRestartScheduled, whose deadline of kind `restart` is due at the exit's "
        "`occurred_at` plus the back-off (`restart_backoff.initial_seconds`, doubling per restart "
        "in a row, at most `restart_backoff.max_seconds`; default 1 s to 300 s). When "
        "`max_restarts` restarts in a row were made already, the exit ends in Error instead "
        "(SandboxRestartsExhausted, reason `RestartLimit: ...`). A generation that was Ready for "
        "at least `restart_reset_seconds` (setting `SANDSTREAM_RESTART_RESET_SECONDS`, default "
        "600 s) before it ended resets the count of restarts in a row (SandboxRestartScheduled "
        "records `backoff_reset`); a restart for rotated credentials or a detached provider "
        "does not end that run. A hold defers a restart, never cancels it: an exit while "
        "held schedules it as ever, its DeadlineDue while held is ignored (deferred until "
        "released), and after ReleaseSandbox the scheduler's next DeadlineDue restarts it, at "
        "once if it fell due meanwhile (the row's reason says `once released` while held). "
        "The completion policy "
        "(`on_exit=delete`) applies only "
        "to an exit the policy does not restart (SandboxCompleted, SandboxFailed, "
        "SandboxTimedOut), and to the exit that reaches the limit (SandboxRestartsExhausted, "
        "whatever the exit was: a failed launch of a rotation or detach restart, "
        "AgentRestartFailed, included). A failed launch of such a restart that does not reach "
        "a limit (under Never, or with no policy) is no exit the completion policy acts on: the "
        "sandbox stays in Error (`tests/test_restart_policy.py`). Every "
        "restart's history entry names the policy and the attempt (so does the row's reason "
        "until the new generation is Ready).",
        "",
        "| while a restart is scheduled | what becomes of it |",
        "|---|---|",
        *(f"| {what} | {effect} |" for what, effect in PENDING_RESTART_TABLE.items()),
        "",
        "A DeadlineDue for a restart that is no longer scheduled is ignored.",
        "",
        "### Credential rotation (RotateCredentials) by phase",
        "",
        "| phase | a rotation of an attached provider |",
        "|---|---|",
    ]
    for phase in PHASE_COLUMNS:
        action = ROTATION_TABLE[phase]
        cell = (
            "**restart**: AgentRestarted, a new generation"
            if action == RESTART
            else (f"skip: AgentRestartSkipped ({action})")
        )
        lines.append(f"| {phase.value} | {cell} |")
    lines += [
        "",
        "One command per sandbox names every rotated provider it has attached, so it restarts "
        "once per update. Providers it has not attached: idempotent, nothing recorded but the "
        f"input. With `restart: false` every phase skips ({NO_RESTART}); a held sandbox skips in "
        f"every phase ({HELD}). A failed launch of a rotation restart (Starting) is "
        "AgentRestartFailed → Error.",
        "",
        "A rotation skipped because a launch is pending records its providers and revisions "
        "in the row (`awaited`). That launch reads the values when it runs, which may be "
        "before or after the rotation was stored, and its result (`DriverOperationResult."
        "credentials`) names the revision of each attached provider it read. On that result: "
        "Ready, and if it read an older revision than one awaited (or its revisions are "
        "unknown: a runtime made by an earlier, interrupted launch), AgentRestarted at once "
        "for those providers (AgentRestartSkipped if a hold was made meanwhile). While "
        "anything is awaited a running snapshot does not make the row Ready: "
        "Ready means running the newest values. So an agent restarts once for any number of "
        "rotations that arrive while its restart is pending, and a second time only when its "
        "launch had already read an older value (it must end up on the newest).",
        "",
        "A rotation skipped in Error is recorded in `awaited` too: that generation may be seen "
        "running again (a running snapshot lifts Error to Ready), and then, as after a launch "
        "whose read is unknown, it restarts at once onto the newest values (AgentRestartSkipped "
        "if held). Stopping never leads back to Ready (a failed stop stays Stopping), so a "
        "rotation skipped there applies at the next start. "
        "`awaited` is kept in Provisioning, Starting and Error "
        "(`projections.lifecycle.OWED_PHASES`); a new generation or any other phase clears it "
        "(the next start reads the newest values).",
        "",
        "A rotation naming only providers a claim attached to a pool member it adopted "
        "(`claim_providers`), while the adopted generation runs in Ready, restarts nothing: "
        f"AgentRestartSkipped ({CLAIM_ROTATED}). That process was started before the claim and "
        "never read them; they reach each exec through the doors (docs/pools.md). Its next "
        "start reads them, and from then on the table applies.",
        "",
        "### Detaching a provider (DetachProvider) by phase",
        "",
        "| phase | detaching an attached provider |",
        "|---|---|",
    ]
    for phase, action in DETACH_TABLE.items():
        cell = (
            "**restart**: ProviderDetached, then AgentRestarted (`detached`), a new generation "
            "launched without the provider"
            if action == RESTART
            else f"ProviderDetached only ({action})"
        )
        lines.append(f"| {phase.value} | {cell} |")
    lines += [
        "",
        "The agent must stop seeing a detached provider's values, as it must stop running a "
        "rotated value: a Ready sandbox restarts at once (both events on the one command). "
        f"With `restart: false` no phase restarts ({DETACH_NO_RESTART}); a held sandbox does "
        f"not either ({DETACH_HELD}). Deleting refuses the detach (the commands table). A "
        "failed launch of that restart is AgentRestartFailed → Error, as for a rotation.",
        "",
        "A detach while a launch is pending records the provider in the row's `awaited` with "
        "revision 0 (that launch must not have read it). On the launch's result: Ready, and if "
        "its `credentials` name the detached provider (it read the values before the detach) "
        "or are unknown, AgentRestarted at once without it; the running snapshot waits for that "
        "result, as for an awaited rotation. A detach in Error is recorded the same "
        "way: if that generation is seen running again, it restarts at once without the "
        "provider. Detaching a provider only a claim attached, while the adopted generation "
        f"runs in Ready, restarts nothing either: ProviderDetached only ({CLAIM_DETACHED}).",
    ]
    return "\n".join(lines)


def embedded(text: str) -> str:
    return text.split(BEGIN, 1)[1].split(END, 1)[0].strip()


def main() -> int:
    text = DOC.read_text()
    current = embedded(text)
    if "--write" in sys.argv:
        before, rest = text.split(BEGIN, 1)
        after = rest.split(END, 1)[1]
        DOC.write_text(f"{before}{BEGIN}\n{render()}\n{END}{after}")
        return 0
    if current != render():
        print("docs/state-machine.md is stale: run python -m projections.table_doc --write")
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
