"""CPU priority of Transom's services on a machine they share with training ranks.

On a cluster the broker, the TEE and the controller run on machines of their own, and a GPU node's
agent and checkpoint daemon use cores the training job leaves idle. Where they share cores with
ranks (a node's agent and TCE daemon, everything on one machine in ``transom up``, the demo, the
benches), they run at a lower CPU priority, so a rank's step is never queued behind a replica's
copy, a digest or a heartbeat: the services get the cores when the ranks wait (data loading,
collectives, I/O) and a small share when they do not.

One setting, ``TRANSOM_SERVICE_PRIORITY`` (env; the service's own command line has no flag):

- ``batch:N`` (default ``batch:10``): ``SCHED_BATCH`` at nice ``N`` (0-19). ``SCHED_BATCH`` never
  preempts a running task when it wakes up (a rank keeps its core until its time slice ends); nice
  10 weighs 110 against a rank's 1024 (nice 0), about a tenth of a core when both want it;
- ``nice:N``: the normal policy at nice ``N`` (0-19);
- ``idle``: ``SCHED_IDLE``, only what nothing else wants (a busy host can starve the service: a
  checkpoint's replication and persistence wait for an idle moment; not the default);
- ``normal``: unchanged (the priority it was started with).

A process that already runs at a higher nice value keeps it (lowering nice needs privileges).
Processes that start ranks keep the priority they were started with, because their children
inherit it and an unprivileged rank cannot raise it again: the node launcher, and the controller
with its embedded local backend. systemd units set the same with ``Nice=`` and
``CPUSchedulingPolicy=`` (deploy/systemd). :func:`read` reports a process's policy and nice value
from ``/proc/PID/stat``.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

from .config import ConfigError, env_str

__all__ = ["KEY", "DEFAULT", "Priority", "parse", "configured", "apply", "preexec", "read", "lower_service"]

KEY = "TRANSOM_SERVICE_PRIORITY"
DEFAULT = "batch:10"

_POLICIES = {"normal": os.SCHED_OTHER, "nice": os.SCHED_OTHER, "batch": os.SCHED_BATCH, "idle": os.SCHED_IDLE}
_NAMES = {os.SCHED_OTHER: "other", os.SCHED_BATCH: "batch", os.SCHED_IDLE: "idle",
          getattr(os, "SCHED_FIFO", 1): "fifo", getattr(os, "SCHED_RR", 2): "rr"}


@dataclass(frozen=True)
class Priority:
    """A scheduling policy (``other``, ``batch``, ``idle``) and a nice value; ``keep``: change nothing."""

    policy: str
    nice: int
    keep: bool = False

    def __str__(self) -> str:
        if self.keep or (self.policy == "other" and self.nice == 0):
            return "normal"
        return "idle" if self.policy == "idle" else f"{'nice' if self.policy == 'other' else self.policy}:{self.nice}"


def parse(value: str, key: str = KEY) -> Priority:
    """``batch:N``, ``nice:N``, ``idle`` or ``normal``; a bad value raises :class:`ConfigError` naming ``key``."""
    text = value.strip().lower()
    expected = "expected batch:N or nice:N (N from 0 to 19), idle or normal"
    if text == "normal":
        return Priority("other", 0, keep=True)
    if text == "idle":
        return Priority("idle", 19)
    kind, sep, num = text.partition(":")
    if kind not in ("batch", "nice") or not sep:
        raise ConfigError(f"{key}={value!r}: {expected}")
    try:
        nice = int(num)
    except ValueError:
        raise ConfigError(f"{key}={value!r}: {expected}") from None
    if not 0 <= nice <= 19:
        raise ConfigError(f"{key}={value!r}: the nice value must be from 0 to 19 ({expected})")
    return Priority("batch" if kind == "batch" else "other", nice)


def configured() -> Priority:
    """The services' priority from ``TRANSOM_SERVICE_PRIORITY`` (default ``batch:10``)."""
    return parse(env_str(KEY, DEFAULT))


def apply(prio: Priority, pid: int = 0) -> Priority:
    """Give process ``pid`` (0: this one; call it before threads start, they inherit it) ``prio``;
    return what it runs at now. Never lowers a nice value that is already higher."""
    if prio.keep:
        return read(pid or os.getpid())
    policy = _POLICIES["nice" if prio.policy == "other" else prio.policy]
    os.sched_setscheduler(pid, policy, os.sched_param(0))
    current = os.getpriority(os.PRIO_PROCESS, pid)
    if prio.nice > current:
        os.setpriority(os.PRIO_PROCESS, pid, prio.nice)
    return read(pid or os.getpid())


def preexec(prio: Priority):
    """A ``preexec_fn`` for ``subprocess.Popen`` that gives the child ``prio`` before it execs (plain
    syscalls only: safe in a forked child); None for ``normal``. A refused change leaves the child as is."""
    if prio.keep:
        return None
    policy = _POLICIES["nice" if prio.policy == "other" else prio.policy]
    nice = prio.nice

    def lower() -> None:
        try:
            os.sched_setscheduler(0, policy, os.sched_param(0))
            if nice > os.getpriority(os.PRIO_PROCESS, 0):
                os.setpriority(os.PRIO_PROCESS, 0, nice)
        except OSError:
            pass
    return lower


def read(pid: int) -> Priority:
    """Policy and nice value of process ``pid`` (its main thread), from ``/proc/PID/stat``."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    # after the command name: field 3 (state) is index 0; nice is field 19, policy field 41
    nice, policy = int(fields[16]), int(fields[38])
    return Priority(_NAMES.get(policy, str(policy)), nice)


def lower_service(name: str) -> Priority | None:
    """At the start of service ``name``: apply the configured priority and log it; None when it keeps
    its own (``normal``). A bad setting raises :class:`ConfigError`; a refused change is logged."""
    from .log import get

    prio = configured()
    if prio.keep:
        return None
    try:
        got = apply(prio)
    except OSError as exc:
        get("priority").warning("%s: cannot set CPU priority %s (%s=%s): %s; running at %s", name, prio, KEY,
                                env_str(KEY, DEFAULT), exc, read(os.getpid()))
        return None
    get("priority").info("%s runs at CPU priority %s (%s; ranks keep theirs)", name, got, KEY)
    return got
