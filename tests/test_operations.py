"""What a user does with jobs and nodes, and the mistakes a controller answers: one real controller
(local backend, three nodes, no pre-check), `transom run/jobs/cancel/nodes` as a user types them.

Ranks here are tiny Python scripts (no torch): a script that crashes at start, one that never calls
report(). Every wait has a deadline (the subprocess timeout); nothing asserts how fast.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from transom.broker import EmbeddedBroker

from util import wait_until

pytestmark = pytest.mark.integration
TRANSOM = [sys.executable, "-m", "transom.cli"]
CRASH = "import sys\nprint('loading data')\nopen('data/missing.bin')\n"
SILENT = "import time\nprint('training without report()', flush=True)\ntime.sleep(300)\n"


@pytest.fixture(scope="module")
def ctl(tmp_path_factory):
    """A broker and a controller of this module's own, three nodes, and the scripts in a user's folder."""
    tmp = tmp_path_factory.mktemp("ops")
    (tmp / "crash.py").write_text(CRASH)
    (tmp / "silent.py").write_text(SILENT)
    with EmbeddedBroker(log_path=str(tmp / "broker.log")) as broker:
        env = {**os.environ, "TRANSOM_BOOTSTRAP": broker.bootstrap, "PYTHONUNBUFFERED": "1"}
        no_controller = cli(env, "run", "--nodes", "1", "--wait-controller", "1", "--", sys.executable,
                            str(tmp / "silent.py"))
        args = ["controller", "--run-dir", str(tmp / "runs"), "--precheck", "off", "--no-warm-ranks", "--lease", "2"]
        for i in range(3):
            args += ["--node", f"n{i}=127.0.0.1:9"]
        log = open(tmp / "controller.log", "wb")
        proc = subprocess.Popen(TRANSOM + args, env=env, stdout=log, stderr=subprocess.STDOUT,
                                stdin=subprocess.DEVNULL, start_new_session=True)
        try:
            wait_until(lambda: proc.poll() is not None or "holds the lease" in (tmp / "controller.log").read_text(),
                       60, "the controller's lease")
            assert proc.poll() is None, (tmp / "controller.log").read_text()[-3000:]
            yield env, tmp, no_controller
        finally:
            os.killpg(proc.pid, signal.SIGTERM)
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
            from transom.controller.local import LocalBackend
            for gen_dir in (tmp / "runs").glob("*/gen-*"):
                LocalBackend(tmp / "runs", {}).stop(gen_dir.parent.name, int(gen_dir.name.split("-")[1]), 5)


def cli(env, *args: str, timeout: float = 90) -> subprocess.CompletedProcess:
    return subprocess.run(TRANSOM + list(args), env=env, capture_output=True, text=True, timeout=timeout,
                          stdin=subprocess.DEVNULL)


def history(env, job: str) -> str:
    """The job's events on transom.history as text, read in this process (for waiting: no CLI start-up)."""
    from transom import contracts as c

    from util import topic_values
    return "\n".join(f"{e.name} {e.detail}" for e in topic_values(env["TRANSOM_BOOTSTRAP"], c.HISTORY) if e.job == job)


def show(env, job: str) -> str:
    return cli(env, "jobs", "show", job).stdout


def test_run_without_a_controller_says_so(ctl):
    _, _, proc = ctl
    assert proc.returncode == 1 and "no controller holds the lease" in proc.stderr, proc.stderr


def test_a_script_that_crashes_at_start_fails_the_job_with_its_log(ctl):
    env, tmp, _ = ctl
    got = cli(env, "run", "--nodes", "2", "--job-id", "crash", "--follow", "--", sys.executable, str(tmp / "crash.py"))
    assert got.returncode == 1, got.stdout + got.stderr
    failed = got.stdout.strip().splitlines()[-1]
    assert "failed" in failed and "before its first training step" in failed, failed
    assert "gen-0/rank-" in failed and "FileNotFoundError" in failed, failed
    assert "relaunching" not in got.stdout                     # no crash loop
    assert "FileNotFoundError" in show(env, "crash")


def test_warnings_queue_nodes_and_cancel(ctl):
    env, tmp, _ = ctl
    silent = [sys.executable, str(tmp / "silent.py")]
    assert cli(env, "run", "--nodes", "1", "--spares", "5", "--report-warn", "1", "--job-id", "quiet", "--",
               *silent).returncode == 0
    wait_until(lambda: "no training report from generation 0 within 1s" in history(env, "quiet"), 60, "the warning")
    assert "asked for 5 spare node(s), got 2" in show(env, "quiet")
    # every node is taken (one rank, two spares): the next job waits
    assert cli(env, "run", "--nodes", "2", "--job-id", "later", "--", *silent).returncode == 0
    wait_until(lambda: "queued" in history(env, "later"), 60, "the queued job")
    too_big = cli(env, "run", "--nodes", "5", "--job-id", "big", "--follow", "--", *silent)
    assert too_big.returncode == 1 and "this cluster has 3 schedulable (n0, n1, n2): not queued" in too_big.stdout
    listing = wait_until(lambda: (out := cli(env, "nodes").stdout) and "spare for quiet" in out and out, 60, "nodes")
    assert "n0" in listing and "quiet" in listing
    cancelled = cli(env, "cancel", "quiet", "--reason", "done testing")
    assert cancelled.returncode == 0 and "cancelled" in cancelled.stdout and "done testing" in cancelled.stdout
    wait_until(lambda: "launched" in history(env, "later"), 60, "the queued job's launch once nodes are free")
    assert cli(env, "cancel", "later").returncode == 0
    assert "cancelled" in cli(env, "jobs").stdout


def test_cordon_and_uncordon_with_a_reason(ctl):
    env, _, _ = ctl
    got = cli(env, "nodes", "cordon", "n2", "--reason", "bad fan")
    assert got.returncode == 0 and "operator: bad fan" in got.stdout, got.stdout + got.stderr
    got = cli(env, "nodes", "uncordon", "n2", "--reason", "fan replaced")
    line = [ln for ln in got.stdout.splitlines() if ln.startswith("n2 ")][0]
    assert got.returncode == 0 and "bad fan" not in line, got.stdout
    wrong = cli(env, "nodes", "uncordon", "n9", "--reason", "typo")
    assert wrong.returncode == 1 and "no node 'n9'" in wrong.stderr


def test_a_generation_that_never_steps_fails_its_launch(ctl):
    env, tmp, _ = ctl
    got = cli(env, "run", "--nodes", "1", "--job-id", "stuck", "--start-timeout", "2", "--max-restarts", "0",
              "--follow", "--", sys.executable, str(tmp / "silent.py"))
    assert got.returncode == 1 and "did not reach its first training step within 2s" in got.stdout, got.stdout


def test_ranks_run_in_the_submitters_directory_with_its_environment(ctl, tmp_path):
    env, _, _ = ctl
    (tmp_path / "probe.py").write_text(
        "import json, os\njson.dump({'cwd': os.getcwd(), 'env': dict(os.environ)}, open('seen.json', 'w'))\n")
    env = {**env, "PATH": f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}",
           "MY_API_TOKEN": "s3cret", "USER_SETTING": "kept"}
    got = subprocess.run(TRANSOM + ["run", "--nodes", "1", "--job-id", "probe", "--env", "GREETING=hi", "--follow",
                                    "--", "python", "probe.py"],            # relative path, python from PATH
                         env=env, cwd=tmp_path, capture_output=True, text=True, timeout=90, stdin=subprocess.DEVNULL)
    assert got.returncode == 0, got.stdout + got.stderr
    seen = __import__("json").loads((tmp_path / "seen.json").read_text())
    assert seen["cwd"] == str(tmp_path)
    assert seen["env"]["GREETING"] == "hi" and seen["env"]["USER_SETTING"] == "kept"
    assert "MY_API_TOKEN" not in seen["env"] and "s3cret" not in show(env, "probe")


def test_the_same_answers_from_a_compacted_lifecycle_and_the_lease_after_compaction(ctl, tmp_path):
    """Issue 16: copy the topics to a broker of their own with transom.lifecycle reduced to what
    compaction leaves (the newest value per key); `jobs`, `jobs show` and the report's timeline
    answer the same; a controller started there takes the lease and runs a job."""
    from transom import contracts as c
    from transom.kafka import make_producer, read_records
    from transom.report import collect

    env, tmp, _ = ctl
    jobs = ["crash", "quiet", "later", "stuck", "big"]
    before = {j: show(env, j) for j in jobs}
    listed = cli(env, "jobs").stdout
    a = env["TRANSOM_BOOTSTRAP"]
    with EmbeddedBroker(log_path=str(tmp_path / "broker.log")) as compacted:
        producer = make_producer(compacted.bootstrap)
        for topic in (c.HISTORY, c.CHECKPOINTS, c.FAULTS, c.LIFECYCLE):
            records = list(read_records(a, topic))
            if topic == c.LIFECYCLE:                 # what a compacting broker leaves: the newest per key
                newest = {r.key: i for i, r in enumerate(records)}
                assert len(newest) < len(records)
                records = [r for i, r in enumerate(records) if newest[r.key] == i]
            for r in records:
                producer.produce(topic, key=r.key, value=r.value, headers=r.headers)
        assert producer.flush(30) == 0
        env_b = {**env, "TRANSOM_BOOTSTRAP": compacted.bootstrap}
        assert {j: show(env_b, j) for j in jobs} == before
        assert cli(env_b, "jobs").stdout == listed
        assert [e.name for e in collect(compacted.bootstrap, "crash").lifecycle] == \
            [e.name for e in collect(a, "crash").lifecycle]
        args = ["controller", "--run-dir", str(tmp_path / "runs"), "--precheck", "off", "--no-warm-ranks",
                "--node", "n0=127.0.0.1:9"]
        log = tmp_path / "controller.log"
        proc = subprocess.Popen(TRANSOM + args, env=env_b, stdout=open(log, "wb"), stderr=subprocess.STDOUT,
                                stdin=subprocess.DEVNULL, start_new_session=True)
        try:
            (tmp_path / "done.py").write_text("from transom.agents.intake import report\nreport(step=1)\n")
            got = cli(env_b, "run", "--nodes", "1", "--job-id", "after", "--follow", "--", sys.executable,
                      str(tmp_path / "done.py"))
            assert got.returncode == 0 and "completed" in got.stdout, got.stdout + got.stderr + log.read_text()
            assert "holds the lease (term" in log.read_text()
            assert "after" in cli(env_b, "jobs").stdout and "quiet" in cli(env_b, "jobs").stdout
        finally:
            os.killpg(proc.pid, signal.SIGTERM)
            proc.wait(30)
