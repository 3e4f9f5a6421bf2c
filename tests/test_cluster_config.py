"""The local Kafka cluster's layout and each node's broker properties (pure), and its ports."""

from __future__ import annotations

from pathlib import Path

from services.common.settings import Settings
from services.localstack import cluster
from services.localstack import cluster_config as cc
from services.localstack import config as cfg


def props(text: str) -> dict[str, str]:
    pairs = (line.split("=", 1) for line in text.splitlines() if "=" in line and line[0] != "#")
    return {k.strip(): v.strip() for k, v in pairs}


def three(tmp: Path = Path("/nonexistent")) -> Settings:
    return Settings(kafka_bootstrap="127.0.0.1:30000", kafka_controller_port=30001,
                    kafka_brokers=3, state_dir=tmp)  # fmt: skip


def test_three_nodes_get_consecutive_port_pairs_and_state_dirs_of_their_own() -> None:
    nodes = cc.nodes(three())
    assert [n.node_id for n in nodes] == [1, 2, 3]
    assert [n.address for n in nodes] == ["127.0.0.1:30000", "127.0.0.1:30002", "127.0.0.1:30004"]
    assert [n.settings.kafka_controller_port for n in nodes] == [30001, 30003, 30005]
    assert len({cfg.kafka_paths(n.settings).data for n in nodes}) == 3
    assert cc.bootstrap_list(three()) == "127.0.0.1:30000,127.0.0.1:30002,127.0.0.1:30004"


def test_a_node_is_one_voter_of_three_with_replicated_data_and_internal_topics() -> None:
    settings = three()
    node = cc.nodes(settings)[1]
    p = props(cc.node_properties(cfg.KAFKA_PROPERTIES_TEMPLATE.read_text(), settings, node))
    assert p["node.id"] == "2"
    assert p["controller.quorum.voters"] == (
        "1@127.0.0.1:30001,2@127.0.0.1:30003,3@127.0.0.1:30005"
    )
    assert p["listeners"] == "PLAINTEXT://127.0.0.1:30002,CONTROLLER://127.0.0.1:30003"
    assert p["advertised.listeners"] == "PLAINTEXT://127.0.0.1:30002"
    assert p["log.dirs"] == str(cfg.kafka_paths(node.settings).data)
    for key in (
        "default",
        "offsets.topic",
        "transaction.state.log",
        "share.coordinator.state.topic",
    ):
        assert p[f"{key}.replication.factor"] == "3", key
    assert p["min.insync.replicas"] == p["transaction.state.log.min.isr"] == "2"
    assert p["share.coordinator.state.topic.min.isr"] == "2"


def test_only_a_single_node_writes_its_controllers_no_op_records_less_often() -> None:
    template = cfg.KAFKA_PROPERTIES_TEMPLATE.read_text()
    single = props(cfg.render_server_properties(template, Settings()))
    assert single["metadata.max.idle.interval.ms"] == "5000"
    settings = three()
    node = props(cc.node_properties(template, settings, cc.nodes(settings)[0]))
    assert node["metadata.max.idle.interval.ms"] == "500"  # Kafka's default


def test_topics_are_replicated_three_times_with_two_in_sync_only_on_a_cluster() -> None:
    assert (cfg.replication_factor(three()), cfg.min_insync_replicas(three())) == (3, 2)
    assert cfg.topic_configs(three())["min.insync.replicas"] == "2"
    single = Settings()
    assert (cfg.replication_factor(single), cfg.min_insync_replicas(single)) == (1, 1)
    two = single.model_copy(update={"kafka_brokers": 2})
    assert (cfg.replication_factor(two), cfg.min_insync_replicas(two)) == (2, 1)


def test_set_properties_replaces_a_key_in_place_and_appends_a_missing_one() -> None:
    text = "a=1\n# a=comment\nab=2\n"
    assert cfg.set_properties(text, {"a": "x\\y", "c": "3"}) == "a=x\\y\n# a=comment\nab=2\nc=3\n"
    # Every line setting a key is set (the last one wins where the file is read); what is
    # appended comes after the header, when there is one.
    twice = cfg.set_properties("a = 1\nb=2\na=3\n", {"a": "9", "d": "4"}, header="more")
    assert twice == "a=9\nb=2\na=9\n\n# more\nd=4\n"


def test_every_node_logs_in_with_the_clusters_one_set_of_principals(tmp_path: Path) -> None:
    """The nodes' state dirs differ, their credentials file does not: the admin written into
    each node's storage and the role users created once are the same principals."""
    settings = Settings(state_dir=tmp_path, kafka_brokers=3)
    paths = {n.settings.kafka_credentials_path for n in cc.nodes(settings)}
    assert paths == {settings.kafka_credentials_path}


def test_a_private_clusters_ports_lie_outside_the_kernels_ephemeral_range() -> None:
    """Regression: a port of the ephemeral range, free when chosen, was taken by another
    test's outgoing connection before the node bound it ("Address already in use")."""
    low, high = cluster.ephemeral_ports()
    for _ in range(30):
        base = cluster.free_port_run(7)
        assert all(not low <= port <= high for port in range(base, base + 7)), (base, low, high)
