"""Delivery without loss: the spool (unit) and a real broker outage (integration).

The outage test stops a real embedded broker while an agent publishes, keeps it down 30 s,
starts a new one on the same port, and checks that every batch the agent produced arrived
exactly once and in seq order across both brokers' lifetimes (the embedded broker keeps data in
memory, so a live consumer reads the first broker's topic before it is stopped).
"""

from __future__ import annotations

import os
import time

import pytest
from confluent_kafka import OFFSET_BEGINNING, Consumer, TopicPartition

from transom import contracts
from transom.agents.agent import Agent, is_fault_class
from transom.agents.spool import FAULT, SeqState, Spool
from transom.broker import EmbeddedBroker
from transom.kafka import client_config, make_producer

from util import wait_until


# ----------------------------------------------------------------------------- unit: the spool


def test_spool_replays_in_seq_order_survives_reopen_and_ignores_a_torn_tail(tmp_path):
    d = str(tmp_path / "spool")
    sp = Spool(d, max_bytes=1 << 20, segment_bytes=64)
    for seq in (5, 6, 7):
        sp.append(seq, f"batch-{seq}".encode())
    sp.append(3, b"batch-3")  # a late delivery failure of an older batch comes back first
    sp.append(4, b"batch-4")
    assert [(r.seq, p) for r, p in sp.head(10)] == [(s, f"batch-{s}".encode()) for s in range(3, 8)]
    sp.take(3)
    assert [r.seq for r, _ in sp.head(2)] == [4, 5]
    sp.untake(3)
    sp.ack(3)
    sp.ack(4)
    sp.close()
    # a torn record at the end of a segment (a crash mid-write) is ignored on reopen
    last = sorted(os.listdir(d))[-1]
    with open(os.path.join(d, last), "ab") as fh:
        fh.write(b"\x40\x00\x00\x00\x00\x09")
    again = Spool(d, max_bytes=1 << 20, segment_bytes=64)
    assert [r.seq for r, _ in again.head(10)] == [5, 6, 7] and again.max_seq == 7
    for seq in (5, 6, 7):
        again.ack(seq)
    again.close()
    assert len(again) == 0 and os.listdir(d) == []  # every segment file is gone once delivered


def test_spool_bound_drops_oldest_metric_batches_never_fault_ones(tmp_path, caplog):
    sp = Spool(str(tmp_path), max_bytes=1000, segment_bytes=300)
    sp.append(0, b"x" * 200, FAULT)
    for seq in range(1, 10):
        sp.append(seq, b"m" * 200)
    sp.append(10, b"y" * 200, FAULT)
    kept = [r.seq for r, _ in sp.head(100)]
    assert 0 in kept and 10 in kept and sp.bytes <= 1000
    assert kept == sorted(kept) and kept[-3:] == [8, 9, 10]  # the newest metrics survive
    assert sp.dropped == 11 - len(kept) and sp.dropped_bytes == 200 * sp.dropped
    assert sum("is full" in r.getMessage() for r in caplog.records) == 1  # one warning


def test_seq_state_survives_a_restart_and_never_goes_below_the_spool(tmp_path):
    s = SeqState(str(tmp_path))
    assert [s.take() for _ in range(3)] == [0, 1, 2]
    assert SeqState(str(tmp_path)).next == 3
    assert SeqState(str(tmp_path), floor=10).next == 10
    s.close()
    old = tmp_path / "old"                # a state written by the rename-per-batch version: read, then kept up
    old.mkdir()
    (old / "seq").write_text("123")
    s = SeqState(str(old))
    assert [s.take() for _ in range(2)] == [123, 124] and SeqState(str(old)).next == 125
    s.close()


def test_fault_class_batches():
    xid = contracts.Sample(contracts.Source.GPU, {contracts.DCGM.XID_ERRORS: 79}, index=0)
    nan = contracts.Sample(contracts.Source.TRAIN, {"loss_nonfinite": 1, "alive": 1}, index=0)
    ok = contracts.Sample(contracts.Source.GPU, {contracts.DCGM.GPU_UTIL: 90.0}, index=0)
    mk = lambda *s: contracts.MetricBatch(node="n", ts=1.0, seq=0, samples=s)  # noqa: E731
    assert is_fault_class(mk(ok, xid)) and is_fault_class(mk(nan)) and not is_fault_class(mk(ok))


# ----------------------------------------------------------------------------- integration: the outage


class _Live:
    """A consumer that reads one node's batches from the start of the metrics topic as they come."""

    def __init__(self, bootstrap: str, node: str) -> None:
        self.key = node.encode()
        self.seqs: list[int] = []
        self.partition: int | None = None
        self.bootstrap = bootstrap
        self.c = Consumer(client_config(bootstrap, group_id="transom-test-live", enable_auto_commit=False,
                                        auto_offset_reset="earliest", fetch_wait_max_ms=50) | {"log_level": 0})
        md = self.c.list_topics(contracts.METRICS, timeout=10)
        self.c.assign([TopicPartition(contracts.METRICS, p, OFFSET_BEGINNING)
                       for p in md.topics[contracts.METRICS].partitions])

    def poll(self, seconds: float = 0.2) -> int:
        msg = self.c.poll(seconds)  # returns as soon as one message is there (consume() waits it all out)
        while msg is not None:
            if msg.error() is None and msg.key() == self.key:
                self.seqs.append(contracts.decode(contracts.METRICS, msg.value()).seq)
                self.partition = msg.partition()
            msg = self.c.poll(0)
        return len(self.seqs)

    def push_watermark(self, timeout: float = 10.0) -> None:
        """The embedded broker's high watermark can lag one producer batch (docs/architecture.md):
        one message of another key on the node's partition makes the agent's last batch readable."""
        p = make_producer(self.bootstrap, message_timeout_ms=int(timeout * 1000))
        p.produce(contracts.METRICS, key=b"watermark-push", value=b"{}", partition=self.partition or 0)
        p.flush(timeout)

    def until(self, cond, what: str, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while not cond():
            if time.monotonic() > deadline:
                raise AssertionError(f"timed out after {timeout:.0f}s waiting for {what} (read {self.seqs[-5:]})")
            self.poll()

    def close(self) -> None:
        self.c.close()


@pytest.mark.integration
def test_broker_down_30s_every_batch_arrives_once_in_order(tmp_path):
    first = EmbeddedBroker(log_path=str(tmp_path / "broker1.log")).start()
    second = live1 = live2 = None
    agent = Agent("t-outage", first.bootstrap, gpu_source="simulated", gpus=2, seed=3, interval=0.5,
                  collectors=["host", "gpu", "agent"], state_dir=str(tmp_path / "state"),
                  delivery_timeout_s=2.0, retry_s=0.5)
    try:
        live1 = _Live(first.bootstrap, agent.node)
        agent.start()
        p = agent.publisher
        live1.until(lambda: len(live1.seqs) >= 4, "4 batches on the first broker", 20)
        # stop right after a batch arrived with nothing in flight, so the live reader has all the broker took
        n = len(live1.seqs)
        live1.until(lambda: len(live1.seqs) > n and p.in_flight == 0 and p.delivered == len(live1.seqs),
                    "a quiet moment between batches", 20)
        # The broker dies at once (SIGKILL). On SIGTERM Tansu goes on acknowledging batches for ~5 s
        # while shutting down, then loses them with its in-memory store: no client can tell those apart
        # from delivered ones, and with a real Kafka they would be on disk.
        first.proc.kill()
        first.proc.wait(10)
        down_at = time.monotonic()
        before = list(live1.seqs)
        wait_until(lambda: p.outages >= 1 and len(p.spool) >= 2, 20, "the agent to spool", interval=0.1)
        time.sleep(max(0.0, 30.0 - (time.monotonic() - down_at)))
        assert p.outages == 1 and not p.connected and len(p.spool) >= 50  # 30 s at 2 Hz, on disk
        assert os.listdir(tmp_path / "state" / "spool")
        second = EmbeddedBroker(port=first.port, log_path=str(tmp_path / "broker2.log")).start()
        live2 = _Live(second.bootstrap, agent.node)
        wait_until(lambda: p.replayed > 0 and len(p.spool) == 0, 30, "the spool to be replayed", interval=0.1)
        live2.until(lambda: len(live2.seqs) >= 3 and live2.seqs[-1] >= before[-1] + 66, "replay and new batches", 30)
        agent.stop()
        produced = p.produced
        live2.push_watermark()
        live2.until(lambda: len(before) + len(live2.seqs) >= produced, f"all {produced} batches (first broker: {before}, missing {sorted(set(range(produced)) - set(before) - set(live2.seqs))})", 20)
        live2.poll(1.0)  # a duplicate would come now
        arrived = before + live2.seqs
        assert arrived == list(range(produced)), (before[-3:], live2.seqs[:3], produced)
        assert p.dropped == 0 and p.replayed == p.spooled >= 60 and p.delivered == produced
        assert len(p.spool) == 0 and os.listdir(tmp_path / "state" / "spool") == []
    finally:
        agent.stop(timeout=1) if agent.publisher is not None and agent._thread and agent._thread.is_alive() else None
        for c in (live1, live2):
            if c is not None:
                c.close()
        for b in (first, second):
            if b is not None:
                b.stop()


def test_the_agents_batch_encoder_is_byte_for_byte_the_contracts():
    from transom.agents.agent import encode_batch

    batch = contracts.MetricBatch(node="n1", ts=1.5, seq=7, job="j", samples=(
        contracts.Sample(contracts.Source.GPU, {"a": 1, "b": 2.5}, index=3, tags={"uuid": "GPU-x"}, ts=1.25),
        contracts.Sample(contracts.Source.HOST, {"c": 0.0}),
    ))
    assert encode_batch(batch) == contracts.encode(batch)
    assert contracts.decode(contracts.METRICS, encode_batch(batch)) == batch
    with pytest.raises(ValueError):
        encode_batch(contracts.MetricBatch(node="n", ts=1.0, seq=0, samples=(
            contracts.Sample(contracts.Source.HOST, {"x": float("nan")}),)))
