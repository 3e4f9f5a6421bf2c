"""Pure helpers for a local KRaft cluster of several nodes: each node's settings, ports and
broker properties, and the replication every project topic gets.

Node ``i`` (0-based) of a cluster whose first address is ``host:port`` listens on
``port + 2i`` for clients and ``kafka_controller_port + 2i`` for the controller quorum, and keeps
its files under ``state_dir/kafka-cluster/node-<i+1>``. Every node is a combined broker and
controller (KRaft combined mode): three small JVMs instead of six. The properties are the
single broker's template (compose/kafka/server.properties) rendered for the node, with the keys
that differ in a cluster set afterwards, so the template stays the one source of the rest.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from services.common.settings import Settings
from services.localstack import config as cfg


@dataclass(frozen=True)
class Node:
    node_id: int  # 1-based, as Kafka's node.id
    settings: Settings  # the node's own address, controller port and state dir

    @property
    def address(self) -> str:
        return self.settings.kafka_bootstrap


def first_address(settings: Settings) -> tuple[str, int]:
    """The first ``host:port`` of ``kafka_bootstrap`` (a client may be given the whole list)."""
    return cfg.split_host_port(settings.kafka_bootstrap.split(",")[0].strip())


def cluster_home(settings: Settings) -> Path:
    return settings.state_dir / "kafka-cluster"


def nodes(settings: Settings) -> list[Node]:
    """The ``settings.kafka_brokers`` nodes of the local cluster."""
    host, port = first_address(settings)
    return [
        Node(
            node_id=i + 1,
            settings=settings.model_copy(
                update={
                    "kafka_bootstrap": f"{host}:{port + 2 * i}",
                    "kafka_controller_port": settings.kafka_controller_port + 2 * i,
                    "state_dir": cluster_home(settings) / f"node-{i + 1}",
                    # one set of principals for the cluster, not one per node's state dir
                    "kafka_credentials_file": settings.kafka_credentials_path,
                }
            ),
        )
        for i in range(settings.kafka_brokers)
    ]


def bootstrap_list(settings: Settings) -> str:
    """Every node's client address, comma-separated: what clients should be given, so that
    they can start while any one node is down."""
    return ",".join(n.address for n in nodes(settings))


def node_properties(
    template: str, settings: Settings, node: Node, extra: Mapping[str, str] | None = None
) -> str:
    """Broker ``node``'s server.properties: the template rendered for it, then the keys a
    cluster sets differently (node id, quorum, replication of data and internal topics), then
    ``extra`` (a private cluster's own keys, e.g. a benchmark's)."""
    host, _ = first_address(settings)
    voters = ",".join(
        f"{n.node_id}@{host}:{n.settings.kafka_controller_port}" for n in nodes(settings)
    )
    rf, isr = str(cfg.replication_factor(settings)), str(cfg.min_insync_replicas(settings))
    overrides = {
        "node.id": str(node.node_id),
        "controller.quorum.voters": voters,
        "default.replication.factor": rf,
        "min.insync.replicas": isr,
        "offsets.topic.replication.factor": rf,
        "transaction.state.log.replication.factor": rf,
        "transaction.state.log.min.isr": isr,
        "share.coordinator.state.topic.replication.factor": rf,
        "share.coordinator.state.topic.min.isr": isr,
        # Kafka's default back: the single node's longer wait (the template's) is for a quorum
        # with no other voter or observer to show that its controller is alive.
        "metadata.max.idle.interval.ms": "500",
    }
    rendered = cfg.render_server_properties(template, node.settings)
    return cfg.set_properties(rendered, overrides | dict(extra or {}))
