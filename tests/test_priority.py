"""Services run at TRANSOM_SERVICE_PRIORITY (transom/priority.py): a bad value names the key, and a
real service process (a checkpoint daemon, the embedded broker) runs at the configured policy and
nice value, read from /proc/PID/stat."""

from __future__ import annotations

import os
import signal
import subprocess
import sys

import pytest

from transom import priority
from transom.broker import EmbeddedBroker
from transom.checkpoint import segments
from transom.config import ConfigError

from util import wait_until


@pytest.mark.parametrize("bad", ["fast", "nice", "nice:x", "batch:20", "nice:-5", "idle:3", "batch10"])
def test_a_bad_priority_names_the_key(bad):
    with pytest.raises(ConfigError, match="TRANSOM_SERVICE_PRIORITY"):
        priority.parse(bad)


def test_priorities_parse():
    assert priority.parse(priority.DEFAULT) == priority.Priority("batch", 10)
    assert priority.parse("nice:7") == priority.Priority("other", 7)
    assert priority.parse("IDLE") == priority.Priority("idle", 19)
    assert priority.parse("normal").keep
    assert str(priority.parse("batch:12")) == "batch:12" and str(priority.parse("nice:3")) == "nice:3"


def _env(prio: str, tmp_path) -> dict:
    env = {k: v for k, v in os.environ.items() if k not in ("TRANSOM_BOOTSTRAP",)}
    env.update(TRANSOM_SERVICE_PRIORITY=prio, TRANSOM_CKPT_RUNTIME=str(tmp_path / "rt"), PYTHONUNBUFFERED="1",
               TRANSOM_CKPT_LOCAL_DIR=str(tmp_path / "local"))
    return env


def test_a_service_runs_at_the_configured_priority(tmp_path):
    mine = priority.read(os.getpid())
    want = max(mine.nice, 13)
    proc = subprocess.Popen([sys.executable, "-m", "transom.cli", "ckpt-server", "--node", "prio0"],
                            env=_env(f"batch:{want}", tmp_path), stdout=subprocess.DEVNULL,
                            stderr=open(tmp_path / "daemon.log", "wb"))
    try:
        wait_until(lambda: segments.registered(tmp_path / "rt").get("prio0") or proc.poll() is not None, 60,
                   "the checkpoint daemon registers")
        assert proc.poll() is None, (tmp_path / "daemon.log").read_text()
        assert priority.read(proc.pid) == priority.Priority("batch", want)
        # every thread the daemon started afterwards inherits it
        for tid in os.listdir(f"/proc/{proc.pid}/task"):
            with open(f"/proc/{proc.pid}/task/{tid}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
            assert (int(fields[16]), int(fields[38])) == (want, os.SCHED_BATCH), f"thread {tid}"
        assert "CPU priority batch:%d" % want in (tmp_path / "daemon.log").read_text()
        # the test process itself is untouched
        assert priority.read(os.getpid()) == mine
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def test_a_bad_priority_stops_a_service_with_the_key(tmp_path):
    got = subprocess.run([sys.executable, "-m", "transom.cli", "ckpt-server", "--node", "prio1"],
                         env=_env("batch:99", tmp_path), capture_output=True, text=True, timeout=60)
    assert got.returncode != 0
    assert "TRANSOM_SERVICE_PRIORITY='batch:99'" in got.stderr, got.stderr[-2000:]


def test_the_embedded_broker_runs_at_the_configured_priority(tmp_path, monkeypatch):
    mine = priority.read(os.getpid())
    want = max(mine.nice, 11)
    monkeypatch.setenv("TRANSOM_SERVICE_PRIORITY", f"nice:{want}")
    with EmbeddedBroker(create_topics=False, log_path=str(tmp_path / "broker.log")) as b:
        assert priority.read(b.proc.pid) == priority.Priority("other", want)
    assert priority.read(os.getpid()) == mine
