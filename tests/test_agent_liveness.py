"""Rank liveness without PID lookups: heartbeats and exit reports, across PID namespaces.

A training rank in another PID namespace (a container, a pod) has a pid that means nothing to the
agent. Its liveness comes from the rank itself: a heartbeat thread (stops when the rank is
SIGSTOPped) and an exit report. Uses the real intake socket and a real process in a new PID
namespace (``unshare``; skipped where namespaces cannot be made).
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import signal
import subprocess
import sys
import time

import psutil
import pytest

from transom import contracts
from transom.agents.intake import IntakeError, IntakeServer, TrainReport, parse_datagram
from transom.agents.training import TrainingCollector
from transom.streams.config import TEEConfig
from transom.streams.engine import TEEEngine

from util import wait_until

CHILD = r"""
import sys
from transom.agents.intake import report
report(step=1, loss=2.0, step_time=0.1, phase="eval")
print("ready", flush=True)
sys.stdin.readline()
"""


def _can_unshare() -> str | None:
    if shutil.which("unshare") is None:
        return "no unshare command"
    try:
        r = subprocess.run(["unshare", "--pid", "--fork", "--mount-proc", "true"], capture_output=True, timeout=20)
    except (OSError, subprocess.SubprocessError) as exc:
        return f"unshare failed: {exc}"
    return None if r.returncode == 0 else f"cannot make a PID namespace here: {r.stderr.decode().strip()[:80]}"


def test_heartbeat_and_exit_datagrams_parse_with_phase_and_stack():
    hb = parse_datagram(json.dumps({"type": "heartbeat", "rank": 2, "pid": 9, "job": "j", "phase": "checkpoint",
                                    "stack": "x.py:3 wait", "pidns": "pid:[1]", "step": 5}).encode())
    assert (hb.kind, hb.phase, hb.stack, hb.pidns, dict(hb.values)) == ("heartbeat", "checkpoint", "x.py:3 wait",
                                                                        "pid:[1]", {})
    assert parse_datagram(b'{"type":"exit","rank":0,"pid":3}').kind == "exit"


def test_a_heartbeat_carries_what_its_process_wrote_and_a_bad_count_is_refused_with_the_reason():
    hb = parse_datagram(b'{"type":"heartbeat","rank":0,"pid":3,"io":[4096,8192]}')
    assert hb.io == (4096, 8192)
    assert parse_datagram(b'{"type":"heartbeat","rank":0,"pid":3}').io is None
    for bad in (b'[1]', b'[-1,2]', b'[1.5,2]', b'"many"', b'[true,1]'):
        with pytest.raises(IntakeError, match="field 'io' must be"):
            parse_datagram(b'{"type":"heartbeat","rank":0,"pid":3,"io":' + bad + b'}')
    # a training report's own "io" (not a number) is one of its values, left out, not a refusal
    assert parse_datagram(b'{"type":"train","rank":0,"pid":3,"step":2,"io":"x"}').values == {"step": 2}


def test_a_rank_in_another_pid_namespace_is_found_hung_when_stopped_and_exited_when_it_exits():
    why = _can_unshare()
    if why:
        pytest.skip(why)
    col = TrainingCollector("n1")
    server = IntakeServer("127.0.0.1", 0, on_train=col.update, on_inject=lambda r: {}, logger=logging.getLogger("t"))
    addr = server.start()
    env = {**os.environ, "RANK": "1", "TRANSOM_JOB": "jl", "TRANSOM_NODE": "n1", "TRANSOM_AGENT_ADDR": addr,
           "TRANSOM_HEARTBEAT_S": "0.2"}
    proc = subprocess.Popen(["unshare", "--pid", "--fork", "--mount-proc", sys.executable, "-c", CHILD], env=env,
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout.readline().strip() == "ready"
        rank = wait_until(lambda: [c for c in psutil.Process(proc.pid).children() if "python" in c.name()], 10,
                          "the rank process inside the namespace")[0]

        def sample() -> contracts.Sample | None:
            got = col.collect()
            return got[0] if got else None

        first = wait_until(sample, 10, "a sample of the rank", interval=0.05)
        assert first.tags["pid"] != str(rank.pid)          # its own namespace's pid, not ours
        assert first.tags["phase"] == "eval" and first.fields["alive"] == 1
        # the main thread waits on stdin: the heartbeat says where
        wait_until(lambda: "<string>:6 <module>" in ((sample() or first).tags.get("stack") or ""), 10, "a stack sample")
        # the TEE's hang detector, fed the collector's samples as the agent would publish them
        engine = TEEEngine(TEEConfig(hang_timeout=1.0, hang_stale_s=1.5, soft_detectors=()))
        hangs: list[contracts.FaultEvent] = []

        def feed() -> contracts.Sample | None:
            s = sample()
            if s is not None:
                now = time.time()
                hangs.extend(engine.process(contracts.MetricBatch(node="n1", ts=now, seq=0, job="jl", samples=(s,)),
                                            now=now))
            return s

        for _ in range(15):          # standing still with a live heartbeat (waiting on stdin) is no hang
            feed()
            time.sleep(0.2)
        assert hangs == []
        rank.send_signal(signal.SIGSTOP)
        stuck = wait_until(lambda: (s := feed()) and s.fields["heartbeat_age_s"] > 2 and s, 15,
                           "the stopped rank's heartbeat to age", interval=0.2)
        assert stuck.fields["alive"] == 1 and "stopped" not in stuck.fields   # no pid lookup across namespaces
        [hang] = wait_until(lambda: feed() and hangs, 10, "the hang event", interval=0.2)
        assert (hang.node, hang.rank, hang.evidence["cause"]) == ("n1", 1, "stuck")
        assert "<string>:6 <module>" in hang.evidence["stack"]     # where it was when its heartbeat stopped
        rank.send_signal(signal.SIGCONT)
        wait_until(lambda: (s := sample()) and s.fields["heartbeat_age_s"] < 1, 10, "the heartbeat back")
        proc.stdin.write("bye\n")
        proc.stdin.flush()
        proc.wait(20)
        gone = wait_until(lambda: (s := sample()) and s.fields["alive"] == 0 and s, 10, "alive=0 after the exit")
        assert gone.fields["alive"] == 0 and col.collect() == []     # reported once, then forgotten
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)
        server.stop()


WRITER = r"""
import os, sys, time
from transom.agents.intake import report
report(step=1, loss=2.0, step_time=0.1)
print("ready", flush=True)
sys.stdin.readline()
block = os.urandom(1 << 20)
end = time.monotonic() + 2.0
with open(sys.argv[1], "wb") as f:          # a checkpoint written in parts, about 40 MB/s
    while time.monotonic() < end:
        f.seek(0)
        for _ in range(4):
            f.write(block)
        f.flush()
        time.sleep(0.1)
print("saved", flush=True)
sys.stdin.readline()
"""


@pytest.mark.parametrize("how", ["heartbeats", "the agent's own reading"])
def test_the_rate_a_rank_writes_at_tells_the_tee_it_saves(tmp_path, how):
    """``write_bytes_per_s``: how fast the rank's process writes. Its heartbeats carry what it has written
    (its own ``/proc/self/io``: any namespace, any user); without them, for a rank in the agent's PID namespace,
    the agent reads the process's counters. Rank 0 saving alone behind a barrier writes at a save's rate (the
    TEE's ``hang_save_write_mb_s``) and is not hung; idle, it writes nothing. The heartbeats' rank runs in a PID
    namespace of its own where namespaces can be made (the agent cannot read its counters there)."""
    col = TrainingCollector("n1")
    server = IntakeServer("127.0.0.1", 0, on_train=col.update, on_inject=lambda r: {}, logger=logging.getLogger("t"))
    addr = server.start()
    env = {**os.environ, "RANK": "0", "TRANSOM_JOB": "jw", "TRANSOM_NODE": "n1", "TRANSOM_AGENT_ADDR": addr,
           "TRANSOM_HEARTBEAT_S": "0" if how == "the agent's own reading" else "0.2"}
    cmd = [sys.executable, "-c", WRITER, str(tmp_path / "ckpt.bin")]
    if how == "heartbeats" and _can_unshare() is None:
        cmd = ["unshare", "--pid", "--fork", "--mount-proc", *cmd]
    proc = subprocess.Popen(cmd, env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    saving = TEEConfig().hang_save_write_mb_s * 1e6

    def rate() -> float | None:
        got = [s for s in col.collect() if s.index == 0]
        return got[0].fields.get("write_bytes_per_s") if got else None

    try:
        assert proc.stdout.readline().strip() == "ready"
        wait_until(lambda: len(col), 10, "the rank's report", interval=0.05)
        wait_until(lambda: rate() is not None, 10, "a first write rate", interval=0.25)
        idle = rate()
        assert idle is None or idle < 1e6       # waiting on stdin
        proc.stdin.write("save\n")
        proc.stdin.flush()
        rates = []
        for _ in range(6):                      # 1.5 s of its 2 s save
            time.sleep(0.25)
            rates.append(rate())
        assert max(r for r in rates if r is not None) >= saving, rates
        assert proc.stdout.readline().strip() == "saved"
        time.sleep(0.5)
        rate()
        assert wait_until(lambda: (r := rate()) is not None and r < 1e6, 5, "an idle rate", interval=0.25)
    finally:
        proc.kill()
        proc.wait(10)
        server.stop()


def test_heartbeats_less_often_than_batches_keep_the_write_rate_until_they_stop():
    """A rank whose heartbeats come less often than the agent's batches (``TRANSOM_HEARTBEAT_S`` over the agent's
    interval) has no new reading in some batches: the last rate stands there, so a long save does not read as
    stopped writes between two heartbeats (the TEE holds a save 5 s past its last write report); once its
    heartbeats stop (a stuck rank), after two of their gaps, it has none."""
    col = TrainingCollector("n1")
    rank = {"job": "j", "rank": 0, "generation": 0, "pid": 4242, "node": "n1", "pidns": ""}
    col.update(TrainReport(ts=time.time(), values={"step": 1.0}, **rank))
    written, rates = 0, []
    for i in range(12):                 # heartbeats every 0.3 s, batches every 0.1 s: 60 MB/s written
        if i % 3 == 0:
            col.update(TrainReport(ts=time.time(), kind="heartbeat", io=(written, 0), **rank))
            written += 18_000_000
        time.sleep(0.1)
        rates.append(col.collect()[0].fields.get("write_bytes_per_s"))
    assert rates[:3] == [None] * 3                                  # one reading: no rate yet
    assert all(r is not None and 3e7 < r < 1.2e8 for r in rates[3:]), rates
    after = []
    for _ in range(10):                 # the heartbeats stop
        time.sleep(0.1)
        after.append(col.collect()[0].fields.get("write_bytes_per_s"))
    assert after[-3:] == [None] * 3 and after[0] is not None, after
