"""Golden logs: recorded input logs of real runs (a Podman session with restarts, a rotation
under concurrent starts, a delete and re-create, a dead letter; a run whose processor was
SIGKILLed three times) must produce exactly the recorded histories, rows and outcomes with
today's rules. After an intended rule change: `python -m services.audit.golden regenerate`,
then review `git diff tests/golden`."""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

import changed_rules
import pytest
from harness import isolated_env

from projections import lifecycle
from services.audit import golden
from services.audit.verify import load_rules

FIXTURES = golden.fixture_names()


def test_there_are_golden_logs_of_real_runs() -> None:
    assert {"podman-session", "sigkill-run"} <= set(FIXTURES)


@pytest.mark.parametrize("name", FIXTURES)
def test_a_golden_log_gives_exactly_its_recorded_outcome(name: str) -> None:
    difference = golden.check(name)
    assert difference is None, (
        f"{name}: line {difference.line} differs\n  expected: {difference.expected}\n"
        f"  replayed: {difference.replayed}\nIf the rule change is intended, run "
        "`python -m services.audit.golden regenerate` and review `git diff tests/golden`."
    )


def test_a_changed_rule_fails_the_golden_check() -> None:
    difference = golden.check("podman-session", rules=changed_rules.decide)
    assert difference is not None and "StopSandbox" in (difference.expected or "")


def test_a_copy_of_the_rules_under_another_name_decides_with_its_own_modules(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """How ``audit verify --rules`` pins a release: its rules package copied under another
    name. The copy's modules import each other, not today's: a rule changed in the copy's
    admission table is what the copy decides with."""
    copy = tmp_path / "rules_copy"
    shutil.copytree(Path(lifecycle.__file__).parent, copy)
    table = copy / "commands.py"
    stop_row = '"StopSandbox":     (A,   A,    A,'
    text = table.read_text()
    assert stop_row in text
    table.write_text(text.replace(stop_row, '"StopSandbox":     (A,   A,    R,'))
    monkeypatch.syspath_prepend(str(tmp_path))
    try:
        rules = load_rules("rules_copy")
        assert rules.__module__ == "rules_copy.decisions"
        difference = golden.check("podman-session", rules=rules)
        assert difference is not None and "StopSandbox" in (difference.expected or "")
    finally:
        for name in [m for m in sys.modules if m.split(".")[0] == "rules_copy"]:
            del sys.modules[name]


async def test_the_real_processor_decides_a_golden_log_as_recorded() -> None:
    inputs = golden.load_inputs("podman-session")
    expected = [
        json.loads(line)["history"]
        for line in golden.expected_lines("podman-session")
        if line.startswith('{"history"')
    ]
    async with isolated_env(partitions=12) as env:
        await env.start_processor()
        s = env.settings
        topics = {"commands": s.topic_commands, "observations": s.topic_observations}
        for n, item in enumerate(inputs, start=1):
            # The recorded partition and order: one at a time, each decided before the next.
            await env.produce_to(topics[item.role], item.partition, item.key, item.value)
            await env.wait_applied(n)
        live = await env.fetch(
            "SELECT key, disposition, reason, phase, generation, version, event_types "
            "FROM history ORDER BY id"
        )
    got = [
        (r["key"], r["disposition"], r["reason"], r["phase"], r["generation"], r["version"],
         list(r["event_types"]))
        for r in live
    ]  # fmt: skip
    want = [
        (e["key"], e["disposition"], e["reason"], e["phase"], e["generation"], e["version"],
         e["events"])
        for e in expected
    ]  # fmt: skip
    assert got == want
