"""Node agent: collectors, the training intake, fault injection, publishing to a real broker.

Unit tests drive the collector policy, the datagram parser and the simulated GPU source through
the GPU collector; integration tests run agents against the session broker, with real training
processes (subprocesses calling ``report()``) and the real ``transom`` command.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import re
import signal
import subprocess
import sys
import time
import uuid

import psutil
import pytest
from confluent_kafka import OFFSET_BEGINNING, Consumer, TopicPartition

from transom import contracts
from transom.agents import cli as agent_cli
from transom.agents.agent import Agent
from transom.agents.intake import IntakeError, parse_datagram, report, send_inject, stats, TrainReport
from transom.broker import free_port, free_udp_port
from transom.contracts import DCGM, Source
from transom.kafka import client_config

from util import wait_until

INTERVAL = 0.2
TRANSOM = [sys.executable, "-m", "transom.cli"]

# A real training-side process: calls report(**kwargs) for each JSON line on stdin (NaN allowed).
CHILD = r"""
import json, sys
from transom.agents.intake import report
print("ready", flush=True)
for line in sys.stdin:
    print("sent" if report(**json.loads(line)) else "dropped", flush=True)
"""


def _node(what: str) -> str:
    return f"t-{what}-{uuid.uuid4().hex[:6]}"


class _Tail:
    """Reads transom.metrics from the beginning as it grows, keeping one node's batches in order.

    (``transom.kafka.read_topic`` waits for the end of every partition, which a live agent's
    partition never reaches; other tests' values on the topic are not decoded.)
    """

    def __init__(self, bootstrap: str, node: str) -> None:
        self.key = node.encode()
        self.batches: list[contracts.MetricBatch] = []
        self.consumer = Consumer(client_config(bootstrap, group_id="transom-test-tail", enable_auto_commit=False))
        md = self.consumer.list_topics(contracts.METRICS, timeout=10)
        self.consumer.assign([TopicPartition(contracts.METRICS, p, OFFSET_BEGINNING)
                              for p in md.topics[contracts.METRICS].partitions])

    def until(self, cond, what: str, timeout: float = 15.0) -> list[contracts.MetricBatch]:
        """Read on until ``cond(batches)`` holds; return the batches read so far."""
        deadline = time.monotonic() + timeout
        while not cond(self.batches):
            if time.monotonic() > deadline:
                raise AssertionError(f"timed out after {timeout:.0f}s waiting for {what} "
                                     f"({len(self.batches)} batches read)")
            for msg in self.consumer.consume(500, 0.2):
                if msg.error() is None and msg.key() == self.key:
                    self.batches.append(contracts.decode(contracts.METRICS, msg.value()))
        return list(self.batches)

    def count(self, n: int) -> list[contracts.MetricBatch]:
        return self.until(lambda bs: len(bs) >= n, f"{n} batches")

    def more(self, n: int) -> list[contracts.MetricBatch]:
        return self.count(len(self.batches) + n)

    def __enter__(self) -> "_Tail":
        return self

    def __exit__(self, *exc) -> None:
        self.consumer.close()


def _train(batches, pid: int) -> list[contracts.Sample]:
    return [s for b in batches for s in b.of(Source.TRAIN) if s.tags.get("pid") == str(pid)]


class _Child:
    """A training process with the launcher's environment, reporting on command."""

    def __init__(self, agent: Agent, *, rank: int, job: str, generation: int = 0) -> None:
        env = {**os.environ, "RANK": str(rank), "TRANSOM_JOB": job, "TRANSOM_GENERATION": str(generation),
               "TRANSOM_NODE": agent.node, "TRANSOM_AGENT_ADDR": agent.intake_addr, "PYTHONUNBUFFERED": "1"}
        self.proc = subprocess.Popen([sys.executable, "-c", CHILD], env=env, text=True,
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE)
        assert self.proc.stdout.readline().strip() == "ready"

    @property
    def pid(self) -> int:
        return self.proc.pid

    def report(self, **fields) -> None:
        self.proc.stdin.write(json.dumps(fields) + "\n")
        self.proc.stdin.flush()
        assert self.proc.stdout.readline().strip() == "sent"

    def finish(self) -> None:
        self.proc.stdin.close()
        self.proc.wait(10)

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)


# ----------------------------------------------------------------------------- unit


def test_parse_datagram_turns_nonfinite_loss_into_a_flag_and_rejects_malformed():
    rep = parse_datagram(json.dumps({"type": "train", "job": "j", "rank": 1, "generation": 2, "pid": 42,
                                     "node": "n", "ts": 1.5, "step": 3, "loss": "nan", "grad_norm": "-inf",
                                     "tokens_per_s": 10.0, "note": "text", "skipped": True}).encode())
    assert rep == TrainReport(job="j", rank=1, generation=2, pid=42, node="n", ts=1.5,
                              values={"step": 3, "loss_nonfinite": 1, "grad_norm_nonfinite": 1,
                                      "tokens_per_s": 10.0, "skipped": 1})
    for raw, reason in [(b"{oops", "not JSON"), (b"[1]", "JSON object"), (b'{"type":"x"}', "unknown"),
                        (b'{"type":"train","rank":-1,"pid":3}', "'rank'"), (b'{"type":"train","rank":0}', "'pid'"),
                        (b'{"type":"inject","fault":"meltdown"}', "unknown fault")]:
        with pytest.raises(IntakeError, match=reason):
            parse_datagram(raw)


def test_report_without_an_agent_drops_and_never_raises(monkeypatch):
    monkeypatch.delenv("TRANSOM_AGENT_ADDR", raising=False)
    before = stats()
    assert report(step=1, loss=2.0) is False
    for bad in ("nonsense", "127.0.0.1:notaport", "127.0.0.1:0"):
        monkeypatch.setenv("TRANSOM_AGENT_ADDR", bad)
        assert report(step=1, loss=float("nan")) is False
    assert stats()["dropped"] == before["dropped"] + 4
    # nobody listens on this port: UDP cannot tell, the report is handed to the socket and lost
    monkeypatch.setenv("TRANSOM_AGENT_ADDR", f"127.0.0.1:{free_port()}")
    monkeypatch.setenv("RANK", "not-a-number")
    assert report(step=1) is False
    monkeypatch.setenv("RANK", "0")
    before = stats()
    for _ in range(200):
        report(step=1, loss=2.0, weird=object())  # a value that is not a number is left out
    after = stats()
    assert after["sent"] + after["dropped"] == before["sent"] + before["dropped"] + 200
    assert after["sent"] > before["sent"]  # (a full socket buffer may drop some, never block)


# ----------------------------------------------------------------------------- integration


def test_agent_command_publishes_batches_keyed_by_node_in_order(broker, transom_env):
    node = _node("cli")
    proc = subprocess.Popen(TRANSOM + ["agent", "--node", node, "--gpu-source", "simulated", "--gpus", "2",
                                       "--interval", str(INTERVAL), "--bootstrap", broker.bootstrap],
                            env=transom_env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    with _Tail(broker.bootstrap, node) as tail:
        try:
            first = proc.stdout.readline()
            assert first.startswith(f"agent {node} intake 127.0.0.1:"), first + proc.stderr.read()
            tail.count(4)
        finally:
            proc.send_signal(signal.SIGTERM)
            _out, err = proc.communicate(timeout=20)
        assert proc.returncode == 0, err
        sent = int(re.search(rf"agent of node {node} stopped after (\d+) batches", err).group(1))
        batches = tail.count(sent)  # all of them were flushed before the exit
    assert [b.seq for b in batches] == list(range(sent))
    assert all(b.node == node and b.job is None for b in batches)
    assert [b.ts for b in batches] == sorted(b.ts for b in batches)
    # SIGTERM: the last batch, a batch like the others, is the goodbye
    assert [b.of(Source.AGENT)[0].fields.get("stopping") for b in batches] == [None] * (sent - 1) + [1]
    for b in batches:
        sources = [s.source for s in b.samples]
        nics = sources.count(Source.NIC)
        assert sources == [Source.HOST, Source.GPU, Source.GPU] + [Source.NIC] * nics + [Source.AGENT]
        assert [s.index for s in b.of(Source.GPU)] == [0, 1]
        assert {DCGM.GPU_UTIL, DCGM.FB_USED, DCGM.GPU_TEMP, DCGM.POWER_USAGE, DCGM.SM_CLOCK} <= set(b.of(Source.GPU)[0].fields)
        assert 0 <= b.of(Source.HOST)[0].fields["mem_used_percent"] <= 100
    assert [b.of(Source.AGENT)[0].fields["batches_sent"] for b in batches] == list(range(sent))


def test_xid79_injected_by_the_inject_command_yields_one_xid_then_gpu_lost(broker, transom_env):
    node = _node("xid")
    with _Tail(broker.bootstrap, node) as tail:
        with Agent(node, broker.bootstrap, gpu_source="simulated", gpus=2, seed=1, interval=INTERVAL) as agent:
            tail.count(1)
            done = subprocess.run(TRANSOM + ["inject", "--agent", agent.intake_addr, "xid79", "--gpu", "1"],
                                  env=transom_env, capture_output=True, text=True, timeout=30)
            assert done.returncode == 0, done.stderr
            reply = json.loads(done.stdout)
            assert reply["ok"] and reply["gpu"] == 1 and reply["node"] == node

            def xid_seq(bs):
                return next((b.seq for b in bs for s in b.of(Source.GPU) if DCGM.XID_ERRORS in s.fields), None)

            tail.until(lambda bs: xid_seq(bs) is not None and bs[-1].seq >= xid_seq(bs) + 2,
                       "two batches after the XID")
        batches = tail.count(agent.batches_sent)
    gpu1 = [(b.seq, s) for b in batches for s in b.of(Source.GPU) if s.index == 1]
    xids = [(seq, s) for seq, s in gpu1 if DCGM.XID_ERRORS in s.fields]
    assert len(xids) == 1
    seq_xid, xid = xids[0]
    assert dict(xid.fields) == {DCGM.XID_ERRORS: 79} and xid.ts == reply["ts"]
    # the XID goes out in a batch of its own as it happens; a tick that raced it may show the loss first
    before = [s for seq, s in gpu1 if seq < seq_xid and not (seq == seq_xid - 1 and DCGM.GPU_LOST in s.fields)]
    after = [s for seq, s in gpu1 if seq > seq_xid]
    assert before and all(DCGM.GPU_UTIL in s.fields for s in before)
    assert len(after) == len([b for b in batches if b.seq > seq_xid]) >= 2
    assert [b for b in batches if b.seq == seq_xid][0].samples == (xid,)
    assert all(dict(s.fields) == {DCGM.GPU_LOST: 1} for s in after)
    assert [s for seq, s in gpu1 if seq == seq_xid] == [xid]  # the XID stands for GPU 1 in its batch
    assert all(DCGM.GPU_UTIL in s.fields for b in batches for s in b.of(Source.GPU) if s.index == 0)


def test_training_report_from_a_process_then_nan_then_dead_rank_alive0_once(broker):
    node, job = _node("train"), f"job-{uuid.uuid4().hex[:6]}"
    with _Tail(broker.bootstrap, node) as tail:
        with Agent(node, broker.bootstrap, gpu_source="simulated", gpus=1, interval=INTERVAL) as agent:
            child = _Child(agent, rank=3, job=job, generation=2)
            try:
                child.report(step=7, loss=2.5, tokens_per_s=1000.0, step_time=0.1, grad_norm=1.25)
                tail.until(lambda bs: len(_train(bs, child.pid)) >= 2, "two TRAIN samples of the reporting process")
                child.report(step=8, loss=float("nan"), tokens_per_s=990.0, step_time=0.1)
                tail.until(lambda bs: any(s.fields.get("step") == 8 for s in _train(bs, child.pid)), "the NaN report")
                child.finish()  # exits and is reaped: the rank is gone
                tail.until(lambda bs: any(s.fields["alive"] == 0 for s in _train(bs, child.pid)),
                           "alive=0 for the exited rank")
                tail.more(2)
            finally:
                child.kill()
        batches = tail.count(agent.batches_sent)
    samples = _train(batches, child.pid)
    first = samples[0]
    assert first.index == 3 and dict(first.tags) == {"job": job, "generation": "2", "pid": str(child.pid)}
    assert {k: first.fields[k] for k in ("step", "loss", "tokens_per_s", "step_time", "grad_norm", "alive")} == \
        {"step": 7, "loss": 2.5, "tokens_per_s": 1000.0, "step_time": 0.1, "grad_norm": 1.25, "alive": 1}
    nan = [s for s in samples if s.fields.get("step") == 8]
    assert nan[0].fields["loss_nonfinite"] == 1 and "loss" not in nan[0].fields
    assert [s.fields["alive"] for s in samples].count(0) == 1 and samples[-1].fields["alive"] == 0
    with_rank = [b for b in batches if _train([b], child.pid)]
    assert {b.job for b in with_rank} == {job}
    assert batches[-1].seq >= with_rank[-1].seq + 2  # batches went on without the forgotten rank
    # the batch that says the rank is gone carries its job; the ones after it, with no rank left, none
    after = [b.job for b in batches if b.seq > with_rank[-1].seq]
    assert with_rank[-1].job == job and len(after) >= 2 and set(after) == {None}


def test_hang_injection_sigstops_the_reporting_process(broker):
    node = _node("hang")
    with _Tail(broker.bootstrap, node) as tail:
        with Agent(node, broker.bootstrap, gpu_source="simulated", gpus=1, interval=INTERVAL) as agent:
            child = _Child(agent, rank=0, job="job-hang")
            try:
                child.report(step=1, loss=3.0, tokens_per_s=1.0, step_time=0.5)
                wait_until(lambda: agent.training.processes(), 10, "the agent to know the training process",
                           interval=0.05)
                reply = send_inject(agent.intake_addr, "hang", timeout=10)
                assert reply["ok"] and reply["pids"] == [child.pid], reply
                wait_until(lambda: psutil.Process(child.pid).status() == psutil.STATUS_STOPPED, 10,
                           "the training process to be stopped", interval=0.05)
                # a stopped process is alive: it is still reported, with its last step
                n = len(tail.count(1))
                later = tail.more(2)[n:]
                assert [(s.fields["alive"], s.fields["step"]) for s in _train(later, child.pid)] == [(1, 1)] * len(later)
            finally:
                child.proc.send_signal(signal.SIGKILL)
                child.proc.wait(10)


def test_nvml_agent_refuses_injection_and_without_a_driver_says_so_once(broker, caplog):
    node = _node("nvml")
    with caplog.at_level(logging.INFO, logger="transom"), _Tail(broker.bootstrap, node) as tail:
        with Agent(node, broker.bootstrap, gpu_source="nvml", interval=INTERVAL) as agent:
            reply = send_inject(agent.intake_addr, "xid79", gpu=0, timeout=10)
            assert reply["ok"] is False and "--gpu-source simulated" in reply["error"]
            tail.count(3)
            no_driver = agent.nvml is None
        batches = tail.count(agent.batches_sent)
    messages = [r.getMessage() for r in caplog.records]
    assert messages.count(f"agent: refused a xid79 injection: {reply['error']}") == 1
    assert all(b.of(Source.HOST) and b.of(Source.AGENT) for b in batches)
    if no_driver:  # this machine has no NVIDIA driver: one clear line, no GPU samples
        lines = [m for m in messages if "no usable NVIDIA driver" in m]
        assert len(lines) == 1 and "--gpu-source simulated" in lines[0]
        assert not any(b.of(Source.GPU) for b in batches)
    else:
        assert all(b.of(Source.GPU) for b in batches)


def test_agent_command_has_help_and_inject_parses(capsys):
    done = subprocess.run(TRANSOM + ["agent", "--help"], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert "--gpu-source {nvml,simulated,none}" in done.stdout and "--intake-port" in done.stdout
    assert "--state-dir" in done.stdout and "--list-collectors" in done.stdout and "--scenario" in done.stdout
    # `transom inject` runs for real in the XID test; here its parser, without a second process
    parser = argparse.ArgumentParser(prog="transom")
    agent_cli.register(parser.add_subparsers())
    args = parser.parse_args(["inject", "--agent", "127.0.0.1:9", "hang"])
    assert (args.fault, args.agent, args.func) == ("hang", "127.0.0.1:9", agent_cli.run_inject)
    with pytest.raises(SystemExit) as exited:
        parser.parse_args(["inject", "--help"])
    assert exited.value.code == 0 and "--gpu GPU" in capsys.readouterr().out


# A training loop in a real process: reports every step, never waits for the agent.
LOOP = r"""
import sys, time
from transom.agents.intake import report, stats
print("ready", flush=True)
for line in sys.stdin:
    n = int(line)
    for step in range(n):
        report(step=step, loss=1.0 / (step + 1), tokens_per_s=1000.0, grad_norm=0.5)
    print(stats()["sent"] + stats()["dropped"], flush=True)
"""


@pytest.mark.integration
def test_training_intake_from_a_process_survives_the_agent_stopping_and_coming_back(broker):
    node, port = _node("intake"), free_udp_port()
    env = {**os.environ, "RANK": "0", "TRANSOM_JOB": "job-intake", "TRANSOM_NODE": node,
           "TRANSOM_AGENT_ADDR": f"127.0.0.1:{port}", "PYTHONUNBUFFERED": "1"}
    loop = subprocess.Popen([sys.executable, "-c", LOOP], env=env, text=True, stdin=subprocess.PIPE, stdout=subprocess.PIPE)
    try:
        assert loop.stdout.readline().strip() == "ready"

        def steps(n: int) -> int:
            loop.stdin.write(f"{n}\n")
            loop.stdin.flush()
            return int(loop.stdout.readline())

        with _Tail(broker.bootstrap, node) as tail:
            with Agent(node, broker.bootstrap, gpu_source="none", intake_port=port, interval=INTERVAL,
                       collectors=["train", "agent"]) as agent:
                steps(5)
                tail.until(lambda bs: any(s.fields.get("step") == 4 for s in _train(bs, loop.pid)), "step 4")
            # the agent is gone: the loop goes on, every report handed to the socket or dropped, none raised
            assert steps(500) == 505 and loop.poll() is None
            with Agent(node, broker.bootstrap, gpu_source="none", intake_port=port, interval=INTERVAL,
                       collectors=["train", "agent"]) as agent:
                assert agent.intake_addr == f"127.0.0.1:{port}"
                steps(3)
                batches = tail.until(lambda bs: any(s.fields.get("step") == 2 and b.seq < 3 for b in bs[1:]
                                                    for s in _train([b], loop.pid)), "a report to the new agent")
        assert {b.job for b in batches if _train([b], loop.pid)} == {"job-intake"}
    finally:
        loop.kill()
        loop.wait(10)


def test_an_agent_stopped_says_goodbye_and_the_tee_waits_for_it_instead_of_evicting_its_node(broker):
    """SIGTERM (a restart, an upgrade) stops the agent with a last batch that says so: the training rank as it
    stands, marked ``agent_stopping``, and the agent's own sample with ``stopping``. Its batches, read back from
    the broker, through the TEE: the node is lost at the heartbeat timeout without the goodbye, and only after
    ``heartbeat_bye_grace_s`` with it (no peer of its job tells either way here)."""
    node, job = _node("bye"), f"job-{uuid.uuid4().hex[:6]}"
    child = None
    try:
        with _Tail(broker.bootstrap, node) as tail:
            with Agent(node, broker.bootstrap, gpu_source="simulated", gpus=1, interval=INTERVAL) as agent:
                child = _Child(agent, rank=0, job=job)
                child.report(step=1, loss=2.0, step_time=0.1)
                tail.until(lambda bs: len(_train(bs, child.pid)) >= 2, "two TRAIN samples")
            batches = tail.count(agent.batches_sent)
    finally:
        if child is not None:
            child.kill()
    *before, bye = batches
    assert [s.fields["stopping"] for s in bye.of(Source.AGENT)] == [1]
    # the rank trains on as its agent stops: its job's worker judges the silence
    assert [(s.fields.get("agent_stopping"), s.fields["alive"]) for s in bye.of(Source.TRAIN)] == [(1, 1)]
    assert not any(s.fields.get("stopping") or s.fields.get("agent_stopping") for b in before for s in b.samples)

    from transom.streams.config import TEEConfig
    from transom.streams.engine import TEEEngine

    def lost_at(batches) -> float | None:
        engine = TEEEngine(TEEConfig(soft_detectors=(), heartbeat_bye_grace_s=30.0))
        for b in batches:
            engine.process(b, now=b.ts + 0.1)
        last = batches[-1].ts
        for t in range(1, 40):
            if any(f.kind == contracts.FaultKind.NODE_LOST for f in engine.check_heartbeats(now=last + t)):
                return t
        return None

    assert lost_at(before) == 7                 # past the 6 s heartbeat timeout
    assert lost_at(batches) == 31               # past the 30 s grace its goodbye asked for
    with pytest.raises(Exception, match="heartbeat_bye_grace_s=200.*at most heartbeat_horizon"):
        TEEConfig(heartbeat_bye_grace_s=200.0)


@pytest.mark.integration
def test_restart_keeps_seq_and_replays_what_an_unreachable_broker_never_got(broker, tmp_path):
    node, state = _node("restart"), str(tmp_path / "state")
    dead = f"127.0.0.1:{free_port()}"  # nothing listens: every batch goes to the spool, SIGTERM keeps them
    with Agent(node, dead, gpu_source="none", interval=INTERVAL, collectors=["host", "agent"], state_dir=state,
               delivery_timeout_s=1.0, retry_s=0.5) as agent:
        wait_until(lambda: agent.publisher.outages == 1 and agent.batches_sent >= 5, 20, "batches spooled", 0.1)
    spooled = agent.batches_sent
    assert agent.publisher.delivered == 0 and len(agent.publisher.spool) == spooled
    with _Tail(broker.bootstrap, node) as tail:
        with Agent(node, broker.bootstrap, gpu_source="none", interval=INTERVAL, collectors=["host", "agent"],
                   state_dir=state) as again:
            # numbering goes on where it stopped (checked on what arrives, below: the first batch
            # of this lifetime may already be out by now)
            tail.count(spooled + 3)
        batches = tail.count(spooled + again.batches_sent)
    assert [b.seq for b in batches] == list(range(spooled + again.batches_sent))
    # (batches made while the old ones were still replaying queued behind them in the spool)
    assert again.publisher.replayed == spooled + again.publisher.spooled and again.publisher.dropped == 0
    last = batches[-1].of(Source.AGENT)[0].fields
    # self-metrics are a snapshot taken when the batch was made (replays may still be in flight then)
    assert last["produced"] == again.batches_sent - 1 and last["dropped"] == 0
    assert last["replayed"] <= again.publisher.replayed
