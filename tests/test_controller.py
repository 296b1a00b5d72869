"""The controller with the local backend: real broker, real 4-rank torch jobs, real files.

Faults are published to transom.faults the way the TEE publishes them, so these tests exercise
the controller alone; the end-to-end test runs the TEE too.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from transom import contracts as c
from transom.broker import free_port
from transom.kafka import make_producer, publish
from transom.stack import train_command

from util import topic_values, wait_until

pytestmark = pytest.mark.integration
NODES = [f"node{i}" for i in range(5)]


def start_controller(bootstrap: str, run_dir: Path, job: str | None, steps: int = 60, ckpt_every: int = 10,
                     log_name: str = "controller.log") -> subprocess.Popen:
    args = [sys.executable, "-m", "transom.cli", "controller", "--bootstrap", bootstrap, "--run-dir", str(run_dir),
            "--exit-when-done"]
    for node in NODES:   # no agents here: reports to these ports are dropped, by design of report()
        args += ["--node", f"{node}=127.0.0.1:{free_port()}"]
    if job:
        args += ["--job-id", job, "--world-size", "4", "--", *train_command(steps, ckpt_every)]
    out = open(run_dir.parent / log_name, "ab")
    return subprocess.Popen(args, stdout=out, stderr=subprocess.STDOUT, start_new_session=True,
                            env={**os.environ, "PYTHONUNBUFFERED": "1"})


def lifecycle(bootstrap: str, job: str) -> list[c.LifecycleEvent]:
    return [e for e in topic_values(bootstrap, c.LIFECYCLE) if e.job == job]


def checkpoints(bootstrap: str, job: str) -> list[c.CheckpointReady]:
    return [e for e in topic_values(bootstrap, c.CHECKPOINTS) if e.job == job]


def xid_fault(job: str, node: str) -> c.FaultEvent:
    now = time.time()
    return c.FaultEvent(fault_id=c.stable_id(job, node, "xid", now), job=job, node=node, kind=c.FaultKind.XID,
                        severity=c.Severity.CRITICAL, detector="rule:xid", action=c.Action.EVICT,
                        observed_ts=now, detected_ts=now, evidence={"xid": 79}, summary=f"XID 79 on {node}")


def finish(proc: subprocess.Popen, timeout: float = 240) -> int:
    try:
        return proc.wait(timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        raise


def test_xid_fault_relaunches_on_the_spare_from_the_newest_checkpoint(broker, tmp_path):
    job = "ctl-xid"
    run_dir = tmp_path / "runs"
    proc = start_controller(broker.bootstrap, run_dir, job, steps=80, ckpt_every=10)
    try:
        wait_until(lambda: any(e.step >= 20 for e in checkpoints(broker.bootstrap, job)), 180,
                   "a checkpoint at step 20 or later")
        fault = xid_fault(job, "node1")
        producer = make_producer(broker.bootstrap)
        publish(producer, c.FAULTS, job, fault)
        publish(producer, c.FAULTS, job, fault)          # a redelivery: must not cause a second action
        producer.flush(10)
        assert finish(proc) == 0
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    events = lifecycle(broker.bootstrap, job)
    names = [e.name for e in events]
    relaunch = [e for e in events if e.name == "relaunching"]
    assert len(relaunch) == 1, names
    r = relaunch[0]
    assert r.cause["fault_id"] == fault.fault_id
    assert r.detail["evicted"] == "node1" and r.detail["replacement"] == "node4"
    assert r.detail["nodes"] == ["node0", "node4", "node2", "node3"]
    newest_before = max(e.step for e in checkpoints(broker.bootstrap, job) if e.ts <= r.ts)
    assert r.detail["resume_step"] == newest_before
    assert names[-1] == "completed"
    # the relaunched ranks really resumed from that step (their log says so) and finished
    gen1 = run_dir / job / "gen-1"
    assert json.loads((gen1 / "launch.json").read_text())["resume_step"] == newest_before
    assert all((gen1 / f"rank-{r}.exit").read_text().strip() == "0" for r in range(4))
    assert not (run_dir / job / "gen-2").exists()


def test_restarted_controller_rebuilds_state_and_does_not_relaunch(broker, tmp_path):
    job = "ctl-restart"
    run_dir = tmp_path / "runs"
    first = start_controller(broker.bootstrap, run_dir, job, steps=60, ckpt_every=10, log_name="first.log")
    try:
        wait_until(lambda: any(e.name == "launched" for e in lifecycle(broker.bootstrap, job)), 60,
                   "the first launch")
        os.killpg(first.pid, signal.SIGKILL)
        first.wait(10)
        # same command line: the job is found in the lifecycle and not submitted again
        second = start_controller(broker.bootstrap, run_dir, job, steps=60, ckpt_every=10, log_name="second.log")
        assert finish(second) == 0
    finally:
        for p in (first,):
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
    names = [e.name for e in lifecycle(broker.bootstrap, job)]
    assert names.count("submitted") == 1
    assert names.count("launched") == 1
    assert names[-1] == "completed"
    assert sorted(p.name for p in (run_dir / job).glob("gen-*")) == ["gen-0"]
    assert "already known" in (tmp_path / "second.log").read_text()
