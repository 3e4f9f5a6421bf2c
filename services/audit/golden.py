"""Golden logs: recorded input logs of real runs, replayed through today's rules in CI.

A fixture is two files in ``tests/golden/``:

- ``NAME.log.jsonl``: the input records of a real run in the order the processor decided them
  (topic role, partition, offset, record timestamp, key and value bytes as recorded);
- ``NAME.expected.jsonl``: what they must produce, one line per history entry (decision,
  resulting phase/generation/version/incarnation, events, chain hash), then the final rows and
  the command outcomes.

The replay is the processor's own path (its intake and plan stages: parse, fold, batch
planning, hash chain) with the default topic names, so event ids and hashes do not depend on
where the run was recorded.

Recording (``record``) reads a live environment's history and log, replays it, and refuses if
the replay does not reproduce the run's decisions. ``regenerate`` rewrites every expected file
with today's rules: the deliberate step after changing an intended rule, whose diff is then
reviewed. ``check`` is what the test runs.

    python -m services.audit.golden record NAME      # from the environment's settings
    python -m services.audit.golden regenerate
    python -m services.audit.golden check
"""

from __future__ import annotations

import asyncio
import base64
import json
import sys
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import asyncpg
from aiokafka import ConsumerRecord

from events.topics import COMMANDS, DEADLETTER, EVENTS, OBSERVATIONS
from projections.fold import Rules
from projections.lifecycle import Sandbox, decide
from projections.store import HistoryRow
from services.audit.entries import ENTRY_COLUMNS, entry_from_record
from services.audit.log import read_partition
from services.common.kafka_clients import kafka_client_args
from services.common.settings import PROJECT_ROOT, Settings
from services.processor.intake import parse
from services.processor.plan import Replay

GOLDEN_DIR = PROJECT_ROOT / "tests" / "golden"
ROLES = {"commands": COMMANDS, "observations": OBSERVATIONS}


@dataclass(frozen=True, slots=True)
class Input:
    role: str  # commands | observations
    partition: int
    offset: int
    timestamp: int  # the record's timestamp (ms): a dead letter records it
    key: bytes | None
    value: bytes | None
    # 1: the broker stamped it on append (LogAppendTime), which a command's time never
    # precedes (services.processor.intake.entered); 0, CreateTime, is left out of the JSON.
    timestamp_type: int = 0

    def to_json(self) -> dict[str, Any]:
        kept = {"timestamp_type": self.timestamp_type} if self.timestamp_type else {}
        return {"role": self.role, "partition": self.partition, "offset": self.offset,
                "timestamp": self.timestamp, **kept, "key": _text(self.key),
                "value": _text(self.value)}  # fmt: skip

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> Input:
        return cls(d["role"], d["partition"], d["offset"], d["timestamp"], _bytes(d["key"]),
                   _bytes(d["value"]), d.get("timestamp_type", 0))  # fmt: skip

    def record(self) -> ConsumerRecord[bytes, bytes]:
        return ConsumerRecord(
            topic=ROLES[self.role], partition=self.partition, offset=self.offset,
            timestamp=self.timestamp, timestamp_type=self.timestamp_type, key=self.key,
            value=self.value,
            checksum=None, serialized_key_size=len(self.key or b""),
            serialized_value_size=len(self.value or b""), headers=(),
        )  # fmt: skip


def _text(raw: bytes | None) -> dict[str, str] | str | None:
    """Bytes as text when they are UTF-8, else as {"base64": ...}: exact either way."""
    if raw is None:
        return None
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError:
        return {"base64": base64.b64encode(raw).decode()}


def _bytes(value: dict[str, str] | str | None) -> bytes | None:
    if value is None:
        return None
    return base64.b64decode(value["base64"]) if isinstance(value, dict) else value.encode()


def replay(
    inputs: Sequence[Input], rules: Rules = decide, partitions: int = 12, chunk: int = 500
) -> list[str]:
    """The expected lines: each input's history entry, then the rows and the outcomes."""
    # The default topic names: ids and hashes do not depend on where the run was recorded.
    settings = Settings().model_copy(
        update={
            "topic_events": EVENTS,
            "topic_deadletter": DEADLETTER,
            "kafka_partitions": partitions,
        }
    )
    decider = Replay(settings, rules)
    history: list[HistoryRow] = []
    for start in range(0, len(inputs), chunk):
        items = [
            parse(
                i.record(),
                COMMANDS,
                settings.kafka_partitions,
                max_bytes=settings.processor_max_input_bytes,
            )
            for i in inputs[start : start + chunk]
        ]
        history.extend(decider.decide(items).plan.history)
    lines = [json.dumps({"history": _history(h)}, sort_keys=True) for h in history]
    lines += [
        json.dumps({"row": _row(s)}, sort_keys=True)
        for _, s in sorted(decider.states.items())
        if s is not None
    ]
    lines += [
        json.dumps({"outcome": o.model_dump(mode="json")}, sort_keys=True)
        for _, o in sorted(decider.outcomes.items())
    ]
    return lines


def _history(h: HistoryRow) -> dict[str, Any]:
    return {
        "key": h.key, "at": f"{h.topic}[{h.partition}]@{h.offset}", "input": h.message_type,
        "disposition": h.disposition, "reason": h.reason, "phase": h.phase,
        "generation": h.generation, "version": h.version, "events": h.event_types,
        "sandbox_id": str(h.sandbox_id) if h.sandbox_id else None,
        "hash": h.entry_hash.hex() if h.entry_hash else None,
    }  # fmt: skip


def _row(s: Sandbox) -> dict[str, Any]:
    return {
        "key": s.key, "sandbox_id": str(s.sandbox_id), "phase": s.phase.value,
        "generation": s.generation, "version": s.version, "identity": s.identity,
        "providers": list(s.providers), "exit_code": s.exit_code, "reason": s.reason,
        "spec": s.spec.model_dump(mode="json"), "created_at": s.created_at.isoformat(),
        "updated_at": s.updated_at.isoformat(),
    }  # fmt: skip


# ---------------------------------------------------------------------------------------------
# Fixtures on disk


def fixture_names(directory: Path = GOLDEN_DIR) -> list[str]:
    return sorted(p.name.removesuffix(".log.jsonl") for p in directory.glob("*.log.jsonl"))


def load_inputs(name: str, directory: Path = GOLDEN_DIR) -> list[Input]:
    path = directory / f"{name}.log.jsonl"
    return [Input.from_json(json.loads(line)) for line in path.read_text().splitlines() if line]


def fixture_partitions(name: str, directory: Path = GOLDEN_DIR) -> int:
    """The input topics' partition count of the recorded run (``NAME.meta.json``): the
    processor checks every record's partition against it, so a replay must use the same."""
    meta = directory / f"{name}.meta.json"
    return int(json.loads(meta.read_text())["partitions"]) if meta.exists() else 12


def expected_lines(name: str, directory: Path = GOLDEN_DIR) -> list[str]:
    return (directory / f"{name}.expected.jsonl").read_text().splitlines()


def write_fixture(
    name: str, inputs: Iterable[Input], partitions: int, directory: Path = GOLDEN_DIR
) -> int:
    directory.mkdir(parents=True, exist_ok=True)
    listed = list(inputs)
    log = "".join(json.dumps(i.to_json(), sort_keys=True) + "\n" for i in listed)
    (directory / f"{name}.log.jsonl").write_text(log)
    (directory / f"{name}.meta.json").write_text(json.dumps({"partitions": partitions}) + "\n")
    expected = replay(listed, partitions=partitions)
    (directory / f"{name}.expected.jsonl").write_text("\n".join(expected) + "\n")
    return len(listed)


@dataclass(frozen=True, slots=True)
class Difference:
    fixture: str
    line: int  # 1-based line of the expected file
    expected: str | None
    replayed: str | None


def check(name: str, directory: Path = GOLDEN_DIR, rules: Rules = decide) -> Difference | None:
    """The first line where today's replay differs from the fixture (None: identical)."""
    want = expected_lines(name, directory)
    got = replay(load_inputs(name, directory), rules, fixture_partitions(name, directory))
    for n in range(max(len(want), len(got))):
        a = want[n] if n < len(want) else None
        b = got[n] if n < len(got) else None
        if a != b:
            return Difference(name, n + 1, a, b)
    return None


# ---------------------------------------------------------------------------------------------
# Recording from a live environment


async def recorded_inputs(settings: Settings) -> list[Input]:
    """The environment's inputs in decision order, with their exact bytes from the log.

    Refuses when the replay of them would not reproduce the run's recorded decisions."""
    conn = await asyncpg.connect(
        settings.pg_dsn, server_settings={"search_path": settings.pg_schema}
    )
    try:
        entries = [
            entry_from_record(r)
            for r in await conn.fetch(f"SELECT {ENTRY_COLUMNS} FROM history ORDER BY id")
        ]
    finally:
        await conn.close()
    roles = {settings.topic_commands: "commands", settings.topic_observations: "observations"}
    records: dict[tuple[str, int, int], Any] = {}
    for p in sorted({e.partition for e in entries}):
        found = await read_partition(kafka_client_args(settings, "audit"), list(roles), p)
        records.update({(r.topic, p, r.offset): r for rs in found.values() for r in rs})
    inputs = []
    for e in entries:
        r = records.get((e.topic, e.partition, e.offset))
        if r is None:
            raise RuntimeError(f"{e.topic}[{e.partition}]@{e.offset} is no longer in the log")
        stamped = (r.timestamp, r.key, r.value, r.timestamp_type)
        inputs.append(Input(roles[e.topic], e.partition, e.offset, *stamped))
    replayed = [
        json.loads(line)["history"]
        for line in replay(inputs, partitions=settings.kafka_partitions)[: len(entries)]
    ]
    for e, again in zip(entries, replayed, strict=True):
        recorded = (e.disposition, e.reason, e.phase, e.generation, e.version, e.event_types)
        now = (again["disposition"], again["reason"], again["phase"], again["generation"],
               again["version"], again["events"])  # fmt: skip
        if recorded != now:
            raise RuntimeError(
                f"today's rules do not reproduce {e.topic}[{e.partition}]@{e.offset}: "
                f"recorded {recorded}, replayed {now}"
            )
    return inputs


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if args[:1] == ["record"] and len(args) == 2:
        settings = Settings()
        inputs = asyncio.run(recorded_inputs(settings))
        count = write_fixture(args[1], inputs, settings.kafka_partitions)
        print(f"recorded {count} inputs as tests/golden/{args[1]}")
        return 0
    if args == ["regenerate"]:
        for name in fixture_names():
            write_fixture(name, load_inputs(name), fixture_partitions(name))
            print(f"regenerated tests/golden/{name}.expected.jsonl: review `git diff tests/golden`")
        return 0
    if args == ["check"]:
        failed = 0
        for name in fixture_names():
            difference = check(name)
            failed += difference is not None
            print(
                f"{name}: " + ("ok" if difference is None else f"differs at line {difference.line}")
            )
        return 1 if failed else 0
    print(
        "usage: python -m services.audit.golden record NAME | regenerate | check", file=sys.stderr
    )
    return 2


if __name__ == "__main__":
    raise SystemExit(main())
