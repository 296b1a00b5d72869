"""The node launcher: starts and stops the ranks of this host at the controller's request.

``transom launcher --node NAME --listen HOST:PORT --advertise ADDR`` runs one per node host, next
to the node's agent and checkpoint daemon. It answers the hosts backend (:mod:`.hosts`) over the
authenticated channel (:mod:`transom.channel`: HMAC under the cluster key, the same trust as fault
events; a request without it is refused and logged), and keeps one zygote (:mod:`.zygote`), so a
rank on this host starts warm. Operations (the channel's ops; arguments as keywords):

``launch(job, generation, ranks=[{"rank", "env"}], command=[...], workdir=None)``
    start each rank (its environment: this launcher's, then ``env`` from the controller, then this
    host's own ``TRANSOM_NODE``, ``TRANSOM_AGENT_ADDR`` and ``GLOO_SOCKET_IFNAME``); idempotent: a
    generation already started here is adopted. -> ``{"pids": {rank: pid}, "forked": N}``
``status(job, generation)`` -> ``[[rank, running, exit_code], ...]`` (empty: never started here)
``health(want=[[job, generation], ...])`` -> ``{"node", "ts", "statuses": {"JOB/GEN": [...]}}``
``stop(job, generation, timeout)`` -> true if something was running
``collective(ranks=[[rank, node]], world, master, timeout)`` -> ``{node: reason}`` of failures
``port()`` -> a free TCP port on this host (the rendezvous port when rank 0 runs here)
``logs(job, generation, rank, nbytes)`` -> the tail of the rank's log
``spare(job, generation, env, command, workdir=None)`` -> ``{"pid", "dir"}``: a warm spare of the
    generation (``env`` from the controller, with ``TRANSOM_SPARE=1`` and no ``RANK``), waiting at the
    elastic API's join point; stopped with the generation
``assign(job, generation, rank, pid)`` -> true: the spare ``pid`` is now rank ``rank`` here (its status,
    logs and stop follow it)
``kill(job, generation, rank)`` -> true if the rank ran: SIGKILL to its process group (an in-job heal)

Files: ``RUN_DIR/JOB/gen-G/host.json`` (this host's part of a launch: rank -> pid, and ``dirs``:
rank -> the directory of the spare that took it), ``RUN_DIR/JOB/gen-G/spare-K/`` (a spare's
``spare.json`` and its ``rank-0.*`` files) and the rank files of :mod:`.rankhost`. Nothing taken
from a request is run through a shell.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import threading
import time
from pathlib import Path
from typing import Any, Mapping, Sequence

import psutil

from transom.channel import ChannelServer, cluster_key
from transom.config import ConfigError
from transom.log import get
from transom.security import valid_name

from .rankhost import RankHost, alive, signal_group
from .rankwrap import write_atomic
from .zygote import PRELOAD

__all__ = ["Launcher", "register", "main", "DEFAULT_PORT", "interface_of"]

log = get("controller.launcher")
DEFAULT_PORT = 7070
_HOST_KEYS = ("TRANSOM_NODE", "TRANSOM_AGENT_ADDR", "GLOO_SOCKET_IFNAME")   # this host's, never the controller's


def interface_of(addr: str) -> str | None:
    """The network interface that holds ``addr`` on this host, or None."""
    for name, addrs in psutil.net_if_addrs().items():
        if any(a.family == socket.AF_INET and a.address == addr for a in addrs):
            return name
    return None


class Launcher:
    """This host's ranks, driven through :meth:`handlers` (one channel op each)."""

    def __init__(self, node: str, run_dir: str | os.PathLike, *, advertise: str = "127.0.0.1",
                 agent: str | None = None, warm: bool = True, preload: str = PRELOAD) -> None:
        if not valid_name(node):
            raise ConfigError(f"--node {node!r}: expected letters, digits, '.', '_' or '-'")
        self.node, self.advertise = node, advertise
        self.run_dir = Path(run_dir)
        self.host_env = {"TRANSOM_NODE": node}
        if agent:
            self.host_env["TRANSOM_AGENT_ADDR"] = agent
        iface = os.environ.get("GLOO_SOCKET_IFNAME") or interface_of(advertise)
        if iface:
            self.host_env["GLOO_SOCKET_IFNAME"] = iface     # gloo's address: the one peers can route to
        self.host = RankHost(self.run_dir, env=self.host_env, warm=warm, preload=preload)
        self._lock = threading.Lock()
        self._gens: dict[tuple[str, int], dict[int, int]] = {}      # (job, gen) -> rank -> pid
        self._dirs: dict[tuple[str, int], dict[int, str]] = {}      # (job, gen) -> rank -> a spare's directory

    @property
    def handlers(self) -> dict[str, Any]:
        return {"launch": self.launch, "status": self.status, "health": self.health, "stop": self.stop,
                "collective": self.collective, "port": self.port, "logs": self.logs, "spare": self.spare,
                "assign": self.assign, "kill": self.kill}

    def _gen_dir(self, job: str, generation: int) -> Path:
        if not valid_name(str(job)):
            raise ValueError(f"job {str(job)[:80]!r} is not a job name (letters, digits, '.', '_', '-')")
        return self.run_dir / job / f"gen-{int(generation)}"

    def _pids(self, job: str, generation: int) -> dict[int, int] | None:
        key = (job, int(generation))
        if key not in self._gens:
            record = self._gen_dir(job, generation) / "host.json"
            if not record.exists():
                return None
            got = json.loads(record.read_text())
            self._gens[key] = {int(r): int(p) for r, p in got["pids"].items()}
            self._dirs[key] = {int(r): str(d) for r, d in (got.get("dirs") or {}).items()}
        return self._gens[key]

    def _write(self, job: str, generation: int) -> None:
        key = (job, int(generation))
        write_atomic(str(self._gen_dir(job, generation) / "host.json"), json.dumps(
            {"node": self.node, "pids": self._gens[key], "dirs": self._dirs.get(key, {})}))

    def _spares(self, job: str, generation: int) -> list[dict[str, Any]]:
        gen_dir = self._gen_dir(job, generation)
        out = []
        for rec in sorted(gen_dir.glob("spare-*/spare.json")) if gen_dir.is_dir() else ():
            try:
                out.append(json.loads(rec.read_text()))
            except (OSError, ValueError):
                continue
        return out

    # ------------------------------------------------------------------ ops
    def launch(self, job: str, generation: int, ranks: Sequence[Mapping[str, Any]],
               command: Sequence[str], workdir: str | None = None) -> dict[str, Any]:
        gen_dir = self._gen_dir(job, generation)
        if not command or not all(isinstance(a, str) for a in command):
            raise ValueError("command must be a non-empty list of strings")
        if workdir and not os.path.isdir(workdir):
            raise ValueError(f"the job's working directory {workdir} does not exist on {self.node}")
        with self._lock:
            pids = self._pids(job, generation)
            if pids is not None:
                log.info("job %s generation %d was already launched here: adopting it", job, generation)
                return {"pids": pids, "forked": 0, "adopted": True}
            wanted = []
            for item in ranks:
                env = {**os.environ, **{str(k): str(v) for k, v in dict(item["env"]).items()}, **self.host_env}
                wanted.append((int(item["rank"]), env))
            pids, forked = self.host.start(gen_dir, wanted, list(command), workdir or None)
            self._gens[(job, int(generation))] = pids
            self._write(job, generation)
        log.info("launched ranks %s of job %s generation %d on %s (%d forked from the zygote)",
                 ",".join(map(str, sorted(pids))), job, generation, self.node, forked)
        return {"pids": pids, "forked": forked}

    def status(self, job: str, generation: int) -> list[list[Any]]:
        pids = self._pids(job, generation)
        if pids is None:
            return []
        gen_dir, dirs = self._gen_dir(job, generation), self._dirs.get((job, int(generation)), {})
        out = []
        for rank, pid in sorted(pids.items()):
            if rank in dirs:                  # a spare took this rank: its files are rank-0.* of its directory
                (st,) = self.host.status(Path(dirs[rank]), {0: pid})
            else:
                (st,) = self.host.status(gen_dir, {rank: pid})
            out.append([rank, st.running, st.exit_code])
        return out

    def health(self, want: Sequence[Sequence[Any]] = ()) -> dict[str, Any]:
        return {"node": self.node, "ts": time.time(),
                "statuses": {f"{job}/{int(gen)}": self.status(job, gen) for job, gen in want}}

    def stop(self, job: str, generation: int, timeout: float = 10.0) -> bool:
        gen_dir = self._gen_dir(job, generation)
        pids = list((self._pids(job, generation) or {}).values())
        pids += [int(s["pid"]) for s in self._spares(job, generation) if int(s["pid"]) not in pids]
        stopped = self.host.stop(gen_dir, pids, float(timeout))
        if stopped:
            log.info("stopped job %s generation %d on %s", job, generation, self.node)
        return stopped

    def collective(self, ranks: Sequence[Sequence[Any]], world: int, master: str, timeout: float) -> dict[str, str]:
        return self.host.collective([(int(r), str(n)) for r, n in ranks], int(world), str(master), float(timeout))

    def port(self) -> int:
        from transom.broker import free_port
        return free_port()

    def logs(self, job: str, generation: int, rank: int, nbytes: int = 4096) -> str:
        self._pids(job, generation)
        spare_dir = self._dirs.get((job, int(generation)), {}).get(int(rank))
        if spare_dir is not None:
            return self.host.log_tail(Path(spare_dir), 0, min(int(nbytes), 1 << 20))
        return self.host.log_tail(self._gen_dir(job, generation), int(rank), min(int(nbytes), 1 << 20))

    def spare(self, job: str, generation: int, env: Mapping[str, Any], command: Sequence[str],
              workdir: str | None = None) -> dict[str, Any]:
        gen_dir = self._gen_dir(job, generation)
        if not command or not all(isinstance(a, str) for a in command):
            raise ValueError("command must be a non-empty list of strings")
        if workdir and not os.path.isdir(workdir):
            raise ValueError(f"the job's working directory {workdir} does not exist on {self.node}")
        spare_env = {**os.environ, **{str(k): str(v) for k, v in dict(env).items()}, **self.host_env}
        for key in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "TRANSOM_RESUME_STEP"):
            spare_env.pop(key, None)
        spare_env["TRANSOM_SPARE"] = "1"
        with self._lock:
            k = len(list(gen_dir.glob("spare-*"))) if gen_dir.is_dir() else 0
            spare_dir = gen_dir / f"spare-{k}"
            spare_dir.mkdir(parents=True, exist_ok=True)
            pids, _forked = self.host.start(spare_dir, [(0, spare_env)], list(command), workdir or None)
            out = {"pid": pids[0], "node": self.node, "dir": str(spare_dir)}
            write_atomic(str(spare_dir / "spare.json"), json.dumps(out))
        log.info("started a warm spare of job %s generation %d on %s (pid %d)", job, generation, self.node, pids[0])
        return out

    def assign(self, job: str, generation: int, rank: int, pid: int) -> bool:
        with self._lock:
            spare = next((s for s in self._spares(job, generation) if int(s["pid"]) == int(pid)), None)
            if spare is None or not alive(int(pid)):
                raise ValueError(f"no live warm spare {pid} of job {job} generation {generation} on {self.node}")
            key = (job, int(generation))
            if self._pids(job, generation) is None:
                self._gens[key] = {}
            self._gens[key][int(rank)] = int(pid)
            self._dirs.setdefault(key, {})[int(rank)] = str(spare["dir"])
            self._write(job, generation)
        log.info("job %s generation %d: the warm spare %d on %s is rank %d now", job, generation, pid, self.node, rank)
        return True

    def kill(self, job: str, generation: int, rank: int) -> bool:
        pid = (self._pids(job, generation) or {}).get(int(rank))
        if pid is None or not alive(pid):
            return False
        signal_group(pid, signal.SIGKILL)        # a hung (stopped) rank too: SIGKILL needs no SIGCONT
        log.info("killed rank %d of job %s generation %d on %s (pid %d): a spare takes it", rank, job, generation,
                 self.node, pid)
        return True

    def close(self) -> None:
        self.host.close()


# --------------------------------------------------------------------------- command

def _hostport(text: str) -> tuple[str, int]:
    host, sep, port = text.rpartition(":")
    if not sep or not host or not port.isdigit():
        raise argparse.ArgumentTypeError(f"{text!r}: expected HOST:PORT")
    return host, int(port)


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "launcher", help="run this node's launcher: starts and stops ranks here at the controller's request",
        description="One per node host (next to the agent and the checkpoint daemon). Serves the hosts backend "
                    "over an authenticated channel (HMAC-SHA256 under TRANSOM_CLUSTER_KEY, else "
                    "TRANSOM_SIGNING_KEY; refuses to start without one) and keeps one zygote so ranks start warm.",
        epilog="example: TRANSOM_CLUSTER_KEY_FILE=/etc/transom/key transom launcher --node node3 "
               "--listen 0.0.0.0:7070 --advertise 10.0.0.13 --agent 127.0.0.1:7000")
    p.add_argument("--node", default=os.environ.get("TRANSOM_NODE"), help="this node's id (env TRANSOM_NODE)")
    p.add_argument("--listen", type=_hostport, default=("0.0.0.0", DEFAULT_PORT), metavar="HOST:PORT",
                   help=f"address to serve on (default 0.0.0.0:{DEFAULT_PORT}; port 0: any free port)")
    p.add_argument("--advertise", default=None, metavar="ADDR",
                   help="the address the controller and the other ranks reach this host at (default: the listen "
                        "host, which must then not be 0.0.0.0); rank 0's host address is the job's MASTER_ADDR")
    p.add_argument("--agent", default=os.environ.get("TRANSOM_AGENT_ADDR"), metavar="HOST:PORT",
                   help="this node's agent intake, handed to the ranks (env TRANSOM_AGENT_ADDR)")
    p.add_argument("--run-dir", default=os.environ.get("TRANSOM_RUN_DIR", "runs"),
                   help="where rank logs and records go on this host (default: runs; env TRANSOM_RUN_DIR)")
    p.add_argument("--warm-ranks", action=argparse.BooleanOptionalAction, default=True,
                   help="ranks and pre-check processes are forks of one zygote that imported torch (default: on)")
    p.add_argument("--bootstrap", default=os.environ.get("TRANSOM_BOOTSTRAP") or None, metavar="HOST:PORT",
                   help="Kafka bootstrap servers: the launcher registers itself in the service registry there "
                        "(env TRANSOM_BOOTSTRAP; unset: the controller must be given --launcher NODE=ADDR:PORT)")
    p.set_defaults(func=main)


def main(args: argparse.Namespace) -> int:
    from transom.cli import wait_for_signal

    if not args.node:
        raise ConfigError("--node is not set (nor TRANSOM_NODE); expected this node's id")
    host, port = args.listen
    advertise = args.advertise or host
    if advertise in ("0.0.0.0", ""):
        raise ConfigError("--advertise is not set and --listen is 0.0.0.0; expected the address peers reach this "
                          "host at (never 0.0.0.0)")
    key = cluster_key()
    if key is None:
        raise ConfigError("no cluster key: set TRANSOM_CLUSTER_KEY (or TRANSOM_CLUSTER_KEY_FILE), the same as the "
                          "controller's; a launcher without one would start processes for anyone")
    launcher = Launcher(args.node, args.run_dir, advertise=advertise, agent=args.agent, warm=args.warm_ranks)
    server = ChannelServer(key, launcher.handlers, host, port).start()
    addr = f"{advertise}:{server.port}"
    launcher.host.warm_up()
    log.info("launcher of %s serving on %s:%d, advertised as %s (run dir %s)", args.node, host, server.port, addr,
             args.run_dir)
    registration = None
    if args.bootstrap:
        from .hosts import advertise_launcher
        registration = advertise_launcher(args.bootstrap, args.node, advertise, server.port)
    try:
        wait_for_signal()
    finally:
        if registration is not None:
            registration.stop()
        server.stop()
        launcher.close()
    return 0
