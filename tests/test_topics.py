"""Topics from configuration: partitions, replication and min.insync.replicas, checked on the real broker."""

from __future__ import annotations

import pytest

from transom import contracts as c
from transom import kafka
from transom.broker import EmbeddedBroker
from transom.cli import main
from transom.config import ConfigError
from transom.topics import TopicMismatch, TopicSettings, parse_partitions


def test_partitions_parse_short_and_full_names_and_refuse_unknown_topics():
    assert parse_partitions("metrics=24, transom.faults=4") == {c.METRICS: 24, c.FAULTS: 4}
    with pytest.raises(ConfigError, match="TRANSOM_TOPIC_PARTITIONS: 'metric=3': expected TOPIC=N"):
        parse_partitions("metric=3")
    with pytest.raises(ConfigError, match="expected a positive partition count"):
        parse_partitions("metrics=0")
    s = TopicSettings.from_env({"TRANSOM_TOPIC_PARTITIONS": "metrics=24"})
    assert s.partitions_of(c.METRICS) == 24 and s.partitions_of(c.FAULTS) == 2


def test_replication_defaults_follow_the_cluster_and_refuse_what_it_cannot_honour():
    auto = TopicSettings()
    assert auto.replication(1) == (1, 1)          # the embedded broker
    assert auto.replication(2) == (2, 1)
    assert auto.replication(5) == (3, 2)          # production: 3 replicas, writes wait for 2
    with pytest.raises(ConfigError, match=r"TRANSOM_REPLICATION_FACTOR=3: the cluster has 2 broker\(s\)"):
        TopicSettings(replication_factor=3).replication(2)
    with pytest.raises(ConfigError, match="TRANSOM_MIN_INSYNC_REPLICAS=3: above the replication factor 2"):
        TopicSettings(min_insync_replicas=3).replication(2)
    with pytest.raises(ConfigError, match="TRANSOM_REPLICATION_FACTOR='x': expected a positive integer or 'auto'"):
        TopicSettings.from_env({"TRANSOM_REPLICATION_FACTOR": "x"})


@pytest.fixture()
def bare_broker(tmp_path):
    """A broker of the test's own, with no topic yet."""
    with EmbeddedBroker(create_topics=False, log_path=str(tmp_path / "broker.log")) as b:
        yield b


@pytest.mark.integration
def test_topics_on_the_broker_created_checked_and_refused(bare_broker, capsys):
    bs = bare_broker.bootstrap
    # a replication factor the single broker cannot honour: a clear error, and nothing is created
    with pytest.raises(ConfigError, match=r"TRANSOM_REPLICATION_FACTOR=3: the cluster has 1 broker\(s\)"):
        kafka.ensure_topics(bs, settings=TopicSettings(replication_factor=3))
    assert main(["topics", "--bootstrap", bs, "--replication-factor", "3"]) == 2
    assert "TRANSOM_REPLICATION_FACTOR=3: the cluster has 1 broker(s)" in capsys.readouterr().err
    from confluent_kafka.admin import AdminClient
    admin = AdminClient(kafka.client_config(bs))
    assert not {s.name for s in c.TOPICS} & set(admin.list_topics(timeout=10).topics)

    # metrics created earlier with 4 partitions (the old default), then the configured 12 asked for
    old = TopicSettings(partitions={c.METRICS: 4})
    assert set(kafka.ensure_topics(bs, settings=old)) == {s.name for s in c.TOPICS}
    with pytest.raises(TopicMismatch) as err:
        kafka.ensure_topics(bs)
    assert str(err.value).startswith("topic transom.metrics has 4 partitions, configured 12; more workers than 4 "
                                     "cannot share it")
    assert "TRANSOM_TOPIC_PARTITIONS=transom.metrics=4" in str(err.value)
    # the CLI check says the same and exits 3; growing is refused by Tansu (no CreatePartitions), clearly
    assert main(["topics", "--bootstrap", bs, "--check"]) == 3
    assert "ERROR topic transom.metrics has 4 partitions, configured 12" in capsys.readouterr().out
    with pytest.raises(TopicMismatch, match="could not add partitions .*CreatePartitions"):
        kafka.ensure_topics(bs, grow=True)
    # more partitions than configured, and the topics as created: nothing severe, nothing raised
    assert kafka.ensure_topics(bs, settings=TopicSettings(partitions={c.METRICS: 2})) == []
    admin_md = admin.list_topics(timeout=10).topics
    assert len(admin_md[c.METRICS].partitions) == 4
    diffs = kafka.check_topics(admin, old.specs(1), 1)
    assert diffs == []                         # Tansu describes min.insync.replicas and the retention as set
    diffs = kafka.check_topics(admin, old.specs(2), 1)
    assert {(d.topic, d.what, d.have, d.want) for d in diffs} >= {(c.METRICS, "min.insync.replicas", "1", "2")}
    del admin                                  # its connection would hold the broker's shutdown 5 s
