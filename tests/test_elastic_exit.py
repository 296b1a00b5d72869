"""A rank healed in the job exits at once at the end, even while a group it left still waits on a live peer.

Real broker, real gloo ranks (tests/elastic_rank.py) on the public API of transom.elastic; the test
plays the controller's part on the timeline (``reforming`` on ``transom.history``, the contract the
controller writes), so that the lost rank can be left alive: a rank on a host that did not answer the
kill, whose sockets stay open. The survivor's all-reduce of the old group then never ends; tearing
that group down at the end used to wait for the group's timeout (TRANSOM_PG_TIMEOUT_S, 300 s by
default): the demo's job was once seen completed only 297 s after its last step.
"""

from __future__ import annotations

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

from util import wait_until

pytestmark = pytest.mark.integration
RANK = Path(__file__).with_name("elastic_rank.py")
PG_TIMEOUT_S = 120          # the old group's collective would end only then: far past the waits below


def test_a_survivor_exits_at_once_while_the_group_it_left_still_waits_on_a_live_peer(broker, tmp_path):
    job = f"exit-{os.getpid()}"
    master = free_port()
    base = {**os.environ, "TRANSOM_JOB": job, "TRANSOM_BOOTSTRAP": broker.bootstrap, "TRANSOM_GENERATION": "0",
            "TRANSOM_PG_TIMEOUT_S": str(PG_TIMEOUT_S), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(master),
            "WORLD_SIZE": "2", "PYTHONUNBUFFERED": "1"}
    base.pop("RANK", None)
    base.pop("TRANSOM_SPARE", None)
    procs: dict[str, subprocess.Popen] = {}
    logs = {name: tmp_path / f"{name}.log" for name in ("rank0", "rank1", "spare")}

    def start(name: str, **env: str) -> None:
        with logs[name].open("w") as out:
            procs[name] = subprocess.Popen([sys.executable, str(RANK), "80", "0.05"], env={**base, **env},
                                           stdout=out, stderr=subprocess.STDOUT, start_new_session=True)

    def text(name: str) -> str:
        return logs[name].read_text(errors="replace")

    try:
        start("spare", TRANSOM_NODE="node2", TRANSOM_SPARE="1")
        wait_until(lambda: "waiting for a rank" in text("spare"), 90, "a spare waiting")    # before the job runs
        start("rank0", RANK="0", TRANSOM_NODE="node0")
        start("rank1", RANK="1", TRANSOM_NODE="node1")
        wait_until(lambda: "step 5 epoch 0" in text("rank0"), 90, "step 5")
        os.kill(procs["rank1"].pid, signal.SIGSTOP)      # lost, but alive: its connections stay open
        time.sleep(1.0)                                  # rank 0 is in an all-reduce that rank 1 never joins
        assert "step 80" not in text("rank0")
        # what the controller names for the heal: the spare on node2 takes rank 1 in a new group
        producer = make_producer(broker.bootstrap, linger_ms=0)
        ev = c.LifecycleEvent(job=job, seq=0, ts=time.time(), name="reforming", state="recovering", detail={
            "path": "in-job", "generation": 0, "epoch": 1, "master": f"127.0.0.1:{free_port()}", "world": 2,
            "nodes": ["node0", "node2"], "assign": {"node2": 1}, "rank": 1})
        publish(producer, c.HISTORY, job, ev)
        assert producer.flush(10) == 0
        # both finish the job (80 steps) in the new group and exit, while rank 1 still lives (stopped)
        for name in ("rank0", "spare"):
            try:
                procs[name].wait(60)
            except subprocess.TimeoutExpired:
                raise AssertionError(f"{name} did not exit within 60 s of the heal:\n{text(name)[-3000:]}") from None
            assert procs[name].returncode == 0, text(name)[-3000:]
            assert "step 80 epoch 1" in text(name) and "closed" in text(name), text(name)[-3000:]
        assert procs["rank1"].poll() is None
        survivor = text("rank0")
        assert "all-reduce of rank 0 given up: group epoch 1 was named" in survivor
        assert "the group of epoch 0 keeps a pending collective" in survivor
        assert "the group(s) of epoch 0 still wait on a peer; left to the process's end" in survivor
    finally:
        for p in procs.values():
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait(10)
