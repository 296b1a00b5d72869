"""The Slurm backend: one batch job (``sbatch``) per generation, nodes drained with ``scontrol``.

- ``launch``: ``sbatch --parsable --job-name=transom-JOB-gG --nodes=N --ntasks=N
  --ntasks-per-node=1 --nodelist=... --exclude=<drained> --export=ALL --output=RUN_DIR/JOB/gen-G/sbatch.log
  RUN_DIR/JOB/gen-G/batch.py``, a batch script in Python that execs ``srun --kill-on-bad-exit=1
  --export=ALL python -m transom.controller.rankwrap ...`` as an argv list (no shell): a real
  allocation whose one step runs each task under :mod:`transom.controller.rankwrap` (which takes
  the rank from ``SLURM_PROCID`` and records its exit code in ``RUN_DIR/JOB/gen-G/rank-R.exit``;
  RUN_DIR must be on a filesystem every node shares). The allocation lives in slurmctld, not in a
  process of the controller's host: a controller that crashes, or a standby on another login
  node, finds it by name. ``launch.json`` makes a repeated launch adopt it.
- placement: srun orders a step's tasks by its node table, not by ``--nodelist``, so rank r need
  not run on ``nodes[r]``. ``MASTER_ADDR`` is therefore set by the wrapper in each task, to the
  node of task 0 (node 0 of ``SLURM_STEP_NODELIST``), and each task records the node it ran on
  (``rank-R.node``); :meth:`SlurmBackend.placement` reads what srun did.
- ``status``: running while ``squeue`` lists the job (pending included); then each rank's exit file,
  or SIGKILL for a rank that never wrote one (its node died, the job was cancelled).
- ``stop``: ``scancel --name=transom-JOB-gG``, then waits for ``squeue`` to drop it.
- ``cordon``: ``scontrol update NodeName=X State=DRAIN Reason="..."``.
- ``nodes`` / ``health``: ``scontrol show nodes --oneliner``; DRAIN, DOWN, FAIL or
  NOT_RESPONDING nodes fail.
- collective test: an ``srun`` of :mod:`transom.controller.collective` across the nodes.
- warm spares (in-job recovery): ``start_spare`` submits a one-node batch job
  ``transom-JOB-gG-spare-NODE-K`` whose step runs the user's command under rankwrap in
  ``RUN_DIR/JOB/gen-G/spare-NODE-K/`` with ``TRANSOM_SPARE=1``: it waits at the elastic API's join
  point, in an allocation of its own (the generation's allocation holds exactly its ranks' nodes).
  ``heal`` kills the failed rank's process if it still runs (a step of its allocation on its node:
  ``srun --jobid=J --overlap --nodelist=NODE kill -KILL PID``; a rank's wrapper exits 0 whatever the
  rank did, so ``--kill-on-bad-exit`` never takes the survivors with it), records that the spare is
  rank R from now on (``dirs``, ``spare_jobs``, ``healed_nodes`` in ``launch.json``: status, placement
  and stop follow it), and names the new rendezvous on the node where rank 0 runs (its agent's
  address when known, else the node's name) and a free port.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Mapping, Sequence

from transom.broker import free_port
from transom.log import get

from .backend import Backend, LaunchRecord, RankStatus, register_backend

__all__ = ["SlurmBackend", "SlurmError"]

log = get("controller.slurm")
BAD_STATES = ("DRAIN", "DOWN", "FAIL", "NOT_RESPONDING", "NO_RESPOND")


class SlurmError(RuntimeError):
    """A Slurm command failed; the message has its output."""


class SlurmBackend(Backend):
    name = "slurm"
    warm_spares = True

    def __init__(self, run_dir: str | os.PathLike = "runs", *, partition: str | None = None,
                 bootstrap: str | None = None, ckpt_dir: str | None = None,
                 agents: Mapping[str, str] | None = None) -> None:
        self.run_dir = Path(run_dir)
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self.partition = partition
        self.bootstrap = bootstrap
        self.ckpt_dir = ckpt_dir
        self.agents = {k: v for k, v in (agents or {}).items() if v}
        for tool in ("sbatch", "srun", "scontrol", "squeue", "scancel"):
            if shutil.which(tool) is None:
                raise SlurmError(f"the slurm backend needs `{tool}` on PATH")

    @staticmethod
    def _run(*argv: str) -> str:
        proc = subprocess.run(argv, capture_output=True, text=True, timeout=30)
        if proc.returncode != 0:
            raise SlurmError(f"{' '.join(argv)} exited {proc.returncode}: {proc.stderr.strip() or proc.stdout.strip()}")
        return proc.stdout

    def _node_states(self) -> dict[str, tuple[str, str]]:
        out = {}
        for line in self._run("scontrol", "show", "nodes", "--oneliner").splitlines():
            fields = dict(m.groups() for m in re.finditer(r"(\w+)=(\S+(?: \S+)*?)(?= \w+=|$)", line))
            if "NodeName" in fields:
                out[fields["NodeName"]] = (fields.get("State", ""), fields.get("Reason", ""))
        return out

    @staticmethod
    def _bad(state: str) -> bool:
        return any(b in state.upper() for b in BAD_STATES)

    @staticmethod
    def _step(job: str, generation: int) -> str:
        return f"transom-{job}-g{generation}"

    # ------------------------------------------------------------------ nodes
    def nodes(self) -> list[str]:
        return [n for n, (state, _) in self._node_states().items() if not self._bad(state)]

    def health(self, nodes: Sequence[str]) -> dict[str, str]:
        states = self._node_states()
        out = {}
        for node in nodes:
            if node not in states:
                out[node] = "unknown to Slurm"
            elif self._bad(states[node][0]):
                out[node] = f"state {states[node][0]}" + (f" ({states[node][1]})" if states[node][1] else "")
        return out

    def cordon(self, node: str, reason: str) -> None:
        self._run("scontrol", "update", f"NodeName={node}", "State=DRAIN", f"Reason={reason[:200]}")
        log.info("drained node %s: %s", node, reason)

    def _drained(self) -> list[str]:
        return [n for n, (state, _) in self._node_states().items() if self._bad(state)]

    def _allocation(self, name: str, nodes: Sequence[str]) -> list[str]:
        """The options of an allocation of exactly ``nodes``, one task each (sbatch and srun share them)."""
        argv = [f"--job-name={name}", f"--nodes={len(nodes)}", f"--ntasks={len(nodes)}", "--ntasks-per-node=1",
                f"--nodelist={','.join(nodes)}", "--export=ALL"]
        drained = [n for n in self._drained() if n not in nodes]
        if drained:
            argv.append(f"--exclude={','.join(drained)}")
        if self.partition:
            argv.append(f"--partition={self.partition}")
        return argv

    def _srun(self, name: str, nodes: Sequence[str]) -> list[str]:
        # --immediate: a request the cluster cannot satisfy now fails instead of waiting in the queue
        return ["srun", *self._allocation(name, nodes), "--kill-on-bad-exit=1", "--immediate=30"]

    def collective_test(self, job: str, generation: int, nodes: Sequence[str], timeout: float) -> dict[str, str]:
        port = free_port()
        argv = self._srun(f"transom-precheck-{job}-g{generation}", nodes) + [
            sys.executable, "-c", "import os,sys; from transom.controller.collective import main; "
            "from transom.controller.rankwrap import slurm_master; "
            "sys.exit(main(['--rank', os.environ['SLURM_PROCID'], '--world', os.environ['SLURM_NTASKS'], "
            f"'--master', slurm_master(os.environ)[1] + ':{port}', '--timeout', '{timeout}']))"]
        env = self._env()
        try:
            proc = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=timeout + 30)
        except subprocess.TimeoutExpired:
            return {n: "collective test (srun) did not finish" for n in nodes}
        if proc.returncode == 0:
            return {}
        why = (proc.stderr.strip().splitlines() or [f"exit {proc.returncode}"])[-1]
        bad = [n for n in nodes if n in why]
        return {n: f"collective test: {why}" for n in (bad or nodes)}

    # ------------------------------------------------------------------ ranks
    def launch(self, job: str, generation: int, nodes: tuple[str, ...], command: tuple[str, ...],
               resume_step: int | None, *, workdir: str | None = None,
               env: Mapping[str, str] | None = None) -> Mapping[str, Any]:
        record = LaunchRecord(self.run_dir, job, generation)
        if (adopted := record.adopt(log)) is not None:
            return adopted
        gen_dir = record.dir.resolve()
        name = self._step(job, generation)
        if self._queued(name):
            self._run("scancel", f"--name={name}")       # a launch interrupted before launch.json was written
        port = free_port()
        env = {**self._job_env(job, generation, env), "MASTER_PORT": str(port)}
        if resume_step is not None:
            env["TRANSOM_RESUME_STEP"] = str(resume_step)
        job_id = self._sbatch(name, nodes, gen_dir, command, workdir, env)
        handle = {"step_name": name, "job_id": job_id, "nodes": list(nodes), "port": port,
                  "resume_step": resume_step, "run_dir": str(gen_dir), "ts": time.time()}
        record.write(handle)
        log.info("launched job %s generation %d: Slurm job %s on %s", job, generation, job_id, ",".join(nodes))
        return handle

    def _job_env(self, job: str, generation: int, user: Mapping[str, str] | None) -> dict[str, str]:
        user_env = {k: v for k, v in (user or {}).items() if k != "MASTER_ADDR"}   # the submitter's, ours win
        env = {**self._env(), **user_env, "TRANSOM_JOB": job, "TRANSOM_GENERATION": str(generation),
               "PYTHONUNBUFFERED": "1",
               "TRANSOM_CKPT_DIR": self.ckpt_dir or str((self.run_dir / job / "ckpt").resolve())}
        env.pop("TRANSOM_RESUME_STEP", None)
        if self.bootstrap:
            env["TRANSOM_BOOTSTRAP"] = self.bootstrap
        return env

    def _sbatch(self, name: str, nodes: Sequence[str], run_dir: Path, command: Sequence[str], workdir: str | None,
                env: Mapping[str, str]) -> str:
        """Submit a batch job whose one step runs ``command`` under rankwrap on each of ``nodes``; its id."""
        # the controller's srun and sbatch, not ones on the submitter's PATH (env carries the submitter's)
        step = [shutil.which("srun") or "srun", "--kill-on-bad-exit=1", "--export=ALL",
                *([f"--chdir={workdir}"] if workdir else []),
                sys.executable, "-m", "transom.controller.rankwrap", "--dir", str(run_dir), "--", *command]
        script = run_dir / "batch.py"            # no shell anywhere: Python execs srun with the argv list
        script.write_text(f"#!{sys.executable}\nimport os\nargv = {json.dumps(step)}\nos.execvp(argv[0], argv)\n")
        script.chmod(0o755)
        argv = [shutil.which("sbatch") or "sbatch", "--parsable", *self._allocation(name, nodes),
                f"--output={run_dir / 'sbatch.log'}", f"--chdir={run_dir}", str(script)]
        proc = subprocess.run(argv, env=dict(env), capture_output=True, text=True, timeout=30)
        if proc.returncode != 0:
            raise SlurmError(f"sbatch exited {proc.returncode}: {proc.stderr.strip() or proc.stdout.strip()}")
        return proc.stdout.strip().split(";")[0]

    # ------------------------------------------------------------------ in-job healing
    def start_spare(self, job: str, generation: int, node: str, command: tuple[str, ...], *,
                    workdir: str | None = None, env: Mapping[str, str] | None = None) -> Mapping[str, Any]:
        record = LaunchRecord(self.run_dir, job, generation)
        handle = record.read()
        if handle is None:
            raise RuntimeError(f"job {job} generation {generation} has no launch record")
        k = len(list(record.dir.glob(f"spare-{node}-*")))
        spare_dir = (record.dir / f"spare-{node}-{k}").resolve()
        spare_dir.mkdir(parents=True)
        name = f"{self._step(job, generation)}-spare-{node}-{k}"
        spare_env = {**self._job_env(job, generation, env), "TRANSOM_SPARE": "1", "TRANSOM_NODE": node}
        job_id = self._sbatch(name, [node], spare_dir, command, workdir, spare_env)
        spare = {"name": name, "job_id": job_id, "dir": str(spare_dir)}
        handle = record.read() or handle
        handle.setdefault("spares", {}).setdefault(node, []).append(spare)
        record.write(handle)
        log.info("started a warm spare of job %s generation %d on %s: Slurm job %s", job, generation, node, job_id)
        return {**spare, "node": node}

    def _rank_node(self, handle: Mapping[str, Any], job: str, generation: int, rank: int) -> str:
        healed = (handle.get("healed_nodes") or {}).get(str(rank))
        if healed:
            return healed
        placed = self.placement(job, generation).get(rank) or {}
        return placed.get("node") or handle["nodes"][rank]

    def heal(self, job: str, generation: int, rank: int, node: str, nodes: Sequence[str]) -> str:
        record = LaunchRecord(self.run_dir, job, generation)
        handle = record.read()
        if handle is None:
            raise RuntimeError(f"job {job} generation {generation} has no launch record")
        if (handle.get("healed_nodes") or {}).get(str(rank)) == node and str(rank) in (handle.get("masters") or {}):
            return handle["masters"][str(rank)]      # carried out already (a controller restarted mid-heal)
        spares = [sp for sp in (handle.get("spares") or {}).get(node, []) if self._queued(sp["name"])]
        if not spares:
            raise RuntimeError(f"no waiting spare job of job {job} generation {generation} on {node}")
        spare = spares[0]
        self._kill_rank(handle, job, generation, rank)
        rank0 = node if rank == 0 else self._rank_node(handle, job, generation, 0)
        host = self.agents[rank0].rpartition(":")[0] if rank0 in self.agents else rank0
        master = f"{host}:{free_port()}"
        handle["spares"][node] = [sp for sp in handle["spares"][node] if sp["name"] != spare["name"]]
        handle.setdefault("dirs", {})[str(rank)] = spare["dir"]
        handle.setdefault("spare_jobs", {})[str(rank)] = spare["name"]
        handle.setdefault("healed_nodes", {})[str(rank)] = node
        handle.setdefault("masters", {})[str(rank)] = master
        record.write(handle)
        log.info("job %s generation %d: rank %d -> the warm spare on %s (Slurm job %s); new group at %s", job,
                 generation, rank, node, spare["job_id"], master)
        return master

    def _kill_rank(self, handle: Mapping[str, Any], job: str, generation: int, rank: int) -> None:
        """SIGKILL rank ``rank``'s process if it still runs: a step of its allocation on its node."""
        taken = (handle.get("spare_jobs") or {}).get(str(rank))
        if taken:                                   # a spare had taken this rank: its allocation is its own
            self._run("scancel", f"--name={taken}")
            return
        gen_dir = LaunchRecord(self.run_dir, job, generation).dir
        pid_file = gen_dir / f"rank-{rank}.pid"
        if (gen_dir / f"rank-{rank}.exit").exists() or not pid_file.exists():
            return
        child = pid_file.read_text().split()[-1]
        where = self._rank_node(handle, job, generation, rank)
        argv = [shutil.which("srun") or "srun", f"--jobid={handle['job_id']}", "--overlap", f"--nodelist={where}",
                "--nodes=1", "--ntasks=1", "kill", "-KILL", child]
        try:
            proc = subprocess.run(argv, capture_output=True, text=True, timeout=30)
        except subprocess.TimeoutExpired:
            log.warning("job %s generation %d: the kill of rank %d on %s did not return", job, generation, rank, where)
            return
        if proc.returncode != 0:
            log.warning("job %s generation %d: could not kill rank %d on %s: %s", job, generation, rank, where,
                        proc.stderr.strip() or proc.stdout.strip())

    def _queued(self, name: str) -> bool:
        return bool(self._run("squeue", "--noheader", "--format=%i", f"--name={name}").strip())

    def _env(self) -> dict[str, str]:
        """The environment srun passes on; MASTER_ADDR is left to each task (see the module's doc)."""
        env = {k: v for k, v in os.environ.items() if k != "MASTER_ADDR"}
        if self.agents:
            env["TRANSOM_AGENTS"] = ",".join(f"{k}={v}" for k, v in self.agents.items())
        return env

    def placement(self, job: str, generation: int) -> dict[int, dict[str, Any]]:
        """What srun did: rank -> {node, node_id, master_node, master_addr} for the ranks that started."""
        gen_dir = LaunchRecord(self.run_dir, job, generation).dir
        out = {}
        for path in gen_dir.glob("rank-*.node"):
            try:
                out[int(path.name[5:-5])] = json.loads(path.read_text())
            except (ValueError, OSError):
                continue
        return out

    def status(self, job: str, generation: int) -> list[RankStatus]:
        record = LaunchRecord(self.run_dir, job, generation)
        gen_dir, handle = record.dir, record.read()
        if handle is None:
            return []
        running = self._queued(handle["step_name"])
        placed = {r: p.get("node") for r, p in self.placement(job, generation).items()}
        dirs, spare_jobs = handle.get("dirs") or {}, handle.get("spare_jobs") or {}
        placed.update({int(r): n for r, n in (handle.get("healed_nodes") or {}).items()})
        out = []
        for rank in range(len(handle["nodes"])):
            # a spare took this rank: its files are rank-0.* of its directory, its allocation its own
            exit_file = Path(dirs[str(rank)]) / "rank-0.exit" if str(rank) in dirs else gen_dir / f"rank-{rank}.exit"
            if exit_file.exists():
                out.append(RankStatus(rank, False, int(exit_file.read_text().split()[0]), placed.get(rank)))
            elif self._queued(spare_jobs[str(rank)]) if str(rank) in spare_jobs else running:
                out.append(RankStatus(rank, True, None, placed.get(rank)))
            else:
                out.append(RankStatus(rank, False, -int(signal.SIGKILL), placed.get(rank)))
        return out

    def stop(self, job: str, generation: int, timeout: float = 10.0) -> None:
        name = self._step(job, generation)
        handle = LaunchRecord(self.run_dir, job, generation).read() or {}
        names = [name, *(handle.get("spare_jobs") or {}).values(),
                 *(sp["name"] for spares in (handle.get("spares") or {}).values() for sp in spares)]
        for each in names:                        # the generation's allocation, and its spares' own
            self._run("scancel", f"--name={each}")
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if not any(self._queued(each) for each in names):
                log.info("stopped job %s generation %d (scancel)", job, generation)
                return
            time.sleep(0.2)
        log.warning("job %s generation %d: still in squeue %.0fs after scancel", job, generation, timeout)


register_backend("slurm", SlurmBackend)
