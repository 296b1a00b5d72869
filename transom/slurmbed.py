"""A real Slurm cluster on the test bed: ``slurmctld`` on a control host, one ``slurmd`` per node host.

Debian's ``slurm-wlm`` and ``munge`` (the Makefile installs them), on the hosts of a
:class:`transom.testbed.Bed`::

    with Bed(["ctl", "node0", "node1", "node2"], share=[work]) as bed:
        with SlurmBed(bed, "ctl", ["node0", "node1", "node2"], work) as slurm:
            slurm.env                    # SLURM_CONF=...: give it to every Slurm command
            slurm.sh("sinfo")            # run a Slurm command on the control host
            slurm.node_state("node1")    # ("IDLE", "") or ("IDLE+DRAIN", "the reason")

- munge: one key (``mungekey``) and one ``munged`` on the control host; its socket lies in
  ``work`` (a directory every host shares), so every daemon and command of every host, and the
  caller, authenticates with it (a Unix socket path is not bound to a network namespace). It runs
  as root (``--force``): the bed's shared directory is root's.
- slurm.conf: ``SlurmctldHost`` the control host and its bed address, ``NodeName`` the node
  hosts' UTS hostnames with their addresses, one CPU each (one task per node); process tracking
  and tasks without systemd or cgroup delegation (``proctrack/linuxproc``, ``task/none``), no
  accounting, state, spool, pid and log files under ``work``. ``ReturnToService=2``,
  ``SlurmdTimeout=10``: a killed slurmd is ``DOWN*`` within about 20 s.
- each daemon runs in the foreground (``-D``) on its host; :meth:`stop` (and the bed's own
  kill) ends them. A drained node stays drained until :meth:`resume` (as for an operator).

:func:`available` says in one line why a cluster cannot be made here (no bed, no packages).
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import time
from pathlib import Path
from typing import Sequence

from transom.log import get

__all__ = ["SlurmBed", "SlurmBedError", "available", "DAEMONS"]

log = get("slurmbed")
DAEMONS = ("slurmctld", "slurmd", "munged", "mungekey", "srun", "sbatch", "scontrol", "squeue", "scancel", "sinfo")
PARTITION = "bed"


class SlurmBedError(RuntimeError):
    """The Slurm cluster did not come up or a command failed; the message names the daemon and its log."""


def available() -> tuple[bool, str]:
    """``(True, "ok")`` when the Slurm and munge programs are installed and a bed can be made."""
    from transom import testbed

    missing = [d for d in DAEMONS if shutil.which(d) is None and not Path("/usr/sbin", d).exists()]
    if missing:
        return False, f"Slurm is not installed ({', '.join(missing)} missing: apt-get install slurm-wlm munge)"
    return testbed.available()


def _which(name: str) -> str:
    return shutil.which(name) or str(Path("/usr/sbin", name))


class SlurmBed:
    """A Slurm cluster on ``bed``: ``control`` runs slurmctld, each of ``nodes`` a slurmd."""

    def __init__(self, bed, control: str, nodes: Sequence[str], work: str | os.PathLike, *,
                 cluster: str = "transombed", timeout: float = 60.0) -> None:
        self.bed, self.control, self.nodes = bed, control, list(nodes)
        self.work = Path(work).resolve()
        self.cluster, self.timeout = cluster, timeout
        self.conf = self.work / "slurm.conf"
        self.socket = self.work / "munge" / "munge.socket"
        self.munged: subprocess.Popen | None = None
        self.daemons: dict[str, subprocess.Popen] = {}

    @property
    def env(self) -> dict[str, str]:
        """What Slurm commands need: the config file (which names the munge socket)."""
        return {**os.environ, "SLURM_CONF": str(self.conf)}

    # ------------------------------------------------------------------ lifecycle
    def __enter__(self) -> "SlurmBed":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    def start(self) -> "SlurmBed":
        try:
            self._munge()
            self._write_conf()
            self._spawn(self.control, "slurmctld", [_which("slurmctld"), "-D", "-i"])
            for node in self.nodes:
                (self.work / node / "spool").mkdir(parents=True, exist_ok=True)
                self._spawn(node, f"slurmd-{node}", [_which("slurmd"), "-D", "-N", node])
            self._wait_idle(self.nodes)
        except BaseException:
            self.stop()
            raise
        log.info("slurm cluster %s up: slurmctld on %s, slurmd on %s", self.cluster, self.control,
                 ",".join(self.nodes))
        return self

    def stop(self) -> None:
        for name, proc in reversed(list(self.daemons.items())):
            if proc.poll() is None:
                proc.terminate()
        for name, proc in self.daemons.items():
            try:
                proc.wait(15)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        self.daemons.clear()
        if self.munged is not None and self.munged.poll() is None:
            self.munged.terminate()
            try:
                self.munged.wait(10)
            except subprocess.TimeoutExpired:
                self.munged.kill()
                self.munged.wait()
        self.munged = None

    def _munge(self) -> None:
        d = self.work / "munge"
        d.mkdir(parents=True, exist_ok=True)
        d.chmod(0o711)                                  # munged wants its socket directory 711
        key = d / "munge.key"
        if not key.exists():
            subprocess.run([_which("mungekey"), "-c", "-k", str(key)], check=True, capture_output=True, timeout=30)
        # on the control host, so it dies with the bed even when its owner is SIGKILLed
        self.munged = self.bed.run(
            self.control,
            [_which("munged"), "-F", "--force", f"--key-file={key}", f"--socket={self.socket}",
             f"--pid-file={d / 'munged.pid'}", f"--log-file={d / 'munged.log'}", f"--seed-file={d / 'munged.seed'}"],
            stdout=subprocess.DEVNULL, stderr=open(d / "munged.out", "ab"))
        deadline = time.monotonic() + self.timeout
        while not self.socket.exists():
            if self.munged.poll() is not None or time.monotonic() > deadline:
                raise SlurmBedError(f"munged did not start: {(d / 'munged.out').read_text()[-500:]}")
            time.sleep(0.05)

    def _write_conf(self) -> None:
        w = self.work
        (w / "ctld").mkdir(parents=True, exist_ok=True)
        nodes = "\n".join(f"NodeName={n} NodeAddr={self.bed.addr(n)} CPUs=1 RealMemory=1000 State=UNKNOWN"
                          for n in self.nodes)
        self.conf.write_text(f"""# written by transom.slurmbed for a test bed (bed {self.bed.index})
ClusterName={self.cluster}
SlurmctldHost={self.control}({self.bed.addr(self.control)})
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
AuthInfo=socket={self.socket}
StateSaveLocation={w}/ctld
SlurmctldPidFile={w}/ctld/slurmctld.pid
SlurmctldLogFile={w}/ctld/slurmctld.log
SlurmdSpoolDir={w}/%n/spool
SlurmdPidFile={w}/%n/slurmd.pid
SlurmdLogFile={w}/%n/slurmd.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
AccountingStorageType=accounting_storage/none
JobAcctGatherType=jobacct_gather/none
JobCompType=jobcomp/none
MpiDefault=none
ReturnToService=2
SlurmdTimeout=10
SlurmctldTimeout=10
MessageTimeout=5
KillWait=5
InactiveLimit=0
MinJobAge=30
SchedulerType=sched/backfill
{nodes}
PartitionName={PARTITION} Nodes=ALL Default=YES MaxTime=INFINITE State=UP
""")
        (w / "cgroup.conf").write_text("CgroupPlugin=cgroup/v1\nCgroupAutomount=no\n")

    def _spawn(self, host: str, name: str, argv: list[str]) -> None:
        out = open(self.work / f"{name}.out", "ab")
        self.daemons[name] = self.bed.run(host, argv, env=self.env, stdout=out, stderr=subprocess.STDOUT)

    def _wait_idle(self, nodes: Sequence[str]) -> None:
        deadline = time.monotonic() + self.timeout
        states: dict[str, tuple[str, str]] = {}
        while time.monotonic() < deadline:
            for name, proc in self.daemons.items():
                if proc.poll() is not None:
                    raise SlurmBedError(f"{name} exited {proc.returncode}: {self.log_tail(name)}")
            try:
                states = self.node_states()
            except SlurmBedError:
                states = {}
            if all(states.get(n, ("",))[0].upper().startswith("IDLE") for n in nodes):
                return
            time.sleep(0.2)
        raise SlurmBedError(f"nodes not idle within {self.timeout:.0f}s: {states}; slurmctld: "
                            f"{self.log_tail('slurmctld')}")

    def log_tail(self, name: str, lines: int = 8) -> str:
        text = ""
        for path in (self.work / f"{name}.out", self.work / "ctld" / "slurmctld.log"
                     if name == "slurmctld" else self.work / name.removeprefix("slurmd-") / "slurmd.log"):
            if path.exists():
                text += path.read_text(errors="replace")
        return " | ".join(text.strip().splitlines()[-lines:])

    # ------------------------------------------------------------------ commands
    def run(self, *argv: str, check: bool = True, timeout: float = 30) -> subprocess.CompletedProcess:
        """A Slurm command here (the caller's namespaces reach slurmctld over the bed's link)."""
        proc = subprocess.run(list(argv), env=self.env, capture_output=True, text=True, timeout=timeout)
        if check and proc.returncode != 0:
            raise SlurmBedError(f"{' '.join(argv)} exited {proc.returncode}: {proc.stderr.strip()}")
        return proc

    def node_states(self) -> dict[str, tuple[str, str]]:
        """node -> (State, Reason) from ``scontrol show nodes --oneliner``."""
        out = {}
        for line in self.run("scontrol", "show", "nodes", "--oneliner").stdout.splitlines():
            name = re.search(r"NodeName=(\S+)", line)
            state = re.search(r"\bState=(\S+)", line)
            reason = re.search(r"\bReason=(.*?)(?: \[[^\]]*\])?(?= \w+=|$)", line)
            if name and state:
                out[name.group(1)] = (state.group(1), reason.group(1) if reason else "")
        return out

    def node_state(self, node: str) -> tuple[str, str]:
        return self.node_states()[node]

    def resume(self, node: str) -> None:
        """What an operator does after repairing a drained node."""
        self.run("scontrol", "update", f"NodeName={node}", "State=RESUME")

    def kill_slurmd(self, node: str) -> None:
        proc = self.daemons.get(f"slurmd-{node}")
        if proc is not None and proc.poll() is None:
            proc.send_signal(signal.SIGKILL)
