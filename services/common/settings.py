"""One settings object for ports, paths and credentials.

Every value has a local default (the embedded stack that `make up` starts) and can be
overridden by an environment variable named ``SANDSTREAM_<FIELD>`` (e.g.
``SANDSTREAM_KAFKA_BOOTSTRAP``).
"""

from __future__ import annotations

from functools import cached_property
from pathlib import Path

from pydantic import Field
from pydantic_settings import BaseSettings, SettingsConfigDict

from events import topics as names
from projections.lifecycle import Limits

PROJECT_ROOT = Path(__file__).resolve().parents[2]


class Settings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="SANDSTREAM_", frozen=True)

    # Runtime state (Kafka data, logs, pid files, sockets, tokens) and download cache.
    state_dir: Path = PROJECT_ROOT / ".sandstream"
    cache_dir: Path = PROJECT_ROOT / ".cache"

    # Kafka
    kafka_version: str = "4.1.1"
    kafka_bootstrap: str = "127.0.0.1:19092"
    kafka_controller_port: int = 19093
    kafka_heap: str = "384m"
    kafka_partitions: int = Field(default=12, ge=1)
    topic_commands: str = names.COMMANDS
    topic_observations: str = names.OBSERVATIONS
    topic_events: str = names.EVENTS
    topic_deadletter: str = names.DEADLETTER
    # How long a consumer that died without leaving (SIGKILL) keeps its partitions.
    kafka_session_timeout_ms: int = Field(default=10_000, ge=1000)
    processor_group: str = "sandstream-processor"
    processor_max_records: int = Field(default=5000, ge=1)  # per poll, across partitions
    # How long the broker may hold the processor's fetch when nothing is new. A partition whose
    # records are still buffered is left out of the fetch in flight, so its next records wait
    # for that fetch to return: a long wait shows up as latency at moderate rates.
    # Rows the processor keeps from its own writes, so later batches need not read them back.
    processor_row_cache: int = Field(default=20_000, ge=0)
    processor_fetch_max_wait_ms: int = Field(default=100, ge=0, le=500)
    executor_group: str = "sandstream-executor"

    # PostgreSQL
    pg_host: str = "127.0.0.1"
    pg_port: int = 5432
    pg_user: str = "sandstream"
    pg_password: str = "sandstream"
    pg_database: str = "sandstream"
    pg_schema: str = "public"  # tests and the rebuild tool use schemas of their own
    # TLS costs a third of the processor's time on loopback; turn it on for remote servers.
    pg_sslmode: str = "disable"
    pg_cluster_version: str = "15"
    pg_cluster_name: str = "main"

    # Podman
    podman_socket: Path | None = None
    sandbox_image: str = "localhost/sandstream-base:1"
    stop_timeout_seconds: int = Field(default=10, ge=0)

    # Executor and reconciler (services/executor.py, services/watcher.py)
    executor_concurrency: int = Field(default=64, ge=1)  # driver calls in flight at once
    executor_retry_seconds: float = Field(default=600, ge=0)  # retry transient failures this long
    reconcile_interval_seconds: float = Field(default=30, gt=0)

    # Operator lifecycle (the processor records the deadlines; the scheduler says when they
    # fall due). 0 turns a deadline off.
    launch_timeout_seconds: float = Field(default=300, ge=0)  # Provisioning/Starting
    stop_margin_seconds: float = Field(default=30, ge=0)  # Stopping: grace period + this
    delete_retry_seconds: float = Field(default=120, ge=0)  # Deleting: first retry, then x2
    delete_retry_max_seconds: float = Field(default=1800, ge=0)
    # Time to live of a sandbox created without one (None: lives until deleted).
    default_ttl_seconds: int | None = Field(default=None, ge=1)
    # The scheduler looks for due deadlines at least this often (and on every change).
    scheduler_poll_seconds: float = Field(default=5.0, gt=0)
    # `status` and the metrics count sandboxes expiring within this many seconds.
    expiring_soon_seconds: float = Field(default=3600, ge=0)

    # API
    api_host: str = "127.0.0.1"
    api_port: int = 8787
    # Where clients (the CLI) reach the API; default http://{api_host}:{api_port}.
    api_url: str | None = None
    # OpenShell-compatible gRPC API (services/openshell/), run by `sandstream up` when enabled.
    openshell_enabled: bool = True
    openshell_host: str = "127.0.0.1"
    openshell_port: int = Field(default=8788, ge=0, le=65535)
    # Calls without a bearer token act as a local admin: for local use (OpenShell's conformance
    # suite sends no credentials); refused unless openshell_host is a loopback address.
    openshell_allow_unauthenticated: bool = False
    # Tokens file, admin token and pid file of `sandstream up` (default: state_dir).
    run_dir: Path | None = None
    # /readyz fails while the processor is more input records than this behind Kafka.
    readiness_max_lag: int = Field(default=1000, ge=0)

    @property
    def lifecycle_limits(self) -> Limits:
        """The deadlines the processor records (see projections.lifecycle.Limits)."""
        return Limits(
            launch_seconds=self.launch_timeout_seconds or None,
            stop_grace_seconds=float(self.stop_timeout_seconds),
            stop_margin_seconds=self.stop_margin_seconds or None,
            delete_seconds=self.delete_retry_seconds or None,
            delete_backoff_max_seconds=self.delete_retry_max_seconds,
        )

    @property
    def pg_dsn(self) -> str:
        return (
            f"postgresql://{self.pg_user}:{self.pg_password}"
            f"@{self.pg_host}:{self.pg_port}/{self.pg_database}?sslmode={self.pg_sslmode}"
        )

    @cached_property
    def podman_socket_path(self) -> Path:
        return self.podman_socket or self.state_dir / "podman" / "podman.sock"

    @property
    def podman_url(self) -> str:
        return f"unix://{self.podman_socket_path}"

    @property
    def api_base_url(self) -> str:
        if self.api_url:
            return self.api_url.rstrip("/")
        host = "127.0.0.1" if self.api_host in ("0.0.0.0", "::", "") else self.api_host
        return f"http://{host}:{self.api_port}"

    @property
    def run_path(self) -> Path:
        return self.run_dir or self.state_dir

    @property
    def tokens_file(self) -> Path:
        """Hashed API tokens (names, scopes, sha256), mode 0600."""
        return self.run_path / "tokens.json"

    @property
    def admin_token_file(self) -> Path:
        """The plaintext admin token, written once by `sandstream up`, mode 0600."""
        return self.run_path / "admin.token"

    @property
    def up_pid_file(self) -> Path:
        return self.run_path / "up.pid"

    @property
    def containers_conf(self) -> Path:
        return PROJECT_ROOT / "compose" / "podman" / "containers.conf"

    @property
    def topics(self) -> tuple[str, str, str, str]:
        return (
            self.topic_commands,
            self.topic_observations,
            self.topic_events,
            self.topic_deadletter,
        )

    def as_env(self) -> dict[str, str]:
        """These settings as SANDSTREAM_* variables, for a child process to load the same."""
        return {
            f"SANDSTREAM_{name.upper()}": str(value)
            for name, value in self.model_dump().items()
            if value is not None
        }


def load_settings() -> Settings:
    return Settings()
