"""The local backend: every rank a real process on this machine, "nodes" simulated by name.

Each rank runs under :mod:`transom.controller.rankwrap` in its own process group, so stopping a
rank stops everything it started, and its exit code lands in a file any controller can read.
Layout of ``run_dir``::

    run_dir/JOB/gen-G/launch.json      what was launched (written once the ranks are started)
    run_dir/JOB/gen-G/rank-R.{pid,log,exit}
    run_dir/cordoned.json              nodes kept out of launches, with the reason

    run_dir/JOB/gen-G/spare-NODE-K/rank-0.{pid,log,exit}   the K-th warm spare of G on NODE (spare.json: its pid)

Each launch gets a fresh rendezvous port (gloo cannot re-form a group on the old one), and so does
each in-job heal (:meth:`LocalBackend.heal`). A spare that takes rank R is recorded in the launch
record (``pids[R]``, ``dirs[R]``: its directory), so status and stop follow it.

Starting, watching and stopping the ranks is :class:`~.rankhost.RankHost`'s work, the same code
the node launcher runs on each host of the hosts backend: warm starts (``warm=True``, the default)
make a rank of ``python -m MODULE`` or ``python SCRIPT.py`` a fork of one zygote that imported
torch once, and so every process of the pre-check's all-reduce. ``run_dir/zygote.log`` has what
the zygote and the pre-check's processes said.
"""

from __future__ import annotations

import json
import os
import signal
from pathlib import Path
from typing import Any, Mapping, Sequence

from transom.broker import free_port
from transom.log import get

from .backend import Backend, CordonedNodes, Cordons, LaunchRecord, RankStatus, register_backend
from .rankhost import RankHost, alive, signal_group, warm_argv
from .rankwrap import write_atomic
from .zygote import PRELOAD

__all__ = ["LocalBackend", "warm_argv"]

log = get("controller.local")


class LocalBackend(CordonedNodes, Backend):
    """Ranks as local processes; ``agents`` maps each simulated node to its agent's intake address."""

    name = "local"
    warm_spares = True

    def __init__(self, run_dir: str | os.PathLike, agents: Mapping[str, str], *, ckpt_dir: str | None = None,
                 bootstrap: str | None = None, env: Mapping[str, str] | None = None, warm: bool = True,
                 preload: str = PRELOAD) -> None:
        self.run_dir = Path(run_dir).resolve()      # absolute: ranks run in the submitter's directory
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self.agents = dict(agents)
        self.ckpt_dir = os.path.abspath(ckpt_dir) if ckpt_dir else None
        self.bootstrap = bootstrap
        self.extra_env = dict(env or {})
        self.host = RankHost(self.run_dir, env=self.extra_env, warm=warm, preload=preload)
        self.cordons = Cordons(self.run_dir)
        self.log = log

    @property
    def _zygote(self):
        return self.host._zygote

    # ------------------------------------------------------------------ interface
    def nodes(self) -> list[str]:
        cordoned = self.cordons.read()
        return [n for n in self.agents if n not in cordoned]

    def launch(self, job: str, generation: int, nodes: tuple[str, ...], command: tuple[str, ...],
               resume_step: int | None, *, workdir: str | None = None,
               env: Mapping[str, str] | None = None) -> Mapping[str, Any]:
        record = LaunchRecord(self.run_dir, job, generation)
        if (adopted := record.adopt(log)) is not None:
            return adopted
        unknown = [n for n in nodes if n not in self.agents]
        if unknown:
            raise ValueError(f"nodes {unknown} have no agent address; known: {sorted(self.agents)}")
        port = free_port()
        ckpt_dir = self.ckpt_dir or str(self.run_dir / job / "ckpt")
        ranks = []
        user_env = dict(env or {})
        if workdir and not os.path.isdir(workdir):
            raise ValueError(f"the job's working directory {workdir} does not exist on this host")
        for rank, node in enumerate(nodes):
            rank_vars = dict(os.environ)
            rank_vars.update(user_env)
            rank_vars.update(self.extra_env)
            rank_vars.pop("TRANSOM_RESUME_STEP", None)
            rank_vars.update(rank_env(job, generation, rank, node, len(nodes), "127.0.0.1", port, ckpt_dir,
                                      resume_step, self.bootstrap))
            rank_vars["TRANSOM_AGENT_ADDR"] = self.agents[node]
            ranks.append((rank, rank_vars))
        pids, forked = self.host.start(record.dir, ranks, command, workdir)
        handle = {"pids": [pids[r] for r in range(len(nodes))], "port": port, "run_dir": str(record.dir),
                  "nodes": list(nodes), "resume_step": resume_step}
        record.write(handle)
        log.info("launched job %s generation %d on %s (resume from %s; %d of %d ranks forked from the zygote)", job,
                 generation, ",".join(nodes), "scratch" if resume_step is None else f"step {resume_step}", forked,
                 len(pids))
        return handle

    def status(self, job: str, generation: int) -> list[RankStatus]:
        record = LaunchRecord(self.run_dir, job, generation)
        handle = record.read()
        if handle is None:
            return []
        dirs = handle.get("dirs") or {}
        out = []
        for rank, pid in enumerate(handle["pids"]):
            if str(rank) in dirs:             # a spare took this rank: its files are rank-0.* of its directory
                (st,) = self.host.status(Path(dirs[str(rank)]), {0: pid})
                out.append(RankStatus(rank, st.running, st.exit_code))
            else:
                out.extend(self.host.status(record.dir, {rank: pid}))
        return out

    def stop(self, job: str, generation: int, timeout: float = 10.0) -> None:
        record = LaunchRecord(self.run_dir, job, generation)
        handle = record.read()
        pids = list(handle["pids"]) if handle else []
        pids += [p for p in self._spare_pids(job, generation) if p not in pids]
        if self.host.stop(record.dir, pids, timeout):
            log.info("stopped job %s generation %d", job, generation)

    # ------------------------------------------------------------------ in-job healing
    def _spare_pids(self, job: str, generation: int) -> list[int]:
        gen_dir = self.run_dir / job / f"gen-{generation}"
        out = []
        for rec in gen_dir.glob("spare-*/spare.json") if gen_dir.is_dir() else ():
            try:
                out.append(int(json.loads(rec.read_text())["pid"]))
            except (OSError, ValueError, KeyError):
                continue
        return out

    def start_spare(self, job: str, generation: int, node: str, command: tuple[str, ...], *,
                    workdir: str | None = None, env: Mapping[str, str] | None = None) -> Mapping[str, Any]:
        if node not in self.agents:
            raise ValueError(f"node {node} has no agent address; known: {sorted(self.agents)}")
        gen_dir = self.run_dir / job / f"gen-{generation}"
        k = len(list(gen_dir.glob(f"spare-{node}-*")))
        spare_dir = gen_dir / f"spare-{node}-{k}"
        spare_dir.mkdir(parents=True, exist_ok=True)
        ckpt_dir = self.ckpt_dir or str(self.run_dir / job / "ckpt")
        handle = LaunchRecord(self.run_dir, job, generation).read() or {}
        spare_env = {**os.environ, **dict(env or {}), **self.extra_env}
        for key in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "TRANSOM_RESUME_STEP"):
            spare_env.pop(key, None)
        spare_env.update({k2: v for k2, v in rank_env(job, generation, 0, node, len(handle.get("nodes") or ()) or 1,
                                                      "", 0, ckpt_dir, None, self.bootstrap).items()
                          if k2 not in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")})
        spare_env.update(TRANSOM_SPARE="1", TRANSOM_AGENT_ADDR=self.agents[node])
        pids, _forked = self.host.start(spare_dir, [(0, spare_env)], command, workdir)
        out = {"pid": pids[0], "node": node, "dir": str(spare_dir)}
        write_atomic(str(spare_dir / "spare.json"), json.dumps(out))
        log.info("started a warm spare of job %s generation %d on %s (pid %d)", job, generation, node, pids[0])
        return out

    def heal(self, job: str, generation: int, rank: int, node: str, nodes: Sequence[str]) -> str:
        record = LaunchRecord(self.run_dir, job, generation)
        handle = record.read()
        if handle is None:
            raise RuntimeError(f"job {job} generation {generation} has no launch record")
        spare = None
        for rec in sorted((record.dir).glob(f"spare-{node}-*/spare.json")):
            got = json.loads(rec.read_text())
            if alive(int(got["pid"])):
                spare = got
        if spare is None:
            raise RuntimeError(f"no live warm spare of job {job} generation {generation} on {node}")
        if (handle.get("dirs") or {}).get(str(rank)) == spare["dir"] and str(rank) in (handle.get("masters") or {}):
            return handle["masters"][str(rank)]      # carried out already (a controller restarted mid-heal)
        old = int(handle["pids"][rank])
        if alive(old):
            signal_group(old, signal.SIGKILL)            # a hung (stopped) rank too: SIGKILL needs no SIGCONT
        handle["pids"][rank] = int(spare["pid"])
        handle.setdefault("dirs", {})[str(rank)] = spare["dir"]
        handle["nodes"][rank] = node
        master = f"127.0.0.1:{free_port()}"             # every "node" is this machine
        handle.setdefault("masters", {})[str(rank)] = master
        record.write(handle)
        log.info("job %s generation %d: rank %d -> the warm spare on %s (pid %d); new group at %s", job, generation,
                 rank, node, spare["pid"], master)
        return master

    def health(self, nodes: Sequence[str]) -> dict[str, str]:
        cordoned = self.cordons.read()
        out = {}
        for node in nodes:
            if node not in self.agents:
                out[node] = "no agent address (give --node NAME=HOST:PORT)"
            elif node in cordoned:
                out[node] = f"cordoned: {cordoned[node]}"
        return out

    def collective_test(self, job: str, generation: int, nodes: Sequence[str], timeout: float) -> dict[str, str]:
        """A gloo all-reduce across one process per node (``TRANSOM_NODE`` set); retried once on a new port.

        The processes are forks of the zygote (no torch import), else fresh interpreters.
        """
        failed: dict[str, str] = {}
        for _attempt in range(2):
            failed = self.host.collective(list(enumerate(nodes)), len(nodes), f"127.0.0.1:{free_port()}", timeout)
            if len(failed) < len(nodes):
                return failed
            log.warning("collective test failed on every node (%s); retrying once on a new port",
                        next(iter(failed.values()), ""))
        return failed

    def close(self) -> None:
        """Stop the zygote (the ranks it forked live on, in their own sessions)."""
        self.host.close()


def rank_env(job: str, generation: int, rank: int, node: str, world: int, master_addr: str, master_port: int,
             ckpt_dir: str, resume_step: int | None, bootstrap: str | None) -> dict[str, str]:
    """What a rank is told about its place in the job (the backend adds its node's agent address)."""
    env = {
        "RANK": str(rank), "LOCAL_RANK": "0", "WORLD_SIZE": str(world),
        "MASTER_ADDR": master_addr, "MASTER_PORT": str(master_port),
        "TRANSOM_JOB": job, "TRANSOM_NODE": node, "TRANSOM_GENERATION": str(generation),
        "TRANSOM_CKPT_DIR": ckpt_dir, "PYTHONUNBUFFERED": "1",
    }
    if bootstrap:
        env["TRANSOM_BOOTSTRAP"] = bootstrap
    if resume_step is not None:
        env["TRANSOM_RESUME_STEP"] = str(resume_step)
    return env


register_backend("local", LocalBackend)
