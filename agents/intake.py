"""Training intake: UDP JSON datagrams from training processes (and fault injections) to the agent.

Client side (imported by training scripts; standard library only):

- :func:`report` ``(**fields)`` sends one training report to ``TRANSOM_AGENT_ADDR``, filling
  ``job``/``rank``/``generation``/``pid``/``node``/``ts`` from ``TRANSOM_JOB``, ``RANK``,
  ``TRANSOM_GENERATION``, the process and ``TRANSOM_NODE`` (a keyword argument wins). It never
  blocks and never raises: with no agent, no address, a bad value or a socket error the report
  is dropped and counted (:func:`stats`). NaN/Inf values travel as the strings "nan"/"inf"/"-inf"
  (JSON has no NaN); values that are not numbers are left out. ``phase="checkpoint"`` (or "eval",
  "data", "compile", "startup"; "" or "train" ends it) says what the rank is doing until it says
  otherwise, so a long legitimate pause is not taken for a hang; :func:`phase` says it without a
  report (the checkpoint engine marks its blocking snapshot so).
- Liveness that needs no PID lookup (ranks may live in another PID namespace or container): the
  first :func:`report` starts a daemon thread that sends ``{"type":"heartbeat",...}`` every
  ``TRANSOM_HEARTBEAT_S`` seconds (default 1; 0: none), with the current phase and, once the
  main thread has not reported for two heartbeats, a sample of its stack (where it waits); at
  interpreter exit one ``{"type":"exit"}`` is sent. A SIGSTOPped or GIL-stuck rank stops its
  heartbeat; a rank that exits says so. Each heartbeat also carries what the process has written so
  far (``io``: the kernel's ``wchar`` and ``write_bytes`` from ``/proc/self/io``, which a process may
  always read of itself): the agent turns it into the rank's write rate, in any namespace and as any
  user (a rank 0 that writes while the other ranks wait saves a checkpoint, not a hang). Every datagram carries the process's PID namespace
  (``pidns``) so an agent in the same namespace may also ask the kernel.
- :func:`report_event` ``(name, **fields)`` sends a one-off event of the rank (a checkpoint save and
  how long it stalled training, a restore and where it came from): the agent publishes each event
  once, as a ``TRAIN`` sample tagged ``event=NAME``, instead of keeping only the newest report.
  The checkpoint engine reports its own events; training scripts may add theirs.
- :func:`send_inject` sends ``{"type":"inject","fault":"xid79"|"hang"|"straggler",...}`` and returns the
  agent's answer ``{"ok": bool, ...}`` (the agent answers injections, not reports).

Agent side:

- :func:`parse_datagram` validates one datagram into a :class:`TrainReport` (``kind`` "train",
  "heartbeat" or "exit") or an :class:`InjectRequest`, or raises :class:`IntakeError` with the reason. In a report, a
  non-finite value of field ``f`` becomes ``f_nonfinite = 1`` with ``f`` left out (so a NaN loss
  arrives as ``loss_nonfinite = 1``); booleans become 0/1; other non-numbers are left out.
- :class:`IntakeServer` receives datagrams on a UDP socket in a thread and hands them to
  callbacks; injections get a JSON reply sent back to the sender.

Exception tree::

    IntakeError(ValueError)        a datagram or an address is malformed; the message says which
"""

from __future__ import annotations

import atexit
import json
import logging
import math
import numbers
import os
import socket
import sys
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping

__all__ = ["report", "report_event", "phase", "stats", "send_inject", "parse_addr", "parse_datagram",
           "TrainReport", "InjectRequest", "IntakeError", "IntakeServer", "FAULTS", "MAX_DATAGRAM"]

#: Fault names an inject datagram may carry.
FAULTS = ("xid79", "hang", "straggler")
MAX_DATAGRAM = 65507

_IDENTITY = ("type", "job", "rank", "generation", "pid", "node", "ts", "phase", "stack", "pidns")
_KINDS = ("train", "heartbeat", "exit")
_IO_KEYS = (b"wchar", b"write_bytes")
#: Longest stack sample a heartbeat carries (characters; a datagram holds 64 KiB).
MAX_STACK = 4000
_NONFINITE = {"nan": "nan", "inf": "inf", "+inf": "inf", "-inf": "-inf",
              "infinity": "inf", "-infinity": "-inf"}


class IntakeError(ValueError):
    """A datagram or an address is malformed; ``str(err)`` says what is wrong."""


def parse_addr(addr: str) -> tuple[str, int]:
    """``"HOST:PORT"`` -> ``(host, port)``; raise :class:`IntakeError` when malformed."""
    host, sep, port = (addr or "").strip().rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise IntakeError(f"agent address {addr!r} is not HOST:PORT (e.g. 127.0.0.1:7070)")
    return host, int(port)


# ----------------------------------------------------------------------------- client

_lock = threading.Lock()
_counts = {"sent": 0, "dropped": 0}
_sock: socket.socket | None = None
_target: tuple[str | None, tuple[str, int] | None] = (None, None)


def _count(what: str) -> None:
    with _lock:
        _counts[what] += 1


def stats() -> dict[str, int]:
    """How many reports this process sent and dropped."""
    with _lock:
        return dict(_counts)


def _resolve_target() -> tuple[str, int] | None:
    global _target
    raw = os.environ.get("TRANSOM_AGENT_ADDR") or None
    if raw is None:
        return None
    if _target[0] != raw:
        try:
            host, port = parse_addr(raw)
            info = socket.getaddrinfo(host, port, socket.AF_INET, socket.SOCK_DGRAM)
            resolved = info[0][4][:2] if info else None
        except (IntakeError, OSError):
            resolved = None
        _target = (raw, resolved)
    return _target[1]


def _socket() -> socket.socket:
    global _sock
    if _sock is None:
        with _lock:
            if _sock is None:
                s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
                s.setblocking(False)
                _sock = s
    return _sock


def _wire(value: Any) -> Any:
    """A JSON-safe form of one value; raises for values that are not numbers or strings."""
    if isinstance(value, (bool, str)):
        return value
    if isinstance(value, numbers.Integral):
        return int(value)
    f = float(value)
    if math.isfinite(f):
        return f
    return "nan" if f != f else ("inf" if f > 0 else "-inf")


def _pidns() -> str:
    try:
        return os.readlink("/proc/self/ns/pid")     # "pid:[4026531836]"
    except OSError:
        return ""


def written(path: str = "/proc/self/io") -> list[int] | None:
    """The ``wchar`` and ``write_bytes`` so far of this process (or of the one whose ``/proc/PID/io`` is
    ``path``); None where the kernel does not say (no such file, or not this process's and not readable)."""
    try:
        with open(path, "rb") as f:
            lines = dict(line.split(b":", 1) for line in f.read().splitlines() if b":" in line)
        return [int(lines[k]) for k in _IO_KEYS]
    except (OSError, KeyError, ValueError):
        return None


def _identity(kind: str) -> dict[str, Any]:
    env = os.environ
    return {"type": kind, "job": env.get("TRANSOM_JOB", ""), "rank": int(env.get("RANK") or 0),
            "generation": int(env.get("TRANSOM_GENERATION") or 0), "pid": os.getpid(),
            "node": env.get("TRANSOM_NODE", ""), "ts": time.time(), "pidns": _live["pidns"]}


# this process's liveness state: the heartbeat thread's pid (a fork has none), phase, last report
_live: dict[str, Any] = {"pid": 0, "phase": "", "last": 0.0, "main": 0, "pidns": ""}


def _send(msg: dict[str, Any], target: tuple[str, int]) -> None:
    _socket().sendto(json.dumps(msg, separators=(",", ":")).encode(), target)


def _stack_of(thread_id: int) -> str:
    frame = sys._current_frames().get(thread_id)
    lines = []
    while frame is not None and len(lines) < 30:
        code = frame.f_code
        lines.append(f"{os.path.basename(code.co_filename)}:{frame.f_lineno} {code.co_name}")
        frame = frame.f_back
    return " < ".join(lines)[:MAX_STACK]       # innermost first


def _heartbeat(interval: float, pid: int) -> None:
    while _live["pid"] == pid:
        time.sleep(interval)
        try:
            target = _resolve_target()
            if target is None or _live["pid"] != pid:
                continue
            msg = _identity("heartbeat")
            msg["phase"] = _live["phase"]
            if (io := written()) is not None:
                msg["io"] = io
            if time.time() - _live["last"] > 2 * interval:     # the main thread is not stepping: where is it?
                msg["stack"] = _stack_of(_live["main"])
            _send(msg, target)
        except Exception:
            pass


def _at_exit() -> None:
    if _live["pid"] != os.getpid():
        return
    try:
        target = _resolve_target()
        if target is not None:
            _send(_identity("exit"), target)
    except Exception:
        pass


def _start_liveness() -> None:
    """Start the heartbeat thread of this process (once; again in a forked child)."""
    pid = os.getpid()
    with _lock:
        if _live["pid"] == pid:
            return
        _live.update(pid=pid, main=threading.get_ident(), pidns=_pidns())
    try:
        interval = float(os.environ.get("TRANSOM_HEARTBEAT_S") or 1.0)
    except ValueError:
        interval = 1.0
    if interval > 0:
        threading.Thread(target=_heartbeat, args=(interval, pid), name="transom-heartbeat", daemon=True).start()


atexit.register(_at_exit)


def phase(name: str | None) -> str:
    """Declare what this rank does from now on ("checkpoint", "eval", "data", "compile", "startup",
    "restore"; None, "" or "train": stepping) without sending a report: the heartbeats carry it, and
    so does the next report. Returns the phase it replaces. Never raises."""
    previous = _live["phase"]
    _live["phase"] = "" if name in (None, "", "train") else str(name)[:32]
    return previous


def report(**fields: Any) -> bool:
    """Send one training report to the local agent; True when handed to the socket. Never raises."""
    return _report(None, fields)


def report_event(name: str, **fields: Any) -> bool:
    """Send one event of this rank (kept once by the agent, never overwritten); like :func:`report`."""
    return _report(str(name)[:64], fields)


def _report(event: str | None, fields: Mapping[str, Any]) -> bool:
    try:
        target = _resolve_target()
        if target is None:
            _count("dropped")
            return False
        if _live["pid"] != os.getpid():
            _start_liveness()
        _live["last"] = time.time()
        msg = _identity("train")
        for name, value in fields.items():
            try:
                msg[name] = _wire(value)
            except (TypeError, ValueError, OverflowError):
                continue  # not a number: left out, the rest still goes
        if "phase" in fields:
            _live["phase"] = msg["phase"] = "" if fields["phase"] in (None, "train") else str(fields["phase"])[:32]
        else:
            msg["phase"] = _live["phase"]
        msg["type"] = "train"
        if event:
            msg["event"] = event
        _send(msg, target)
        _count("sent")
        return True
    except Exception:  # the training loop must never pay for monitoring
        _count("dropped")
        return False


def send_inject(addr: str, fault: str, *, gpu: int | None = None, timeout: float = 2.0) -> dict[str, Any]:
    """Ask the agent at ``addr`` to inject ``fault``; return its reply.

    Raises :class:`IntakeError` for a bad address or fault name and :class:`TimeoutError` when
    no agent answers within ``timeout`` seconds.
    """
    if fault not in FAULTS:
        raise IntakeError(f"unknown fault {fault!r}; expected one of: {', '.join(FAULTS)}")
    host, port = parse_addr(addr)
    msg: dict[str, Any] = {"type": "inject", "fault": fault}
    if gpu is not None:
        msg["gpu"] = int(gpu)
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        s.settimeout(timeout)
        s.connect((host, port))
        try:
            s.send(json.dumps(msg).encode())
            data = s.recv(MAX_DATAGRAM)
        except (socket.timeout, ConnectionRefusedError):
            raise TimeoutError(f"no agent answered at {addr} within {timeout:g}s; is `transom agent` "
                               f"running with --intake-port {port}?") from None
    try:
        reply = json.loads(data)
    except (UnicodeDecodeError, json.JSONDecodeError):
        reply = None
    if not isinstance(reply, dict):
        raise IntakeError(f"agent at {addr} sent a malformed reply: {data[:200]!r}")
    return reply


# ----------------------------------------------------------------------------- agent side

@dataclass(frozen=True)
class TrainReport:
    """One training rank's report; ``values`` holds only finite numbers (and ``*_nonfinite`` flags).

    ``kind``: "train" (a report with values), "heartbeat" (liveness only; ``stack`` is the main
    thread's stack when it has not reported for a while) or "exit" (the process is ending).
    ``pidns``: the sender's PID namespace ("" when unknown).
    """

    job: str
    rank: int
    generation: int
    pid: int
    node: str
    ts: float
    values: Mapping[str, float] = field(default_factory=dict)
    kind: str = "train"
    phase: str = ""
    stack: str = ""
    pidns: str = ""
    event: str = ""            # a one-off event (report_event), not the rank's newest state
    io: tuple[int, int] | None = None    # a heartbeat's: the process's wchar and write_bytes so far


@dataclass(frozen=True)
class InjectRequest:
    fault: str
    gpu: int = 0


def _int(d: Mapping[str, Any], key: str, *, minimum: int, default: int | None = None) -> int:
    value = d.get(key, default)
    if value is None:
        raise IntakeError(f"training report: missing field '{key}'")
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise IntakeError(f"training report: field '{key}' must be an integer >= {minimum}, got {value!r}")
    return value


def _values(d: Mapping[str, Any]) -> dict[str, float]:
    values: dict[str, float] = {}
    for name, value in d.items():
        if name in _IDENTITY:
            continue
        if isinstance(value, bool):
            values[name] = int(value)
        elif isinstance(value, (int, float)):
            if math.isfinite(value):
                values[name] = value
            else:
                values[f"{name}_nonfinite"] = 1
        elif isinstance(value, str) and value.strip().lower() in _NONFINITE:
            values[f"{name}_nonfinite"] = 1
    return values


def parse_datagram(data: bytes) -> TrainReport | InjectRequest:
    """Validate one datagram; raise :class:`IntakeError` with the reason."""
    try:
        d = json.loads(data)
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise IntakeError(f"datagram is not JSON: {exc}") from None
    if not isinstance(d, dict):
        raise IntakeError(f"datagram must be a JSON object, got {type(d).__name__}")
    kind = d.get("type")
    if kind in _KINDS:
        job, node = d.get("job", ""), d.get("node", "")
        if not isinstance(job, str) or not isinstance(node, str):
            raise IntakeError("training report: fields 'job' and 'node' must be strings")
        ts = d.get("ts")
        if ts is None:
            ts = time.time()
        if isinstance(ts, bool) or not isinstance(ts, (int, float)) or not math.isfinite(ts):
            raise IntakeError(f"training report: field 'ts' must be an epoch time, got {ts!r}")
        event = d.get("event", "")
        if not isinstance(event, str) or len(event) > 64:
            raise IntakeError("training report: field 'event' must be a name of at most 64 characters")
        text = {k: d.get(k) if isinstance(d.get(k), str) else "" for k in ("phase", "stack", "pidns")}
        io = d.get("io") if kind == "heartbeat" else None      # (a report's "io" is one of its values)
        if io is not None and (type(io) is not list or len(io) != 2
                               or not all(type(v) is int and v >= 0 for v in io)):
            raise IntakeError(f"training report: field 'io' must be [wchar, write_bytes], two byte counts >= 0, "
                              f"got {io!r}")
        return TrainReport(job=job, rank=_int(d, "rank", minimum=0), generation=_int(d, "generation", minimum=0, default=0),
                           pid=_int(d, "pid", minimum=1), node=node, ts=float(ts),
                           values=_values(d) if kind == "train" else {}, kind=kind, phase=text["phase"][:32],
                           stack=text["stack"][:MAX_STACK], pidns=text["pidns"][:64], event=event,
                           io=None if io is None else (io[0], io[1]))
    if kind == "inject":
        fault = d.get("fault")
        if fault not in FAULTS:
            raise IntakeError(f"inject: unknown fault {fault!r}; expected one of: {', '.join(FAULTS)}")
        gpu = d.get("gpu", 0)
        if isinstance(gpu, bool) or not isinstance(gpu, int) or gpu < 0:
            raise IntakeError(f"inject: field 'gpu' must be an integer >= 0, got {gpu!r}")
        return InjectRequest(fault=fault, gpu=gpu)
    raise IntakeError(f"datagram type {kind!r} is unknown; expected 'train', 'heartbeat', 'exit' or 'inject'")


class IntakeServer:
    """A UDP socket on ``host:port`` (0: any free port) served by a daemon thread.

    ``on_train(report)`` gets every valid training report; ``on_inject(request)`` returns the
    reply dict sent back to the injector. Malformed datagrams are counted in ``rejected`` and
    logged once per distinct reason.
    """

    def __init__(self, host: str, port: int, *, on_train: Callable[[TrainReport], None],
                 on_inject: Callable[[InjectRequest], dict[str, Any]], logger: logging.Logger) -> None:
        from .collectors import LogOnce

        self.host, self.port = host, port
        self.on_train, self.on_inject = on_train, on_inject
        self.log = logger
        self._once = LogOnce(logger)
        self.received = 0
        self.rejected = 0
        self._sock: socket.socket | None = None
        self._thread: threading.Thread | None = None
        self._stop = threading.Event()

    @property
    def addr(self) -> str:
        if self._sock is None:
            raise RuntimeError("the intake is not started")
        host, port = self._sock.getsockname()[:2]
        return f"{host}:{port}"

    def start(self) -> str:
        """Bind and start serving; return the address (``OSError`` when the port is taken)."""
        s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        try:
            s.bind((self.host, self.port))
        except OSError:
            s.close()
            raise
        s.settimeout(1.0)  # only how long stop() may wait for the thread
        self._sock = s
        self._thread = threading.Thread(target=self._serve, name="transom-intake", daemon=True)
        self._thread.start()
        return self.addr

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(5)
        if self._sock is not None:
            self._sock.close()

    def _serve(self) -> None:
        assert self._sock is not None
        while not self._stop.is_set():
            try:
                data, sender = self._sock.recvfrom(MAX_DATAGRAM)
            except socket.timeout:
                continue
            except OSError as exc:
                if self._stop.is_set():
                    return
                self._once(("recv", str(exc)), logging.WARNING, "intake: receive failed: %s", exc)
                continue
            self.received += 1
            try:
                msg = parse_datagram(data)
            except IntakeError as exc:
                self.rejected += 1
                self._once(("bad", str(exc)), logging.WARNING,
                           "intake: rejected a datagram from %s:%s: %s (logged once per reason)", *sender[:2], exc)
                continue
            try:
                if isinstance(msg, TrainReport):
                    self.on_train(msg)
                else:
                    reply = self.on_inject(msg)
                    self._sock.sendto(json.dumps(reply).encode(), sender)
            except Exception as exc:  # a handler bug must not end the intake
                self._once(("handler", type(exc).__name__, str(exc)), logging.ERROR,
                           "intake: handling a %s datagram failed: %s: %s", type(msg).__name__, type(exc).__name__, exc)
