"""The checker's table: what was injected and driven, and what the checks found."""

from __future__ import annotations

from services.chaos.faults import KINDS
from services.chaos.run import Result

SHOWN_FINDINGS = 20
# The driver side's observers, by the actor their observations carry.
OBSERVERS = (
    ("podman-watcher", "from the watcher: Podman events"),
    ("fake-watcher", "from the watcher: fake listings"),
    ("reconciler", "from reconcile passes"),
)


def _yes(held: bool | None) -> str:
    return {True: "yes", False: "NO", None: "-"}[held]


def table(result: Result) -> str:
    plan = result.plan
    roles = (
        f"{plan.ups} `sandstream up`"
        if plan.ups
        else f"{plan.processors} processors, {plan.executors} executors, 1 watcher"
    )
    handed = [  # the runs of `up` that were stopped at the end log theirs; killed ones do not
        f"  {'handed over in `up` (last runs)':<32}{sum(result.handed.values()):>8}",
        f"    {'queued at once':<30}{result.handed['queued']:>8}",
        f"  {'runs of `up` that queued some':<32}{result.runs_queued:>8}",
    ]
    if not plan.ups:
        handed = []
    lines = [
        f"chaos run: seed {plan.seed}, {plan.sandboxes} sandboxes on the fake and {plan.podman} "
        f"on Podman, {plan.duration:.0f}s of workload under faults, 3 Kafka brokers, "
        f"{roles}, {plan.partitions} partitions ({result.elapsed:.0f}s in all)",
        "",
        f"{'faults injected':<34}{sum(result.faults.values()):>8}",
        *(f"  {kind:<32}{result.faults[kind]:>8}" for kind in KINDS),
        f"{'commands sent (distinct ids)':<34}{result.commands:>8}",
        f"  {'acknowledged by the API':<32}{result.acknowledged:>8}",
        *(
            f"  {what:<32}{n:>8}"
            for what, n in sorted(result.workload.items())
            if not what.startswith("command ")
        ),
        f"{'inputs decided (history)':<34}{result.inputs:>8}",
        *(f"  {what:<32}{result.by_actor[actor]:>8}" for actor, what in OBSERVERS),
        f"{'decided events':<34}{result.events.decided:>8}",
        f"  {'republished after a crash':<32}{result.events.republished:>8}",
        *handed,
        f"{'polls refused: a gap before them':<34}{result.input_gaps:>8}",
        f"{'settled after healing':<34}{'yes' if result.settled else 'NO':>8}",
        f"{'watcher saw Podman after healing':<34}{_yes(result.watcher_sees_podman):>8}",
        f"{'rows checked against the backend':<34}{result.backend.rows:>8}",
        f"  {'on Podman':<32}{result.backend.podman_rows:>8}",
        f"    {'containers running':<30}{result.backend.podman_running:>8}",
        f"    {'divergences':<30}{result.backend.podman_divergences:>8}",
        f"{'lost':<34}{result.count('lost'):>8}",
        f"{'duplicated':<34}{result.count('duplicated'):>8}",
        f"{'divergences':<34}{result.count('divergence'):>8}",
        f"{'roles ended by themselves':<34}{result.count('ended'):>8}",
    ]
    for finding in result.findings[:SHOWN_FINDINGS]:
        lines.append(f"{finding.kind.upper()} [{finding.check}] {finding.detail}")
    if len(result.findings) > SHOWN_FINDINGS:
        lines.append(f"... and {len(result.findings) - SHOWN_FINDINGS} more")
    if not result.ok:
        lines.append(f"logs kept in {result.home}")
    return "\n".join(lines)
