"""One settings object for ports, paths and credentials.

Every value has a local default (the embedded stack that `make up` starts) and can be
overridden by an environment variable named ``SANDSTREAM_<FIELD>`` (e.g.
``SANDSTREAM_KAFKA_BOOTSTRAP``).
"""

from __future__ import annotations

import ipaddress
import json
import os
from functools import cached_property
from pathlib import Path
from typing import Literal
from urllib.parse import quote, urlencode

from pydantic import Field, SecretStr, ValidationInfo, field_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

from events import topics as names
from projections.lifecycle import Limits
from services.common.secret_files import read_secret_file

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
    # Authentication (docs/security.md): SASL_PLAINTEXT with SCRAM-SHA-512 on the local
    # stack; SASL_SSL (with kafka_ssl_cafile, or the system's CAs) on a real cluster; PLAINTEXT
    # only for a broker without authentication.
    kafka_security_protocol: Literal["PLAINTEXT", "SASL_PLAINTEXT", "SSL", "SASL_SSL"] = (
        "SASL_PLAINTEXT"
    )
    kafka_sasl_mechanism: Literal["SCRAM-SHA-512", "SCRAM-SHA-256", "PLAIN"] = "SCRAM-SHA-512"
    kafka_ssl_cafile: Path | None = None
    # Username and password per role (services/common/kafka_clients.py), as JSON
    # {"role": {"username": ..., "password": ...}}: from SANDSTREAM_KAFKA_CREDENTIALS when set,
    # else from this file (mode 0600; default state_dir/kafka-credentials.json, which the
    # local stack's `up` writes once with generated passwords).
    kafka_credentials_file: Path | None = None
    kafka_credentials: SecretStr | None = None
    kafka_partitions: int = Field(default=12, ge=1)
    # Brokers of the local stack: 1 (the default), or a KRaft cluster of this many combined
    # broker+controller nodes on consecutive port pairs (services/localstack/cluster.py);
    # topics then get min(3, brokers) replicas and min.insync.replicas=2 from three brokers.
    kafka_brokers: int = Field(default=1, ge=1, le=9)
    # retention.ms set on the project topics when they are created: -1 keeps them forever,
    # which replays (rebuild, a fresh processor) and the audit need; tiered storage can move
    # old segments to object storage instead (docs/operations.md).
    kafka_retention_ms: int = Field(default=-1, ge=-1)
    topic_commands: str = names.COMMANDS
    topic_observations: str = names.OBSERVATIONS
    topic_events: str = names.EVENTS
    topic_deadletter: str = names.DEADLETTER
    topic_checkpoints: str = names.CHECKPOINTS
    # How long a consumer that died without leaving (SIGKILL) keeps its partitions.
    kafka_session_timeout_ms: int = Field(default=10_000, ge=1000)
    # How long a Kafka request (a send's acknowledgement included) may take before it fails;
    # the processor then backs off and resumes from PostgreSQL instead of stopping.
    kafka_request_timeout_ms: int = Field(default=40_000, ge=1000)
    # The largest record the processor sends (key and value; below the topics'
    # max.message.bytes): an outbox record above it is set aside, never sent (a dead letter is
    # at most 16 KiB, so it always fits).
    kafka_max_record_bytes: int = Field(default=names.MAX_RECORD_BYTES, ge=64 * 1024)
    processor_group: str = "sandstream-processor"
    processor_max_records: int = Field(default=5000, ge=1)  # per poll, across partitions
    # The largest input record value the processor decides; a larger one is dead-lettered.
    # Keep it 64 KiB or more below kafka_max_record_bytes, so what is decided from it fits.
    processor_max_input_bytes: int = Field(default=names.MAX_INPUT_BYTES, ge=1024)
    # How long the broker may hold the processor's fetch when nothing is new. A partition whose
    # records are still buffered is left out of the fetch in flight, so its next records wait
    # for that fetch to return: a long wait shows up as latency at moderate rates.
    # Rows the processor keeps from its own writes, so later batches need not read them back.
    processor_row_cache: int = Field(default=20_000, ge=0)
    # Decide the next poll (already fetched) while the current one's write is in flight, so
    # the processor's Python and PostgreSQL work at once; kept only if that write commits.
    processor_decide_ahead: bool = True
    processor_fetch_max_wait_ms: int = Field(default=100, ge=0, le=500)
    # The same when no partition's records are buffered: every assigned partition is then in
    # the fetch, which returns as soon as any has a record, so a longer wait costs no latency
    # and spares the broker most of an idle processor's fetches (services/processor/fetch_wait).
    processor_idle_fetch_max_wait_ms: int = Field(default=500, ge=0, le=2000)
    executor_group: str = "sandstream-executor"

    # PostgreSQL
    pg_host: str = "127.0.0.1"
    pg_port: int = 5432
    pg_user: str = "sandstream"
    # The password: SANDSTREAM_PG_PASSWORD, else read from pg_password_file (default
    # <state_dir>/postgres/password, mode 0600), which the local stack generates when missing.
    # Resolved once, when the settings are made: copies keep it.
    pg_password_file: Path | None = None
    pg_password: SecretStr | None = Field(default=None, validate_default=True)
    pg_database: str = "sandstream"
    pg_schema: str = "public"  # tests and the rebuild tool use schemas of their own
    # TLS costs a third of the processor's time on loopback; turn it on for remote servers
    # (verify-full with pg_sslrootcert, the CA file that signed the server's certificate).
    pg_sslmode: Literal["disable", "allow", "prefer", "require", "verify-ca", "verify-full"] = (
        "disable"
    )
    pg_sslrootcert: Path | None = None
    pg_cluster_version: str = "15"
    pg_cluster_name: str = "main"

    # Podman
    podman_socket: Path | None = None
    sandbox_image: str = "localhost/sandstream-base:1"
    stop_timeout_seconds: int = Field(default=10, ge=0)
    # A suspend checkpoints the agent's memory with CRIU (4.1 or newer on the Podman host's
    # PATH; the local stack builds one) and a resume restores it, falling back to a fresh
    # start on the kept workspace (docs/drivers.md). The checkpoints live in
    # podman_checkpoint_dir (default state_dir/podman/checkpoints), on the Podman host.
    podman_suspend_memory: bool = False
    podman_checkpoint_dir: Path | None = None
    # How an exec reaches a container (docs/drivers.md, "Exec"): "runtime" runs Podman's runc
    # directly (root on the Podman host, rootful Podman with runc), "api" Podman's exec API,
    # "auto" runc where it can. podman_runc_root: runc's state root as Podman runs it.
    podman_exec: Literal["auto", "runtime", "api"] = "auto"
    podman_runc_root: Path = Path("/run/runc")

    # Which driver `sandstream up`, `sandstream executor|watcher` and `python -m
    # services.executor` use. "fake": the in-memory fake driver (drivers/fake.py), for tests and
    # fault-injection runs of `sandstream executor` where the backend does not matter; its
    # runtimes live and die with the executor process (no watcher process can see them).
    driver: Literal["podman", "kubernetes", "fake"] = "podman"
    # With driver "fake": keep the fake's runtimes in this file instead, shared by every
    # process that names it (drivers/fake_shared.py), as the chaos checker's executors and
    # watcher do.
    fake_state_file: Path | None = None
    # Sandboxes whose name starts with driver_route_prefix run on driver_route instead of
    # `driver` (drivers/routing.py): the chaos checker's few real Podman sandboxes beside the
    # shared fake's hundreds. Each backend then shows only its own names.
    driver_route_prefix: str | None = None
    driver_route: Literal["podman", "kubernetes"] = "podman"

    # Kubernetes driver (drivers/kubernetes.py): which cluster, and how Pods are made there.
    # kube_config None: $KUBECONFIG or ~/.kube/config, else the in-cluster service account.
    kube_config: Path | None = None
    kube_context: str | None = None
    kube_namespace: str = "sandstream"
    kube_service_account: str | None = None
    kube_image_pull_policy: str = "IfNotPresent"
    kube_cpu_limit: str | None = None  # e.g. "1", "500m"
    kube_memory_limit: str | None = None  # e.g. "512Mi"
    kube_node_selector: str = ""  # "key=value,key2=value2"
    kube_tolerations: str = ""  # "key=value:Effect,key:Effect" (no value: operator Exists)
    kube_storage_class: str | None = None  # None: workspace in an emptyDir (docs/drivers.md)
    kube_workspace_size: str = "1Gi"
    # The local cluster (services/localstack/kubernetes.py): binaries and Go caches live in
    # kube_home (default $XDG_CACHE_HOME/sandstream/kubernetes, outside the clone, so that later
    # runs on this machine are warm); the running cluster's files under state_dir/kubernetes.
    kube_home: Path | None = None
    kube_version: str = "v1.37.2"
    kube_etcd_version: str = "v3.6.16"
    kube_kwok_version: str = "v0.8.0"
    kube_build_jobs: int = Field(default=2, ge=1)
    kube_apiserver_port: int = 16443
    kube_etcd_port: int = 16379  # and the next port for etcd's peer listener
    kube_kwok_port: int = 16247
    # The real node (`up --real-node`, services/localstack/kube_node.py): the kubelet's port on the
    # node's address (added to the loopback device: a kubelet refuses 127.0.0.1), its healthz on
    # the next port.
    kube_kubelet_port: int = 16250
    kube_node_ip: str = "10.86.0.1"
    # sandstream's image (`make image`, services/localstack/image.py) keeps its dependencies'
    # wheels here (default $XDG_CACHE_HOME/sandstream/image, beside kube_home's default).
    image_home: Path | None = None

    # Executor and reconciler (services/executor.py, services/watcher.py)
    executor_concurrency: int = Field(default=64, ge=1)  # driver calls in flight at once
    # Slow calls (delete, an operator's restart's launch: they may wait out a grace period) run
    # in their caller's own lane, at most this many at once per caller (token name); stops and
    # rotation restarts take none (services/executor/intents.py, takes_lane). As many as the
    # shared slots: a burst of one caller's deletes waits out its removals that many at a time
    # (16 made 300 deletes on Kubernetes take 19 rounds of the node's removal, docs/benchmarks.md).
    executor_slow_per_caller: int = Field(default=64, ge=1)
    # Per caller (token name) exceptions to it, e.g. SANDSTREAM_EXECUTOR_SLOW_CALLERS='{"ci": 4}'.
    executor_slow_callers: dict[str, int] = Field(default_factory=dict)
    executor_retry_seconds: float = Field(default=600, ge=0)  # retry transient failures this long
    reconcile_interval_seconds: float = Field(default=30, gt=0)

    # Providers: the AES-GCM key of the credential values (32 bytes). `sandstream up` creates
    # the file once (mode 0600); SANDSTREAM_CREDENTIALS_KEY (base64) supplies it instead.
    credentials_key_file: Path | None = None
    credentials_key: SecretStr | None = None
    # `sandstream up` also runs the provider-sync controller on this directory when set, or on
    # the Kubernetes Secrets this label selector picks (in provider_sync_kube_namespace, by
    # default kube_namespace; the cluster of kube_config/kube_context).
    provider_sync_dir: Path | None = None
    provider_sync_kube_selector: str | None = None
    provider_sync_kube_namespace: str | None = None
    # Every API and provider-sync process sends the stored commands of provider changes that
    # Kafka has not acknowledged yet this often, each once it is this old (docs/providers.md).
    provider_outbox_seconds: float = Field(default=5.0, gt=0)
    # The API forgets a command id (its idempotency record, a provider write's kept answer)
    # this long after it was first used; 0 keeps them forever (docs/api.md, "Idempotency").
    api_command_retention_hours: float = Field(default=720, ge=0)
    # Operator lifecycle (the processor records the deadlines; the scheduler says when they
    # fall due). 0 turns a deadline off.
    launch_timeout_seconds: float = Field(default=300, ge=0)  # Provisioning/Starting
    stop_margin_seconds: float = Field(default=30, ge=0)  # Stopping: grace period + this
    delete_retry_seconds: float = Field(default=120, ge=0)  # Deleting: first retry, then x2
    delete_retry_max_seconds: float = Field(default=1800, ge=0)
    # The restart policy: a generation Ready at least this long before it ends resets the
    # back-off (its restart is the first in a row again). Decided when the exit is, and recorded
    # in the decided event, so a rebuild reproduces it whatever this is then.
    restart_reset_seconds: float = Field(default=600, ge=0)
    # Time to live of a sandbox created without one (None: lives until deleted).
    default_ttl_seconds: int | None = Field(default=None, ge=1)
    # The scheduler looks for due deadlines at least this often (and on every change).
    scheduler_poll_seconds: float = Field(default=5.0, gt=0)
    # The pool controller (in the scheduler role) looks at every pool at least this often (and
    # on every change of a row or a pool).
    pool_poll_seconds: float = Field(default=2.0, gt=0)
    # `status` and the metrics count sandboxes expiring within this many seconds.
    expiring_soon_seconds: float = Field(default=3600, ge=0)

    # API
    api_host: str = "127.0.0.1"
    api_port: int = 8787
    # `sandstream up` serves the API from a child process of its own (services/up/api_process.py)
    # instead of its own event loop.
    up_api_process: bool = False
    # `sandstream up` hands each decided event its processor commits to its executor at once,
    # a Kafka hop sooner than the log delivers it (the log's copy is then not run again).
    up_handoff: bool = True
    # How long the API waits for Kafka to acknowledge a command before it answers 503 (a
    # provider change's commands: pending, sent later by the relay).
    api_publish_timeout_seconds: float = Field(default=15.0, gt=0)
    # Wake on access: how long an exec or a file call on a Suspended sandbox waits for its
    # resume to make it Ready before it fails (docs/api.md).
    wake_timeout_seconds: float = Field(default=60.0, gt=0)
    # Idle suspend: the doors write the sandboxes used (or with a session open) at most this
    # often, one statement per API process; the scheduler adds it to every idle timeout, so a
    # use not yet written never counts as idle time (docs/operations.md, "Idle policy").
    use_flush_seconds: float = Field(default=10.0, gt=0, le=3600)
    # Where clients (the CLI) reach the API; default http(s)://{api_host}:{api_port}.
    api_url: str | None = None
    # TLS: with a certificate (PEM, the chain after it) and its key the API speaks https only.
    api_tls_certfile: Path | None = None
    api_tls_keyfile: Path | None = None
    # The CA a client (the CLI) verifies the API's certificate with (default: the system's).
    api_ca_file: Path | None = None
    # The proxies (IP addresses or networks, comma-separated) whose X-Forwarded-Proto and
    # X-Forwarded-For the API believes: the scheme (https: the console's cookie is Secure) and
    # the client address it logs. Empty (the default): no one's; a header from any other peer
    # changes nothing (docs/security.md).
    api_forwarded_allow_ips: str = ""
    # OpenShell-compatible gRPC API (services/openshell/), run by `sandstream up` when enabled.
    openshell_enabled: bool = True
    openshell_host: str = "127.0.0.1"
    openshell_port: int = Field(default=8788, ge=0, le=65535)
    # Calls without a bearer token act as the local principal `openshell-local`: for local use
    # (OpenShell's conformance suite sends no credentials); refused unless openshell_host is a
    # loopback address. That principal holds openshell_unauthenticated_scopes (comma-separated):
    # by default sandboxes' reads and commands, not exec, providers or audit (any local user
    # could use them).
    openshell_allow_unauthenticated: bool = False
    # With the API's certificate the gRPC API speaks TLS too; false keeps it plaintext
    # (OpenShell's CLI connects to an https gateway only with mutual-TLS files of its own).
    openshell_tls: bool = True
    openshell_unauthenticated_scopes: str = "sandbox:read,sandbox:write"
    # Exec over the OpenShell API: the longest a command may run (also when the client sets no
    # limit), the sessions one token may have open at once, and all sessions at once (each
    # holds a thread reading Podman's stream while it runs).
    openshell_exec_timeout_seconds: int = Field(default=3600, ge=1, le=86_400)
    openshell_exec_sessions_per_token: int = Field(default=8, ge=1, le=1024)
    openshell_exec_sessions: int = Field(default=64, ge=1, le=4096)
    # The three above hold the HTTP API's exec too (services/common/exec_sessions.py), with
    # these: the sessions one sandbox may have open at once (both doors), and the most of each
    # output (stdout, stderr) the HTTP API's non-streaming exec answers with (the rest is
    # read and dropped, the answer says it was cut).
    exec_sessions_per_sandbox: int = Field(default=8, ge=1, le=1024)
    exec_output_max_bytes: int = Field(default=1024 * 1024, ge=1024, le=64 * 1024 * 1024)
    # Tokens file, admin token and pid file of `sandstream up` (default: state_dir).
    run_dir: Path | None = None
    # Request bodies above this are refused (413) unread; it stays below Kafka's message size
    # limit (1 MiB), so an accepted command always fits in a record.
    api_max_body_bytes: int = Field(default=512 * 1024, ge=1024)
    # Files (/v1/sandboxes/{name}/files): an upload above this is refused with 413 (from its
    # Content-Length at once, or once the streamed bytes pass it); a listing answers at most
    # this many entries (saying when there were more).
    files_max_upload_bytes: int = Field(default=1024 * 1024 * 1024, ge=1024)
    files_list_max_entries: int = Field(default=10_000, ge=1, le=1_000_000)
    # The longest grace period (stop_timeout_seconds) a create may ask for, unless its token
    # sets its own max_stop_timeout_seconds (tokens file).
    api_max_stop_timeout_seconds: int = Field(default=600, ge=0, le=3600)
    # /readyz fails while the processor is more input records than this behind Kafka.
    readiness_max_lag: int = Field(default=1000, ge=0)

    # Roles run as separate processes (`sandstream processor|executor|watcher|scheduler|api`):
    # each serves /healthz, /readyz and /metrics here; port 0 picks a free port, which the
    # process logs and writes to its --port-file.
    health_host: str = "127.0.0.1"
    health_port: int = Field(default=0, ge=0, le=65535)
    # Single-active roles (watcher and reconciler, scheduler) hold a PostgreSQL advisory lock:
    # a standby tries to take it this often, and the holder checks its connection this often
    # (and gives the role up when the check fails).
    lease_check_seconds: float = Field(default=2.0, gt=0)

    @property
    def lifecycle_limits(self) -> Limits:
        """The deadlines the processor records (see projections.lifecycle.Limits)."""
        return Limits(
            launch_seconds=self.launch_timeout_seconds or None,
            launch_retry_seconds=self.executor_retry_seconds,
            stop_grace_seconds=float(self.stop_timeout_seconds),
            stop_margin_seconds=self.stop_margin_seconds or None,
            delete_seconds=self.delete_retry_seconds or None,
            delete_backoff_max_seconds=self.delete_retry_max_seconds,
            restart_reset_seconds=self.restart_reset_seconds,
        )

    @field_validator("api_forwarded_allow_ips", mode="after")
    @classmethod
    def _proxy_addresses(cls, value: str) -> str:
        for entry in filter(None, (e.strip() for e in value.split(","))):
            try:
                ipaddress.ip_network(entry)  # an address is a network of one
            except ValueError:
                raise ValueError(
                    f"{entry!r} is neither an IP address nor a network (e.g. 10.0.0.0/8): "
                    "only the proxies' addresses are trusted, never a name or '*'"
                ) from None
        return value

    @property
    def trusted_proxies(self) -> tuple[str, ...]:
        """api_forwarded_allow_ips as a list (empty: forwarded headers are never read), each
        IPv4 entry also as IPv6-mapped (how an API listening on ``::`` sees IPv4 peers)."""
        entries = [e.strip() for e in self.api_forwarded_allow_ips.split(",") if e.strip()]
        networks = [ipaddress.ip_network(e) for e in entries]
        mapped = [
            f"::ffff:{n.network_address}/{96 + n.prefixlen}" for n in networks if n.version == 4
        ]
        return (*entries, *mapped)

    @property
    def openshell_local_scopes(self) -> frozenset[str]:
        """The scopes of an unauthenticated OpenShell call (when those are allowed); the
        OpenShell server refuses to start with an unknown one."""
        given = self.openshell_unauthenticated_scopes.split(",")
        return frozenset(s.strip() for s in given if s.strip())

    @field_validator("pg_password", mode="after")
    @classmethod
    def _password_from_file(cls, value: SecretStr | None, info: ValidationInfo) -> SecretStr | None:
        if value is not None or "state_dir" not in info.data:
            return value
        return read_secret_file(
            pg_password_path(info.data["state_dir"], info.data.get("pg_password_file"))
        )

    @property
    def pg_password_path(self) -> Path:
        return pg_password_path(self.state_dir, self.pg_password_file)

    @property
    def pg_dsn(self) -> str:
        """The DSN asyncpg connects with (in memory only: it holds the password)."""
        secret = (
            ""
            if self.pg_password is None
            else ":" + quote(self.pg_password.get_secret_value(), safe="")
        )
        query: dict[str, str] = {"sslmode": self.pg_sslmode}
        if self.pg_sslrootcert is not None:
            query["sslrootcert"] = str(self.pg_sslrootcert)
        return (
            f"postgresql://{quote(self.pg_user, safe='')}{secret}"
            f"@{self.pg_host}:{self.pg_port}/{quote(self.pg_database, safe='')}?{urlencode(query)}"
        )

    @cached_property
    def podman_socket_path(self) -> Path:
        return self.podman_socket or self.state_dir / "podman" / "podman.sock"

    @property
    def podman_checkpoint_path(self) -> Path:
        return self.podman_checkpoint_dir or self.state_dir / "podman" / "checkpoints"

    @property
    def podman_url(self) -> str:
        return f"unix://{self.podman_socket_path}"

    @property
    def kube_home_path(self) -> Path:
        return self.kube_home or _user_cache() / "sandstream" / "kubernetes"

    @property
    def image_home_path(self) -> Path:
        return self.image_home or _user_cache() / "sandstream" / "image"

    @property
    def api_base_url(self) -> str:
        if self.api_url:
            return self.api_url.rstrip("/")
        host = "127.0.0.1" if self.api_host in ("0.0.0.0", "::", "") else self.api_host
        scheme = "https" if self.api_tls_certfile else "http"
        return f"{scheme}://{host}:{self.api_port}"

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
    def credentials_key_path(self) -> Path:
        return self.credentials_key_file or self.state_dir / "credentials.key"

    @property
    def kafka_credentials_path(self) -> Path:
        return self.kafka_credentials_file or self.state_dir / "kafka-credentials.json"

    @property
    def containers_conf(self) -> Path:
        return PROJECT_ROOT / "compose" / "podman" / "containers.conf"

    @property
    def topics(self) -> tuple[str, str, str, str, str]:
        return (
            self.topic_commands,
            self.topic_observations,
            self.topic_events,
            self.topic_deadletter,
            self.topic_checkpoints,
        )

    def as_env(self) -> dict[str, str]:
        """These settings as SANDSTREAM_* variables, for a child process to load the same."""
        found = {
            f"SANDSTREAM_{name.upper()}": _env_value(value)
            for name, value in self.model_dump().items()
            # Secrets are never copied into a child's environment from here: a child inherits
            # SANDSTREAM_CREDENTIALS_KEY / _PG_PASSWORD / _KAFKA_CREDENTIALS if they were set, or
            # reads the key file, the password file (named here, wherever the state dir is) and
            # the Kafka credentials file.
            if value is not None
            and name not in ("credentials_key", "pg_password", "kafka_credentials")
        }
        found["SANDSTREAM_PG_PASSWORD_FILE"] = str(self.pg_password_path)
        return found


def _user_cache() -> Path:
    xdg = os.environ.get("XDG_CACHE_HOME")
    return Path(xdg) if xdg else Path.home() / ".cache"


def pg_password_path(state_dir: Path, configured: Path | None) -> Path:
    return configured or state_dir / "postgres" / "password"


def _env_value(value: object) -> str:
    """Mappings as JSON, which is how pydantic-settings reads them back."""
    return json.dumps(value) if isinstance(value, dict) else str(value)


def load_settings() -> Settings:
    return Settings()
