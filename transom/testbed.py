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

import argparse
import atexit
import fcntl
import json
import os
import queue
import re
import select
import shutil
import signal
import subprocess
import sys
import threading
import time
import weakref
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterable, Sequence

from . import log

__all__ = ["Bed", "BedError", "BedUnavailable", "HostProcess", "available", "beds_in_use", "clean_stale",
           "netem_available", "register"]

ROOT = Path(__file__).resolve().parents[1]
_BEDPROC = Path(__file__).resolve().with_name("_bedproc.py")
_MAX_INDEX = 254
_NAME = re.compile(r"^[a-z][a-z0-9-]{0,30}$")
_PRIVATE = ("/tmp", "/dev/shm")
_log = log.get("testbed")


class BedError(RuntimeError):
    """A test-bed operation failed."""


class BedUnavailable(BedError):
    """This machine cannot make the bed's namespaces (not root, no CAP_SYS_ADMIN, no ``ip``...)."""


def state_dir() -> Path:
    return Path(os.environ.get("TRANSOM_TESTBED_DIR") or "/run/transom-testbed")


# --------------------------------------------------------------------------- availability

_available: tuple[bool, str] | None = None
_netem: bool | None = None


def available() -> tuple[bool, str]:
    """``(True, "ok ...")`` when beds can be made here, else ``(False, one-line reason)``."""
    global _available
    if _available is None:
        _available = _probe()
    return _available


def _probe() -> tuple[bool, str]:
    if not sys.platform.startswith("linux"):
        return False, f"the test bed needs Linux namespaces (this is {sys.platform})"
    if os.geteuid() != 0:
        return False, "the test bed needs root (namespaces, veth links, mounts); run as root"
    missing = [t for t in ("ip", "unshare", "nsenter") if shutil.which(t) is None]
    if missing:
        return False, f"the test bed needs {', '.join(missing)} (iproute2, util-linux)"
    if not _cap_sys_admin():
        return False, "the test bed needs CAP_SYS_ADMIN (namespaces and mounts)"
    try:
        probe = subprocess.run(
            ["unshare", "--net", "--mount", "--pid", "--uts", "--ipc", "--fork", "--kill-child", "sh", "-c",
             "ip link add name a type veth peer name b && ip link add name br type bridge && mount -t tmpfs t /tmp"],
            capture_output=True, text=True, timeout=60)
    except subprocess.TimeoutExpired:
        return False, "making a throwaway namespace took over 60 s"
    if probe.returncode != 0:
        err = (probe.stderr.strip().splitlines() or ["exit %d" % probe.returncode])[-1]
        return False, f"cannot make namespaces, veth or bridge links here: {err}"
    try:
        state_dir().mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        return False, f"cannot write the bed's state directory {state_dir()}: {exc.strerror}"
    return True, f"ok: namespaces, veth and bridge work (state in {state_dir()}; netem: " \
                 f"{'yes' if netem_available() else 'no, rate limiting only (tbf)'})"


def _cap_sys_admin() -> bool:
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("CapEff:"):
                    return bool(int(line.split()[1], 16) & (1 << 21))
    except OSError:
        pass
    return False


def netem_available() -> bool:
    """Whether the kernel has the netem qdisc (delay); tested in a throwaway namespace."""
    global _netem
    if _netem is None:
        r = subprocess.run(["unshare", "--net", "sh", "-c",
                            "ip link add name d0 type dummy && tc qdisc add dev d0 root netem delay 1ms"],
                           capture_output=True, timeout=30)
        _netem = r.returncode == 0
    return _netem


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
                self._root_start = _start_time(self._root_pid)
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
            if pid is not None and _start_time(pid) == self._root_start:
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
        if len(names) > _MAX_INDEX - 1:
            raise ValueError(f"Bed: hosts: at most {_MAX_INDEX - 1} hosts, got {len(names)}")
        self.hosts: list[str] = names
        always = [ROOT, sys.prefix, sys.base_prefix, Path(os.path.realpath(sys.executable)).parent]
        self.shared = sorted({os.path.realpath(p) for p in [*always, *share]}, key=len)
        # a private directory that is itself shared (or lies in a shared one) stays the machine's
        self.private = [p for p in map(os.path.realpath, private)
                        if not any(p == s or p.startswith(s.rstrip("/") + "/") for s in self.shared)]
        for p in self.private:
            if not os.path.isdir(p):
                raise ValueError(f"Bed: private: {p} is not a directory (each host mounts its own tmpfs on it)")
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
        for pid in _netns_pids(h.netns):
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
        self._lock_fd, self.index = _allocate()
        _LIVE.add(self)
        _install_handlers()
        try:
            for i, name in enumerate(self.hosts):
                self._hosts[name] = _Host(name, i + 2, f"tb{self.index}-{name}", f"h{i + 2}")
            self._save()
            n, s = self.index, self.switch
            _ip_batch(None, [f"netns add {s}", *(f"netns add {h.netns}" for h in self._hosts.values()),
                             f"link add name {self.link} type veth peer name up0 netns {s}",
                             f"addr add {self.root_addr}/24 dev {self.link}", f"link set {self.link} up"])
            _ip_batch(s, ["link set lo up", "link add name br0 type bridge", "link set br0 up",
                          "link set up0 master br0 up",
                          *(line for h in self._hosts.values() for line in self._port_lines(h))])
            for h in self._hosts.values():
                self._host_net(h)
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
                        _kill_pid(h.pid)
                    elif h.init is not None:      # started, not yet answered: --kill-child takes it along
                        h.init.kill()
                for h in self._hosts.values():
                    self._reap_init(h)
                _clean_index(self.index, {"pids": []})
            finally:
                _LIVE.discard(self)
                if self._lock_fd is not None:     # None: a SIGTERM handler closed it meanwhile
                    os.close(self._lock_fd)
                    self._lock_fd = None
                    _log.info("bed %d closed", self.index)

    def _port_lines(self, h: _Host) -> list[str]:
        return [f"link add name {h.port} type veth peer name eth0 netns {h.netns}",
                f"link set {h.port} master br0 up"]

    def _host_net(self, h: _Host) -> None:
        _ip_batch(h.netns, ["link set lo up", f"addr add 198.18.{self.index}.{h.octet}/24 dev eth0",
                            "link set eth0 up"])

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
        h.init = _spawn_kept(argv, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL)

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
        h.start = _start_time(h.pid)

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
            _ip_batch(self.switch, [f"link set {h.port} down"])
            if h.pid is not None:
                _kill_pid(h.pid)
            self._reap_init(h)
            rest = _netns_pids(h.netns)          # relays, and whatever entered the netns alone
            for pid in rest:
                _kill_pid(pid)
            _wait_dead(rest)
            h.up, h.pid, h.start, h.fds = False, None, None, {}
            self._save()

    def restart(self, host: str) -> None:
        """A fresh, empty host of the same name and address (killed first if it runs)."""
        with self._mutex:
            h = self._host(host)
            if h.up:
                self.kill(host)
            _ip_batch(self.switch, [f"link del {h.port}"])
            _ip_batch(None, [f"netns del {h.netns}", f"netns add {h.netns}"])
            _ip_batch(self.switch, self._port_lines(h))
            self._host_net(h)
            h.partitioned = h.slowed = False
            self._start_init(h)
            self._await_init(h)
            self._save()

    def partition(self, host: str) -> None:
        """Cut ``host`` off the bridge (its link down): packets to and from it are lost, its
        processes keep running. :meth:`heal` brings the link back."""
        with self._mutex:
            h = self._host(host, need_up=True)
            _ip_batch(self.switch, [f"link set {h.port} down"])
            h.partitioned = True

    def heal(self, host: str) -> None:
        with self._mutex:
            h = self._host(host, need_up=True)
            _ip_batch(self.switch, [f"link set {h.port} up"])
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
                _run(["tc", "-n", ns, "qdisc", "replace", "dev", dev, "root", *qdisc.split()])
            h.slowed = True

    def unslow(self, host: str) -> None:
        with self._mutex:
            h = self._host(host)
            for ns, dev in ((h.netns, "eth0"), (self.switch, h.port)):
                _run(["tc", "-n", ns, "qdisc", "del", "dev", dev, "root"], check=False)
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


def python_env(env: dict | None = None) -> dict:
    """``env`` (default: this process's environment) for a Python service on a bed host."""
    out = dict(os.environ if env is None else env)
    out["PYTHONUNBUFFERED"] = "1"
    return out


# --------------------------------------------------------------------------- allocation, cleanup

_LIVE: "weakref.WeakSet[Bed]" = weakref.WeakSet()
_handlers_installed = False


def _allocate() -> tuple[int, int]:
    """Lock a free bed number; clean what a dead owner of it left; ``(lock_fd, N)``.

    Numbers go round (the search starts after the last number handed out, kept in ``next``) and
    ones a dead owner left something under are taken only when no clean one is free, so a number
    just freed, or left for ``transom testbed clean``, is not at once somebody else's.
    """
    d = state_dir()
    d.mkdir(parents=True, exist_ok=True)
    start = _next_number(d)
    order = [(start - 1 + i) % _MAX_INDEX + 1 for i in range(_MAX_INDEX)]
    dirty = _dirty_numbers()
    for n in [x for x in order if x not in dirty] + [x for x in order if x in dirty]:
        fd = os.open(d / f"{n}.lock", os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            continue
        try:
            _clean_index(n, _read_state(n))
            _next_number(d, n % _MAX_INDEX + 1)
        except BaseException:
            os.close(fd)
            raise
        return fd, n
    raise BedError(f"all {_MAX_INDEX} bed numbers are in use (see {d}; `transom testbed clean` frees dead ones)")


def _next_number(d: Path, value: int | None = None) -> int:
    """Read (or, given ``value``, write) the number the next search starts at; 1 when unknown."""
    path = d / "next"
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        if value is not None:
            os.ftruncate(fd, 0)
            os.pwrite(fd, str(value).encode(), 0)
            return value
        text = os.pread(fd, 16, 0).decode().strip()
        return int(text) if text.isdigit() and 1 <= int(text) <= _MAX_INDEX else 1
    finally:
        os.close(fd)


def _dirty_numbers() -> set[int]:
    """Bed numbers with a state file, a namespace or a link (in use, or left by a dead owner)."""
    found = {int(p.stem) for p in state_dir().glob("*.json") if p.stem.isdigit()}
    found |= {int(m.group(1)) for ns in _netns_names() if (m := re.match(r"tb(\d+)-", ns))}
    found |= {int(m.group(1)) for link in _root_links() if (m := re.fullmatch(r"tb(\d+)", link))}
    return {n for n in found if 1 <= n <= _MAX_INDEX}


def _read_state(n: int) -> dict:
    try:
        return json.loads((state_dir() / f"{n}.json").read_text())
    except (OSError, ValueError):
        return {}


def clean_stale() -> list[int]:
    """Remove every bed whose owner is dead (its lock is free): processes, namespaces, links.

    Returns the bed numbers cleaned. Beds in use by a live process are left alone.
    """
    if not available()[0]:
        return []
    d = state_dir()
    cleaned = []
    for n in sorted(_dirty_numbers()):
        fd = os.open(d / f"{n}.lock", os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            continue                      # a live owner
        else:
            _clean_index(n, _read_state(n))
            cleaned.append(n)
        finally:
            os.close(fd)
    return cleaned


def beds_in_use() -> dict[int, dict]:
    """``{N: state}`` of every bed whose owner lives (its lock is held), as recorded in ``N.json``."""
    out = {}
    for path in sorted(state_dir().glob("*.json")):
        if not path.stem.isdigit():
            continue
        n = int(path.stem)
        try:
            fd = os.open(state_dir() / f"{n}.lock", os.O_RDONLY)
        except FileNotFoundError:
            continue
        try:
            fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        except BlockingIOError:
            out[n] = _read_state(n)
        finally:
            os.close(fd)
    return out


def _clean_index(n: int, state: dict) -> None:
    """With bed ``n``'s lock held: kill its processes, delete its namespaces, link and files."""
    killed = [pid for pid, start in state.get("pids", []) if pid and _start_time(pid) == start]
    names = [ns for ns in _netns_names() if ns.startswith(f"tb{n}-")]
    killed += [pid for ns in names for pid in _netns_pids(ns)]
    for pid in killed:
        _kill_pid(pid)
    _wait_dead(killed)
    for ns in names:
        _run(["ip", "netns", "del", ns], check=False)
    if f"tb{n}" in _root_links():
        _run(["ip", "link", "del", f"tb{n}"], check=False)
    for suffix in (".json", ".hosts", ".tmp"):
        try:
            (state_dir() / f"{n}{suffix}").unlink()
        except FileNotFoundError:
            pass


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


# --------------------------------------------------------------------------- small helpers

_keeper_queue: "queue.Queue | None" = None
_keeper_lock = threading.Lock()


def _spawn_kept(argv: list[str], **popen) -> subprocess.Popen:
    """``Popen`` from a thread that lives as long as this process.

    PR_SET_PDEATHSIG fires when the *thread* that forked the child exits, so a host's init started
    from a short-lived thread would die with that thread: such calls are handed to one keeper
    thread (the main thread starts its own).
    """
    global _keeper_queue
    if threading.current_thread() is threading.main_thread():
        return subprocess.Popen(argv, **popen)
    with _keeper_lock:
        if _keeper_queue is None:
            _keeper_queue = queue.Queue()
            threading.Thread(target=_keeper, args=(_keeper_queue,), name="testbed-keeper", daemon=True).start()
    box: list = []
    done = threading.Event()
    _keeper_queue.put((argv, popen, box, done))
    done.wait()
    ok, value = box[0]
    if not ok:
        raise value
    return value


def _keeper(q: "queue.Queue") -> None:
    while True:
        argv, popen, box, done = q.get()
        try:
            box.append((True, subprocess.Popen(argv, **popen)))
        except BaseException as exc:  # handed back to the caller's thread
            box.append((False, exc))
        done.set()


def _run(argv: list[str], check: bool = True, input: str | None = None) -> subprocess.CompletedProcess:
    r = subprocess.run(argv, input=input, capture_output=True, text=True, timeout=60)
    if check and r.returncode != 0:
        raise BedError(f"{' '.join(argv)}: {r.stderr.strip() or 'exit %d' % r.returncode}")
    return r


def _ip_batch(netns: str | None, lines: list[str]) -> None:
    _run(["ip", *(["-n", netns] if netns else []), "-b", "-"], input="\n".join(lines) + "\n")


def _netns_names() -> list[str]:
    try:
        return sorted(os.listdir("/run/netns"))
    except OSError:
        return []


def _root_links() -> set[str]:
    return set(os.listdir("/sys/class/net")) if os.path.isdir("/sys/class/net") else set()


def _netns_pids(netns: str) -> list[int]:
    """Every process whose network namespace is ``netns`` (what ``ip netns pids`` prints)."""
    try:
        st = os.stat(f"/run/netns/{netns}")
    except OSError:
        return []
    want = (st.st_dev, st.st_ino)
    out = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                s = os.stat(f"/proc/{entry}/ns/net")
            except OSError:
                continue
            if (s.st_dev, s.st_ino) == want:
                out.append(int(entry))
    return out


def _start_time(pid: int) -> int | None:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return int(f.read().rsplit(")", 1)[1].split()[19])
    except (OSError, IndexError, ValueError):
        return None


def _state(pid: int) -> str | None:
    """The process state letter of ``pid`` (R, S, D, T, Z...), None when there is no such process."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return None


def _alive(pid: int) -> bool:
    """Whether ``pid`` runs (a zombie, dead but not yet reaped by its parent, does not)."""
    return _state(pid) not in (None, "Z", "X")


def _wait_dead(pids: list[int], timeout: float = 30.0) -> None:
    """Wait until none of ``pids`` (SIGKILLed) runs; a process in uninterruptible sleep may take a while."""
    started = {p: _start_time(p) for p in pids}          # against a PID reused meanwhile
    deadline = time.monotonic() + timeout
    while left := [p for p, t in started.items() if t is not None and _alive(p) and _start_time(p) == t]:
        if time.monotonic() > deadline:
            raise BedError(f"processes {left} did not die within {timeout:.0f}s of SIGKILL")
        time.sleep(0.02)


def _kill_pid(pid: int) -> None:
    try:
        os.kill(pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


# --------------------------------------------------------------------------- CLI

def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("testbed", help="a bed of namespaced hosts on this machine (check, clean, up)",
                       description="The test bed: hosts as Linux namespaces on a private bridge "
                                   "(198.18.N.0/24). See docs/testbed.md.")
    tsub = p.add_subparsers(dest="action", metavar="ACTION")
    tsub.required = True
    c = tsub.add_parser("check", help="say whether beds can be made here (exit 0) or why not (exit 1)",
                        description="Print 'ok: ...' and exit 0 when this machine can make beds, else "
                                    "'unavailable: REASON' and exit 1.")
    c.set_defaults(func=_cmd_check)
    c = tsub.add_parser("clean", help="remove beds left by dead owners (namespaces, links, processes)",
                        description="Remove every bed whose owner process is dead; beds in use are kept.")
    c.set_defaults(func=_cmd_clean)
    c = tsub.add_parser("up", help="bring up a bed and keep it until SIGINT/SIGTERM",
                        description="Bring up a bed, print its hosts with their addresses and how to "
                                    "enter them, and keep it until interrupted.")
    c.add_argument("hosts", nargs="*", default=None, metavar="HOST",
                   help="host names (default: node0..node{N-1} from --count)")
    c.add_argument("--count", "-n", type=int, default=3, help="number of hosts when no names are given (3)")
    c.add_argument("--share", action="append", default=[], metavar="PATH",
                   help="a path every host sees even under its private /tmp (repeatable)")
    c.set_defaults(func=_cmd_up)


def _cmd_check(args) -> int:
    ok, reason = available()
    print(reason if ok else f"unavailable: {reason}")
    return 0 if ok else 1


def _cmd_clean(args) -> int:
    ok, reason = available()
    if not ok:
        print(f"unavailable: {reason}")
        return 1
    cleaned = clean_stale()
    print(f"cleaned {len(cleaned)} stale bed(s){': ' + ', '.join(map(str, cleaned)) if cleaned else ''}")
    for n, state in beds_in_use().items():
        print(f"in use: bed {n} (198.18.{n}.0/24) of pid {state.get('owner', '?')}: "
              f"{' '.join(ns.split('-', 1)[1] for ns in state.get('netns', [])[1:])}")
    return 0


def _cmd_up(args) -> int:
    from .cli import wait_for_signal

    if args.count < 1:
        print("transom testbed up: --count: expected a number >= 1", file=sys.stderr)
        return 2
    hosts = args.hosts or args.count
    try:
        bed = Bed(hosts, share=args.share).up()
    except BedError as exc:
        print(f"transom testbed up: {exc}", file=sys.stderr)
        return 1
    with bed:
        print(f"bed {bed.index}: {bed.subnet}, this namespace is {bed.root_addr} on link {bed.link}", flush=True)
        for h in bed.hosts:
            print(f"  {h:<12} {bed.addr(h):<15} enter: nsenter -t {bed.init_pid(h)} -n -m -p -u -i", flush=True)
        wait_for_signal()
    return 0
