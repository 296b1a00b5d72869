"""A test bed of real hosts on one machine: Linux namespaces on a private bridge.

Each host of a bed is a network, mount, PID, UTS and IPC namespace with its own hostname, its own
address on the bed's bridge, its own ``/tmp`` and ``/dev/shm`` (tmpfs, gone when the host is
killed) and no route anywhere but that bridge. Bed number ``N`` (allocated under a lock, unique
among every bed on the machine) uses ``198.18.N.0/24``::

    root namespace ── tbN (198.18.N.1) ─┐         tbN-switch: bridge br0
                                         ├─ up0 ── br0 ─┬─ h2 ── eth0 of tbN-node0 (198.18.N.2)
                                                        ├─ h3 ── eth0 of tbN-node1 (198.18.N.3)
                                                        └─ ...

The root namespace (the test process) reaches the hosts through ``tbN``; it gets no route beyond
``198.18.N.0/24`` from the bed, and the hosts have no default route, so nothing a bed host sends
can leave the bridge. Each host's processes run under a small init (PID 1 of the host, see
transom/_bedproc.py); killing it kills every process of the host and frees its memory.

Use::

    with Bed(["ctl", "node0", "node1"], share=[tmp_path]) as bed:
        srv = bed.python("node0", ["-m", "http.server", "8000", "--bind", bed.addr("node0")])
        bed.sh("node1", "hostname").stdout            # "node1\\n"
        bed.kill("node0")                              # a node lost for real
        bed.restart("node0")                           # a fresh, empty host

Shared paths (the checkout, the venv, the Python install and ``share=``) stay visible in every
host even when they lie under ``/tmp``: a host's private ``/tmp`` binds them back in, like a
cluster's shared filesystem.

State lives in ``/run/transom-testbed`` (env ``TRANSOM_TESTBED_DIR``): ``N.lock`` is held
(flock) by the bed's owner for the bed's whole life, ``N.json`` names what was made. A bed whose
lock is free is stale (its owner died): :func:`clean_stale` (``transom testbed clean``) removes its
namespaces, links and processes.

Errors::

    BedError                 an operation on the bed failed (the message names host and command)
     └── BedUnavailable      this machine cannot make namespaces; the reason is one line
"""

from __future__ import annotations

import atexit
import json
import os
import re
import select
import shutil
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterable, Sequence

from . import log
from . import testbed_machine as machine
from .testbed_machine import (BedError, BedUnavailable, available, beds_in_use, clean_stale, netem_available,
                              state_dir)

__all__ = ["Bed", "BedError", "BedUnavailable", "HostProcess", "available", "beds_in_use", "clean_stale",
           "netem_available", "python_env", "register"]

ROOT = Path(__file__).resolve().parents[1]
_BEDPROC = Path(__file__).resolve().with_name("_bedproc.py")
_NAME = re.compile(r"^[a-z][a-z0-9-]{0,30}$")
_PRIVATE = ("/tmp", "/dev/shm")
_log = log.get("testbed")


# --------------------------------------------------------------------------- processes

class HostProcess(subprocess.Popen):
    """A process started on a bed host (``Bed.run``).

    ``pid``/``wait``/``poll``/``returncode`` are those of a small relay in the bed's namespace
    that lives exactly as long as the real process, forwards ``terminate()``/``send_signal()`` to it
    and exits as it did; ``kill()`` kills both. ``root_pid`` is the real process's PID as the
    bed's own namespace sees it (use it for SIGSTOP/SIGCONT: :meth:`signal`), ``host_pid`` the PID
    inside the host.
    """

    host: str
    _pid_pipe: int | None = None
    _root_pid: int | None = None
    _root_start: int | None = None

    @property
    def root_pid(self) -> int | None:
        if self._root_pid is None and self._pid_pipe is not None:
            ready, _, _ = select.select([self._pid_pipe], [], [], 30)
            data = os.read(self._pid_pipe, 64) if ready else b""
            os.close(self._pid_pipe)
            self._pid_pipe = None
            if data.strip():
                self._root_pid = int(data)
                self._root_start = machine.start_time(self._root_pid)
        return self._root_pid

    @property
    def host_pid(self) -> int | None:
        pid = self.root_pid
        try:
            with open(f"/proc/{pid}/status") as f:
                for line in f:
                    if line.startswith("NSpid:"):
                        return int(line.split()[-1])
        except (OSError, TypeError):
            pass
        return None

    def send_signal(self, sig: int) -> None:
        """Signals go to the relay, which passes them on. SIGKILL and SIGSTOP, which a relay cannot
        catch, go to the real process (a dying relay takes a SIGKILLed process with it; one killed
        first would leave its process to this machine's PID 1 to reap, and hold up the host's
        teardown until then)."""
        if sig in (signal.SIGKILL, signal.SIGSTOP) and self.poll() is None:
            pid = self.root_pid
            if pid is not None and machine.start_time(pid) == self._root_start:
                try:
                    os.kill(pid, sig)
                    return
                except ProcessLookupError:
                    pass
        super().send_signal(sig)

    def signal(self, sig: int) -> None:
        """Send ``sig`` to the real process itself (SIGSTOP stops it, not the relay)."""
        pid = self.root_pid
        if pid is None:
            raise ProcessLookupError(f"the process on {self.host} did not start")
        os.kill(pid, sig)

    def __del__(self) -> None:
        if self._pid_pipe is not None:
            os.close(self._pid_pipe)
            self._pid_pipe = None
        super().__del__()


# --------------------------------------------------------------------------- the bed

@dataclass
class _Host:
    name: str
    octet: int
    netns: str
    port: str                                  # the bridge-side end of its link, in the switch
    init: subprocess.Popen | None = None       # the unshare process whose child is the host's init
    pid: int | None = None                     # the init's PID in the bed's own namespace
    start: int | None = None                   # and its start time (/proc/PID/stat), against PID reuse
    up: bool = False
    partitioned: bool = False
    slowed: bool = False
    fds: dict = field(default_factory=dict)


class Bed:
    """``Bed(hosts)``: hosts is a list of names (``[a-z][a-z0-9-]*``) or a count (``node0``...).

    ``share``: extra paths every host sees (e.g. a test's directory standing in for a shared
    filesystem) even under a private directory; the checkout, ``sys.prefix``,
    ``sys.base_prefix`` and the interpreter's directory are always shared. ``private``: the
    directories each host gets a fresh tmpfs on. Use as a context manager or ``up()``/``close()``.
    """

    def __init__(self, hosts: Sequence[str] | int = 3, *, share: Iterable[str | os.PathLike] = (),
                 private: Sequence[str] = _PRIVATE, prefix: str = "node", timeout: float = 60.0) -> None:
        names = [f"{prefix}{i}" for i in range(hosts)] if isinstance(hosts, int) else list(hosts)
        if not names:
            raise ValueError("Bed: hosts: expected at least one host name or a count >= 1")
        for n in names:
            if not _NAME.match(n):
                raise ValueError(f"Bed: hosts: {n!r} is not a host name (expected [a-z][a-z0-9-]*, <= 31 chars)")
        if len(set(names)) != len(names):
            raise ValueError(f"Bed: hosts: duplicate names in {names}")
        if len(names) > machine.MAX_INDEX - 1:
            raise ValueError(f"Bed: hosts: at most {machine.MAX_INDEX - 1} hosts, got {len(names)}")
        self.hosts: list[str] = names
        always = [ROOT, sys.prefix, sys.base_prefix, Path(os.path.realpath(sys.executable)).parent]
        self.shared = sorted({os.path.realpath(p) for p in [*always, *share]}, key=len)
        # a private directory that is itself shared (or lies in a shared one) stays the machine's
        self.private = [p for p in map(os.path.realpath, private)
                        if not any(p == s or p.startswith(s.rstrip("/") + "/") for s in self.shared)]
        for p in self.private:
            if not os.path.isdir(p):
                raise ValueError(f"Bed: private: {p} is not a directory (each host mounts its own tmpfs on it)")
        for p in self.shared:
            if not os.path.exists(p) and any(p.startswith(d.rstrip("/") + "/") for d in self.private):
                raise ValueError(f"Bed: share: {p} does not exist; create it first (a host binds in what is "
                                 f"there when it starts)")
        self.timeout = timeout
        self._owner = os.getpid()
        self.index: int | None = None
        self._lock_fd: int | None = None
        self._hosts: dict[str, _Host] = {}
        self._mutex = threading.RLock()

    # ---- naming

    @property
    def subnet(self) -> str:
        return f"198.18.{self._index}.0/24"

    @property
    def root_addr(self) -> str:
        """The test process's own address on the bed (the link ``tbN``)."""
        return f"198.18.{self._index}.1"

    @property
    def link(self) -> str:
        return f"tb{self._index}"

    @property
    def switch(self) -> str:
        return f"tb{self._index}-switch"

    @property
    def _index(self) -> int:
        if self.index is None:
            raise BedError("the bed is not up")
        return self.index

    def addr(self, host: str) -> str:
        return f"198.18.{self._index}.{self._host(host).octet}"

    def hostname(self, host: str) -> str:
        """The host's hostname (its name); every host's /etc/hosts resolves every bed name."""
        return self._host(host).name

    def netns(self, host: str) -> str:
        return self._host(host).netns

    def init_pid(self, host: str) -> int:
        """PID (in the bed's own namespace) of the host's init: ``nsenter -t PID -n -m -p -u -i``."""
        h = self._host(host, need_up=True)
        return h.pid

    def addresses(self) -> dict[str, str]:
        """``{host: address}`` for every host of the bed."""
        return {h: self.addr(h) for h in self.hosts}

    def processes(self, host: str) -> list[dict]:
        """The processes running in ``host`` (its init left out): ``{"pid": PID seen from here,
        "host_pid": PID inside the host, "cmdline": [...]}``, e.g. to SIGSTOP a rank the host's own
        launcher started."""
        h = self._host(host, need_up=True)
        try:
            want = os.stat(f"/proc/{h.pid}/ns/pid")
        except OSError:
            return []
        out = []
        for pid in machine.netns_pids(h.netns):
            try:
                if pid == h.pid or os.stat(f"/proc/{pid}/ns/pid").st_ino != want.st_ino:
                    continue
                with open(f"/proc/{pid}/cmdline", "rb") as f:
                    cmdline = [a.decode(errors="replace") for a in f.read().split(b"\0")[:-1]]
                with open(f"/proc/{pid}/status") as f:
                    nspid = next(int(line.split()[-1]) for line in f if line.startswith("NSpid:"))
            except (OSError, StopIteration):
                continue                          # exited meanwhile
            out.append({"pid": pid, "host_pid": nspid, "cmdline": cmdline})
        return out

    def is_up(self, host: str) -> bool:
        return self._host(host).up

    def _host(self, host: str, need_up: bool = False) -> _Host:
        try:
            h = self._hosts[host]
        except KeyError:
            raise BedError(f"no host {host!r} in this bed (hosts: {', '.join(self.hosts)})") from None
        if need_up and not h.up:
            raise BedError(f"host {host} is down (killed); restart({host!r}) brings up a fresh one")
        return h

    # ---- life cycle

    def __enter__(self) -> "Bed":
        return self if self._lock_fd is not None else self.up()

    def __exit__(self, *exc) -> None:
        self.close()

    def up(self) -> "Bed":
        if self._lock_fd is not None:
            return self
        if self.index is not None:
            raise BedError(f"bed {self.index} was closed; a Bed is brought up once (make a new one)")
        ok, reason = available()
        if not ok:
            raise BedUnavailable(reason)
        started = time.monotonic()
        self._owner = os.getpid()
        self._lock_fd, self.index = machine.allocate()
        _LIVE.add(self)
        _install_handlers()
        try:
            for i, name in enumerate(self.hosts):
                self._hosts[name] = _Host(name, i + 2, f"tb{self.index}-{name}", f"h{i + 2}")
            self._save()
            n, s = self.index, self.switch
            machine.ip_batch(None, [f"netns add {s}", *(f"netns add {h.netns}" for h in self._hosts.values()),
                             f"link add name {self.link} type veth peer name up0 netns {s}"])
            _sealed(self.link)
            machine.ip_batch(None, [f"addr add {self.root_addr}/24 dev {self.link}", f"link set {self.link} up"])
            machine.ip_batch(s, ["link set lo up", "link add name br0 type bridge", "link set br0 up",
                          "link set up0 master br0 up",
                          *(line for h in self._hosts.values() for line in self._port_lines(h))])
            machine.ip_batches({h.netns: self._host_net_lines(h) for h in self._hosts.values()})
            self._hosts_file().write_text(
                "127.0.0.1\tlocalhost\n::1\tlocalhost ip6-localhost ip6-loopback\n"
                f"198.18.{n}.1\ttestbed-root\n"
                + "".join(f"198.18.{n}.{h.octet}\t{h.name}\n" for h in self._hosts.values()))
            for h in self._hosts.values():
                self._start_init(h)
            for h in self._hosts.values():
                self._await_init(h)
            self._save()
        except BaseException:
            self.close()
            raise
        _log.info("bed %d up in %.1fs: %s", self.index, time.monotonic() - started,
                  " ".join(f"{h}={self.addr(h)}" for h in self.hosts))
        return self

    def __repr__(self) -> str:
        where = f"bed {self.index} ({self.subnet})" if self.index is not None else "bed (down)"
        return f"<{where}: {', '.join(self.hosts)}>"

    def close(self) -> None:
        """Kill every process of the bed, delete its namespaces and links, free its number."""
        with self._mutex:
            if self._lock_fd is None:
                return
            try:
                for h in self._hosts.values():
                    if h.pid is not None:
                        machine.kill_pid(h.pid)
                    elif h.init is not None:      # started, not yet answered: --kill-child takes it along
                        h.init.kill()
                for h in self._hosts.values():
                    self._reap_init(h)
                machine.clean_number(self.index, {"pids": []})
            finally:
                _LIVE.discard(self)
                if self._lock_fd is not None:     # None: a SIGTERM handler closed it meanwhile
                    os.close(self._lock_fd)
                    self._lock_fd = None
                    _log.info("bed %d closed", self.index)

    def _port_lines(self, h: _Host) -> list[str]:
        return [f"link add name {h.port} type veth peer name eth0 netns {h.netns}",
                f"link set {h.port} master br0 up"]

    def _host_net_lines(self, h: _Host) -> list[str]:
        return ["link set lo up", f"addr add 198.18.{self.index}.{h.octet}/24 dev eth0", "link set eth0 up"]

    def _hosts_file(self) -> Path:
        return state_dir() / f"{self.index}.hosts"

    def _start_init(self, h: _Host) -> None:
        spec = {"hostname": h.name, "private": self.private, "share": self.shared,
                "hosts_file": str(self._hosts_file())}
        argv = ["nsenter", f"--net=/run/netns/{h.netns}", "--", "unshare", "--mount", "--pid", "--uts",
                "--ipc", "--fork", "--kill-child", sys.executable, "-I", "-S", str(_BEDPROC), "init",
                json.dumps(spec)]
        if shutil.which("setpriv"):
            # the hosts die with the bed's owner even when it is SIGKILLed (its namespaces and link
            # stay until clean_stale)
            argv = ["setpriv", "--pdeathsig", "KILL", *argv]
        # stderr: unshare 2.38 prints a spurious "sigprocmask unblock failed" when its child is killed;
        # the init reports its own errors on stdout
        h.init = machine.spawn_kept(argv, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL)

    def _await_init(self, h: _Host) -> None:
        ready, _, _ = select.select([h.init.stdout], [], [], self.timeout)
        line = h.init.stdout.readline() if ready else b""
        h.init.stdout.close()
        try:
            msg = json.loads(line or b"{}")
        except ValueError:
            msg = {"error": line.decode(errors="replace").strip()[-300:]}
        if "pid" not in msg:
            why = msg.get("error") or (f"it exited ({h.init.wait(10)})" if ready else
                                       f"no answer within {self.timeout:.0f}s")
            raise BedError(f"host {h.name}: its init did not start: {why}")
        h.pid, h.fds, h.up = msg["pid"], msg["fds"], True
        h.start = machine.start_time(h.pid)

    def _reap_init(self, h: _Host) -> None:
        if h.init is not None:
            try:
                h.init.wait(self.timeout)
            except subprocess.TimeoutExpired:
                h.init.kill()
                h.init.wait()
            h.init = None

    def _save(self) -> None:
        state = {"index": self.index, "owner": os.getpid(), "link": self.link,
                 "netns": [self.switch, *(h.netns for h in self._hosts.values())],
                 "pids": [[h.pid, h.start] for h in self._hosts.values() if h.pid]}
        path = state_dir() / f"{self.index}.json"
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps(state))
        tmp.replace(path)

    # ---- processes on a host

    def run(self, host: str, argv: Sequence[str], env: dict | None = None, *, cwd: str | None = None,
            stdin=subprocess.DEVNULL, stdout=None, stderr=None, **popen) -> HostProcess:
        """Start ``argv`` inside ``host`` (every namespace of it); returns a :class:`HostProcess`.

        ``cwd``: a directory as the host sees it (default: the caller's, else ``/``). Other
        keyword arguments go to :class:`subprocess.Popen`.
        """
        with self._mutex:
            h = self._host(host, need_up=True)
            r, w = os.pipe()
            try:
                proc = HostProcess(
                    [sys.executable, "-I", "-S", str(_BEDPROC), "enter", f"{h.pid}:{h.start}", str(w), cwd or "", "--",
                     *map(str, argv)],
                    env=env, stdin=stdin, stdout=stdout, stderr=stderr,
                    pass_fds=(w, *popen.pop("pass_fds", ())), **popen)
            except BaseException:
                os.close(r)
                raise
            finally:
                os.close(w)
        proc.host, proc._pid_pipe = host, r
        return proc

    def sh(self, host: str, cmd: str, *, check: bool = False, timeout: float | None = 60,
           env: dict | None = None, input: str | None = None) -> subprocess.CompletedProcess:
        """Run a shell command on ``host`` and wait; stdout and stderr captured as text."""
        proc = self.run(host, ["/bin/sh", "-c", cmd], env, stdin=subprocess.PIPE if input else subprocess.DEVNULL,
                        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        try:
            out, err = proc.communicate(input, timeout=timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.communicate()
            raise BedError(f"{host}: {cmd!r} did not finish within {timeout}s") from None
        result = subprocess.CompletedProcess(["sh", "-c", cmd], proc.returncode, out, err)
        if check and proc.returncode != 0:
            raise BedError(f"{host}: {cmd!r} exited {proc.returncode}: {err.strip()[-500:]}")
        return result

    def python(self, host: str, args: Sequence[str], env: dict | None = None, *, cwd: str | None = None,
               **kw) -> HostProcess:
        """Run this interpreter (the project's venv) on ``host``: ``bed.python(h, ["-m", "transom", ...])``.

        The checkout and the venv are shared into every host, so ``-m transom...`` works from a
        checkout anywhere; ``cwd`` defaults to the checkout, output is unbuffered.
        """
        return self.run(host, [sys.executable, *args], python_env(env), cwd=cwd or str(ROOT), **kw)

    # ---- faults

    def kill(self, host: str) -> None:
        """Lose ``host`` for real: its link goes down, every process of it is SIGKILLed and its
        ``/tmp`` and ``/dev/shm`` are gone. Returns when nothing of it runs."""
        with self._mutex:
            h = self._host(host)
            machine.ip_batch(self.switch, [f"link set {h.port} down"])
            if h.pid is not None:
                machine.kill_pid(h.pid)
            self._reap_init(h)
            rest = machine.netns_pids(h.netns)          # relays, and whatever entered the netns alone
            for pid in rest:
                machine.kill_pid(pid)
            machine.wait_dead(rest)
            h.up, h.pid, h.start, h.fds = False, None, None, {}
            self._save()

    def restart(self, host: str) -> None:
        """A fresh, empty host of the same name and address (killed first if it runs)."""
        with self._mutex:
            h = self._host(host)
            if h.up:
                self.kill(host)
            machine.ip_batch(self.switch, [f"link del {h.port}"])
            machine.ip_batch(None, [f"netns del {h.netns}", f"netns add {h.netns}"])
            machine.ip_batch(self.switch, self._port_lines(h))
            machine.ip_batch(h.netns, self._host_net_lines(h))
            h.partitioned = h.slowed = False
            self._start_init(h)
            self._await_init(h)
            self._save()

    def partition(self, host: str) -> None:
        """Cut ``host`` off the bridge (its link down): packets to and from it are lost, its
        processes keep running. :meth:`heal` brings the link back."""
        with self._mutex:
            h = self._host(host, need_up=True)
            machine.ip_batch(self.switch, [f"link set {h.port} down"])
            h.partitioned = True

    def heal(self, host: str) -> None:
        with self._mutex:
            h = self._host(host, need_up=True)
            machine.ip_batch(self.switch, [f"link set {h.port} up"])
            h.partitioned = False

    def slow(self, host: str, rate: str = "10mbit", *, delay: str | None = None, burst: str | None = None,
             latency: str = "500ms") -> None:
        """Limit ``host``'s link to ``rate`` (tc units: ``"10mbit"``, ``"1gbit"``, ``"500kbps"``) both
        ways with tc tbf; ``burst`` defaults to 10 ms of ``rate`` (at least 32 KiB), so high rates
        are reached. ``delay`` (e.g. ``"50ms"``) needs the netem qdisc, which this kernel may not
        have: then :class:`BedError` says so."""
        per_second = _rate_bytes(rate)
        with self._mutex:
            h = self._host(host, need_up=True)
            if delay is not None:
                if not netem_available():
                    raise BedError("slow(delay=...): this kernel has no netem qdisc (CONFIG_NET_SCH_NETEM); "
                                   "only rate limiting (tbf) is available")
                qdisc = f"netem delay {delay} rate {rate}"
            else:
                qdisc = f"tbf rate {rate} burst {burst or max(32768, per_second // 100)} latency {latency}"
            if shutil.which("tc") is None:
                raise BedError("slow(): needs tc (iproute2), which is not installed")
            for ns, dev in ((h.netns, "eth0"), (self.switch, h.port)):
                machine.run(["tc", "-n", ns, "qdisc", "replace", "dev", dev, "root", *qdisc.split()])
            h.slowed = True

    def unslow(self, host: str) -> None:
        with self._mutex:
            h = self._host(host)
            for ns, dev in ((h.netns, "eth0"), (self.switch, h.port)):
                machine.run(["tc", "-n", ns, "qdisc", "del", "dev", dev, "root"], check=False)
            h.slowed = False


_RATE_UNITS = {"bit": 1 / 8, "kbit": 1e3 / 8, "mbit": 1e6 / 8, "gbit": 1e9 / 8, "tbit": 1e12 / 8,
               "bps": 1, "kbps": 1e3, "mbps": 1e6, "gbps": 1e9, "tbps": 1e12, "": 1 / 8}


def _rate_bytes(rate: str) -> int:
    """Bytes per second of a tc rate (``"10mbit"``; a bare number is bits per second, as in tc)."""
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*", str(rate))
    unit = m and m.group(2).lower()
    if not m or unit not in _RATE_UNITS:
        raise ValueError(f"slow: rate: {rate!r} is not a tc rate (expected e.g. '10mbit', '1gbit', '500kbps')")
    return int(float(m.group(1)) * _RATE_UNITS[unit])


def _sealed(link: str) -> None:
    """This namespace never forwards what arrives on the bed's link, even where IP forwarding is on
    (a host could add a route through ``198.18.N.1``), and takes no IPv6 (router adverts) from it."""
    for path, value in ((f"/proc/sys/net/ipv4/conf/{link}/forwarding", "0"),
                        (f"/proc/sys/net/ipv4/conf/{link}/accept_redirects", "0"),
                        (f"/proc/sys/net/ipv6/conf/{link}/disable_ipv6", "1")):
        try:
            with open(path, "w") as f:
                f.write(value)
        except FileNotFoundError:          # no IPv6 in this kernel
            pass


def python_env(env: dict | None = None) -> dict:
    """``env`` (default: this process's environment) for a Python service on a bed host."""
    out = dict(os.environ if env is None else env)
    out["PYTHONUNBUFFERED"] = "1"
    return out


# --------------------------------------------------------------------------- exit and SIGTERM

_LIVE: "set[Bed]" = set()      # the beds up in this process; held here, so none is dropped unclosed
_handlers_installed = False


def _close_all() -> None:
    """Close this process's beds (a forked child inherits the list, not the beds)."""
    for bed in list(_LIVE):
        if bed._owner != os.getpid():
            continue
        try:
            bed.close()
        except Exception:  # cleanup at exit: the rest must still be tried
            pass


def _on_sigterm(signum, frame) -> None:
    _close_all()
    prev = _prev_sigterm
    if callable(prev):
        prev(signum, frame)
    else:
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        os.kill(os.getpid(), signal.SIGTERM)


_prev_sigterm = None


def _install_handlers() -> None:
    """Close every bed at exit and on SIGTERM. The SIGTERM handler is (re)installed at each
    ``up()`` from the main thread, over whatever handler is there, which it calls afterwards."""
    global _handlers_installed, _prev_sigterm
    if not _handlers_installed:
        atexit.register(_close_all)
        _handlers_installed = True
    if threading.current_thread() is threading.main_thread():
        prev = signal.getsignal(signal.SIGTERM)
        if prev is not signal.SIG_IGN and prev is not _on_sigterm:
            _prev_sigterm = prev
            signal.signal(signal.SIGTERM, _on_sigterm)


def register(sub) -> None:
    """The ``transom testbed`` subcommand (transom/testbed_cli.py)."""
    from .testbed_cli import register as register_cli

    register_cli(sub)
