"""Chaos: the broker is killed (SIGKILL) and restarted on the same port while several agents publish.

Promise: no batch is lost and none is duplicated once the agents have replayed their spools,
counted end to end by each node's ``seq`` (0, 1, 2, ... with no gap and no repeat).

How: three real agents (in this process, so their publishers' counters can be read; simulated
GPUs, on-disk state) publish to a real embedded broker; a live reader (no consumer group) reads
every node's batches as they arrive. The embedded broker keeps data in memory, so the reader must
have read everything the first broker acknowledged before it dies: the broker is first frozen
(SIGSTOP), the test checks that every batch an agent counts as delivered has been read, and only
then SIGKILLs it (if a batch was acknowledged but not yet read, the broker is thawed and the test
tries again). The broker stays down a few seconds, a new one starts on the same port, the agents
find it, replay their spools in order and go on; a second reader reads the new broker.
"""

from __future__ import annotations

import os
import signal
import time

import pytest
from confluent_kafka import OFFSET_BEGINNING, Consumer, TopicPartition

from transom import contracts
from transom.agents.agent import Agent
from transom.broker import EmbeddedBroker
from transom.kafka import client_config, make_producer

from util import wait_until

pytestmark = [pytest.mark.chaos, pytest.mark.integration]

NODES = ("chaos-a", "chaos-b", "chaos-c")
DOWN_S = 6.0


class _Reader:
    """Reads every node's batches from the start of transom.metrics as they come: node -> [seq]."""

    def __init__(self, bootstrap: str) -> None:
        self.bootstrap = bootstrap
        self.seqs: dict[str, list[int]] = {n: [] for n in NODES}
        self.partitions: set[int] = set()
        self.c = Consumer(client_config(bootstrap, group_id="transom-chaos-reader", enable_auto_commit=False,
                                        auto_offset_reset="earliest", fetch_wait_max_ms=50) | {"log_level": 0})
        md = self.c.list_topics(contracts.METRICS, timeout=10)
        self.c.assign([TopicPartition(contracts.METRICS, p, OFFSET_BEGINNING)
                       for p in md.topics[contracts.METRICS].partitions])

    def poll(self, seconds: float = 0.1) -> None:
        msg = self.c.poll(seconds)
        while msg is not None:
            if msg.error() is None and msg.key() is not None and msg.key().decode() in self.seqs:
                self.seqs[msg.key().decode()].append(contracts.decode(contracts.METRICS, msg.value()).seq)
                self.partitions.add(msg.partition())
            msg = self.c.poll(0)

    def until(self, cond, what: str, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while not cond():
            if time.monotonic() > deadline:
                raise AssertionError(f"timed out after {timeout:.0f}s waiting for {what} "
                                     f"(read so far: { {n: s[-3:] for n, s in self.seqs.items()} })")
            self.poll()

    def push_watermarks(self) -> None:
        """The embedded broker's high watermark can lag one producer batch (docs/architecture.md): one
        message of another key on each partition makes the agents' last batches readable."""
        p = make_producer(self.bootstrap, message_timeout_ms=10000)
        for part in self.partitions:
            p.produce(contracts.METRICS, key=b"watermark-push", value=b"{}", partition=part)
        p.flush(10)

    def close(self) -> None:
        self.c.close()


def _all_read(agents: list[Agent], reader: _Reader) -> bool:
    return all(a.publisher.in_flight == 0 and a.publisher.delivered == len(reader.seqs[a.node]) for a in agents)


def test_broker_sigkilled_and_restarted_on_its_port_loses_no_batch_of_any_agent(tmp_path):
    first = EmbeddedBroker(log_path=str(tmp_path / "broker1.log")).start()
    second = r1 = r2 = None
    agents = [Agent(node, first.bootstrap, gpu_source="simulated", gpus=2, seed=i + 1, interval=0.3,
                    collectors=["host", "gpu", "agent"], state_dir=str(tmp_path / node),
                    delivery_timeout_s=2.0, retry_s=0.5) for i, node in enumerate(NODES)]
    started: list[Agent] = []
    try:
        r1 = _Reader(first.bootstrap)
        for a in agents:
            a.start()
            started.append(a)
        r1.until(lambda: all(len(s) >= 5 for s in r1.seqs.values()), "5 batches of every node", 30)
        # freeze the broker, let acknowledgements already sent arrive, and kill it only when every
        # acknowledged batch has been read (a batch acked but unread would die with the in-memory store)
        for attempt in range(20):
            r1.until(lambda: _all_read(agents, r1), "every delivered batch to be read", 20)
            os.kill(first.proc.pid, signal.SIGSTOP)
            time.sleep(0.3)
            if all(a.publisher.delivered == len(r1.seqs[a.node]) for a in agents):
                break   # batches still in flight now were not acknowledged: they will be spooled
            os.kill(first.proc.pid, signal.SIGCONT)
        else:
            raise AssertionError("never found a moment where every acknowledged batch had been read")
        first.proc.kill()
        first.proc.wait(10)
        before = {n: list(s) for n, s in r1.seqs.items()}
        delivered_before = {a.node: a.publisher.delivered for a in agents}
        assert delivered_before == {n: len(s) for n, s in before.items()}
        wait_until(lambda: all(a.publisher.outages == 1 and len(a.publisher.spool) >= 3 for a in agents), 20,
                   "every agent to spool during the outage", interval=0.1)
        time.sleep(DOWN_S)
        spooled = {a.node: len(a.publisher.spool) for a in agents}
        assert all(not a.publisher.connected for a in agents)
        assert all(os.listdir(tmp_path / a.node / "spool") for a in agents)   # on disk, not in memory
        second = EmbeddedBroker(port=first.port, log_path=str(tmp_path / "broker2.log")).start()
        r2 = _Reader(second.bootstrap)
        wait_until(lambda: all(a.publisher.replayed > 0 and len(a.publisher.spool) == 0 for a in agents), 40,
                   "every agent to replay its spool", interval=0.1)
        marks = {a.node: a.seq for a in agents}
        r2.until(lambda: all(r2.seqs[n] and r2.seqs[n][-1] >= marks[n] for n in NODES),
                 "new batches after the replay", 30)
        for a in agents:
            a.stop()
        produced = {a.node: a.publisher.produced for a in agents}
        r2.push_watermarks()
        deadline = time.monotonic() + 20    # then the counts below say what is missing
        while time.monotonic() < deadline and not all(len(before[n]) + len(r2.seqs[n]) >= produced[n] for n in NODES):
            r2.poll()
        r2.poll(1.0)  # a duplicate would come now
        for a in agents:
            n, p = a.node, a.publisher
            arrived = before[n] + r2.seqs[n]
            missing = sorted(set(range(produced[n])) - set(arrived))
            dups = sorted({s for s in arrived if arrived.count(s) > 1})
            assert not missing and not dups, f"{n}: missing {missing}, duplicated {dups}"
            assert arrived == list(range(produced[n])), f"{n}: out of order around {before[n][-2:]} / {r2.seqs[n][:2]}"
            assert p.outages == 1 and p.dropped == 0 and p.replayed == p.spooled >= spooled[n] > 0
            assert p.delivered == produced[n] and len(p.spool) == 0
            assert os.listdir(tmp_path / n / "spool") == []
    finally:
        for a in started:
            if a._thread is not None and a._thread.is_alive():
                a.stop(timeout=1)
        for r in (r1, r2):
            if r is not None:
                r.close()
        if first.proc is not None and first.proc.poll() is None:
            os.kill(first.proc.pid, signal.SIGCONT)
        for b in (first, second):
            if b is not None:
                b.stop()
