"""The machine side of the test bed (transom/testbed.py): whether beds can be made here, bed
numbers and their locks, cleaning up after dead owners, and small /proc and iproute2 helpers.

A bed number ``N`` is owned by whoever holds the flock on ``STATE_DIR/N.lock``; nothing of bed
``N`` (namespaces ``tbN-*``, the link ``tbN``) is made before that lock is held, so a free lock
with something under its number means a dead owner, and that is all :func:`clean_stale` removes.
"""

from __future__ import annotations

import fcntl
import json
import os
import queue
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

__all__ = ["BedError", "BedUnavailable", "MAX_INDEX", "alive", "allocate", "available", "beds_in_use",
           "clean_number", "clean_stale", "ip_batch", "ip_batches", "kill_pid", "netem_available", "netns_names",
           "netns_pids", "proc_state", "read_state", "root_links", "run", "spawn_kept", "start_time",
           "state_dir", "wait_dead"]

MAX_INDEX = 254


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


# --------------------------------------------------------------------------- allocation, cleanup

def allocate() -> tuple[int, int]:
    """Lock a free bed number; clean what a dead owner of it left; ``(lock_fd, N)``.

    Numbers go round (the search starts after the last number handed out, kept in ``next``) and
    ones a dead owner left something under are taken only when no clean one is free, so a number
    just freed, or left for ``transom testbed clean``, is not at once somebody else's.
    """
    d = state_dir()
    d.mkdir(parents=True, exist_ok=True)
    start = next_number(d)
    order = [(start - 1 + i) % MAX_INDEX + 1 for i in range(MAX_INDEX)]
    dirty = dirty_numbers()
    for n in [x for x in order if x not in dirty] + [x for x in order if x in dirty]:
        fd = os.open(d / f"{n}.lock", os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            continue
        try:
            clean_number(n, read_state(n))
            next_number(d, n % MAX_INDEX + 1)
        except BaseException:
            os.close(fd)
            raise
        return fd, n
    raise BedError(f"all {MAX_INDEX} bed numbers are in use (see {d}; `transom testbed clean` frees dead ones)")


def next_number(d: Path, value: int | None = None) -> int:
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
        return int(text) if text.isdigit() and 1 <= int(text) <= MAX_INDEX else 1
    finally:
        os.close(fd)


def dirty_numbers() -> set[int]:
    """Bed numbers with a state file, a namespace or a link (in use, or left by a dead owner)."""
    found = {int(p.stem) for p in state_dir().glob("*.json") if p.stem.isdigit()}
    found |= {int(m.group(1)) for ns in netns_names() if (m := re.match(r"tb(\d+)-", ns))}
    found |= {int(m.group(1)) for link in root_links() if (m := re.fullmatch(r"tb(\d+)", link))}
    return {n for n in found if 1 <= n <= MAX_INDEX}


def read_state(n: int) -> dict:
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
    for n in sorted(dirty_numbers()):
        fd = os.open(d / f"{n}.lock", os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            continue                      # a live owner
        else:
            clean_number(n, read_state(n))
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
            out[n] = read_state(n)
        finally:
            os.close(fd)
    return out


def clean_number(n: int, state: dict) -> None:
    """With bed ``n``'s lock held: kill its processes, delete its namespaces, link and files."""
    killed = [pid for pid, start in state.get("pids", []) if pid and start_time(pid) == start]
    names = [ns for ns in netns_names() if ns.startswith(f"tb{n}-")]
    killed += [pid for ns in names for pid in netns_pids(ns)]
    for pid in killed:
        kill_pid(pid)
    wait_dead(killed)
    for ns in names:
        run(["ip", "netns", "del", ns], check=False)
    if f"tb{n}" in root_links():
        run(["ip", "link", "del", f"tb{n}"], check=False)
    for suffix in (".json", ".hosts", ".tmp"):
        try:
            (state_dir() / f"{n}{suffix}").unlink()
        except FileNotFoundError:
            pass


# --------------------------------------------------------------------------- small helpers

_keeper_queue: "queue.Queue | None" = None
_keeper_lock = threading.Lock()


def spawn_kept(argv: list[str], **popen) -> subprocess.Popen:
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


def run(argv: list[str], check: bool = True, input: str | None = None) -> subprocess.CompletedProcess:
    r = subprocess.run(argv, input=input, capture_output=True, text=True, timeout=60)
    if check and r.returncode != 0:
        raise BedError(f"{' '.join(argv)}: {r.stderr.strip() or 'exit %d' % r.returncode}")
    return r


def ip_batch(netns: str | None, lines: list[str]) -> None:
    run(["ip", *(["-n", netns] if netns else []), "-b", "-"], input="\n".join(lines) + "\n")


def ip_batches(batches: dict[str, list[str]]) -> None:
    """:func:`ip_batch` for several namespaces at once (``{netns: lines}``), all run side by side."""
    procs = {ns: subprocess.Popen(["ip", "-n", ns, "-b", "-"], stdin=subprocess.PIPE, stdout=subprocess.DEVNULL,
                                  stderr=subprocess.PIPE, text=True) for ns in batches}
    errors = []
    for ns, proc in procs.items():
        _out, err = proc.communicate("\n".join(batches[ns]) + "\n", timeout=60)
        if proc.returncode != 0:
            errors.append(f"ip -n {ns} -b -: {err.strip() or 'exit %d' % proc.returncode}")
    if errors:
        raise BedError("; ".join(errors))


def netns_names() -> list[str]:
    try:
        return sorted(os.listdir("/run/netns"))
    except OSError:
        return []


def root_links() -> set[str]:
    return set(os.listdir("/sys/class/net")) if os.path.isdir("/sys/class/net") else set()


def netns_pids(netns: str) -> list[int]:
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


def start_time(pid: int) -> int | None:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return int(f.read().rsplit(")", 1)[1].split()[19])
    except (OSError, IndexError, ValueError):
        return None


def proc_state(pid: int) -> str | None:
    """The process state letter of ``pid`` (R, S, D, T, Z...), None when there is no such process."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return None


def alive(pid: int) -> bool:
    """Whether ``pid`` runs (a zombie, dead but not yet reaped by its parent, does not)."""
    return proc_state(pid) not in (None, "Z", "X")


def wait_dead(pids: list[int], timeout: float = 30.0) -> None:
    """Wait until none of ``pids`` (SIGKILLed) runs; a process in uninterruptible sleep may take a while."""
    started = {p: start_time(p) for p in pids}          # against a PID reused meanwhile
    deadline = time.monotonic() + timeout
    while left := [p for p, t in started.items() if t is not None and alive(p) and start_time(p) == t]:
        if time.monotonic() > deadline:
            raise BedError(f"processes {left} did not die within {timeout:.0f}s of SIGKILL")
        time.sleep(0.02)


def kill_pid(pid: int) -> None:
    try:
        os.kill(pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
