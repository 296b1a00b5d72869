"""The hosts backend: ranks on other machines, each started by its host's launcher (:mod:`.launcher`).

The local backend's successor for clusters without Kubernetes or Slurm. The controller reaches
one launcher per node host over the authenticated channel (:mod:`transom.channel`); it learns
their addresses from ``--launcher NODE=HOST:PORT`` and from the service registry (launchers
advertise themselves there when given a broker), and:

- pings every launcher each ``ping_s`` in the background (``health``, with the statuses of the
  generations it runs), so :meth:`HostsBackend.status` never waits on the network;
- counts a launcher that has not answered for ``unreachable_s`` as a lost node: its ranks are
  reported exited with ``-9`` (killed), and the pre-check fails it ("launcher unreachable");
- sets ``MASTER_ADDR`` to the advertised address of rank 0's host and ``MASTER_PORT`` to a port
  that host's launcher found free;
- stops a generation on every host it can reach, and again on a host that comes back (a
  partitioned host's ranks are stopped when its link returns).

In-job recovery (:meth:`HostsBackend.start_spare`, :meth:`HostsBackend.heal`): a warm spare is
started by its spare host's launcher (``spare`` op) and recorded in the launch record
(``spares``: node -> [pid]); a heal kills the failed rank through its host's launcher (``kill``; a
host that does not answer is left to the node-lost path: its ranks are stopped when it answers
again), assigns the spare that rank on its host (``assign``), and names the new group's rendezvous
on the new rank 0's host: its advertised address (never loopback) and a port its launcher found free.

Records: ``RUN_DIR/JOB/gen-G/launch.json`` on the controller (hosts, ranks and pids per node,
rendezvous address, warm spares, and ``masters``: rank -> the rendezvous of the heal that gave it
away), ``RUN_DIR/cordoned.json``; rank logs stay on their hosts (the launcher's ``logs`` op).
"""

from __future__ import annotations

import os
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, Callable, Mapping, Sequence

from transom.channel import ChannelError, call, cluster_key
from transom.config import ConfigError
from transom.log import get

from .backend import Backend, CordonedNodes, Cordons, LaunchRecord, RankStatus, register_backend
from .local import rank_env

__all__ = ["HostsBackend", "advertise_launcher", "discover_launchers", "KILLED"]

log = get("controller.hosts")
KILLED = -9                 # the exit code of a rank whose host was lost


def advertise_launcher(bootstrap: str, node: str, addr: str, port: int):
    """Put this launcher in the service registry; the writer (``stop()`` it on exit), or None without one."""
    try:
        from transom import registry
        from transom.contracts import ServiceKind
    except ImportError:
        log.info("no service registry in this build: give the controller --launcher %s=%s:%d", node, addr, port)
        return None
    reg = registry.registration(ServiceKind.LAUNCHER, node, addr=addr, port=port)
    return registry.RegistryWriter(bootstrap, reg).start()


def discover_launchers(bootstrap: str) -> Callable[[], dict[str, str]] | None:
    """A function returning node -> launcher ``HOST:PORT`` from the service registry, or None without one."""
    try:
        from transom import registry
        from transom.contracts import ServiceKind
    except ImportError:
        return None
    reader = registry.RegistryReader(bootstrap).start()
    return lambda: {node: reg.endpoint for node, reg in reader.live(ServiceKind.LAUNCHER).items()}


class HostsBackend(CordonedNodes, Backend):
    """Ranks on node hosts through their launchers; ``launchers`` maps node -> launcher ``HOST:PORT``."""

    name = "hosts"
    warm_spares = True

    def __init__(self, run_dir: str | os.PathLike, launchers: Mapping[str, str] | None = None, *,
                 key: bytes | None = None, ckpt_dir: str | None = None, bootstrap: str | None = None,
                 env: Mapping[str, str] | None = None, unreachable_s: float = 5.0, ping_s: float = 0.5,
                 discover: Callable[[], Mapping[str, str]] | None = None, launch_timeout: float = 150.0) -> None:
        self.run_dir = Path(run_dir)
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self.key = key or cluster_key()
        if not self.key:
            raise ConfigError("the hosts backend needs the cluster key: set TRANSOM_CLUSTER_KEY (or _FILE), the same "
                              "as every launcher's")
        self.launchers: dict[str, str] = dict(launchers or {})
        self.ckpt_dir, self.bootstrap = ckpt_dir, bootstrap
        self.extra_env = dict(env or {})
        self.unreachable_s, self.ping_s, self.launch_timeout = unreachable_s, ping_s, launch_timeout
        self.discover = discover
        self.cordons = Cordons(self.run_dir)
        self.log = log
        self._lock = threading.Lock()
        self._seen: dict[str, float] = {}                    # node -> monotonic time of its last answer
        self._statuses: dict[str, dict[str, list]] = {}      # node -> "JOB/GEN" -> [[rank, running, code]]
        self._live: dict[tuple[str, int], tuple[float, dict[str, list[int]]]] = {}  # -> (since, node -> ranks)
        self._pending_stops: set[tuple[str, int, str]] = set()
        self._lost_said: set[tuple[str, int, str]] = set()
        self._stopping = threading.Event()
        self._pool = ThreadPoolExecutor(max_workers=32, thread_name_prefix="hosts")
        self._pingers: dict[str, threading.Thread] = {}
        self._refresh()
        self._discoverer = threading.Thread(target=self._discover_loop, name="hosts-discover", daemon=True)
        self._discoverer.start()

    # ------------------------------------------------------------------ launchers
    def _refresh(self) -> None:
        if self.discover is not None:
            try:
                found = dict(self.discover())
            except Exception as exc:          # noqa: BLE001 - the registry may be briefly unreachable
                log.warning("could not read the launchers from the registry: %s", exc)
                found = {}
            with self._lock:
                for node in sorted(found):
                    if self.launchers.get(node) != found[node]:
                        log.info("launcher of %s at %s (from the registry)", node, found[node])
                        self.launchers[node] = found[node]
        for node in list(self.launchers):
            if node not in self._pingers:
                t = threading.Thread(target=self._ping_loop, args=(node,), name=f"ping-{node}", daemon=True)
                self._pingers[node] = t
                t.start()

    def _discover_loop(self) -> None:
        while not self._stopping.wait(2.0):
            if self.discover is not None:
                self._refresh()

    def _call(self, node: str, op: str, wait: float = 5.0, **args: Any) -> Any:
        """``op(**args)`` on ``node``'s launcher, waiting up to ``wait`` seconds for the answer."""
        addr = self.launchers.get(node)
        if addr is None:
            raise ChannelError(f"no launcher known for {node}")
        result = call(addr, self.key, op, args, timeout=wait)
        with self._lock:
            self._seen[node] = time.monotonic()
        return result

    def _ping_loop(self, node: str) -> None:
        reachable = None
        while not self._stopping.is_set():
            with self._lock:
                want = [[job, gen] for (job, gen), (_t, ranks) in self._live.items() if node in ranks]
                stops = [(j, g) for (j, g, n) in self._pending_stops if n == node]
            try:
                got = self._call(node, "health", max(self.ping_s * 4, 2.0), want=want)
                with self._lock:
                    self._statuses[node] = dict(got.get("statuses") or {})
                if reachable is False:
                    log.info("launcher of %s answers again", node)
                reachable = True
                for job, gen in stops:
                    try:
                        self._call(node, "stop", 30.0, job=job, generation=gen, timeout=10.0)
                        log.info("stopped job %s generation %d on %s, which is back", job, gen, node)
                        with self._lock:
                            self._pending_stops.discard((job, gen, node))
                    except ChannelError as exc:
                        log.warning("could not stop job %s generation %d on %s yet: %s", job, gen, node, exc)
            except ChannelError as exc:
                if reachable is not False:
                    log.warning("launcher of %s does not answer: %s", node, exc)
                reachable = False
            self._stopping.wait(self.ping_s)

    def _age(self, node: str) -> float | None:
        seen = self._seen.get(node)
        return None if seen is None else time.monotonic() - seen

    def _each(self, nodes: Sequence[str], fn: Callable[[str], Any]) -> dict[str, Any]:
        """``fn(node)`` for every node at once; node -> result or the exception it raised."""
        futures = {n: self._pool.submit(fn, n) for n in dict.fromkeys(nodes)}
        out = {}
        for n, f in futures.items():
            try:
                out[n] = f.result()
            except Exception as exc:          # noqa: BLE001 - each caller sorts them
                out[n] = exc
        return out

    def _master(self, node: str) -> tuple[str, int]:
        host = self.launchers[node].rpartition(":")[0]
        return host, int(self._call(node, "port"))

    def _track(self, job: str, generation: int, handle: Mapping[str, Any]) -> None:
        with self._lock:
            if (job, generation) not in self._live:
                ranks = {n: list(r) for n, r in handle["ranks"].items()}
                self._live[(job, generation)] = (time.monotonic(), ranks)
                # the newest generations of each job only: older ones are stopped and need no pinging
                mine = sorted(g for j, g in self._live if j == job)
                for old in mine[:-3]:
                    self._live.pop((job, old), None)

    # ------------------------------------------------------------------ interface
    def nodes(self) -> list[str]:
        cordoned = self.cordons.read()
        return [n for n in self.launchers if n not in cordoned]

    def launch(self, job: str, generation: int, nodes: tuple[str, ...], command: tuple[str, ...],
               resume_step: int | None, *, workdir: str | None = None,
               env: Mapping[str, str] | None = None) -> Mapping[str, Any]:
        record = LaunchRecord(self.run_dir, job, generation)
        if (adopted := record.adopt(log)) is not None:
            self._track(job, generation, adopted)
            return adopted
        unknown = [n for n in nodes if n not in self.launchers]
        if unknown:
            raise ValueError(f"nodes {unknown} have no launcher; known: {sorted(self.launchers)}")
        ckpt_dir = self.ckpt_dir or str(self.run_dir / job / "ckpt")
        ranks: dict[str, list[int]] = {}
        for rank, node in enumerate(nodes):
            ranks.setdefault(node, []).append(rank)
        failed: dict[str, str] = {}
        try:
            master_addr, port = self._master(nodes[0])
        except ChannelError as exc:            # rank 0's host is gone: no rank can start; the pre-check sorts it
            master_addr, port = self.launchers[nodes[0]].rpartition(":")[0], 0
            failed = {n: f"no rendezvous port from rank 0's host {nodes[0]}: {exc}" for n in ranks}

        def start(node: str) -> Any:
            items = []
            for rank in ranks[node]:
                rank_vars = {**dict(env or {}), **self.extra_env,
                             **rank_env(job, generation, rank, node, len(nodes), master_addr, port, ckpt_dir,
                                        resume_step, self.bootstrap)}
                items.append({"rank": rank, "env": rank_vars})
            return self._call(node, "launch", self.launch_timeout, job=job, generation=generation, ranks=items,
                              command=list(command), workdir=workdir)

        results = self._each([n for n in ranks if n not in failed], start)
        pids: dict[str, dict[str, int]] = {}
        forked = 0
        for node, res in results.items():
            if isinstance(res, Exception):
                failed[node] = str(res)
                log.warning("job %s generation %d: could not start ranks %s on %s: %s", job, generation,
                            ranks[node], node, res)
            else:
                pids[node] = {str(r): p for r, p in res["pids"].items()}
                forked += int(res.get("forked", 0))
        handle = {"nodes": list(nodes), "hosts": {n: self.launchers[n] for n in ranks}, "ranks": ranks,
                  "pids": pids, "master": f"{master_addr}:{port}", "resume_step": resume_step, "failed": failed,
                  "run_dir": str(record.dir)}
        record.write(handle)
        self._track(job, generation, handle)
        log.info("launched job %s generation %d on %s, rendezvous %s:%d (resume from %s; %d of %d ranks forked)",
                 job, generation, ",".join(nodes), master_addr, port,
                 "scratch" if resume_step is None else f"step {resume_step}", forked, len(nodes))
        return handle

    def status(self, job: str, generation: int) -> list[RankStatus]:
        handle = LaunchRecord(self.run_dir, job, generation).read()
        if handle is None:
            return []
        self._track(job, generation, handle)
        key = f"{job}/{generation}"
        since = self._live.get((job, generation), (time.monotonic(), {}))[0]
        out: dict[int, RankStatus] = {}
        for node, ranks in handle["ranks"].items():
            if not ranks:                      # every rank it had was given to a spare
                continue
            age = self._age(node)
            lost = node in handle.get("failed", {})
            if not lost and (age is None and time.monotonic() - since > self.unreachable_s
                             or age is not None and age > self.unreachable_s):
                lost = True
                if (job, generation, node) not in self._lost_said:
                    self._lost_said.add((job, generation, node))
                    log.warning("job %s generation %d: the launcher of %s has not answered for %.0fs: its ranks %s "
                                "count as killed (node lost)", job, generation, node,
                                age if age is not None else time.monotonic() - since, ranks)
            known = {int(r): (run, code) for r, run, code in self._statuses.get(node, {}).get(key, [])}
            polled = key in self._statuses.get(node, {})
            for rank in ranks:
                if lost:
                    out[rank] = RankStatus(rank, False, KILLED)
                elif rank in known:
                    out[rank] = RankStatus(rank, known[rank][0], known[rank][1])
                elif polled:                   # the launcher does not know this generation: it restarted
                    out[rank] = RankStatus(rank, False, KILLED)
                else:                          # launched, not polled yet
                    out[rank] = RankStatus(rank, True, None)
        return [out[r] for r in sorted(out)]

    def stop(self, job: str, generation: int, timeout: float = 10.0) -> None:
        handle = LaunchRecord(self.run_dir, job, generation).read()
        if handle is None:
            return
        nodes = [n for n in dict.fromkeys([*handle["ranks"], *(handle.get("spares") or {})]) if n in self.launchers]
        # a launcher already counted lost is not waited for: its stop is kept for when it answers again
        lost = {n: ChannelError(f"no answer for {self._age(n):.0f}s") for n in nodes
                if (self._age(n) or 0.0) > self.unreachable_s}
        results = self._each([n for n in nodes if n not in lost], lambda n: self._call(
            n, "stop", timeout + 10, job=job, generation=generation, timeout=timeout))
        for node, res in {**results, **lost}.items():
            if isinstance(res, Exception):
                log.warning("job %s generation %d: cannot reach the launcher of %s (%s): its ranks will be stopped "
                            "when it answers again", job, generation, node, res)
                with self._lock:
                    self._pending_stops.add((job, generation, node))
        log.info("stopped job %s generation %d", job, generation)

    # ------------------------------------------------------------------ in-job healing
    def start_spare(self, job: str, generation: int, node: str, command: tuple[str, ...], *,
                    workdir: str | None = None, env: Mapping[str, str] | None = None) -> Mapping[str, Any]:
        if node not in self.launchers:
            raise ValueError(f"node {node} has no launcher; known: {sorted(self.launchers)}")
        record = LaunchRecord(self.run_dir, job, generation)
        handle = record.read()
        if handle is None:
            raise RuntimeError(f"job {job} generation {generation} has no launch record")
        ckpt_dir = self.ckpt_dir or str(self.run_dir / job / "ckpt")
        spare_env = {**dict(env or {}), **self.extra_env,
                     **{k: v for k, v in rank_env(job, generation, 0, node, len(handle["nodes"]), "", 0, ckpt_dir,
                                                  None, self.bootstrap).items()
                        if k not in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")}}
        try:
            got = self._call(node, "spare", self.launch_timeout, job=job, generation=generation, env=spare_env,
                             command=list(command), workdir=workdir)
        except ChannelError as exc:
            raise RuntimeError(f"the launcher of {node} did not start a spare: {exc}") from exc
        with self._lock:
            handle = record.read() or handle
            handle.setdefault("spares", {}).setdefault(node, []).append(int(got["pid"]))
            record.write(handle)
        log.info("started a warm spare of job %s generation %d on %s (pid %d)", job, generation, node, got["pid"])
        return {"pid": int(got["pid"]), "node": node, "dir": got.get("dir")}

    def heal(self, job: str, generation: int, rank: int, node: str, nodes: Sequence[str]) -> str:
        record = LaunchRecord(self.run_dir, job, generation)
        handle = record.read()
        if handle is None:
            raise RuntimeError(f"job {job} generation {generation} has no launch record")
        if rank in handle["ranks"].get(node, []) and str(rank) in (handle.get("masters") or {}):
            return handle["masters"][str(rank)]      # carried out already (a controller restarted mid-heal)
        spares = list((handle.get("spares") or {}).get(node, []))
        if not spares:
            raise RuntimeError(f"no warm spare of job {job} generation {generation} on {node}")
        old = next((n for n, r in handle["ranks"].items() if rank in r), None)
        if old is not None and old != node:
            lost = old in handle.get("failed", {}) or (self._age(old) or 0.0) > self.unreachable_s
            try:
                if lost:
                    raise ChannelError(f"no answer for {self._age(old) or 0.0:.0f}s")
                self._call(old, "kill", 10.0, job=job, generation=generation, rank=rank)
            except ChannelError as exc:
                log.warning("job %s generation %d: cannot reach the launcher of %s to kill rank %d (%s): it is "
                            "stopped when that host answers again", job, generation, old, rank, exc)
                with self._lock:
                    self._pending_stops.add((job, generation, old))
        pid, why = None, ""
        for candidate in reversed(spares):            # the newest first; one that has exited is refused
            try:
                self._call(node, "assign", 10.0, job=job, generation=generation, rank=rank, pid=candidate)
                pid = candidate
                break
            except ChannelError as exc:
                why = str(exc)
        if pid is None:
            raise RuntimeError(f"the launcher of {node} could not give rank {rank} to a spare: {why}")
        # the new group's store runs in rank 0: its host's advertised address, a port that host found free
        try:
            host, port = self._master(nodes[0])
        except ChannelError as exc:
            raise RuntimeError(f"no rendezvous port from the new rank 0's host {nodes[0]}: {exc}") from exc
        master = f"{host}:{port}"
        with self._lock:
            if old is not None:
                handle["ranks"][old] = [r for r in handle["ranks"][old] if r != rank]
                handle["pids"].get(old, {}).pop(str(rank), None)
            handle["ranks"].setdefault(node, []).append(rank)
            handle["pids"].setdefault(node, {})[str(rank)] = pid
            handle["spares"][node] = [p for p in spares if p != pid]
            handle["nodes"][rank] = node
            handle.setdefault("hosts", {})[node] = self.launchers[node]
            handle.setdefault("masters", {})[str(rank)] = master
            record.write(handle)
            self._statuses.get(node, {}).pop(f"{job}/{generation}", None)   # polled before it had the rank
            if (job, generation) in self._live:
                since, _ranks = self._live[(job, generation)]
                self._live[(job, generation)] = (since, {n: list(r) for n, r in handle["ranks"].items()})
        log.info("job %s generation %d: rank %d -> the warm spare on %s (pid %d); new group at %s", job, generation,
                 rank, node, pid, master)
        return master

    def health(self, nodes: Sequence[str]) -> dict[str, str]:
        cordoned = self.cordons.read()
        out = {}
        ask = []
        for node in nodes:
            if node in cordoned:
                out[node] = f"cordoned: {cordoned[node]}"
            elif node not in self.launchers:
                out[node] = "no launcher registered for it (start `transom launcher` there, or give --launcher)"
            elif (age := self._age(node)) is not None and age > self.unreachable_s:
                out[node] = f"launcher at {self.launchers[node]} unreachable (last answer {age:.0f}s ago)"
            else:
                ask.append(node)
        for node, res in self._each(ask, lambda n: self._call(n, "health", 3.0)).items():
            if isinstance(res, Exception):
                age = self._age(node)
                out[node] = (f"launcher at {self.launchers[node]} unreachable"
                             f"{f' (last answer {age:.0f}s ago)' if age is not None else ''}: {res}")
        return out

    def collective_test(self, job: str, generation: int, nodes: Sequence[str], timeout: float) -> dict[str, str]:
        """The gloo all-reduce with each node's process started by its launcher; retried once on a new port."""
        failed: dict[str, str] = {}
        for _attempt in range(2):
            try:
                host, port = self._master(nodes[0])
            except ChannelError as exc:
                return {nodes[0]: f"launcher unreachable: {exc}"}
            ranks: dict[str, list[list[Any]]] = {}
            for rank, node in enumerate(nodes):
                ranks.setdefault(node, []).append([rank, node])
            results = self._each(list(ranks), lambda n: self._call(
                n, "collective", timeout + 140.0, ranks=ranks[n], world=len(nodes), master=f"{host}:{port}",
                timeout=timeout))
            failed = {}
            for node, res in results.items():
                if isinstance(res, Exception):
                    failed[node] = f"collective test: launcher unreachable: {res}"
                else:
                    failed.update(res)
            if len(failed) < len(nodes):
                return failed
            log.warning("collective test failed on every node (%s); retrying once on a new port",
                        next(iter(failed.values()), ""))
        return failed

    def logs(self, job: str, generation: int, rank: int, nbytes: int = 4096) -> str:
        """The tail of a rank's log, from its host's launcher."""
        handle = LaunchRecord(self.run_dir, job, generation).read() or {}
        node = next((n for n, r in handle.get("ranks", {}).items() if rank in r), None)
        if node is None:
            return ""
        return self._call(node, "logs", 10.0, job=job, generation=generation, rank=rank, nbytes=nbytes)

    def rank_log(self, job: str, generation: int, rank: int, lines: int = 10) -> dict[str, Any]:
        """The tail of a rank's log from its host's launcher (``{"log": "NODE:JOB/gen-G/rank-R.log", "tail"}``);
        {} when its host is lost or does not answer within 2 s (the controller's loop must not wait)."""
        handle = LaunchRecord(self.run_dir, job, generation).read() or {}
        node = next((n for n, r in handle.get("ranks", {}).items() if rank in r), None)
        if node is None or node in handle.get("failed", {}) or (self._age(node) or 0.0) > self.unreachable_s:
            return {}
        try:
            text = self._call(node, "logs", 2.0, job=job, generation=generation, rank=rank, nbytes=8192)
        except ChannelError:
            return {}
        tail = [line[-300:] for line in text.splitlines()[-lines:] if line.strip()]
        return {"log": f"{node}:{job}/gen-{generation}/rank-{rank}.log (under its launcher's --run-dir)",
                "tail": tail}

    def close(self) -> None:
        self._stopping.set()
        self._pool.shutdown(wait=False, cancel_futures=True)


register_backend("hosts", HostsBackend)
