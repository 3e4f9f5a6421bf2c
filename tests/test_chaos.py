"""The fault-injection checker's short form (``make chaos`` runs the long one): a seeded
workload against two processors and two executors (processes) on a private three-broker
cluster and PostgreSQL, with every kind of fault injected at least once; nothing may be
lost, duplicated or decided differently."""

from __future__ import annotations

from services.chaos import report
from services.chaos.faults import KINDS
from services.chaos.run import Plan, remove_home, run
from services.common.settings import Settings

SHORT = Plan(seed=5, sandboxes=100, duration=30, fault_interval=(1.0, 3.0), partitions=4)


async def test_a_short_chaos_run_loses_duplicates_and_diverges_nothing() -> None:
    result = await run(SHORT, Settings())
    table = report.table(result)
    print(table)
    assert all(result.faults[kind] >= 1 for kind in KINDS), table
    assert result.acknowledged > SHORT.sandboxes, table
    assert result.workload["retry"] > 0, table
    # A late observation needs a second generation already decided (the processors may lag
    # behind here), so the short form may have few; the long form has hundreds.
    assert result.inputs > result.commands, table  # the drivers' observations were decided
    assert result.settled, table
    assert result.findings == [], table
    remove_home(result)
