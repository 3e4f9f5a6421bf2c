"""One checker run: bring up a private three-broker cluster and PostgreSQL, the roles as
processes, drive the workload while injecting faults, heal, settle, check, tear down.

``python -m services.chaos --seed N --sandboxes N --duration SECONDS`` (``make chaos``).
"""

from __future__ import annotations

import asyncio
import random
import re
import secrets
import shutil
import tempfile
import time
from collections import Counter
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path

import httpx
from aiokafka import AIOKafkaConsumer, AIOKafkaProducer, TopicPartition

from drivers.podman_objects import ACTOR as PODMAN_WATCHER
from drivers.protocol import RuntimeInfo
from events.publisher import CommandPublisher
from services.api.app import create_app
from services.api.server import start_api
from services.chaos import checks
from services.chaos.faults import Faults
from services.chaos.launch import RoleProcess
from services.chaos.postgres import PrivatePostgres
from services.chaos.workload import Workload
from services.common.kafka_clients import kafka_client_args
from services.common.secret_files import create_secret_file, read_secret_file
from services.common.settings import Settings
from services.common.tokens import SCOPES, TokenStore
from services.executor.backends import driver_from_settings, podman_driver
from services.executor.intake import FIRST_QUEUED_LOGGED
from services.executor.reconcile import Reconciler
from services.localstack import cluster
from services.localstack import cluster_config as cc
from services.localstack.isolation import isolated
from services.processor.consumer import INPUT_GAP_LOGGED

TOKEN = "sst_chaos-admin"
SETTLE_CHECKS = 3  # consecutive quiet checks, a second apart
# The probe's command from each phase a settled sandbox can rest in, towards Ready.
TO_READY = {"Stopped": "start", "Suspended": "start", "Completed": "start", "Error": "start",
            "Deleted": "create"}  # fmt: skip


@dataclass(frozen=True)
class Plan:
    seed: int = 1
    sandboxes: int = 300  # on the shared fake driver
    podman: int = 4  # on real Podman (the shared stack's service): keep them few
    duration: float = 60.0  # seconds of workload under faults (at least one of each kind)
    fault_interval: tuple[float, float] = (2.0, 6.0)
    processors: int = 2
    executors: int = 2
    partitions: int = 6
    settle_timeout: float = 240.0
    # 0: the roles as processes (processors, executors, a watcher). N: N `sandstream up`
    # processes instead, each the whole control plane with its hand-over; every kill of a
    # role kills one of them (the watcher's: the first).
    ups: int = 0


@dataclass
class Result:
    plan: Plan
    faults: Counter[str]
    workload: Counter[str]
    commands: int
    acknowledged: int
    inputs: int
    events: checks.EventStats
    backend: checks.BackendStats
    findings: list[checks.Finding]
    elapsed: float
    home: Path
    podman_prefix: str  # the names of the run's sandboxes on Podman start with it
    settled: bool = True
    by_actor: Counter[str] = field(default_factory=Counter)  # inputs decided, by their actor
    handed: Counter[str] = field(default_factory=Counter)  # `up`'s hand-overs, by outcome
    input_gaps: int = 0  # polls the processors refused: not following the applied offsets
    runs_queued: int = 0  # runs of `up` (killed ones too) that queued a handed event
    # After healing, the watcher process saw a Podman sandbox brought to Ready (None: the run
    # has none on Podman).
    watcher_sees_podman: bool | None = None
    notes: list[str] = field(default_factory=list)

    def count(self, kind: checks.Kind) -> int:
        return sum(1 for f in self.findings if f.kind == kind)

    @property
    def ok(self) -> bool:
        return self.settled and not self.findings and self.watcher_sees_podman is not False


@asynccontextmanager
async def private_stack(
    base: Settings, home: Path, partitions: int
) -> AsyncIterator[tuple[Settings, PrivatePostgres]]:
    """A three-node Kafka cluster and a PostgreSQL server of the run's own; the settings that
    reach them (``kafka_bootstrap`` lists every node)."""
    kafka = cluster.free_port_run(7)  # three nodes' port pairs, then PostgreSQL's
    password = home / "pg-password"  # read by the role processes (mode 0600)
    create_secret_file(password, secrets.token_urlsafe(24))
    nodes = base.model_copy(update={
        "kafka_bootstrap": f"127.0.0.1:{kafka}", "kafka_controller_port": kafka + 1,
        "kafka_brokers": 3, "kafka_partitions": partitions, "state_dir": home / "kafka",
        "pg_host": "127.0.0.1", "pg_port": kafka + 6,
        "pg_password_file": password, "pg_password": read_secret_file(password),
    })  # fmt: skip
    postgres = PrivatePostgres(home / "postgres", nodes.pg_port, nodes.pg_cluster_version)
    try:
        started = await asyncio.to_thread(cluster.start, nodes)
        await asyncio.to_thread(postgres.init, nodes)
        await asyncio.to_thread(cluster.wait, nodes, started)
        await asyncio.to_thread(cluster.secure, nodes)
        yield nodes, postgres
    finally:
        await asyncio.to_thread(cluster.stop, nodes)
        await asyncio.to_thread(postgres.remove)


def client_settings(nodes: Settings, podman_socket: Path, podman_prefix: str) -> Settings:
    """What the roles and the checker's clients use: the cluster's every node, the shared
    fake for most sandboxes and the shared Podman service for the names with
    ``podman_prefix`` (drivers/routing.py)."""
    return nodes.model_copy(update={
        "kafka_bootstrap": cc.bootstrap_list(nodes),
        "kafka_session_timeout_ms": 6000,
        "kafka_request_timeout_ms": 15000,
        "reconcile_interval_seconds": 5.0,
        "processor_max_records": 200,
        "executor_retry_seconds": 3600.0,
        "driver": "fake", "fake_state_file": nodes.state_dir.parent / "fake-backend.pickle",
        "driver_route_prefix": podman_prefix, "driver_route": "podman",
        "podman_socket": podman_socket,
    })  # fmt: skip


def up_settings(settings: Settings, home: Path, index: int) -> Settings:
    """One `sandstream up`'s: its own pid file and tokens, its API on a free port, no OpenShell
    door (the run's API is the checker's own)."""
    return settings.model_copy(
        update={"run_dir": home / f"up-{index}", "api_port": 0, "openshell_enabled": False}
    )


async def run(plan: Plan, base: Settings, home: Path | None = None) -> Result:
    started = time.monotonic()
    home = home or Path(tempfile.mkdtemp(prefix="sandstream-chaos-"))
    home.chmod(0o755)  # the private PostgreSQL runs as its own user
    # Podman is shared with every other user of the stack: names of this run's own.
    prefix = f"cxp{secrets.token_hex(3)}-"
    try:
        async with (
            private_stack(base, home, plan.partitions) as (nodes, postgres),
            isolated(client_settings(nodes, base.podman_socket_path, prefix), "chaos") as (
                settings,
                pool,
            ),
        ):
            return await _run_in(plan, nodes, settings, pool, postgres, home, started)
    finally:
        await remove_podman_sandboxes(base, prefix, plan.podman)


async def remove_podman_sandboxes(settings: Settings, prefix: str, count: int) -> None:
    """Everything the run left on the Podman service, after a failure too: the containers
    and workspaces of its names (also of a name whose launch was cut short)."""
    driver = podman_driver(settings, stop_timeout=1)
    try:
        keys = {rt.key for rt in await driver.list() if rt.key.startswith(prefix)}
        for key in sorted(keys | {f"{prefix}{i}" for i in range(count)}):
            await driver.delete(key)
    finally:
        await driver.close()


async def _run_in(
    plan: Plan,
    nodes: Settings,
    settings: Settings,
    pool: checks.Pool,
    postgres: PrivatePostgres,
    home: Path,
    started: float,
) -> Result:
    logs = home / "logs"
    if plan.ups:
        ups = [
            RoleProcess("up", i, up_settings(settings, home, i), logs)
            for i in range(1, plan.ups + 1)
        ]
        processors, executors, watcher = ups, ups, ups[0]
        lasting = list(ups)
    else:
        processors = [
            RoleProcess("processor", i + 1, settings, logs) for i in range(plan.processors)
        ]
        executors = [RoleProcess("executor", i + 1, settings, logs) for i in range(plan.executors)]
        watcher = RoleProcess("watcher", 1, settings, logs)
        lasting = [*processors, *executors, watcher]
    joiner = RoleProcess("processor", len(processors) + 1, settings, logs)
    roles = [*lasting, joiner]
    rng = random.Random(plan.seed)
    faults = Faults(rng, nodes, settings, processors, executors, watcher, joiner, postgres)
    # The in-process API publishes as the api role; the workload's late observations and the
    # reconciler's write as the watcher does.
    publisher = CommandPublisher(kafka_client_args(settings, "api"), topic=settings.topic_commands)
    producer = AIOKafkaProducer(**kafka_client_args(settings, "watcher"), acks="all",
                                enable_idempotence=True)  # fmt: skip
    await publisher.__aenter__()
    await producer.start()
    app = create_app(settings, pool, publisher, TokenStore.of(admin=(TOKEN, *SCOPES)))
    api = await start_api(app, "127.0.0.1", 0, access_log=False)
    client = httpx.AsyncClient(base_url=api.url, timeout=20,
                               headers={"Authorization": f"Bearer {TOKEN}"})  # fmt: skip
    assert settings.driver_route_prefix is not None
    prefix = settings.driver_route_prefix
    workload = Workload(settings, client, producer, plan.seed, plan.sandboxes, plan.podman, prefix)
    try:
        for role in lasting:
            role.start()
        stop = asyncio.Event()
        driving = asyncio.gather(workload.run(stop), faults.run(stop, plan.fault_interval))
        await asyncio.sleep(plan.duration)
        await faults.every_kind.wait()  # a short run goes on until it has seen every fault
        stop.set()
        await driving
        for role in lasting:  # heal: everything runs
            if not role.running():
                role.start()
        await faults.wait_in_sync()
        watched = await watcher_sees_podman(workload, pool, plan.settle_timeout)
        settled = await settle(settings, pool, plan.settle_timeout)
        # One reconcile pass, through the driver the roles use (the fake and Podman).
        driver = driver_from_settings(settings)
        try:
            reconciler = Reconciler(driver, pool, producer, settings, interval=1.0)
            await reconciler.run_once()
            settled = settled and await settle(settings, pool, plan.settle_timeout)

            async def snapshot() -> tuple[checks.Rows, list[RuntimeInfo]]:
                return await checks.backend_rows(pool), await driver.list()

            # The executors' own reconcile passes repair what their crashes left running,
            # each within its interval: three of them before the backend is judged.
            runtimes = await checks.agreeing_runtimes(
                snapshot, 3 * settings.reconcile_interval_seconds
            )
        finally:
            await driver.close()
        ended = [(r.name, code) for r in lasting if (code := r.exit_code()) is not None]
    finally:
        for role in roles:
            await asyncio.to_thread(role.stop)
        await client.aclose()
        await api.stop()
        await producer.stop()
        await publisher.__aexit__()
    findings = checks.ended_roles(ended)
    findings += await checks.commands(pool, workload.sent.values())
    findings += await checks.history(pool)
    findings += await checks.redecided(settings)
    findings += await checks.rebuild(settings)
    event_findings, event_stats = await checks.events(settings, pool)
    findings += event_findings
    backend_findings, backend_stats = await checks.backend(pool, runtimes, prefix)
    findings += backend_findings
    if findings:
        await _keep_histories(pool, findings, home / "findings.txt")
    return Result(
        plan=plan,
        faults=faults.counts,
        workload=workload.counts,
        commands=len(workload.sent),
        acknowledged=sum(1 for s in workload.sent.values() if s.acknowledged),
        inputs=await pool.fetchval("SELECT count(*) FROM history"),
        events=event_stats,
        backend=backend_stats,
        findings=findings,
        elapsed=time.monotonic() - started,
        home=home,
        podman_prefix=prefix,
        settled=settled,
        by_actor=await _inputs_by_actor(pool),
        handed=handed_over(lasting) if plan.ups else Counter(),
        input_gaps=sum(_logged(role, INPUT_GAP_LOGGED) for role in roles),
        runs_queued=sum(_logged(up, FIRST_QUEUED_LOGGED) for up in lasting) if plan.ups else 0,
        watcher_sees_podman=watched,
    )


async def watcher_sees_podman(workload: Workload, pool: checks.Pool, timeout: float) -> bool | None:
    """After healing, one of the run's Podman sandboxes brought to Ready through the API (a
    create or a start, as its phase needs), until the watcher process's observation of that
    generation running is decided; False at the timeout, None with no Podman sandboxes.

    Whether the workload's own Podman sandboxes ever ran is up to the timing: a slow start
    under faults can see every launch superseded. This shows the watcher sees Podman after
    every fault, whatever the timing."""
    if not workload.podman_names:
        return None
    key = workload.podman_names[0]
    sent: set[tuple[object, ...]] = set()  # (phase, sandbox id, generation) acknowledged from
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        row = await pool.fetchrow("SELECT phase, generation, sandbox_id FROM sandboxes "
                                  "WHERE key = $1", key)  # fmt: skip
        phase, sandbox_id, generation = (
            (row["phase"], row["sandbox_id"], row["generation"]) if row else ("Deleted", None, 0)
        )
        if phase == "Ready" and await checks.observed_running(
            pool, sandbox_id, generation, PODMAN_WATCHER
        ):
            return True
        kind, state = TO_READY.get(phase), (phase, sandbox_id, generation)
        if kind is not None and state not in sent and await workload.send(key, kind):
            sent.add(state)
        await asyncio.sleep(0.5)  # a poll: the row and history move as the roles decide
    return False


def _logged(role: RoleProcess, text: str) -> int:
    """How many lines of ``role``'s log (every run of it) contain ``text``."""
    try:
        return role.log.read_text(errors="replace").count(text)
    except OSError:
        return 0


def handed_over(ups: list[RoleProcess]) -> Counter[str]:
    """What the `up` processes' hand-overs did, by outcome: each run that was stopped (not
    killed) logs its own counts as it stops (``hand-over counts: queued=N ...``)."""
    total: Counter[str] = Counter()
    for up in ups:
        for line in up.log.read_text(errors="replace").splitlines():
            _, found, counts = line.partition("hand-over counts: ")
            if found:
                total.update({k: int(n) for k, _, n in (c.partition("=") for c in counts.split())})
    return total


async def _inputs_by_actor(pool: checks.Pool) -> Counter[str]:
    """Inputs decided per actor: the watcher's, the reconcile passes', the executors' ..."""
    query = "SELECT message->>'actor' AS actor, count(*) AS n FROM history GROUP BY 1"
    return Counter({r["actor"]: r["n"] for r in await pool.fetch(query)})


async def settle(settings: Settings, pool: checks.Pool, timeout: float) -> bool:
    """Wait until the processors have decided every input, the outbox is published and no row
    is in a progressing phase, for ``SETTLE_CHECKS`` checks in a row; False at the timeout."""
    consumer = AIOKafkaConsumer(**kafka_client_args(settings, "admin"))
    await consumer.start()
    try:
        deadline = time.monotonic() + timeout
        quiet = 0
        while quiet < SETTLE_CHECKS:
            if time.monotonic() > deadline:
                return False
            quiet = quiet + 1 if await _quiet(settings, pool, consumer) else 0
            await asyncio.sleep(1.0)
        return True
    finally:
        await consumer.stop()


async def _quiet(settings: Settings, pool: checks.Pool, consumer: AIOKafkaConsumer) -> bool:
    inputs = [settings.topic_commands, settings.topic_observations]
    partitions = [TopicPartition(t, p) for t in inputs for p in range(settings.kafka_partitions)]
    try:
        ends = await consumer.end_offsets(partitions)
        stored = {
            (r["topic"], r["partition"]): r["next_offset"]
            for r in await pool.fetch("SELECT topic, partition, next_offset FROM input_offsets")
        }
        unpublished = await pool.fetchval(
            "SELECT count(*) FROM outbox o LEFT JOIN outbox_cursor c USING (partition) "
            "WHERE o.id > coalesce(c.published_id, 0)"
        )
        progressing = await pool.fetchval(
            "SELECT count(*) FROM sandboxes "
            "WHERE phase IN ('Provisioning', 'Starting', 'Stopping', 'Deleting')"
        )
    except Exception:
        return False
    behind = sum(end - stored.get((tp.topic, tp.partition), 0) for tp, end in ends.items())
    return bool(behind == 0 and unpublished == 0 and progressing == 0)


# A finding's sandbox ("<kind> <id> of <key>: ..." or "<key> at ..."), and a log position it
# names ("<topic>[<partition>]@<offset>").
_KEY = re.compile(r"\bof (\S+): |^(\S+) at |^(\S+): ")
_AT = re.compile(r"([\w.-]+)\[(\d+)\]@(\d+)")
_HISTORY = (
    'SELECT key, topic, partition, "offset", message_type, command_id, disposition, reason, '
    "phase, generation, version, recorded_at FROM history"
)


async def _keep_histories(pool: checks.Pool, findings: list[checks.Finding], path: Path) -> None:
    """The findings, the history of each sandbox they name, and the inputs decided around each
    log position they name (when, by their record time), for a look after the run (the schema
    is dropped with the run)."""
    keys = sorted({k for f in findings if (m := _KEY.search(f.detail)) for k in m.groups() if k})
    rows = list(await pool.fetch(f"{_HISTORY} WHERE key = ANY($1) ORDER BY key, id", keys))
    for topic, partition, offset in {m.groups() for f in findings if (m := _AT.search(f.detail))}:
        rows += await pool.fetch(
            f'{_HISTORY} WHERE topic = $1 AND partition = $2 AND "offset" BETWEEN $3 AND $4 '
            'ORDER BY "offset"',
            topic, int(partition), int(offset) - 20, int(offset) + 20,
        )  # fmt: skip
    lines = [f"{f.kind} [{f.check}] {f.detail}" for f in findings] + [""]
    lines += [" | ".join(str(v) for v in r.values()) for r in rows]
    await asyncio.to_thread(path.write_text, "\n".join(lines) + "\n")


def remove_home(result: Result) -> None:
    """A passing run leaves nothing behind; a failing one keeps its logs for a look."""
    if result.ok:
        shutil.rmtree(result.home, ignore_errors=True)
