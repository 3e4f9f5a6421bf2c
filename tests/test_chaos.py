"""The fault-injection checker's short form (``make chaos`` runs the long one): a seeded
workload (a hundred sandboxes on the shared fake, two on real Podman) against two processors,
two executors and a watcher (processes) on a private three-broker cluster and PostgreSQL,
with every kind of fault injected at least once; nothing may be lost, duplicated or decided
differently, and the backend (the fake and Podman) agrees with the rows. Then the same with
`sandstream up` in place of the roles."""

from __future__ import annotations

from podman import PodmanClient

from drivers.protocol import LABEL_KEY
from services.chaos import report
from services.chaos.faults import KINDS
from services.chaos.run import Plan, Result, remove_home, run
from services.common.settings import Settings

SHORT = Plan(seed=5, sandboxes=100, podman=2, duration=30, fault_interval=(1.0, 3.0), partitions=4)
# One `up`: its processor and executor own the same partitions (but while the rebalance
# fault's joiner holds some), so every run of it hands events over; with two, a run's
# processor and executor can own disjoint halves and hand nothing its executor takes.
SHORT_UP = Plan(seed=7, sandboxes=60, podman=2, duration=20, fault_interval=(1.0, 3.0),
                partitions=4, ups=1)  # fmt: skip


async def test_a_short_chaos_run_loses_duplicates_diverges_and_leaves_nothing(
    settings: Settings, podman: PodmanClient
) -> None:
    await check_run(SHORT, settings, podman)


async def test_a_short_chaos_run_of_sandstream_up_loses_duplicates_diverges_and_leaves_nothing(
    settings: Settings, podman: PodmanClient
) -> None:
    """The same under `sandstream up` (the processor handing decided events to the executor
    beside it), killed by every kill fault: the hand-over's crash windows under faults."""
    result = await check_run(SHORT_UP, settings, podman)
    assert result.runs_queued > 0, result.handed  # the hand-over ran (killed runs count too)


async def check_run(plan: Plan, settings: Settings, podman: PodmanClient) -> Result:
    result = await run(plan, settings)
    table = report.table(result)
    print(table)
    assert all(result.faults[kind] >= 1 for kind in KINDS), table
    assert result.acknowledged > plan.sandboxes, table
    assert result.workload["retry"] > 0, table
    # A late observation needs a second generation already decided (the processors may lag
    # behind here), so the short form may have few; the long form has hundreds.
    assert result.inputs > result.commands, table  # the drivers' observations were decided
    assert result.settled, table
    assert result.backend.podman_rows == plan.podman, table  # created, checked on Podman
    assert result.watcher_sees_podman, table  # after every fault, the watcher sees Podman
    assert result.findings == [], table
    left = left_on_podman(podman, result.podman_prefix)
    assert left == [], f"the run left containers or workspaces on Podman: {left}"
    remove_home(result)
    return result


def left_on_podman(podman: PodmanClient, prefix: str) -> list[str]:
    """The containers and workspace volumes of sandboxes whose name starts with ``prefix``."""
    ours = [f"label={LABEL_KEY}"]
    containers = podman.containers.list(all=True, filters=ours)
    volumes = podman.volumes.list(filters=ours)
    labelled = [(c.name, c.labels) for c in containers]
    labelled += [(v.name, v.attrs.get("Labels") or {}) for v in volumes]
    return [str(name) for name, labels in labelled if labels[LABEL_KEY].startswith(prefix)]
