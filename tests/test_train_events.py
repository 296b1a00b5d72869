"""Training events (report_event): kept once each by the agent, never overwritten by the next report,
and read by the run report (issue 15: restores and stalls vanished behind the newest report)."""

from __future__ import annotations

import json
import os
import socket

from transom import contracts as c
from transom.agents.intake import TrainReport, parse_datagram, report_event
from transom.agents.training import TrainingCollector
from transom.report import RunData, _restores, _stall_series


def test_report_event_travels_with_its_name(monkeypatch):
    sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    sock.bind(("127.0.0.1", 0))
    sock.settimeout(5)
    monkeypatch.setenv("TRANSOM_AGENT_ADDR", f"127.0.0.1:{sock.getsockname()[1]}")
    monkeypatch.setenv("TRANSOM_JOB", "j")
    try:
        assert report_event("restore", restore_tier=1, restore_s=0.25)
        got = parse_datagram(sock.recv(65536))
    finally:
        sock.close()
    assert got.event == "restore" and got.values == {"restore_tier": 1, "restore_s": 0.25} and got.pid == os.getpid()
    assert parse_datagram(json.dumps({"type": "train", "pid": 1, "rank": 0}).encode()).event == ""


def test_each_event_is_published_once_and_the_newest_report_stays():
    col = TrainingCollector("node0")
    pid = os.getpid()
    col.update(TrainReport("j", 0, 1, pid, "node0", 10.0, {"step": 5, "loss": 2.0}))
    col.update(TrainReport("j", 0, 1, pid, "node0", 10.5, {"restore_tier": 1, "restore_s": 0.2}, event="restore"))
    for step in (10, 20):
        col.update(TrainReport("j", 0, 1, pid, "node0", 11.0 + step, {"step": step, "ckpt_stall_s": 0.01},
                               event="checkpoint_save"))
    col.update(TrainReport("j", 0, 1, pid, "node0", 40.0, {"step": 21, "loss": 1.5}))
    first = col.collect()
    events = [s for s in first if s.tags.get("event")]
    assert [(s.tags["event"], s.ts) for s in events] == [("restore", 10.5), ("checkpoint_save", 21.0),
                                                         ("checkpoint_save", 31.0)]
    state = [s for s in first if not s.tags.get("event")]
    assert len(state) == 1 and state[0].fields["step"] == 21 and "restore_tier" not in state[0].fields
    again = col.collect()
    assert not [s for s in again if s.tags.get("event")] and len(again) == 1


def test_the_report_shows_every_stall_and_the_restore_of_several_shards():
    data = RunData("j")
    data.train = [
        {"ts": 1.0, "node": "n1", "rank": 1, "generation": 1, "event": "restore", "restore_tier": 1, "restore_s": 0.2},
        {"ts": 1.1, "node": "n1", "rank": 1, "generation": 1, "event": "restore", "restore_tier": 2, "restore_s": 0.3},
        *({"ts": 2.0 + s, "node": "n0", "rank": r, "generation": 1, "event": "checkpoint_save", "step": s,
           "ckpt_stall_s": 0.01 * (r + 1)} for s in (10, 20, 30) for r in (0, 1)),
    ]
    table = _restores(data)
    assert table.count("<tr><td>") == 1 and "local disk" in table and "0.500" in table
    (_, _, points), = _stall_series(data, 0.0)
    assert [round(v, 3) for _, v in points] == [0.02, 0.02, 0.02]        # one bar per save: the slowest rank


def test_the_controller_and_the_tee_do_not_take_an_event_for_progress():
    from transom.streams.config import TEEConfig
    from transom.streams.hangs import HangDetector

    ev = c.Sample(c.Source.TRAIN, {"step": 10, "ckpt_stall_s": 0.1}, index=0, tags={"job": "j", "event": "checkpoint_save"})
    batch = c.MetricBatch(node="n0", ts=1.0, seq=0, samples=(ev,))

    class State:
        ranks: dict = {}

    hangs = HangDetector(TEEConfig())
    assert hangs.observe(State(), batch, 1.0) == [] and not any(j.ranks for j in hangs.jobs.values())
