"""The stack's own tools: config rendering (pure) and the SQL migration runner (real PostgreSQL)."""

from __future__ import annotations

import uuid
from pathlib import Path

import asyncpg
import pytest

from services.common.migrations import MigrationError, apply_migrations, discover_migrations
from services.common.settings import Settings
from services.localstack import config as cfg
from services.localstack import processes


def rendered(settings: Settings) -> dict[str, str]:
    text = cfg.render_server_properties(cfg.KAFKA_PROPERTIES_TEMPLATE.read_text(), settings)
    return dict(
        line.split("=", 1) for line in text.splitlines() if line and not line.startswith("#")
    )


def test_server_properties_render_from_settings(tmp_path: Path) -> None:
    settings = Settings(
        state_dir=tmp_path, kafka_bootstrap="127.0.0.1:29092", kafka_controller_port=29093
    )
    props = rendered(settings)
    assert props["listeners"] == "PLAINTEXT://127.0.0.1:29092,CONTROLLER://127.0.0.1:29093"
    assert props["controller.quorum.voters"] == "1@127.0.0.1:29093"
    assert props["log.dirs"] == str(tmp_path / "kafka" / "data")
    assert props["auto.create.topics.enable"] == "false"
    assert props["num.partitions"] == str(settings.kafka_partitions)


def test_the_log_cleaners_buffer_leaves_the_brokers_heap_to_the_broker(tmp_path: Path) -> None:
    """Kafka's default dedupe buffer (128 MiB, taken on the heap when the cleaner starts) kept
    the local broker's 384 MiB heap above G1's marking threshold for good: a concurrent cycle
    every couple of seconds under load (docs/benchmarks.md)."""
    default = str(Settings.model_fields["kafka_heap"].default)  # not an override from the env
    heap = int(default[:-1]) << {"k": 10, "m": 20, "g": 30}[default[-1].lower()]
    buffer = int(rendered(Settings(state_dir=tmp_path))["log.cleaner.dedupe.buffer.size"])
    assert buffer * 8 <= heap


def test_the_brokers_jvm_compiles_with_the_first_tier_only(tmp_path: Path) -> None:
    """C2 cost a fresh local broker half its CPU (docs/benchmarks.md, "The broker's JVM"); the
    flag sits before the main class, where java reads its own options."""
    cmd = cfg.kafka_java_command(Settings(state_dir=tmp_path), "kafka.Kafka", "server.properties")
    assert cmd.index("-XX:TieredStopAtLevel=1") < cmd.index("kafka.Kafka")


def test_helpers() -> None:
    assert cfg.split_host_port("127.0.0.1:19092") == ("127.0.0.1", 19092)
    assert cfg.split_host_port("[::1]:5432") == ("::1", 5432)
    assert cfg.is_local_host("localhost") and cfg.is_local_host("127.0.0.2")
    assert not cfg.is_local_host("10.0.0.1") and not cfg.is_local_host("kafka.example")
    cluster_id = cfg.new_kafka_cluster_id()
    assert len(cluster_id) == 22 and not cluster_id.startswith("-")


def test_a_process_just_spawned_is_found_running_by_its_pid_file(tmp_path: Path) -> None:
    """Right after spawn the child may still be in exec, its command line empty: it is ours
    all the same (a second start must not start another; a stop must not miss it)."""
    marker = str(tmp_path / "marker.properties")
    for attempt in range(20):  # the exec window is short: look right after each of several
        pidfile = tmp_path / f"{attempt}.pid"
        proc = processes.spawn(
            ["sh", "-c", "sleep 60", marker], log=tmp_path / "log", pidfile=pidfile
        )
        try:
            assert processes.live_pid(pidfile, marker) == proc.pid
        finally:
            proc.kill()
            proc.wait()
    assert processes.live_pid(pidfile, marker) is None  # and a dead one is not


def _write(directory: Path, files: dict[str, str]) -> Path:
    directory.mkdir(exist_ok=True)
    for name, sql in files.items():
        (directory / name).write_text(sql)
    return directory


async def test_migrations_apply_once_each_in_order_into_a_fresh_schema(
    settings: Settings, tmp_path: Path
) -> None:
    schema = f"test_migrations_{uuid.uuid4().hex[:10]}"
    migrations = _write(
        tmp_path / "m",
        {
            "0002_rows.sql": "INSERT INTO t (v) VALUES ('second');",
            "0001_table.sql": "CREATE TABLE t (v text); INSERT INTO t (v) VALUES ('first');",
            "README.md": "not a migration",
        },
    )
    conn = await asyncpg.connect(settings.pg_dsn)
    try:
        assert await apply_migrations(settings.pg_dsn, migrations, schema=schema) == [
            "0001_table.sql",
            "0002_rows.sql",
        ]
        assert await apply_migrations(settings.pg_dsn, migrations, schema=schema) == []
        values = await conn.fetch(f'SELECT v FROM "{schema}".t ORDER BY v')
        assert [r["v"] for r in values] == ["first", "second"]
        names = await conn.fetch(f'SELECT name FROM "{schema}".schema_migrations ORDER BY name')
        assert [r["name"] for r in names] == ["0001_table.sql", "0002_rows.sql"]
        assert await conn.fetchval("SELECT to_regclass('public.t')") is None

        # A failing file rolls back alone and stays pending; earlier ones stay applied.
        _write(migrations, {"0003_bad.sql": "INSERT INTO t (v) VALUES ('x'); SELECT 1/0;"})
        with pytest.raises(MigrationError, match=r"0003_bad\.sql"):
            await apply_migrations(settings.pg_dsn, migrations, schema=schema)
        assert await conn.fetchval(f'SELECT count(*) FROM "{schema}".t') == 2
        (migrations / "0003_bad.sql").write_text("INSERT INTO t (v) VALUES ('third');")
        assert await apply_migrations(settings.pg_dsn, migrations, schema=schema) == [
            "0003_bad.sql"
        ]
    finally:
        await conn.execute(f'DROP SCHEMA IF EXISTS "{schema}" CASCADE')
        await conn.close()


def test_misnamed_or_missing_migration_directory(tmp_path: Path) -> None:
    assert discover_migrations(tmp_path / "absent") == []
    _write(tmp_path, {"1_oops.sql": "SELECT 1;"})
    with pytest.raises(MigrationError, match=r"1_oops\.sql"):
        discover_migrations(tmp_path)
