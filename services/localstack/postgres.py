"""The local stack's PostgreSQL: the cluster started (and stopped) only where ``up`` had to
start it, the role, database and password, the migrations, and its status line."""

from __future__ import annotations

import asyncio
import os
import secrets
import subprocess
import time

import asyncpg

from services.common.migrations import apply_migrations
from services.common.secret_files import create_secret_file, read_secret_file
from services.common.settings import Settings
from services.localstack import config as cfg
from services.localstack.processes import ComponentStatus, StackError, output, say

CONNECT_TIMEOUT = 20.0


def _pg_ctl(settings: Settings, action: str) -> subprocess.CompletedProcess[str]:
    cmd = [
        "pg_ctlcluster",
        "--skip-systemctl-redirect",
        settings.pg_cluster_version,
        settings.pg_cluster_name,
        action,
    ]
    try:
        return subprocess.run(cmd, capture_output=True, text=True, check=False)
    except FileNotFoundError as exc:
        raise StackError("postgres: pg_ctlcluster not found; run compose/bootstrap.sh") from exc


def ensure_pg_password(settings: Settings) -> Settings:
    """The settings with a PostgreSQL password: the one given, else for a local server the one
    in the password file, generated (mode 0600) the first time. `up` then sets the
    role's password to it when the role does not log in with it (e.g. an older default)."""
    if settings.pg_password is not None or not cfg.is_local_host(settings.pg_host):
        return settings
    path = settings.pg_password_path
    if create_secret_file(path, secrets.token_urlsafe(32)):
        say(f"postgres: generated the password of {settings.pg_user} in {path} (mode 0600)")
    try:
        password = read_secret_file(path)
    except ValueError as exc:
        raise StackError(f"postgres: {exc}") from exc
    return settings.model_copy(update={"pg_password": password})


def up(settings: Settings) -> Settings:
    """Start the local cluster unless it runs (an external server is used as it is), create our
    role and database if they do not log in, wait for a connection, apply the migrations; the
    settings returned carry the password."""
    settings = ensure_pg_password(settings)
    cluster = f"{settings.pg_cluster_version}/{settings.pg_cluster_name}"
    if not cfg.is_local_host(settings.pg_host):
        say(f"postgres: using external server {settings.pg_host}:{settings.pg_port}")
    elif _pg_ctl(settings, "status").returncode == 0:
        say(f"postgres: cluster {cluster} running")
    else:
        result = _pg_ctl(settings, "start")
        if result.returncode != 0:
            raise StackError(f"postgres: starting cluster {cluster} failed:\n{output(result)}")
        marker = cfg.postgres_marker(settings)
        marker.parent.mkdir(parents=True, exist_ok=True)
        marker.write_text(f"{cluster}\n")
        say(f"postgres: cluster {cluster} started")
    if cfg.is_local_host(settings.pg_host) and not asyncio.run(_connects(settings.pg_dsn)):
        create_role_and_database(settings)
    deadline = time.monotonic() + CONNECT_TIMEOUT
    while not asyncio.run(_connects(settings.pg_dsn)):
        if time.monotonic() > deadline:
            raise StackError(
                f"postgres: cannot connect as {settings.pg_user} to {settings.pg_database} "
                f"on {settings.pg_host}:{settings.pg_port}"
            )
        time.sleep(0.25)
    applied = asyncio.run(apply_migrations(settings.pg_dsn))
    say(f"postgres: migrations applied: {', '.join(applied)}" if applied else "postgres: ready")
    return settings


def stop(settings: Settings) -> None:
    """Stop the cluster if ``up`` started it; one it found running is left as it is."""
    marker = cfg.postgres_marker(settings)
    if not marker.exists():
        say("postgres: not started by `up`; left as it is")
        return
    result = _pg_ctl(settings, "stop")
    if result.returncode != 0 and _pg_ctl(settings, "status").returncode == 0:
        raise StackError(f"postgres: stopping the cluster failed:\n{output(result)}")
    marker.unlink()
    say("postgres: cluster stopped")


async def _connects(dsn: str) -> bool:
    try:
        conn = await asyncpg.connect(dsn, timeout=5)
    except (OSError, TimeoutError, asyncpg.PostgresError):
        return False
    await conn.close()
    return True


def create_role_and_database(settings: Settings) -> None:
    """Create (or fix the password of) our role and database as the postgres superuser."""
    if os.geteuid() != 0:
        raise StackError(
            f"postgres: cannot log in as {settings.pg_user}; creating the role and database "
            "needs root (runuser -u postgres psql)"
        )
    if settings.pg_password is None:
        raise StackError(f"postgres: no password for {settings.pg_user} (SANDSTREAM_PG_PASSWORD)")
    cmd = ["runuser", "-u", "postgres", "--", *cfg.psql_bootstrap_args(settings)]
    script = cfg.psql_bootstrap_input(settings.pg_password.get_secret_value(), os.urandom(16))
    result = subprocess.run(cmd, input=script, capture_output=True, text=True, cwd="/", check=False)
    if result.returncode != 0:
        raise StackError(f"postgres: creating role/database failed:\n{output(result)}")
    say(f"postgres: role {settings.pg_user} and database {settings.pg_database} ready")


def status(settings: Settings) -> ComponentStatus:
    connects = asyncio.run(_connects(settings.pg_dsn))
    where = f"{settings.pg_user}@{settings.pg_host}:{settings.pg_port}/{settings.pg_database}"
    if connects:
        ours = " (started by up)" if cfg.postgres_marker(settings).exists() else ""
        return ComponentStatus("postgres", True, f"{where}{ours}")
    return ComponentStatus("postgres", False, f"cannot connect to {where}")
