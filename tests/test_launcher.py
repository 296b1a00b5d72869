"""The node launcher and the hosts backend on 127.0.0.1: the channel's authentication, launch, status, stop,
a lost launcher, and the pre-check's all-reduce through launchers. Real processes, no namespaces."""

from __future__ import annotations

import json
import logging
import os
import socket
import sys
import time

import pytest

from util import wait_until

from transom.channel import ChannelServer, Refused, RemoteError, Unreachable, call
from transom.config import ConfigError

KEY = b"k" * 32


@pytest.fixture()
def launchers(tmp_path):
    """Two launchers (n0, n1) in this process, each with its own run dir, served on 127.0.0.1."""
    from transom.controller.launcher import Launcher

    made = []
    for node in ("n0", "n1"):
        launcher = Launcher(node, tmp_path / node, agent="127.0.0.1:9", preload="json")
        server = ChannelServer(KEY, launcher.handlers).start()
        made.append((launcher, server))
    try:
        yield {lau.node: (lau, srv) for lau, srv in made}
    finally:
        for lau, srv in made:
            srv.stop()
            for job_dir in (tmp_path / lau.node).glob("*/gen-*"):
                lau.stop(job_dir.parent.name, int(job_dir.name.split("-")[1]), 5)
            lau.close()


def test_channel_refuses_requests_without_the_cluster_key_and_replays(caplog):
    server = ChannelServer(KEY, {"echo": lambda **kw: kw}, window_s=5).start()
    addr = f"127.0.0.1:{server.port}"
    try:
        assert call(addr, KEY, "echo", {"a": 1}) == {"a": 1}
        with caplog.at_level(logging.WARNING, "transom.channel"):
            with pytest.raises(Refused, match="MAC does not verify"):
                call(addr, b"x" * 32, "echo", {"a": 1})
            # a frame with no MAC at all, and a replay of a signed one
            import transom.channel as ch
            req = {"op": "echo", "args": {}, "ts": time.time(), "nonce": "n1"}
            for frame, why in (({"op": "echo", "args": {}}, "unauthenticated"),
                               ({**req, "mac": ch._mac(KEY, b"req", req)}, None),
                               ({**req, "mac": ch._mac(KEY, b"req", req)}, "replayed")):
                with socket.create_connection(("127.0.0.1", server.port), timeout=5) as s:
                    ch._send(s, frame)
                    ans = ch._recv(s)
                assert (ans.get("refused") is None) if why is None else why in ans["refused"], ans
            old = {"op": "echo", "args": {}, "ts": time.time() - 60, "nonce": "n2"}
            with socket.create_connection(("127.0.0.1", server.port), timeout=5) as s:
                ch._send(s, {**old, "mac": ch._mac(KEY, b"req", old)})
                assert "window" in ch._recv(s)["refused"]
        refused = [r.getMessage() for r in caplog.records if "refused" in r.getMessage()]
        assert len(refused) == 4 and all("from 127.0.0.1:" in m for m in refused), refused
        with pytest.raises(RemoteError, match="unknown op"):
            call(addr, KEY, "rm -rf")
    finally:
        server.stop()
    with pytest.raises(Unreachable):
        call(addr, KEY, "echo", timeout=2)
    with pytest.raises(ConfigError, match="TRANSOM_CLUSTER_KEY"):
        ChannelServer(None, {})


def test_cluster_key_from_the_environment(tmp_path):
    from transom.channel import cluster_key

    assert cluster_key({}) is None
    assert cluster_key({"TRANSOM_SIGNING_KEY": "s" * 16}) == b"s" * 16        # the fault producers' key
    (tmp_path / "key").write_text("c" * 20 + "\n")
    assert cluster_key({"TRANSOM_CLUSTER_KEY_FILE": str(tmp_path / "key"), "TRANSOM_SIGNING_KEY": "s" * 16}) == b"c" * 20
    with pytest.raises(ConfigError, match="at least 16"):
        cluster_key({"TRANSOM_CLUSTER_KEY": "short"})


def test_hosts_backend_launches_watches_and_stops_ranks_through_launchers(tmp_path, launchers):
    from transom.controller.hosts import KILLED, HostsBackend

    addrs = {n: f"127.0.0.1:{srv.port}" for n, (_l, srv) in launchers.items()}
    backend = HostsBackend(tmp_path / "ctl", addrs, key=KEY, ckpt_dir=str(tmp_path / "ckpt"), unreachable_s=1.5,
                           ping_s=0.2)
    go = tmp_path / "go"
    script = tmp_path / "job.py"
    script.write_text("import os, sys, time\n"
                      "print('rank', os.environ['RANK'], 'on', os.environ['TRANSOM_NODE'], 'agent',"
                      " os.environ['TRANSOM_AGENT_ADDR'], 'master', os.environ['MASTER_ADDR'], flush=True)\n"
                      f"while not os.path.exists({str(go)!r}):\n    time.sleep(0.05)\n"
                      "sys.exit(int(os.environ['RANK']) * 3)\n")
    try:
        assert backend.nodes() == ["n0", "n1"]
        assert backend.health(["n0", "n1", "nX"]) == {"nX": "no launcher registered for it (start `transom "
                                                            "launcher` there, or give --launcher)"}
        handle = backend.launch("j", 0, ("n0", "n1"), (sys.executable, str(script)), None)
        assert handle["ranks"] == {"n0": [0], "n1": [1]} and not handle["failed"]
        assert handle["master"].startswith("127.0.0.1:")
        assert backend.launch("j", 0, ("n0", "n1"), (sys.executable, str(script)), None) == handle   # adopted
        wait_until(lambda: all(s.running for s in backend.status("j", 0)) and
                   "master 127.0.0.1" in backend.logs("j", 0, 1), 30, "both ranks running")
        assert "rank 1 on n1 agent 127.0.0.1:9" in backend.logs("j", 0, 1)      # the host's agent, not the controller's
        assert backend.rank_log("j", 0, 1)["tail"][-1].startswith("rank 1 on n1")
        go.write_text("")
        wait_until(lambda: not any(s.running for s in backend.status("j", 0)), 30, "the ranks to end")
        assert [s.exit_code for s in backend.status("j", 0)] == [0, 3]
        # a generation that runs until stopped; then a lost launcher
        go.unlink()
        backend.launch("j", 1, ("n0", "n1"), (sys.executable, str(script)), None)
        wait_until(lambda: all(s.running for s in backend.status("j", 1)), 30, "generation 1 running")
        backend.stop("j", 1, timeout=5)
        wait_until(lambda: not any(s.running for s in backend.status("j", 1)), 30, "generation 1 stopped")
        backend.launch("j", 2, ("n0", "n1"), (sys.executable, str(script)), None)
        wait_until(lambda: all(s.running for s in backend.status("j", 2)), 30, "generation 2 running")
        launchers["n1"][1].stop()                      # n1's launcher is gone: its ranks count as killed
        lost = wait_until(lambda: [s for s in backend.status("j", 2) if not s.running], 30, "n1 counted as lost")
        assert [(s.rank, s.exit_code) for s in lost] == [(1, KILLED)]
        assert "unreachable" in backend.health(["n1"])["n1"]
        backend.stop("j", 2, timeout=5)                # n0 stopped now, n1 when it answers again
        assert ("j", 2, "n1") in backend._pending_stops
    finally:
        backend.close()


def test_hosts_backend_keeps_warm_spares_and_heals_through_launchers(tmp_path, launchers):
    """A warm spare started by its host's launcher takes a killed rank's place: status, logs and stop follow it."""
    from transom.controller.hosts import HostsBackend

    addrs = {n: f"127.0.0.1:{srv.port}" for n, (_l, srv) in launchers.items()}
    backend = HostsBackend(tmp_path / "ctl", addrs, key=KEY, ckpt_dir=str(tmp_path / "ckpt"), unreachable_s=5,
                           ping_s=0.2)
    script = tmp_path / "job.py"
    script.write_text("import os, time\n"
                      "print('spare' if os.environ.get('TRANSOM_SPARE') else 'rank ' + os.environ['RANK'], 'on',"
                      " os.environ['TRANSOM_NODE'], 'RANK' in os.environ, flush=True)\n"
                      "time.sleep(600)\n")
    command = (sys.executable, str(script))
    try:
        assert backend.warm_spares
        backend.launch("j", 0, ("n0",), command, None)
        wait_until(lambda: [s.running for s in backend.status("j", 0)] == [True], 30, "rank 0 running")
        first = backend.start_spare("j", 0, "n1", command)
        second = backend.start_spare("j", 0, "n1", command)
        wait_until(lambda: "spare on n1" in launchers["n1"][0].host.log_tail(
            tmp_path / "n1" / "j" / "gen-0" / "spare-1", 0), 30, "the spare waiting")
        old = backend.status("j", 0)
        master = backend.heal("j", 0, 0, "n1", ["n1"])
        assert master.startswith("127.0.0.1:") and backend.heal("j", 0, 0, "n1", ["n1"]) == master   # idempotent
        handle = json.loads((tmp_path / "ctl" / "j" / "gen-0" / "launch.json").read_text())
        assert handle["ranks"] == {"n0": [], "n1": [0]} and handle["pids"]["n1"] == {"0": second["pid"]}
        assert handle["spares"]["n1"] == [first["pid"]] and handle["nodes"] == ["n1"]
        wait_until(lambda: not launchers["n0"][0].status("j", 0)[0][1], 30, "the old rank killed on n0")
        assert old and [s.running for s in backend.status("j", 0)] == [True]          # the spare is rank 0 now
        assert backend.logs("j", 0, 0).startswith("spare on n1 False")      # no RANK until assigned
        backend.stop("j", 0, timeout=5)                 # the rank and the spare still waiting
        wait_until(lambda: not any(s.running for s in backend.status("j", 0)), 30, "the spare-rank stopped")
        from transom.controller.rankhost import alive
        wait_until(lambda: not alive(first["pid"]), 30, "the waiting spare stopped")
    finally:
        backend.close()


def test_collective_precheck_through_launchers(tmp_path, launchers):
    from transom.controller.hosts import HostsBackend

    addrs = {n: f"127.0.0.1:{srv.port}" for n, (_l, srv) in launchers.items()}
    backend = HostsBackend(tmp_path / "ctl", addrs, key=KEY)
    try:
        assert backend.collective_test("j", 0, ["n0", "n1"], 30) == {}
    finally:
        backend.close()


def test_launcher_command_refuses_to_start_without_a_cluster_key(tmp_path):
    import subprocess

    env = {k: v for k, v in os.environ.items() if not k.startswith(("TRANSOM_CLUSTER_KEY", "TRANSOM_SIGNING_KEY"))}
    proc = subprocess.run([sys.executable, "-m", "transom.cli", "launcher", "--node", "n0", "--listen", "127.0.0.1:0",
                           "--run-dir", str(tmp_path)], env=env, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2 and "no cluster key" in proc.stderr, proc.stderr


def test_warm_argv_finds_python_on_path(tmp_path, monkeypatch):
    from transom.controller.rankhost import warm_argv

    monkeypatch.setenv("PATH", os.path.dirname(sys.executable) + os.pathsep + os.environ.get("PATH", ""))
    monkeypatch.chdir(tmp_path)                        # no ./python here: PATH decides, not the cwd
    name = os.path.basename(sys.executable)
    assert warm_argv([name, "-m", "json.tool"]) == ["-m", "json.tool"]
    assert warm_argv([sys.executable, "x.py", "--a"]) == ["x.py", "--a"]
    assert warm_argv([sys.executable, "-u", "x.py"]) is None
    assert warm_argv(["no-such-python-here", "-m", "json.tool"]) is None


def test_a_partitioned_host_counts_as_lost_and_its_ranks_are_stopped_when_its_link_returns(bed, tmp_path):
    """On the test bed: two launcher hosts; node1 cut off the network counts as lost (its rank -9 for the
    controller) while its rank still runs there; the stop the controller could not deliver reaches it
    once the link is back, so the old rank cannot outlive its generation."""
    from transom.controller.hosts import KILLED, HostsBackend
    from transom.controller.launcher import DEFAULT_PORT

    b = bed(["node0", "node1"], share=[tmp_path])
    key = "p" * 32
    procs = []                                          # kept: a dropped HostProcess takes its relay down
    for node in b.hosts:
        with open(tmp_path / f"launcher-{node}.log", "ab") as out:
            procs.append(b.python(node, ["-m", "transom.cli", "launcher", "--node", node, "--listen",
                            f"{b.addr(node)}:{DEFAULT_PORT}", "--advertise", b.addr(node), "--run-dir",
                            str(tmp_path / node), "--no-warm-ranks"],
                     {**os.environ, "TRANSOM_CLUSTER_KEY": key}, stdout=out, stderr=out))
    script = tmp_path / "job.py"
    script.write_text("import os, time\n"
                      "beat = os.path.join(os.environ['BEAT_DIR'], 'rank-' + os.environ['RANK'])\n"
                      "while True:\n    open(beat, 'a').write('x')\n    time.sleep(0.1)\n")
    backend = HostsBackend(tmp_path / "ctl", {n: f"{b.addr(n)}:{DEFAULT_PORT}" for n in b.hosts}, key=key.encode(),
                           env={"BEAT_DIR": str(tmp_path)}, unreachable_s=3, ping_s=0.3)
    try:
        wait_until(lambda: backend.health(b.hosts) == {}, 60, "both launchers to answer")
        handle = backend.launch("j", 0, ("node0", "node1"), (sys.executable, str(script)), None)
        assert handle["master"].startswith(b.addr("node0") + ":")      # rank 0's host, as the bed routes it
        wait_until(lambda: all(s.running for s in backend.status("j", 0)) and
                   all((tmp_path / f"rank-{r}").exists() for r in (0, 1)), 60, "both ranks running")
        b.partition("node1")
        lost = wait_until(lambda: [s for s in backend.status("j", 0) if not s.running], 30, "node1 counted as lost")
        assert [(s.rank, s.exit_code) for s in lost] == [(1, KILLED)]
        assert "unreachable" in backend.health(["node1"])["node1"]
        backend.stop("j", 0, timeout=5)                 # rank 0 stops now; node1 cannot be told yet
        assert ("j", 0, "node1") in backend._pending_stops
        beat = tmp_path / "rank-1"
        size = beat.stat().st_size
        wait_until(lambda: beat.stat().st_size > size, 10, "the cut-off rank to keep running")
        b.heal("node1")
        wait_until(lambda: (tmp_path / "node1" / "j" / "gen-0" / "rank-1.exit").exists() and not backend._pending_stops,
                   30, "the old rank on node1 to be stopped once its link is back")
    finally:
        backend.close()
