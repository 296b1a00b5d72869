"""The test bed (transom/testbed.py): hosts as real namespaces on a private bridge.

Every test here needs root and namespaces; the ``bed`` fixture skips with the reason elsewhere
(except the CLI check, which runs everywhere).
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import tempfile
import textwrap
import threading
from pathlib import Path

import pytest

from tests.util import require_bed, wait_until
from transom import testbed
from transom import testbed_machine as machine

pytestmark = pytest.mark.integration       # real namespaces, links and processes

# A TCP echo server and a client, run on bed hosts with the project's interpreter.
SERVER = textwrap.dedent("""
    import socket, sys
    s = socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    s.bind((sys.argv[1], int(sys.argv[2]))); s.listen(8)
    print("listening", flush=True)
    while True:
        c, _ = s.accept()
        c.sendall(c.recv(100)); c.close()
""")
SINK = textwrap.dedent("""
    import socket, sys
    s = socket.socket(); s.bind((sys.argv[1], int(sys.argv[2]))); s.listen(1)
    print("listening", flush=True)
    c, _ = s.accept(); n = 0
    while data := c.recv(65536):
        n += len(data)
    print(n, flush=True)
""")
CLIENT = textwrap.dedent("""
    import errno, socket, sys
    timeout = float(sys.argv[1])
    for target in sys.argv[2:]:
        addr, port = target.rsplit(":", 1)
        try:
            c = socket.create_connection((addr, int(port)), timeout=timeout)
            c.sendall(b"ping"); print(c.recv(100).decode())
        except socket.timeout:
            print("timeout")
        except OSError as e:
            print(errno.errorcode.get(e.errno, e.errno))
""")


def serve(b, host, port=7000):
    proc = b.run(host, [sys.executable, "-I", "-S", "-c", SERVER, b.addr(host), str(port)], stdout=subprocess.PIPE,
                 text=True)
    assert proc.stdout.readline().strip() == "listening"
    return proc


def outputs(b, host, *commands: str) -> list[str]:
    """Run shell ``commands`` on ``host`` in one shell; the stripped output of each."""
    out = b.sh(host, "; echo @@; ".join(commands)).stdout
    return [part.strip() for part in out.split("@@")]


def stop(proc) -> int:
    """Kill a process started on a bed host; its exit status."""
    proc.kill()
    code = proc.wait(30)
    if proc.stdout:
        proc.stdout.close()
    return code


def connect(b, host, addr, port=7000, timeout=5.0, *more: str) -> str | list[str]:
    """Connect from ``host`` to ``addr:port`` (and each of ``more``, "ADDR:PORT"), send "ping" and
    return what came back or the error's name ("timeout", "ENETUNREACH"...); one process for all."""
    targets = [f"{addr}:{port}", *more]
    r = b.run(host, [sys.executable, "-I", "-S", "-c", CLIENT, str(timeout), *targets], stdout=subprocess.PIPE,
              text=True)
    out, _ = r.communicate(timeout=60)
    lines = out.split()
    return lines[0] if not more else lines


def leftovers(index: int) -> list[str]:
    left = [ns for ns in os.listdir("/run/netns") if ns.startswith(f"tb{index}-")] \
        if os.path.isdir("/run/netns") else []
    if os.path.exists(f"/sys/class/net/tb{index}"):
        left.append(f"link tb{index}")
    return left


def test_hosts_have_their_own_name_memory_and_pids(bed):
    b = bed(["alpha", "beta"])
    with tempfile.NamedTemporaryFile(dir="/dev/shm") as mine, tempfile.NamedTemporaryFile(dir="/tmp") as mine2:
        assert outputs(b, "alpha", "hostname", "echo x > /dev/shm/transom-bed-shm; echo y > /tmp/transom-bed-tmp",
                       "cat /dev/shm/transom-bed-shm", f"ls {mine.name} {mine2.name} 2>/dev/null") \
            == ["alpha", "", "x", ""]                               # this machine's /dev/shm and /tmp are not there
    hostname, hosts, net, shm, tmp = outputs(b, "beta", "hostname", "getent hosts alpha", "ls /sys/class/net",
                                             "ls -A /dev/shm", "ls /tmp/transom-bed-tmp 2>/dev/null")
    assert hostname == "beta" and hosts.split()[0] == b.addr("alpha")
    assert net.split() == ["eth0", "lo"]                               # its own /sys
    assert shm == "" and tmp == ""                                     # alpha's /dev/shm and /tmp are alpha's
    assert not os.path.exists("/dev/shm/transom-bed-shm") and not os.path.exists("/tmp/transom-bed-tmp")
    # PIDs: a process sees itself as a low PID of its host; another host cannot see it
    sleeper = b.run("alpha", ["sleep", "300"])
    try:
        assert 1 < sleeper.host_pid < 100 and sleeper.root_pid != sleeper.host_pid
        assert b.sh("alpha", "cat /proc/*/cmdline | tr '\\0' ' '").stdout.count("sleep 300") == 1
        assert "sleep 300" not in b.sh("beta", "cat /proc/*/cmdline | tr '\\0' ' '").stdout
        assert [(p["pid"], p["host_pid"]) for p in b.processes("alpha") if p["cmdline"] == ["sleep", "300"]] \
            == [(sleeper.root_pid, sleeper.host_pid)]
        sleeper.signal(signal.SIGSTOP)            # the real process stops, not its relay
        wait_until(lambda: machine.proc_state(sleeper.root_pid) == "T", 30, "the sleeper stopped")
        assert machine.proc_state(sleeper.pid) != "T"
        sleeper.signal(signal.SIGCONT)
        assert b.sh("beta", "echo $$").stdout.strip() in {str(n) for n in range(2, 100)}
    finally:
        sleeper.terminate()
    assert sleeper.wait(30) == -signal.SIGTERM        # the relay passed SIGTERM on and died of it


def test_tcp_between_hosts_and_no_route_elsewhere(bed):
    b = bed(2)
    server = serve(b, "node0")
    try:
        assert connect(b, "node1", b.addr("node0")) == "ping"
        import socket
        with socket.create_connection((b.addr("node0"), 7000), timeout=10) as c:   # from the root side
            c.sendall(b"root")
            assert c.recv(100) == b"root"
        # nothing leaves the bridge: no route to any other address (refused at once, nothing sent)
        assert b.sh("node1", "ip route").stdout.split("\n")[0].startswith(
            f"198.18.{b.index}.0/24 dev eth0") and "default" not in b.sh("node1", "ip route").stdout
        assert connect(b, "node1", "198.19.255.1", 9, 5.0, "10.255.255.1:9", "192.0.2.1:9") == ["ENETUNREACH"] * 3
        # and this namespace gains nothing beyond the bed's own /24, and forwards nothing from it
        assert Path(f"/proc/sys/net/ipv4/conf/{b.link}/forwarding").read_text().strip() == "0"
        routes = machine.run(["ip", "-4", "route", "show", "dev", b.link]).stdout.strip().splitlines()
        assert [r.split()[0] for r in routes] == [f"198.18.{b.index}.0/24"]
    finally:
        code = stop(server)
    assert code == -signal.SIGKILL and not machine.alive(server.root_pid)


def test_kill_loses_processes_and_memory_restart_gives_a_fresh_host(bed):
    b = bed(2)
    b.sh("node0", "head -c 1048576 /dev/zero > /dev/shm/weights && touch /tmp/scratch", check=True)
    sleeper = b.run("node0", ["sleep", "300"])
    server = serve(b, "node0")
    b.kill("node0")
    assert sleeper.wait(30) == -signal.SIGKILL and stop(server) == -signal.SIGKILL
    assert machine.netns_pids(b.netns("node0")) == []
    assert not b.is_up("node0")
    with pytest.raises(testbed.BedError, match="node0 is down"):
        b.sh("node0", "true")
    assert connect(b, "node1", b.addr("node0"), timeout=1) in {"timeout", "EHOSTUNREACH"}
    b.restart("node0")
    assert b.sh("node0", "ls -A /dev/shm; ls /tmp/scratch; hostname").stdout.split() == ["node0"]
    server = serve(b, "node0")
    try:
        assert wait_until(lambda: connect(b, "node1", b.addr("node0")) == "ping", 30, "the restarted host")
    finally:
        stop(server)


def test_partition_and_heal(bed):
    b = bed(2)
    server = serve(b, "node0")
    try:
        assert connect(b, "node1", b.addr("node0")) == "ping"
        b.partition("node0")
        assert connect(b, "node1", b.addr("node0"), timeout=1) in {"timeout", "EHOSTUNREACH"}
        assert server.poll() is None                       # a partitioned host keeps running
        b.heal("node0")
        wait_until(lambda: connect(b, "node1", b.addr("node0"), timeout=2) == "ping", 30, "the healed link")
    finally:
        stop(server)


def test_slow_is_rate_limiting_and_delay_needs_netem(bed):
    b = bed(2)
    b.slow("node0", "200mbit")
    sink = b.run("node1", [sys.executable, "-I", "-S", "-c", SINK, b.addr("node1"), "7001"], stdout=subprocess.PIPE,
                 text=True)
    try:
        assert sink.stdout.readline().strip() == "listening"
        b.sh("node0", f"head -c 300000 /dev/zero | {sys.executable} -I -S -c 'import socket, sys; "
                      f"socket.create_connection((\"{b.addr('node1')}\", 7001)).sendall(sys.stdin.buffer.read())'",
             check=True)
        assert sink.stdout.readline().strip() == "300000"
    finally:
        stop(sink)
    shown = machine.run(["tc", "-s", "-n", b.netns("node0"), "qdisc", "show", "dev", "eth0"]).stdout
    assert "tbf" in shown and int(shown.split("Sent ")[1].split()[0]) >= 300000     # the data went through it
    with pytest.raises(ValueError, match="rate: '10 furlongs'"):
        b.slow("node0", "10 furlongs")
    b.unslow("node0")
    assert "tbf" not in machine.run(["tc", "-n", b.netns("node0"), "qdisc", "show", "dev", "eth0"]).stdout
    if not testbed.netem_available():
        with pytest.raises(testbed.BedError, match="no netem"):
            b.slow("node0", delay="10ms")


def test_beds_at_once_get_their_own_numbers_and_cannot_reach_each_other(bed):
    a, c = bed(1), bed(1)
    assert a.index != c.index and a.addr("node0") != c.addr("node0")
    assert connect(a, "node0", c.addr("node0"), 9) == "ENETUNREACH"


def test_python_service_from_a_private_shared_dir(bed, tmp_path):
    shared = tmp_path / "private"
    shared.mkdir(mode=0o700)
    (shared / "svc.py").write_text("import socket, transom.testbed; print(socket.gethostname())\n")
    b = bed(1, share=[shared])
    out = b.python("node0", [str(shared / "svc.py")], stdout=subprocess.PIPE, text=True, cwd=str(shared))
    assert out.communicate(timeout=60)[0].strip() == "node0" and out.returncode == 0
    out.stdout.close()
    # the shared directory is the same files, everything else of /tmp is not there
    b.sh("node0", f"echo from-host > {shared}/note", check=True)
    assert (shared / "note").read_text() == "from-host\n"
    with tempfile.NamedTemporaryFile(dir=tmp_path) as not_shared:
        assert b.sh("node0", f"ls {not_shared.name}").returncode != 0


def test_a_bed_made_in_a_thread_outlives_the_thread(bed):
    made = []
    t = threading.Thread(target=lambda: made.append(bed(1)))
    t.start()
    t.join()
    assert made[0].sh("node0", "hostname", timeout=60).stdout.strip() == "node0"


OWNER = textwrap.dedent("""
    import sys, time
    from transom.testbed import Bed
    bed = Bed(2).up()
    bed.run("node0", ["sleep", "300"])
    print(bed.index, bed.init_pid("node0"), bed.init_pid("node1"), flush=True)
    time.sleep(300)
""")


def _owner():
    require_bed()
    proc = subprocess.Popen([sys.executable, "-c", OWNER], stdout=subprocess.PIPE, text=True)
    try:
        index, *pids = map(int, proc.stdout.readline().split())
        assert leftovers(index)
    except BaseException:
        proc.kill()
        proc.wait()
        raise
    return proc, index, pids


def gone(proc, index: int) -> bool:
    """Nothing is left of the bed ``index`` that ``proc`` owned. Other runs on this machine may
    take the number again at once: then its namespaces are theirs, and only its owner is checked."""
    state = testbed.beds_in_use().get(index)
    if state is not None:
        return state.get("owner") != proc.pid
    return leftovers(index) == []


def test_stale_bed_of_a_killed_owner_is_cleaned_and_live_beds_are_kept(bed):
    live = bed(1)
    proc, index, pids = _owner()
    proc.kill()
    proc.wait()
    proc.stdout.close()
    # its hosts die with it; its namespaces and link stay until somebody cleans
    wait_until(lambda: not any(machine.alive(p) for p in pids), 30, "the hosts' inits to die with their owner")
    assert index not in testbed.beds_in_use()
    cleaned = testbed.clean_stale()        # (another run on this machine may have cleaned it first)
    assert live.index in testbed.beds_in_use() and live.index not in cleaned
    assert gone(proc, index)
    assert live.sh("node0", "hostname").stdout.strip() == "node0"


def test_sigterm_of_the_owner_cleans_its_bed():
    proc, index, pids = _owner()
    proc.terminate()
    try:
        assert proc.wait(60) == -signal.SIGTERM
    finally:
        proc.kill()                         # (a no-op when it did exit)
        proc.stdout.close()
    assert gone(proc, index)
    assert not any(machine.alive(p) for p in pids)


def test_bad_arguments_name_the_key(tmp_path):
    for kwargs, message in (({"hosts": ["Node0"]}, "hosts: 'Node0' is not a host name"),
                            ({"hosts": ["a", "a"]}, "hosts: duplicate"),
                            ({"hosts": 0}, "hosts: expected at least one"),
                            ({"private": [str(tmp_path / "nope")]}, "private: .* is not a directory"),
                            ({"share": [str(tmp_path / "later")], "private": [str(tmp_path)]},
                             "share: .* does not exist")):
        with pytest.raises(ValueError, match=message):
            testbed.Bed(**kwargs)
    assert testbed._rate_bytes("10mbit") == 1_250_000 and testbed._rate_bytes("1gbit") == 125_000_000


def test_cli_check_says_ok_or_why_not(capsys):
    from transom.cli import main

    rc = main(["testbed", "check"])
    out = capsys.readouterr().out
    ok, reason = testbed.available()
    assert rc == (0 if ok else 1)
    assert out == (reason if ok else f"unavailable: {reason}") + "\n"


@pytest.mark.skipif(os.geteuid() != 0 or shutil.which("setpriv") is None,
                    reason="needs root and setpriv to take CAP_SYS_ADMIN away")
def test_check_without_cap_sys_admin_says_why_in_one_line():
    r = subprocess.run(["setpriv", "--bounding-set=-sys_admin", sys.executable, "-c",
                        "import sys; from transom import testbed_cli; sys.exit(testbed_cli._cmd_check(None))"],
                       capture_output=True, text=True, timeout=60)
    assert (r.returncode, r.stdout) == (1, "unavailable: the test bed needs CAP_SYS_ADMIN (namespaces and mounts)\n")
