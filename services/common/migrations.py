"""A small SQL migration runner.

Migrations are plain SQL files named ``NNNN_name.sql`` (e.g. ``0001_phase_rows.sql``) in
``compose/migrations/`` (installed from a wheel, as in the image: in
``<prefix>/share/sandstream/migrations``, where pyproject.toml's data-files put them). They are
applied in lexical order, each exactly once and each in its own transaction, and recorded in a
``schema_migrations`` table in the target schema.

With ``schema=...`` everything (the migrations' objects and ``schema_migrations``) goes into
that schema, created if missing, with ``search_path`` set to it alone, so a fresh copy of the
whole database layout can be built next to the live one (the rebuild tool relies on this).
"""

from __future__ import annotations

import re
import sysconfig
from pathlib import Path

import asyncpg

from services.common.settings import PROJECT_ROOT

MIGRATIONS_DIR = PROJECT_ROOT / "compose" / "migrations"
INSTALLED_MIGRATIONS = Path(sysconfig.get_path("data")) / "share" / "sandstream" / "migrations"
MIGRATION_FILE = re.compile(r"^\d{4}_[A-Za-z0-9_]+\.sql$")

_CREATE_TABLE = """
CREATE TABLE IF NOT EXISTS schema_migrations (
    name text PRIMARY KEY,
    applied_at timestamptz NOT NULL DEFAULT now()
)
"""


class MigrationError(RuntimeError):
    """A migration file is misnamed or failed to apply."""


def discover_migrations(directory: Path) -> list[Path]:
    """The migration files in ``directory`` in the order they apply.

    A ``.sql`` file that does not follow ``NNNN_name.sql`` is an error rather than being
    silently skipped; a missing directory means no migrations.
    """
    if not directory.is_dir():
        return []
    files = sorted(p for p in directory.iterdir() if p.suffix == ".sql")
    misnamed = [p.name for p in files if not MIGRATION_FILE.match(p.name)]
    if misnamed:
        raise MigrationError(
            f"migration files must be named NNNN_name.sql, found: {', '.join(misnamed)}"
        )
    return files


def default_directory(checkout: Path, installed: Path) -> Path:
    """Where the migrations are: the checkout's (a development install runs from it), else the
    wheel's installed copy. MigrationError when neither exists: a schema migrated with nothing
    would only fail later, in every role."""
    for directory in (checkout, installed):
        if directory.is_dir():
            return directory
    raise MigrationError(f"no migrations found: neither {checkout} nor {installed} exists")


async def apply_migrations(
    dsn: str, directory: Path | None = None, schema: str | None = None
) -> list[str]:
    """Apply pending migrations; return the names of the newly applied files, in order."""
    if directory is None:
        directory = default_directory(MIGRATIONS_DIR, INSTALLED_MIGRATIONS)
    files = discover_migrations(directory)
    conn: asyncpg.Connection = await asyncpg.connect(dsn)
    try:
        if schema is not None:
            await conn.execute(f"CREATE SCHEMA IF NOT EXISTS {_quote_ident(schema)}")
            await conn.execute("SELECT set_config('search_path', quote_ident($1), false)", schema)
        # One runner at a time per schema (two `up`s started together, tests in parallel).
        lock_key = f"sandstream.migrations:{schema or 'public'}"
        await conn.execute("SELECT pg_advisory_lock(hashtext($1))", lock_key)
        try:
            await conn.execute(_CREATE_TABLE)
            rows = await conn.fetch("SELECT name FROM schema_migrations")
            done = {row["name"] for row in rows}
            applied: list[str] = []
            for path in files:
                if path.name in done:
                    continue
                sql = path.read_text(encoding="utf-8")
                try:
                    async with conn.transaction():
                        await conn.execute(sql)
                        await conn.execute(
                            "INSERT INTO schema_migrations (name) VALUES ($1)", path.name
                        )
                except asyncpg.PostgresError as exc:
                    raise MigrationError(f"migration {path.name} failed: {exc}") from exc
                applied.append(path.name)
            return applied
        finally:
            await conn.execute("SELECT pg_advisory_unlock(hashtext($1))", lock_key)
    finally:
        await conn.close()


def _quote_ident(name: str) -> str:
    return '"' + name.replace('"', '""') + '"'
