"""The service registry (transom/registry.py): the contract, the fold, and a round trip on the real broker."""

from __future__ import annotations

import time
import uuid

import pytest

from transom import contracts, registry
from transom.config import ConfigError
from transom.contracts import ContractError, Registration, ServiceKind

from util import wait_until


def _reg(node="node1", **kw) -> Registration:
    base = dict(kind=ServiceKind.CKPT_DAEMON, node=node, host="h1", addr="198.18.0.11", port=7001,
                instance="abc", started_ts=1000.0, heartbeat_ts=1000.0, ttl_s=10.0, cluster="c1")
    base.update(kw)
    return Registration(**base)


def test_registration_round_trips_and_keys_by_cluster_kind_node():
    reg = _reg(meta={"transport": "tcp"}, boot_id="b00t")
    back = contracts.decode(contracts.REGISTRY, contracts.encode(reg))
    assert back == reg
    assert reg.key == "c1/ckpt-daemon/node1" and reg.endpoint == "198.18.0.11:7001"
    assert _reg(addr="fd00::1").endpoint == "[fd00::1]:7001"
    assert any(t.name == contracts.REGISTRY and t.config.get("cleanup.policy") == "compact" for t in contracts.TOPICS)


@pytest.mark.parametrize("field,value,needle", [
    ("addr", "0.0.0.0", "'addr'"), ("addr", "::", "'addr'"), ("port", 0, "'port'"), ("port", True, "'port'"),
    ("node", "", "'node'"), ("kind", "printer", "'kind'"), ("heartbeat_ts", -1.0, "'heartbeat_ts'"),
    ("ttl_s", 0, "'ttl_s'"), ("node", "a/b", "'node'"),
])
def test_registration_errors_name_the_field(field, value, needle):
    with pytest.raises(ContractError, match=needle):
        _reg(**{field: value})


def test_decode_names_a_missing_field():
    d = contracts._plain(_reg())
    del d["port"]
    with pytest.raises(ContractError, match="'port'"):
        Registration.from_dict(d)


def test_view_keeps_the_newest_live_entry_and_honours_tombstones_and_ttl():
    view = registry.RegistryView("c1")
    old, new = _reg(heartbeat_ts=1000.0, instance="old"), _reg(heartbeat_ts=1005.0, instance="new")
    view.apply(new.key, contracts.encode(new))
    view.apply(old.key, contracts.encode(old))              # a late, older heartbeat does not win
    assert view.get(ServiceKind.CKPT_DAEMON, "node1", now=1006).instance == "new"
    other = _reg(node="node0", cluster="c2")
    view.apply(other.key, contracts.encode(other))          # another cluster: not seen
    view.apply(b"c1/ckpt-daemon/node2", b"{not json")       # rejected, counted, ignored
    assert view.rejected == 1 and list(view.live(ServiceKind.CKPT_DAEMON, now=1006)) == ["node1"]
    assert view.live(ServiceKind.CKPT_DAEMON, now=1016) == {}                 # heartbeat older than its ttl
    assert registry.RegistryView("c1", ttl=60).apply(new.key, contracts.encode(new)) is None
    view.apply(new.key, None)                                                 # tombstone
    assert view.get(ServiceKind.CKPT_DAEMON, "node1", now=1006) is None


def test_advertise_address_is_never_a_wildcard(monkeypatch):
    monkeypatch.delenv("TRANSOM_ADVERTISE_ADDR", raising=False)
    assert registry.advertise_address(None, bind="0.0.0.0") == "127.0.0.1"       # one host, no broker
    assert registry.advertise_address("127.0.0.1:9092", bind="0.0.0.0") == "127.0.0.1"
    assert registry.advertise_address("127.0.0.1:9092", bind="127.0.0.3") == "127.0.0.3"
    assert registry.advertise_address("127.0.0.1:9092", bind="0.0.0.0", explicit="198.18.0.7") == "198.18.0.7"
    assert registry.default_bind(None) == "127.0.0.1" == registry.default_bind("127.0.0.1:9092")
    assert registry.default_bind("127.0.0.1:9092", explicit="198.18.0.7") == "0.0.0.0"
    assert registry.is_loopback("127.0.0.3") and not registry.is_loopback("198.18.0.7")
    monkeypatch.setenv("TRANSOM_ADVERTISE_ADDR", "0.0.0.0")
    with pytest.raises(ConfigError, match="TRANSOM_ADVERTISE_ADDR"):
        registry.advertise_address("127.0.0.1:9092")


def test_round_trip_on_the_real_broker(broker):
    cluster = f"t-{uuid.uuid4().hex[:8]}"
    a = registry.registration(ServiceKind.LAUNCHER, "hostA", addr="127.0.0.2", port=7100, ttl=30,
                              cluster=cluster, meta={"zygote": True})
    assert a.boot_id and a.instance == registry.INSTANCE
    writer = registry.RegistryWriter(broker.bootstrap, a, interval=0.2).start()
    reader = registry.RegistryReader(broker.bootstrap, cluster=cluster).start()
    try:
        got = reader.wait_for(lambda r: r.get(ServiceKind.LAUNCHER, "hostA"), timeout=20)
        assert got is not None and got.endpoint == "127.0.0.2:7100" and got.meta == {"zygote": True}
        first = got.heartbeat_ts
        assert reader.wait_for(lambda r: r.get(ServiceKind.LAUNCHER, "hostA").heartbeat_ts > first, timeout=20)
        writer.update(meta={"zygote": False})
        assert reader.wait_for(lambda r: r.get(ServiceKind.LAUNCHER, "hostA").meta == {"zygote": False}, timeout=20)
        writer.stop()                                                      # tombstone
        assert reader.wait_for(lambda r: r.get(ServiceKind.LAUNCHER, "hostA") is None, timeout=20)
        # a late reader catches up with the compacted history: the entry is gone there too
        assert registry.read_registry(broker.bootstrap, cluster=cluster).get(ServiceKind.LAUNCHER, "hostA") is None
    finally:
        writer.stop(clean=False, timeout=1)
        reader.close()


def test_a_killed_writer_goes_stale_after_its_ttl(broker):
    cluster = f"t-{uuid.uuid4().hex[:8]}"
    reg = registry.registration(ServiceKind.AGENT, "hostB", addr="127.0.0.2", port=7200, ttl=1.5, cluster=cluster)
    writer = registry.RegistryWriter(broker.bootstrap, reg).start()
    writer.stop(clean=False)                        # as if the host died: no tombstone
    with registry.RegistryReader(broker.bootstrap, cluster=cluster).start() as reader:
        assert reader.synced
        # seen live at first only if read within its ttl; certainly gone once the ttl is past
        wait_until(lambda: reader.get(ServiceKind.AGENT, "hostB") is None and time.time() > reg.heartbeat_ts + 1.5,
                   15, "the entry of a writer that stopped heartbeating to go stale")
        assert "hostB" in {r.node for r in reader.view.entries.values()}     # still on the topic, just stale
