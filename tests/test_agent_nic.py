"""NIC collector against a temp-dir sysfs tree with the real layout: a counter wrap, a reset, a link
going down, "N/A" files, and InfiniBand data counters in 4-octet lane units."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest

from transom.agents.nic import NICCollector, NICSettings, counter_delta


class Tree:
    """Writes sysfs files the way the kernel lays them out."""

    def __init__(self, root: Path) -> None:
        self.root = root

    def write(self, rel: str, text: str) -> None:
        p = self.root / rel
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_text(text + "\n")

    def net(self, iface: str, *, oper: str = "up", carrier: str | None = "1", changes: int = 2, **stats: int | str) -> None:
        for name, value in stats.items():
            self.write(f"class/net/{iface}/statistics/{name}", str(value))
        self.write(f"class/net/{iface}/operstate", oper)
        path = self.root / f"class/net/{iface}/carrier"
        if carrier is None:
            path.unlink(missing_ok=True)  # the kernel answers EINVAL for a down interface: unreadable
        else:
            self.write(f"class/net/{iface}/carrier", carrier)
        self.write(f"class/net/{iface}/carrier_changes", str(changes))

    def ib(self, hca: str, port: int, *, state: str = "4: ACTIVE", phys: str = "5: LinkUp",
           rate: str = "400 Gb/sec (4X NDR)", hw: dict | None = None, **counters: int | str) -> None:
        base = f"class/infiniband/{hca}/ports/{port}"
        for name, value in counters.items():
            self.write(f"{base}/counters/{name}", str(value))
        for name, value in (hw or {}).items():
            self.write(f"{base}/hw_counters/{name}", str(value))
        self.write(f"{base}/state", state)
        self.write(f"{base}/phys_state", phys)
        self.write(f"{base}/rate", rate)


@pytest.fixture()
def tree(tmp_path):
    return Tree(tmp_path)


def _clock(monkeypatch, times):
    it = iter(times)
    monkeypatch.setattr("transom.agents.nic.time.monotonic", lambda: next(it))


def _by_dev(samples):
    return {s.tags["device"]: s for s in samples}


def test_counter_delta_wrap_and_reset():
    assert counter_delta(100, 150) == (50, "ok")
    assert counter_delta(2**32 - 10, 5) == (15, "wrap")
    assert counter_delta(2**64 - 1, 9) == (10, "wrap")
    assert counter_delta(1_000_000, 300) == (300, "reset")


def test_ethernet_rates_with_a_wrap_a_reset_and_a_link_going_down(tree, monkeypatch):
    tree.net("lo", rx_bytes=1)
    tree.net("eth0", rx_bytes=2**32 - 1000, tx_bytes=5_000_000, rx_errors=0, tx_dropped="N/A")
    nic = NICCollector(NICSettings(root=str(tree.root)))
    _clock(monkeypatch, [10.0, 12.0, 14.0])
    first = _by_dev(nic.collect())
    assert set(first) == {"eth0"}  # lo is excluded by default
    f = first["eth0"].fields
    assert f["rx_bytes"] == 2**32 - 1000 and "rx_bytes_per_s" not in f and "tx_dropped" not in f  # N/A skipped
    assert (f["link_up"], f["carrier"], f["carrier_changes"]) == (1, 1, 2)
    assert dict(first["eth0"].tags) == {"device": "eth0", "kind": "net"}

    # 32-bit rx_bytes wraps, tx_bytes is reset (driver reload), then the link goes down
    tree.net("eth0", oper="down", carrier=None, changes=3, rx_bytes=3000, tx_bytes=400, rx_errors=6, tx_dropped="N/A")
    f = _by_dev(nic.collect())["eth0"].fields
    assert f["rx_bytes_per_s"] == (1000 + 3000) / 2.0   # across the wrap
    assert f["tx_bytes_per_s"] == 400 / 2.0              # counted from zero after the reset
    assert f["rx_errors_per_s"] == 3.0
    assert (f["link_up"], f["carrier"], f["carrier_changes"]) == (0, 0, 3)
    assert nic.wraps == 1 and nic.resets == 1

    tree.net("eth0", oper="up", changes=4, rx_bytes=5000, tx_bytes=600, rx_errors=6)
    f = _by_dev(nic.collect())["eth0"].fields
    assert (f["rx_bytes_per_s"], f["tx_bytes_per_s"], f["rx_errors_per_s"], f["link_up"]) == (1000.0, 100.0, 0.0, 1)


def test_infiniband_ports_state_rate_lane_units_hw_counters_and_link_down(tree, monkeypatch, caplog):
    tree.ib("mlx5_0", 1, port_xmit_data=1000, port_rcv_data=2000, symbol_error=0, link_downed=0,
            port_rcv_errors="N/A", hw={"out_of_buffer": 5, "np_cnp_sent": 7})
    tree.ib("mlx5_1", 1, port_xmit_data=0)
    nic = NICCollector(NICSettings(root=str(tree.root)))
    _clock(monkeypatch, [0.0, 1.0])
    s = _by_dev(nic.collect())
    f = s["mlx5_0"].fields
    assert (f["port_xmit_bytes"], f["port_rcv_bytes"]) == (4000, 8000)   # 4-octet lanes -> bytes
    assert "port_xmit_data" not in f and "port_rcv_errors" not in f       # renamed; N/A skipped
    assert (f["state"], f["phys_state"], f["rate_gbps"], f["link_up"]) == (4, 5, 400, 1)
    assert (f["out_of_buffer"], f["np_cnp_sent"]) == (5, 7)
    assert s["mlx5_0"].index == 1 and dict(s["mlx5_0"].tags) == {"device": "mlx5_0", "port": "1", "kind": "ib"}

    tree.ib("mlx5_0", 1, state="1: DOWN", phys="3: Disabled", port_xmit_data=1000 + 250_000, port_rcv_data=2000,
            symbol_error=40, link_downed=1, hw={"out_of_buffer": 5, "np_cnp_sent": 7})
    caplog.clear()
    with caplog.at_level(logging.WARNING):
        f = _by_dev(nic.collect())["mlx5_0"].fields
    assert f["port_xmit_bytes_per_s"] == 1_000_000 and f["port_rcv_bytes_per_s"] == 0
    assert (f["symbol_error_per_s"], f["link_downed"]) == (40, 1)
    assert (f["state"], f["phys_state"], f["link_up"]) == (1, 3, 0)
    assert not caplog.records  # a link going down is data, not a warning


def test_include_exclude_and_no_sysfs(tree, caplog):
    tree.net("eth0", rx_bytes=1)
    tree.net("ib0", rx_bytes=1)
    tree.ib("mlx5_0", 1, port_xmit_data=1)
    only = NICCollector(NICSettings(root=str(tree.root), include=["ib0"], infiniband=False))
    assert [s.tags["device"] for s in only.collect()] == ["ib0"]
    with caplog.at_level(logging.WARNING, logger="transom.agent.nic"):
        empty = NICCollector(NICSettings(root=str(tree.root / "nowhere")))
    assert empty.collect() == [] and "does not exist" in caplog.text


def test_reads_this_machines_real_sysfs():
    samples = NICCollector(NICSettings(exclude=[], virtual=True)).collect()
    lo = [s for s in samples if s.tags["device"] == "lo"]
    assert lo and lo[0].fields["rx_bytes"] >= 0 and "link_up" in lo[0].fields
    # by default the virtual ones (lo, veth, bridges, ifb: sysfs puts them under devices/virtual) are not read
    assert "lo" not in {s.tags["device"] for s in NICCollector(NICSettings(exclude=[])).collect()}


def test_virtual_interfaces_are_skipped_unless_asked_for(tree):
    """A container's or test bed's veth that comes and goes is not a link of the node."""
    tree.net("eth0", rx_bytes=1)
    virtual = tree.root / "devices/virtual/net/veth7"
    (virtual / "statistics").mkdir(parents=True)
    (virtual / "statistics/rx_bytes").write_text("5")
    (virtual / "operstate").write_text("up")
    (tree.root / "class/net/veth7").symlink_to(virtual)          # how sysfs links class/net entries
    assert set(_by_dev(NICCollector(NICSettings(root=str(tree.root))).collect())) == {"eth0"}
    assert set(_by_dev(NICCollector(NICSettings(root=str(tree.root), virtual=True)).collect())) == {"eth0", "veth7"}
    assert set(_by_dev(NICCollector(NICSettings(root=str(tree.root), include=["veth7"])).collect())) == {"veth7"}


def test_admin_state_from_the_interface_flags(tree):
    tree.net("eth0", rx_bytes=1)
    tree.write("class/net/eth0/flags", "0x1003")          # UP, BROADCAST, MULTICAST
    tree.net("ifb0", oper="down", carrier=None, rx_bytes=0)
    tree.write("class/net/ifb0/flags", "0x82")            # left down by the operator
    tree.net("eth1", rx_bytes=1)                           # no flags file: no admin_up field
    got = _by_dev(NICCollector(NICSettings(root=str(tree.root))).collect())
    assert got["eth0"].fields["admin_up"] == 1.0 and got["eth0"].fields["link_up"] == 1.0
    assert got["ifb0"].fields["admin_up"] == 0.0 and got["ifb0"].fields["link_up"] == 0.0
    assert "admin_up" not in got["eth1"].fields
